"""End-to-end tests of bucketimer.TimerThread on real threads and event loops.

Where a timer runs (a running loop, the dispatcher thread, a loop named with
``loop=``), in which context, never before its deadline; what ``cancel()``
answers before the timer fires, after it was posted but before it ran (it must
win), while it runs, after it ran, twice, on stale and foreign handles; bad
input; close with pending timers; how callback exceptions are reported; the
order of equal deadlines; the counters; the module-level functions.
"""

from __future__ import annotations

import asyncio
import contextvars
import decimal
import fractions
import gc
import logging
import math
import threading
import time
import weakref

import pytest

import bucketimer

pytestmark = pytest.mark.timeout(60)

var = contextvars.ContextVar("var", default="unset")

SLOT_MASK = 0xFFFF_FFFF


class Recorder:
    """A callback that records where, when and in which context it ran."""

    def __init__(self, name: str = "cb") -> None:
        self.name = name
        self.calls: list[dict] = []
        self.done = threading.Event()

    def __call__(self, *args):
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        self.calls.append(
            {
                "args": args,
                "thread": threading.current_thread(),
                "at": time.monotonic(),
                "var": var.get(),
                "loop": loop,
            }
        )
        self.done.set()

    def wait(self, timeout: float = 5.0) -> dict:
        assert self.done.wait(timeout), f"{self.name} did not run within {timeout}s"
        return self.calls[0]


# -- where and when a timer runs ------------------------------------------------------


def test_fires_in_the_running_loop_in_the_captured_context(tt, run):
    async def main():
        loop = asyncio.get_running_loop()
        cb = Recorder()
        fut = loop.create_future()
        var.set("at schedule")
        h = tt.call_later(0.02, lambda *a: (cb(*a), fut.set_result(None)), "x", 1)
        var.set("changed after schedule")  # the callback must not see this
        assert h.loop is loop
        assert h.callback is not None and h.args == ("x", 1)
        assert h.get_context() is not None and h.get_context()[var] == "at schedule"
        await fut
        return h, cb.calls[0], threading.current_thread(), loop

    h, call, loop_thread, loop = run(main)
    assert call["args"] == ("x", 1)
    assert call["thread"] is loop_thread
    assert call["loop"] is loop
    assert call["var"] == "at schedule"
    assert call["at"] >= h.when()  # never before its deadline
    assert not h.cancelled()
    assert h.callback is None and h.args is None  # released once run
    assert tt.stats()["early_fires"] == 0


def test_counters_count_a_timer_before_it_runs(tt, run):
    """Once a timer's callback has run, stats() counts it as fired and
    posted: the timer thread publishes its counters before it signals the
    loop (it used to bump them after, which a slow machine could see)."""

    async def main():
        loop = asyncio.get_running_loop()
        base = tt.stats()
        for i in range(1, 301):
            fut = loop.create_future()
            tt.call_later(0, fut.set_result, None)
            await fut
            s = tt.stats()
            assert s["fired"] - base["fired"] >= i, (i, s)
            assert s["posted"] - base["posted"] >= i, (i, s)
        return "ok"

    assert run(main) == "ok"


def test_call_at_with_loop_time_never_fires_early(tt, run):
    async def main():
        loop = asyncio.get_running_loop()
        seen = []
        fut = loop.create_future()
        whens = [loop.time() + d for d in (0.001, 0.005, 0.0101, 0.02, 0.0203)]

        def cb(when):
            seen.append((when, loop.time(), time.monotonic()))
            if len(seen) == len(whens):
                fut.set_result(None)

        handles = [tt.call_at(w, cb, w) for w in whens]
        await fut
        return whens, seen, handles

    whens, seen, handles = run(main)
    assert [w for w, _, _ in seen] == whens
    for when, loop_now, mono in seen:
        assert loop_now >= when and mono >= when
    assert [h.when() for h in handles] == whens


