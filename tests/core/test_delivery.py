"""Where, when and in what order a timer's callback runs: in the running loop
or the one named with ``loop=``, on the dispatcher thread without one, in its
captured context, never before its deadline, equal deadlines in schedule
order; the counters; the module-level functions; and what happens when a
callback raises, interrupts, cancels or closes things, or Python holds the
GIL all along (the timer thread never needs it).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import threading
import time
import typing

import pytest
from _helpers import Recorder, check_ok, dispatcher_held, run_python, var, wait_until

import bucketimer

pytestmark = pytest.mark.timeout(120)


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
    if where == "loop" and bucketimer.backend != "native":
        # kept on the loop's heap, whose ties are asyncio's: in heap order
        # (docs/asyncio.rst, "One contract")
        assert sorted(order) == list(range(n))
    else:
        assert order == list(range(n))
    assert len({h.when() for h in hs}) == 1


def test_stats_keys_are_those_the_typeddict_declares(tt):
    assert sorted(tt.stats()) == sorted(typing.get_type_hints(bucketimer.Stats))


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
    if bucketimer.backend == "native":  # the pure backend has no slots
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


def test_dispatcher_callback_that_raises_is_logged_and_others_run(tt, caplog):
    caplog.set_level(logging.ERROR, logger="bucketimer")
    done = threading.Event()
    ran = []

    def boom():
        raise ValueError("boom")

    tt.call_later(0.001, boom)
    tt.call_later(0.002, ran.append, 1)
    tt.call_later(0.003, lambda: (ran.append(2), done.set()))
    assert done.wait(5)
    assert ran == [1, 2]
    assert wait_until(lambda: any(r.exc_info and isinstance(r.exc_info[1], ValueError) for r in caplog.records))
    rec = next(r for r in caplog.records if r.exc_info)
    assert rec.name == "bucketimer" and "Exception in timer callback" in rec.getMessage()


def test_loop_callback_that_raises_goes_to_the_exception_handler(tt, new_loop):
    contexts = []
    new_loop.set_exception_handler(lambda loop, ctx: contexts.append(ctx))
    ran = []

    def boom():
        raise ValueError("boom")

    async def main():
        tt.call_later(0.001, boom)
        tt.call_later(0.002, ran.append, "after")
        asyncio.get_running_loop().call_later(0.001, boom)  # the asyncio reference
        await asyncio.sleep(0.05)

    new_loop.run_until_complete(main())
    assert ran == ["after"]
    assert len(contexts) == 2
    ours, ref = sorted(contexts, key=lambda c: type(c["handle"]).__module__ != "bucketimer._core")
    assert isinstance(ours["exception"], ValueError)
    assert ours["message"].startswith("Exception in callback ")
    assert ours["message"].split(" ")[:3] == ref["message"].split(" ")[:3]
    assert "boom" in ours["message"]


@pytest.mark.native
def test_a_callback_that_rebinds_its_ports_on_error_then_raises(tt, run):
    """The port's ``on_error`` is a writable attribute (the Python side sets
    it); a callback may rebind it, dropping the reporter's last reference,
    and then raise.  The report goes to the reporter the port had when the
    callback began, which drain keeps alive for it."""
    reports = []

    def reporter(tag):
        return lambda handle, exc: reports.append((tag, handle, exc))

    async def main():
        loop = asyncio.get_running_loop()
        far = tt.call_later(30, lambda: None)  # opens this loop's port
        port = tt._ports[loop]
        port.on_error = reporter("first")
        done = asyncio.Event()

        def rebind_and_raise(tag):
            port.on_error = reporter(tag)
            [(i, i) for i in range(100)]  # reuses what was freed, if it was
            loop.call_soon(done.set)
            raise ValueError(tag)

        h = tt.call_later(0, rebind_and_raise, "second")
        await done.wait()
        done.clear()
        h2 = tt.call_later(0, rebind_and_raise, "third")
        await done.wait()
        assert far.cancel() is True
        return h, h2

    h, h2 = run(main)
    assert [(tag, handle, str(exc)) for tag, handle, exc in reports] == [
        ("first", h, "second"), ("second", h2, "third")]


def test_dispatcher_callbacks_cancel_themselves_others_and_schedule_more(tt):
    results = {}
    done = threading.Event()
    handles = {}

    def self_cancel():
        results["self"] = handles["self"].cancel()
        results["self_cancelled"] = handles["self"].cancelled()

    def cancel_other():
        results["other"] = handles["victim"].cancel()

    def victim():
        results["victim_ran"] = True

    def spawner(n):
        results.setdefault("spawned", []).append(n)
        if n < 5:
            handles[f"spawn{n}"] = tt.call_later(0, spawner, n + 1)
        else:
            done.set()

    # Same deadline: the victim sits in the same batch, posted, when it is
    # cancelled.  All armed with the dispatcher held (a machine stalled past
    # the deadline would otherwise run some first).
    with dispatcher_held(tt):
        when = time.monotonic() + 0.02
        handles["self"] = tt.call_at(when, self_cancel)
        handles["canceller"] = tt.call_at(when, cancel_other)
        handles["victim"] = tt.call_at(when, victim)
        tt.call_at(when, spawner, 0)
    assert done.wait(5)
    time.sleep(0.01)
    assert results["self"] is False and results["self_cancelled"] is False
    assert results["other"] is True
    assert "victim_ran" not in results
    assert handles["victim"].cancelled()
    assert results["spawned"] == [0, 1, 2, 3, 4, 5]
    s = tt.stats()
    assert s["early_fires"] == 0 and s["scheduled"] == s["ran"] + s["cancelled"]


def test_loop_callbacks_cancel_themselves_others_and_schedule_more(tt, new_loop):
    results = {}
    handles = {}

    async def main():
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def self_cancel():
            results["self"] = handles["self"].cancel()

        def cancel_other():
            results["other"] = handles["victim"].cancel()

        def spawner(n):
            results.setdefault("spawned", []).append(n)
            if n < 5:
                tt.call_later(0, spawner, n + 1)
            else:
                done.set_result(None)

        # (a microsecond apart: in one pass, and in this order on every
        # backend; equal deadlines on a loop's heap run in its order)
        when = loop.time() + 0.02
        handles["self"] = tt.call_at(when, self_cancel)
        handles["canceller"] = tt.call_at(when + 1e-6, cancel_other)
        handles["victim"] = tt.call_at(when + 2e-6, results.__setitem__, "victim_ran", True)
        tt.call_at(when + 3e-6, spawner, 0)
        await asyncio.wait_for(done, 5)

    new_loop.run_until_complete(main())
    assert results["self"] is False
    assert results["other"] is True and "victim_ran" not in results
    assert results["spawned"] == [0, 1, 2, 3, 4, 5]


def test_dispatcher_callback_that_closes_the_timer_thread():
    tt = bucketimer.TimerThread()
    ran = []
    closed = threading.Event()

    def closer():
        tt.close()  # from the dispatcher thread itself: must not wait for itself
        ran.append("closer")
        closed.set()

    with dispatcher_held(tt):  # the closer runs once all are armed (as above)
        when = time.monotonic() + 0.02
        tt.call_at(when, closer)
        later_same_batch = [tt.call_at(when, ran.append, i) for i in range(5)]
        far = tt.call_later(0.05, ran.append, "far")
    assert closed.wait(5)
    time.sleep(0.1)
    assert ran == ["closer"]
    assert tt.closed
    with pytest.raises(RuntimeError):
        tt.call_later(0, print)
    for h in later_same_batch + [far]:
        assert h.cancel() is False
    tt.close()  # idempotent


def test_loop_callback_that_closes_the_timer_thread(new_loop):
    tt = bucketimer.TimerThread()
    ran = []

    async def main():
        loop = asyncio.get_running_loop()
        when = loop.time() + 0.02  # (the others a microsecond apart, after it)
        tt.call_at(when, tt.close)
        for i in range(5):
            tt.call_at(when + (i + 1) * 1e-6, ran.append, i)
        tt.call_later(0.05, ran.append, "far")
        await asyncio.sleep(0.1)
        with pytest.raises(RuntimeError):
            tt.call_later(0, print)

    new_loop.run_until_complete(main())
    assert ran == []
    assert tt.closed


# -- close() racing call_later ---------------------------------------------------------------


def test_keyboardinterrupt_in_a_loop_callback_propagates_and_the_rest_run_later(tt, new_loop):
    ran = []

    def interrupt():
        raise KeyboardInterrupt

    async def main():
        loop = asyncio.get_running_loop()
        when = loop.time() + 0.01  # (a microsecond apart, as above)
        tt.call_at(when, ran.append, "before")
        tt.call_at(when + 1e-6, interrupt)
        tt.call_at(when + 2e-6, ran.append, "after1")
        tt.call_at(when + 3e-6, ran.append, "after2")
        await asyncio.sleep(1)

    with pytest.raises(KeyboardInterrupt):
        new_loop.run_until_complete(main())
    assert ran == ["before"]
    new_loop.run_until_complete(asyncio.sleep(0.02))
    assert ran == ["before", "after1", "after2"]
    _cancel_all_tasks(new_loop)


def test_keyboardinterrupt_in_a_loop_callback_matches_asyncio(new_loop):
    """The asyncio reference: the same propagation for a loop.call_later handle."""
    ran = []

    def interrupt():
        raise KeyboardInterrupt

    async def main():
        loop = asyncio.get_running_loop()
        loop.call_later(0.01, ran.append, "before")
        loop.call_later(0.01, interrupt)
        loop.call_later(0.01, ran.append, "after")
        await asyncio.sleep(1)

    with pytest.raises(KeyboardInterrupt):
        new_loop.run_until_complete(main())
    assert ran == ["before"]
    new_loop.run_until_complete(asyncio.sleep(0.02))
    assert ran == ["before", "after"]
    _cancel_all_tasks(new_loop)


def _cancel_all_tasks(loop):
    tasks = asyncio.all_tasks(loop)
    for t in tasks:
        t.cancel()
    loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))


def test_keyboardinterrupt_in_a_loop_callback_propagates_out_of_asyncio_run(tt):
    def interrupt():
        raise KeyboardInterrupt

    async def main():
        tt.call_later(0.01, interrupt)
        await asyncio.sleep(5)

    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        asyncio.run(main())
    assert time.monotonic() - t0 < 4


@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit])
def test_keyboardinterrupt_in_a_dispatcher_callback_is_logged_and_dispatch_continues(tt, caplog, exc):
    caplog.set_level(logging.ERROR, logger="bucketimer")
    ran = []
    done = threading.Event()

    def interrupt():
        raise exc

    when = time.monotonic() + 0.01
    tt.call_at(when, interrupt)
    tt.call_at(when, ran.append, "same batch")
    tt.call_later(0.05, lambda: (ran.append("later"), done.set()))
    assert done.wait(5), ran
    assert ran == ["same batch", "later"]
    assert wait_until(lambda: any(r.exc_info and r.exc_info[0] is exc for r in caplog.records))
    if bucketimer.backend == "native":
        assert tt._thread.is_alive()


# -- the timer thread never needs the GIL ---------------------------------------------------


@pytest.mark.native
def test_timers_fire_while_python_holds_the_gil(tt):
    """With a switch interval of 100 s, this thread keeps the GIL while it
    spins for 200 ms: a timer thread that needed the GIL could not fire anything.  The
    core fires (and posts) every due timer anyway; only running the callbacks,
    on the dispatcher thread, waits for the GIL."""
    import sys

    ran = []
    tt.call_later(0, ran.append, "warm")
    assert wait_until(lambda: ran)  # the dispatcher exists
    old = sys.getswitchinterval()
    n = 50
    try:
        sys.setswitchinterval(100.0)
        t_end = time.monotonic() + 0.2
        for i in range(n):
            tt.call_later(0.005, ran.append, i)
        while time.monotonic() < t_end:  # spin, GIL held, nothing blocks
            pass
        n_ran = len(ran)
        s = tt.stats()  # (releases the GIL: read n_ran first)
    finally:
        sys.setswitchinterval(old)
    assert n_ran == 1, "a callback ran while this thread held the GIL"
    assert s["fired"] == n + 1 and s["posted"] == n + 1, s
    assert wait_until(lambda: len(ran) == n + 1)


DEV_MODE_WORKLOAD = r"""
import asyncio, gc, threading, time
import bucketimer
from bucketimer import _core

