"""What ``cancel()`` answers: before the timer fires, after it was posted but
before it ran (it must win), while it runs, after it ran, twice, on stale
handles and on ids of another TimerThread.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from _helpers import Recorder, posted_at_least

import bucketimer

pytestmark = pytest.mark.timeout(60)

SLOT_MASK = 0xFFFF_FFFF  # the low word of an id: its core and slot


@pytest.mark.parametrize("where", ["loop", "dispatcher"])
def test_cancel_before_fire(tt, run, where):
    cb = Recorder()
    # Without a loop, the dispatcher may run the timer the moment it is due:
    # a deadline well past any stall of this thread between arm and cancel.
    delay = 0.25

    def body():
        h = tt.call_later(delay, cb)
        assert h.cancel() is True
        assert h.cancelled()
        assert h.callback is None  # references dropped at once
        assert h.cancel() is False  # second cancel
        return h

    if where == "loop":

        async def main():
            h = body()
            await asyncio.sleep(delay + 0.1)
            return h

        run(main)
    else:
        body()
        time.sleep(delay + 0.1)
    assert cb.calls == []
    s = tt.stats()
    assert s["scheduled"] == 1 and s["cancelled"] == 1 and s["ran"] == 0


def handed_to_the_loop(tt: Any, handle: Any, n: int) -> Callable[[], bool]:
    """For :func:`wait_until`: ``handle``, scheduled inside its running loop,
    is due there: the native core posted it to the loop's port (the ``n``-th
    post), or, on the pure backend, which keeps it on the loop's own heap,
    its deadline passed (docs/design.rst, "The pure-Python backend")."""
    if bucketimer.backend == "native":
        return posted_at_least(tt, n)
    return lambda: time.monotonic() >= handle.when()


#: the ``posted`` count once a loop ran a timer: the pure backend counts a
#: timer of its loop's heap as posted when the loop runs it
POSTED_WITH_ONE_RUN = 2 if bucketimer.backend == "native" else 1


def test_cancel_after_post_before_run_wins_in_the_loop(tt, run, wait_until):
    """The loop thread is blocked inside a callback while a second timer comes
    due and is posted to the loop's port; cancelling it then must win."""

    async def main():
        victim = Recorder("victim")
        result = {}

        def blocker():
            # The timer thread posts the victim (the 2nd post) while we block.
            result["posted"] = wait_until(handed_to_the_loop(tt, hv, 2), 5)
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
    assert (s["posted"], s["cancelled"], s["ran"]) == (POSTED_WITH_ONE_RUN, 1, 1)


def test_cancel_after_post_before_run_from_another_thread(tt, run, wait_until):
    async def main():
        victim = Recorder("victim")
        result = {}
        cancelled = threading.Event()

        def canceller():
            result["posted"] = wait_until(handed_to_the_loop(tt, hv, 2), 5)
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
        result["posted"] = wait_until(posted_at_least(tt, 2), 5)
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


@pytest.mark.native
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


@pytest.mark.native
def test_stale_handle_of_a_cancelled_timer_cannot_cancel_the_slots_new_timer(tt, wait_until):
    never = Recorder("never")
    # (due well after any stall between arm and cancel: without a loop, the
    # dispatcher may run it the moment it is due)
    old = tt.call_later(0.2, never)
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


@pytest.mark.native
def test_an_id_from_one_core_cancels_nothing_on_another(cffi_core: Callable[..., Any]) -> None:
    """Through the C API (``bucketimer._cffi``): a core answers BT_UNKNOWN for
    another core's ids and keeps its own timers, both for the first timer a
    thread schedules on each core and after slots were reused."""
    from bucketimer._cffi import ffi, lib

    def manual_core() -> tuple[Any, Any]:
        tt = cffi_core(manual_clock=1, manual_start_ns=1000)
        port = ffi.new("bt_port **")
        assert lib.bt_port_open(tt, 0, port) == 0
        return tt, port[0]

    (a, pa), (b, pb) = manual_core(), manual_core()
    ids = ffi.new("uint64_t[2]")
    buf = ffi.new("uint64_t[4]")
    for round_ in range(3):  # first use of the slots, then reused ones
        deadline = 2000 + round_
        assert lib.bt_schedule_port(a, deadline, pa, ffi.NULL, ids + 0) == 0
        assert lib.bt_schedule_port(b, deadline, pb, ffi.NULL, ids + 1) == 0
        id_a, id_b = ids[0], ids[1]
        assert id_a != id_b
        assert lib.bt_cancel(a, id_b) == lib.BT_UNKNOWN
        assert lib.bt_cancel(b, id_a) == lib.BT_UNKNOWN
        # Both timers are still there: they fire, on their own core.
        assert lib.bt_advance(a, deadline) == 1 and lib.bt_advance(b, deadline) == 1
        assert lib.bt_port_drain_ids(pa, buf, 4) == 1 and buf[0] == id_a
        assert lib.bt_port_drain_ids(pb, buf, 4) == 1 and buf[0] == id_b



def test_one_meaning_per_method_on_a_timer_threads_handle(tt, wait_until):
    """A TimerThread's Handle: cancel() says whether this call won,
    cancelled() whether a cancel won (not merely that one was asked for),
    and when() keeps an int given to call_at, as asyncio's handles do."""
    ran = Recorder()
    h_ran = tt.call_later(0, ran)
    ran.wait()
    assert wait_until(lambda: h_ran.callback is None)
    assert h_ran.cancel() is False and not h_ran.cancelled()
    at = int(tt.time()) + 3600
    h = tt.call_at(at, print)
    assert type(h.when()) is int and h.when() == at
    assert type(tt.call_at(float(at), print).when()) is float
    assert h.cancel() is True and h.cancelled()
    assert h.cancel() is False and h.cancelled()
    assert type(h).__name__ == "Handle"