def test_explicit_context(tt, run):
    async def main():
        ctx = contextvars.copy_context()
        ctx.run(var.set, "in ctx")
        cb = Recorder()
        fut = asyncio.get_running_loop().create_future()
        h = tt.call_later(0, lambda: (cb(), fut.set_result(None)), context=ctx)
        assert h.get_context() is ctx
        await fut
        return cb.calls[0]

    assert run(main)["var"] == "in ctx"


def test_fires_on_the_dispatcher_thread_without_a_loop(tt):
    var.set("main thread value")
    try:
        cb = Recorder()
        t0 = time.monotonic()
        h = tt.call_later(0.02, cb, "a")
        assert h.loop is None
        call = cb.wait()
    finally:
        var.set("unset")
    assert call["thread"] is not threading.current_thread()
    assert call["thread"].name == "bucketimer-dispatcher"
    assert call["loop"] is None
    assert call["var"] == "main thread value"
    assert call["args"] == ("a",)
    assert call["at"] >= h.when() and call["at"] >= t0 + 0.02


def test_loop_none_inside_a_running_loop_means_that_loop(tt, run):
    async def main():
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        h = tt.call_later(0, lambda: fut.set_result(threading.current_thread()), loop=None)
        assert h.loop is loop
        return await fut

    assert run(main) is threading.current_thread()


def test_loop_argument_names_a_loop_in_another_thread(tt, loop_thread):
    cb = Recorder()
    h = tt.call_later(0.01, cb, loop=loop_thread.loop)
    assert h.loop is loop_thread.loop
    call = cb.wait()
    assert call["thread"] is loop_thread.thread
    assert call["loop"] is loop_thread.loop
    assert call["at"] >= h.when()


def test_loop_argument_from_inside_another_running_loop(tt, run, loop_thread):
    async def main():
        cb = Recorder()
        h = tt.call_later(0.005, cb, loop=loop_thread.loop)
        # wait without blocking this loop
        for _ in range(500):
            if cb.calls:
                break
            await asyncio.sleep(0.01)
        return h, cb.calls

    h, calls = run(main)
    assert len(calls) == 1
    assert calls[0]["thread"] is loop_thread.thread
    assert calls[0]["loop"] is loop_thread.loop
    assert h.loop is loop_thread.loop


def test_loop_thread_can_schedule_on_itself(tt, loop_thread):
    cb = Recorder()
    h = loop_thread.call(lambda: tt.call_later(0.005, cb))
    assert h.loop is loop_thread.loop
    assert cb.wait()["thread"] is loop_thread.thread


# -- cancel ---------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["loop", "dispatcher"])
def test_cancel_before_fire(tt, run, where):
    cb = Recorder()

    def body():
        h = tt.call_later(0.03, cb)
        assert h.cancel() is True
        assert h.cancelled()
        assert h.callback is None  # references dropped at once
        assert h.cancel() is False  # second cancel
        return h

    if where == "loop":

        async def main():
            h = body()
            await asyncio.sleep(0.1)
            return h

        run(main)
    else:
        body()
        time.sleep(0.1)
    assert cb.calls == []
    s = tt.stats()
    assert s["scheduled"] == 1 and s["cancelled"] == 1 and s["ran"] == 0


def _posted_at_least(tt, n):
    return lambda: tt.stats()["posted"] >= n


def test_cancel_after_post_before_run_wins_in_the_loop(tt, run, wait_until):
    """The loop thread is blocked inside a callback while a second timer comes
    due and is posted to the loop's port; cancelling it then must win."""

    async def main():
        victim = Recorder("victim")
        result = {}

        def blocker():
            # The timer thread posts the victim (the 2nd post) while we block.
            result["posted"] = wait_until(_posted_at_least(tt, 2), 5)
            result["cancel"] = hv.cancel()

        tt.call_later(0, blocker)
        hv = tt.call_later(0.005, victim)
        while "cancel" not in result:
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.05)  # give the loop every chance to (wrongly) run it
        return victim, result, hv

    victim, result, hv = run(main)
    assert result["posted"], "the victim was never posted"
    assert result["cancel"] is True
    assert hv.cancelled()
    assert victim.calls == []
    s = tt.stats()
    assert (s["posted"], s["cancelled"], s["ran"]) == (2, 1, 1)