# -X dev: PYTHONMALLOC=debug, whose hooks abort ("Python memory allocator
# called without holding the GIL") if any thread allocates or frees a Python
# object without the GIL -- e.g. a timer thread releasing a Handle.
tt = bucketimer.TimerThread()
ran = []
def cb(*a):
    ran.append(a)
    gc.collect(0)

async def main():
    loop = asyncio.get_running_loop()
    for r in range(20):
        hs = [tt.call_later(0.0005 * (i % 5), cb, [i], {"r": r}) for i in range(200)]
        hs += [bucketimer.call_later(0.0005 * (i % 5), cb, [i]) for i in range(100)]
        hs += [tt.call_later(0.0005 * (i % 5), cb, [i], loop=None) for i in range(100)]
        for h in hs[::3]:
            h.cancel()
        await asyncio.sleep(0.004)
    for i in range(1000):  # pending at close: dropped, never run
        tt.call_later(60, cb, [i])
        tt.call_later(60, cb, [i], loop=None)

asyncio.run(main())
time.sleep(0.05)
tt.close()
del tt
gc.collect()
print("ok", len(ran))
"""


def test_timer_thread_never_touches_python_objects_debug_allocators():
    p = run_python(DEV_MODE_WORKLOAD, timeout=60, env={"PYTHONDEVMODE": "1", "PYTHONMALLOC": "debug"})
    out = check_ok(p)
    assert out.startswith("ok"), out
    assert "without holding the GIL" not in p.stderr, p.stderr