def test_cancel_after_post_before_run_from_another_thread(tt, run, wait_until):
    async def main():
        victim = Recorder("victim")
        result = {}
        cancelled = threading.Event()

        def canceller():
            result["posted"] = wait_until(_posted_at_least(tt, 2), 5)
            result["cancel"] = hv.cancel()
            cancelled.set()

        def blocker():
            threading.Thread(target=canceller).start()
            assert cancelled.wait(5)  # the loop thread is stuck here meanwhile

        tt.call_later(0, blocker)
        hv = tt.call_later(0.005, victim)
        while not cancelled.is_set():
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.05)
        return victim, result

    victim, result = run(main)
    assert result == {"posted": True, "cancel": True}
    assert victim.calls == []


def test_cancel_after_post_before_run_on_the_dispatcher(tt, wait_until):
    victim = Recorder("victim")
    result = {}
    finished = threading.Event()

    def blocker():
        result["posted"] = wait_until(_posted_at_least(tt, 2), 5)
        result["cancel"] = hv.cancel()
        finished.set()

    tt.call_later(0, blocker)
    hv = tt.call_later(0.005, victim)
    assert finished.wait(5)
    time.sleep(0.05)
    assert result == {"posted": True, "cancel": True}
    assert victim.calls == []
    assert wait_until(lambda: tt.stats()["dead"] == 0)  # the drain released it


def test_cancel_from_inside_the_running_callback(tt, run):
    async def main():
        fut = asyncio.get_running_loop().create_future()

        def cb():
            fut.set_result(h.cancel())

        h = tt.call_later(0, cb)
        return await fut, h

    res, h = run(main)
    assert res is False
    assert not h.cancelled()
    assert tt.stats()["cancelled"] == 0


@pytest.mark.parametrize("where", ["dispatcher", "loop_thread"])
def test_cancel_from_another_thread_while_running(tt, loop_thread, where):
    started, release = threading.Event(), threading.Event()
    finished = []

    def cb():
        started.set()
        release.wait(5)
        finished.append(True)

    loop = loop_thread.loop if where == "loop_thread" else None
    h = tt.call_later(0, cb, loop=loop)
    assert started.wait(5)
    try:
        assert h.cancel() is False
        assert not h.cancelled()
    finally:
        release.set()
    deadline = time.monotonic() + 5
    while not finished and time.monotonic() < deadline:
        time.sleep(0.001)
    assert finished == [True]
    assert h.cancel() is False


def test_cancel_after_run_and_cancel_twice(tt):
    cb = Recorder()
    h = tt.call_later(0, cb)
    cb.wait()
    time.sleep(0.01)
    assert h.cancel() is False
    assert not h.cancelled()

    h2 = tt.call_later(10, cb)
    assert h2.cancel() is True
    assert h2.cancel() is False
    assert h2.cancelled()
    assert tt.stats()["cancelled"] == 1


def _same_slot_timer(tt, old, cb, delay, max_tries=64):
    """Schedules timers until one reuses ``old``'s slot; returns it and the
    others (all scheduled on this thread, so from the same bucket)."""
    extra = []
    for _ in range(max_tries):
        h = tt.call_later(delay, cb)
        if h.id & SLOT_MASK == old.id & SLOT_MASK:
            return h, extra
        extra.append(h)
    raise AssertionError("no new timer reused the old timer's slot")


def test_stale_handle_of_a_timer_that_ran_cannot_cancel_the_slots_new_timer(tt, wait_until):
    first = Recorder("first")
    old = tt.call_later(0, first)
    first.wait()
    # the dispatcher released the slot right after running it
    assert wait_until(lambda: tt.stats()["slots_free"] == tt.stats()["slots"])
    new_cb = Recorder("new")
    new, extra = _same_slot_timer(tt, old, new_cb, 0.02)
    assert new.id != old.id  # same slot, newer generation
    assert old.cancel() is False
    assert not new.cancelled()
    assert new_cb.wait()["at"] >= new.when()
    for h in extra:
        h.cancel()


def test_stale_handle_of_a_cancelled_timer_cannot_cancel_the_slots_new_timer(tt, wait_until):
    never = Recorder("never")
    old = tt.call_later(0.01, never)
    assert old.cancel() is True
    # the timer thread reaps it when it collects (at the old deadline)
    assert wait_until(lambda: tt.stats()["reaped"] == 1 and tt.stats()["dead"] == 0)
    new_cb = Recorder("new")
    new, extra = _same_slot_timer(tt, old, new_cb, 0.02)
    assert new.id != old.id
    assert old.cancel() is False
    new_cb.wait()
    assert never.calls == []
    for h in extra:
        h.cancel()


def test_foreign_handle_from_a_closed_timer_thread(tt):
    other = bucketimer.TimerThread()
    cb = Recorder()
    h = other.call_later(10, cb)
    mine = tt.call_later(10, cb)
    other.close()
    assert h.cancel() is False
    assert not h.cancelled()
    assert mine.cancel() is True  # the open one is untouched
    assert cb.calls == []


# -- bad input ------------------------------------------------------------------------


class NoFloat:
    pass


BAD_CALLS = [
    pytest.param(lambda tt, cb: tt.call_later(0.01, 42), TypeError, id="non-callable"),
    pytest.param(lambda tt, cb: tt.call_later(0.01, None), TypeError, id="callback-None"),
    pytest.param(lambda tt, cb: tt.call_later(math.nan, cb), ValueError, id="nan"),
    pytest.param(lambda tt, cb: tt.call_at(math.nan, cb), ValueError, id="call_at-nan"),
    pytest.param(lambda tt, cb: tt.call_later(decimal.Decimal("NaN"), cb), ValueError, id="decimal-nan"),
    pytest.param(lambda tt, cb: tt.call_later(True, cb), TypeError, id="bool"),
    pytest.param(lambda tt, cb: tt.call_at(False, cb), TypeError, id="call_at-bool"),
    pytest.param(lambda tt, cb: tt.call_later("1", cb), TypeError, id="str"),
    pytest.param(lambda tt, cb: tt.call_later(b"1", cb), TypeError, id="bytes"),
    pytest.param(lambda tt, cb: tt.call_later(None, cb), TypeError, id="None"),
    pytest.param(lambda tt, cb: tt.call_later(1j, cb), TypeError, id="complex"),
    pytest.param(lambda tt, cb: tt.call_later(NoFloat(), cb), TypeError, id="object"),
    pytest.param(lambda tt, cb: tt.call_later(0.01), TypeError, id="no-callback"),
    pytest.param(lambda tt, cb: tt.call_later(), TypeError, id="no-args"),
    pytest.param(lambda tt, cb: tt.call_later(0.01, cb, bogus=1), TypeError, id="bad-keyword"),
    pytest.param(lambda tt, cb: tt.call_later(0.01, cb, context={}), TypeError, id="bad-context"),
    pytest.param(lambda tt, cb: tt.call_later(0.01, cb, loop="loop"), TypeError, id="bad-loop"),
]


@pytest.mark.parametrize("call, exc", BAD_CALLS)
def test_bad_input_raises_and_changes_nothing(tt, call, exc):
    sentinel = Recorder("sentinel")
    keeper = Recorder("keeper")
    hs = tt.call_later(0.03, sentinel)
    hk = tt.call_later(30, keeper)
    before = tt.stats()
    with pytest.raises(exc):
        call(tt, Recorder("bad"))
    after = tt.stats()
    assert after["scheduled"] == before["scheduled"] == 2
    assert after["slots"] - after["slots_free"] == 2
    sentinel.wait()
    assert not hs.cancelled()
    assert hk.cancel() is True
    assert keeper.calls == []


def test_closed_loop_is_refused(tt):
    loop = asyncio.new_event_loop()
    loop.close()
    cb = Recorder()
    sentinel = tt.call_later(30, cb)
    with pytest.raises(RuntimeError):
        tt.call_later(0, cb, loop=loop)
    assert sentinel.cancel() is True


@pytest.mark.parametrize(
    "delay",
    [0, 0.0, -0.0, -1, -1e300, -math.inf, -(10**400), fractions.Fraction(-1, 3), decimal.Decimal(-5)],
    ids=repr,
)
def test_zero_and_negative_delays_fire_as_soon_as_possible(tt, delay):
    cb = Recorder()
    t0 = time.monotonic()
    h = tt.call_later(delay, cb)
    call = cb.wait(5)
    assert call["at"] - t0 < 5
    assert not h.cancelled()


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda tt, cb: tt.call_later(math.inf, cb), id="inf"),
        pytest.param(lambda tt, cb: tt.call_at(math.inf, cb), id="call_at-inf"),
        pytest.param(lambda tt, cb: tt.call_later(10**400, cb), id="huge-int"),
        pytest.param(lambda tt, cb: tt.call_later(2**63, cb), id="2**63"),
        pytest.param(lambda tt, cb: tt.call_later(1e300, cb), id="1e300"),
        pytest.param(lambda tt, cb: tt.call_at(10**30, cb), id="call_at-huge"),
    ],
)
def test_infinite_delays_never_fire_but_can_be_cancelled(tt, make):
    never = Recorder("never")
    soon = Recorder("soon")
    h = make(tt, never)
    tt.call_later(0.02, soon)  # a later, finite timer still fires
    soon.wait()
    time.sleep(0.02)
    assert never.calls == []
    assert h.when() == math.inf or h.when() > 1e9
    assert h.cancel() is True
    assert h.cancelled()


def test_int_and_float_subclasses_and_numbers_are_accepted(tt):
    cb = Recorder()
    done = []
    hs = [
        tt.call_later(fractions.Fraction(1, 100), done.append, 1),
        tt.call_later(decimal.Decimal("0.01"), done.append, 2),
        tt.call_at(time.monotonic(), done.append, 3),
        tt.call_at(int(time.monotonic()), done.append, 4),
        tt.call_later(0, cb),
    ]
    cb.wait()
    deadline = time.monotonic() + 5
    while len(done) < 4 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert sorted(done) == [1, 2, 3, 4]
    assert not any(h.cancelled() for h in hs)


def test_closed_timer_thread_refuses_new_timers():
    tt = bucketimer.TimerThread()
    other = bucketimer.TimerThread()
    try:
        cb = Recorder()
        keep = other.call_later(30, cb)
        tt.close()
        assert tt.closed
        with pytest.raises(RuntimeError):
            tt.call_later(0.01, cb)
        with pytest.raises(RuntimeError):
            tt.call_at(time.monotonic(), cb)
        tt.close()  # idempotent
        assert keep.cancel() is True  # another TimerThread is unaffected
    finally:
        other.close()


def test_context_manager_closes():
    with bucketimer.TimerThread() as tt:
        assert not tt.closed
        h = tt.call_later(30, print)
    assert tt.closed
    assert h.cancel() is False
    with pytest.raises(RuntimeError):
        tt.call_later(1, print)


def test_constructor_arguments():
    with pytest.raises(ValueError):
        bucketimer.TimerThread(0)
    with pytest.raises(ValueError):
        bucketimer.TimerThread(257)
    with pytest.raises(ValueError):
        bucketimer.TimerThread(drain_threshold=1)
    with bucketimer.TimerThread(1, drain_threshold=16) as tt:
        cb = Recorder()
        tt.call_later(0, cb)
        cb.wait()


# -- close ------------------------------------------------------------------------------


def test_close_drops_pending_timers_and_releases_their_callbacks(loop_thread):
    tt = bucketimer.TimerThread()
    ran = []
    refs, handles = [], []
    for i in range(20):

        def cb(i=i):
            ran.append(i)

        refs.append(weakref.ref(cb))
        loop = loop_thread.loop if i % 2 else None
        handles.append(tt.call_later(0.05 + 0.001 * i, cb, loop=loop))
        del cb
    tt.close()
    assert all(r() is None for r in refs), "close() kept a dropped callback alive"
    time.sleep(0.15)  # past every deadline
    assert ran == []
    for h in handles:
        assert h.cancel() is False
        assert not h.cancelled()
        assert h.callback is None


def test_close_drops_a_timer_already_posted_but_not_run(wait_until):
    """The dispatcher is busy in a callback while a second timer is posted;
    close() then drops it: it never runs, and its callback is released."""
    tt = bucketimer.TimerThread()
    started, release = threading.Event(), threading.Event()
    ran = []

    def blocker():
        started.set()
        release.wait(5)

    def victim():
        ran.append("victim")

    ref = weakref.ref(victim)
    tt.call_later(0, blocker)
    assert started.wait(5)
    hv = tt.call_later(0, victim)
    del victim
    assert wait_until(_posted_at_least(tt, 2), 5)
    timer = threading.Timer(0.1, release.set)  # close() joins the dispatcher
    timer.start()
    try:
        tt.close()
    finally:
        release.set()
        timer.join()
    gc.collect()
    time.sleep(0.05)
    assert ran == []
    assert ref() is None
    assert hv.cancel() is False


def test_close_from_inside_a_dispatcher_callback():
    tt = bucketimer.TimerThread()
    done = threading.Event()
    ran = []

    def closer():
        tt.close()
        done.set()

    tt.call_later(0, closer)
    tt.call_later(0.05, ran.append, 1)
    assert done.wait(5)
    time.sleep(0.1)
    assert ran == []
    assert tt.closed


def test_close_with_a_loop_port_then_close_the_loop(run):
    tt = bucketimer.TimerThread()

    async def main():
        fut = asyncio.get_running_loop().create_future()
        tt.call_later(0, fut.set_result, 1)
        tt.call_later(30, print)
        return await fut

    assert run(main) == 1
    tt.close()
    assert tt.stats()["ran"] == 1


# -- exceptions ----------------------------------------------------------------------------


def test_loop_callback_exception_goes_to_the_loop_exception_handler(tt, run):
    class Boom(Exception):
        pass

    def failing(arg):
        raise Boom(arg)

    async def main():
        loop = asyncio.get_running_loop()
        contexts = []
        loop.set_exception_handler(lambda lp, ctx: contexts.append(ctx))
        done = loop.create_future()
        h = tt.call_later(0, failing, "tt")
        tt.call_later(0.01, done.set_result, "still running")
        after = await done
        # the same failure through asyncio's own handle, for comparison
        loop.call_soon(failing, "tt")
        await asyncio.sleep(0.01)
        return h, contexts, after

    h, contexts, after = run(main)
    assert after == "still running"
    assert len(contexts) == 2
    ours, theirs = contexts
    assert {"message", "exception", "handle"} <= set(ours)
    assert isinstance(ours["exception"], Boom) and ours["exception"].args == ("tt",)
    assert ours["handle"] is h
    assert ours["message"].startswith("Exception in callback ")
    assert ours["message"] == theirs["message"]


def test_dispatcher_exception_is_logged_and_dispatcher_keeps_running(tt, caplog):
    class Boom(Exception):
        pass

    def failing():
        raise Boom("on the dispatcher")

    after = Recorder("after")
    with caplog.at_level(logging.ERROR, logger="bucketimer"):
        tt.call_later(0, failing)
        tt.call_later(0.02, after)
        after.wait()
    records = [r for r in caplog.records if r.name == "bucketimer"]
    assert len(records) == 1
    rec = records[0]
    assert rec.levelno == logging.ERROR
    assert rec.exc_info is not None and isinstance(rec.exc_info[1], Boom)
    assert after.calls[0]["thread"].name == "bucketimer-dispatcher"
    # still alive afterwards
    again = Recorder("again")
    tt.call_later(0, again)
    again.wait()


# -- ordering and counters ---------------------------------------------------------------


@pytest.mark.parametrize("where", ["loop", "dispatcher"])
@pytest.mark.parametrize("offset", [0.03, -1.0], ids=["future", "past"])
def test_equal_deadlines_fire_in_schedule_order(tt, run, where, offset):
    n = 300
    order = []
    finished = threading.Event()

    def cb(i):
        order.append(i)
        if len(order) == n:
            finished.set()

    def schedule():
        when = time.monotonic() + offset
        # interleave a few other deadlines so the heap has to work
        others = [tt.call_at(when + 10, cb, -1) for _ in range(5)]
        hs = [tt.call_at(when, cb, i) for i in range(n)]
        for h in others:
            assert h.cancel()
        return hs

    if where == "loop":

        async def main():
            hs = schedule()
            while not finished.is_set():
                await asyncio.sleep(0.005)
            return hs

        hs = run(main)
    else:
        hs = schedule()
        assert finished.wait(5)
    assert order == list(range(n))
    assert len({h.when() for h in hs}) == 1


def test_stats_are_consistent(tt, wait_until):
    n, k = 60, 25
    done = threading.Event()
    ran = []

    def cb(i):
        ran.append(i)
        if len(ran) == n - k:
            done.set()

    # far enough out that the cancels below surely come first, even on a loaded machine
    hs = [tt.call_later(0.1 + 0.0005 * i, cb, i) for i in range(n)]
    cancelled = [h.cancel() for h in hs[::2][:k]]
    assert all(cancelled)
    assert done.wait(5)
    time.sleep(0.02)
    assert sorted(ran) == sorted(set(range(n)) - set(range(0, 2 * k, 2)))
    assert wait_until(lambda: tt.stats()["dead"] == 0)
    s = tt.stats()
    assert s["scheduled"] == n
    assert s["cancelled"] == k
    assert s["fired"] == s["posted"] == s["ran"] == n - k
    assert s["early_fires"] == 0
    assert sum(s["lateness_hist"]) == s["ran"]
    assert len(s["lateness_hist"]) == 48
    assert s["reaped"] == k
    assert s["slots_free"] == s["slots"] > 0
    assert s["heap_size"] == 0 and s["list_size"] == 0
    assert 1 <= s["eventfd_writes"] <= s["posted"]
    assert s["passes"] >= 1
    assert s["ports"] >= 1
    for key in ("scheduled", "cancelled", "fired", "posted", "ran", "wakeups", "passes",
                "eventfd_writes", "drains", "sweeps", "reaped", "heap_size", "list_size",
                "dead", "slots", "slots_free", "ports", "early_fires"):
        assert isinstance(s[key], int) and s[key] >= 0, key


# -- the module-level API ----------------------------------------------------------------


def test_module_level_call_later_and_call_at(run):
    tt = bucketimer.default_timer_thread()
    assert tt is bucketimer.default_timer_thread()
    assert isinstance(tt, bucketimer.TimerThread)

    cb = Recorder()
    h = bucketimer.call_later(0.01, cb, "x")
    call = cb.wait()
    assert call["thread"].name == "bucketimer-dispatcher"
    assert call["args"] == ("x",)
    assert call["at"] >= h.when()

    h2 = bucketimer.call_at(time.monotonic() + 30, cb)
    assert h2.cancel() is True

    async def main():
        fut = asyncio.get_running_loop().create_future()
        bucketimer.call_later(0, lambda: fut.set_result(threading.current_thread()))
        h3 = bucketimer.call_at(asyncio.get_running_loop().time() + 30, print)
        assert h3.cancel() is True
        return await fut

    assert run(main) is threading.current_thread()
