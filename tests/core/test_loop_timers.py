"""A TimerThread's timer scheduled inside its running loop, on both backends:
what it needs (no thread of bucketimer's on the pure backend, which keeps it
on the loop's own heap: docs/design.rst, "The pure-Python backend"), and
that it keeps the guarantees there: never early whatever the loop's clock
resolution lets asyncio do, the real clock when the loop's own is patched,
and the close of its loop or of its TimerThread ends it unrun, counted as
the core counts it.
"""

from __future__ import annotations

import asyncio
import decimal
import fractions
import gc
import logging
import math
import threading
import time
import weakref
from typing import Any
from unittest import mock

import pytest
from _helpers import dispatcher_held, wait_until

import bucketimer

pytestmark = pytest.mark.timeout(60)

PURE = bucketimer.backend == "python"


def timer_threads() -> set[str]:
    return {t.name for t in threading.enumerate() if t.name.startswith("bucketimer-")}


@pytest.mark.skipif(not PURE, reason="the pure backend keeps a loop's timers on its heap")
def test_a_loop_timer_needs_no_thread_of_bucketimer() -> None:
    """Scheduled, run and cancelled inside its loop, a timer starts no
    thread (the pure scheduler's thread starts with the first timer it
    keeps: one of no loop, or of a loop in another thread)."""
    before = timer_threads()
    tt = bucketimer.TimerThread()
    try:

        async def main() -> list[int]:
            ran: list[int] = []
            tt.call_later(0.01, ran.append, 1)
            assert tt.call_later(10, ran.append, 2).cancel() is True
            await asyncio.sleep(0.05)
            return ran

        assert asyncio.run(main()) == [1]
        assert timer_threads() == before
        tt.call_later(10, print)  # no loop: the thread starts
        assert "bucketimer-timer" in timer_threads()
    finally:
        tt.close()


def test_never_early_when_the_loop_may_run_a_timer_early(tt) -> None:
    """asyncio runs a timer up to the loop's ``_clock_resolution`` before
    its deadline; a TimerThread's callback still never sees the clock
    before ``when()``."""

    async def main() -> list[tuple[float, float]]:
        loop = asyncio.get_running_loop()
        loop._clock_resolution = 0.05  # type: ignore[attr-defined]
        seen: list[tuple[float, float]] = []
        done = loop.create_future()

        def cb(h: list[bucketimer.Handle]) -> None:
            seen.append((time.monotonic(), h[0].when()))
            if len(seen) == 5:
                done.set_result(None)

        for i in range(5):
            box: list[bucketimer.Handle] = []
            box.append(tt.call_later(0.02 + 0.01 * i, cb, box))
        await asyncio.wait_for(done, 5)
        return seen

    seen = asyncio.run(main())
    assert all(at >= when for at, when in seen), seen
    assert tt.stats()["early_fires"] == 0


def test_a_loop_whose_clock_is_patched_gets_the_real_clock(tt) -> None:
    """A loop whose ``time`` is replaced on the instance (a frozen clock
    here): a TimerThread's timer still falls due by ``time.monotonic()``."""

    async def main() -> float:
        loop = asyncio.get_running_loop()
        fired = loop.create_future()
        start = time.monotonic()
        with mock.patch.object(loop, "time", return_value=loop.time()):
            tt.call_later(0.05, lambda: fired.set_result(time.monotonic() - start))
            return await asyncio.wait_for(fired, 5)

    assert asyncio.run(main()) >= 0.05


# Delays at and around the edges of the fast path of ``call_later`` inside a
# running loop: the range it keeps (about 9.2e9 s), ints beyond a float's,
# NaN, infinities, and numbers that are not a float or an int.
EDGE_DELAYS = [0, -1, 0.5, 30, 2**53 + 1, 9.2e9 - 1, 9.2e9, 9.2e9 + 1, -9.2e9, -9.3e9, 2**63,
               10**400, -(10**400), 1e300, -1e300, math.inf, -math.inf, math.nan, -0.0, True,
               decimal.Decimal("30"), decimal.Decimal("NaN"), fractions.Fraction(1, 3), "30",
               None]


def _answer(tt: bucketimer.TimerThread, delay: object) -> tuple[object, ...]:
    """What ``tt.call_later(delay, ...)`` answers, now: its error, or its
    deadline relative to the clock read just before (cancelled at once)."""
    t0 = time.monotonic()
    try:
        h = tt.call_later(delay, print)  # type: ignore[arg-type]
    except Exception as exc:
        return (type(exc), str(exc))
    when = h.when()
    assert h.cancel() is True
    if math.isinf(when):
        return ("when", when)
    return ("in", round(when - t0, 1) if abs(when - t0) < 1e9 else when - t0 > 0)


@pytest.mark.parametrize("delay", EDGE_DELAYS, ids=repr)
def test_a_delay_inside_a_running_loop_answers_as_outside_one(tt, delay: object) -> None:
    """Inside a running loop, where the pure backend keeps the timer on the
    loop's heap by a path of its own, every delay gets what it gets with no
    loop: the same error and message, or the same deadline."""
    # Outside a loop a timer due at once goes to the dispatcher, held
    # meanwhile: it cannot run before _answer cancels it.  (In the loop,
    # nothing runs until the loop is yielded to.)
    with dispatcher_held(tt):
        outside = _answer(tt, delay)

    async def inside() -> tuple[object, ...]:
        return _answer(tt, delay)

    assert asyncio.run(inside()) == outside
    stats = tt.stats()
    assert stats["scheduled"] == stats["cancelled"] + 1  # (+ the hold)


@pytest.mark.parametrize("ender", [
    "the loop's close", "the drop-in loop's close", "close()",
    pytest.param("the loop going unclosed", marks=pytest.mark.skipif(
        not PURE, reason="a loop on the pure backend is freed as asyncio's is")),
])
def test_a_loop_timer_ended_unrun_is_counted_as_cancelled(ender: str) -> None:
    """Scheduled inside its running loop, then its loop or its TimerThread
    closed before it was due (or the loop freed without a close): it never
    runs, it counts as cancelled, and its handle says neither cancelled nor
    cancellable.  The drop-in loop's close and the TimerThread's let go of
    its callback at once."""
    tt = bucketimer.TimerThread()
    try:
        ran: list[int] = []

        async def main() -> bucketimer.Handle:
            return tt.call_later(0.05, ran.append, 1)

        loop = bucketimer.new_event_loop() if "drop-in" in ender else asyncio.new_event_loop()
        h = loop.run_until_complete(main())
        if ender == "close()":
            tt.close()
            assert h.callback is None
            loop.run_until_complete(asyncio.sleep(0.1))  # past its deadline
        elif "drop-in" in ender:
            loop.close()
            assert h.callback is None
        if ender == "the loop going unclosed":
            with pytest.warns(ResourceWarning, match="unclosed event loop"):
                del loop, h
                gc.collect()
        else:
            loop.close()
        assert wait_until(lambda: tt.stats()["cancelled"] == 1, 5), tt.stats()
        s = tt.stats()
        assert (s["scheduled"], s["ran"], s["cancelled"], s["dropped"]) == (1, 0, 1, 0), s
        if ender != "the loop going unclosed":
            assert h.cancel() is False and not h.cancelled()
        assert ran == []
    finally:
        tt.close()


def test_a_cancel_from_another_thread_wins_or_the_callback_runs(tt) -> None:
    """Timers of a running loop, cancelled from another thread as they fall
    due: each either ran or had ``cancel()`` return True, never both nor
    neither."""
    n = 300
    ran: set[int] = set()
    won: set[int] = set()

    async def main() -> None:
        loop = asyncio.get_running_loop()
        handles = [tt.call_later(0.001 * (i % 30), ran.add, i) for i in range(n)]

        def cancel_all() -> None:
            for i, h in enumerate(handles):
                if h.cancel():
                    won.add(i)

        await loop.run_in_executor(None, cancel_all)
        await asyncio.sleep(0.1)

    asyncio.run(main())
    assert not ran & won
    assert ran | won == set(range(n))
    s = tt.stats()
    assert (s["ran"], s["cancelled"]) == (len(ran), len(won))


def test_the_pure_backend_knows_asyncios_handles() -> None:
    """The pure backend makes asyncio's timer handles itself, and keeps a
    loop's timers on its heap, only where asyncio's ``Handle`` and
    ``TimerHandle`` have the slots it sets (3.11 to 3.15 do): a CPython that
    changes them fails here rather than getting the slower paths unseen."""
    from bucketimer._pure import _loop_timer

    assert _loop_timer.SLOTS_KNOWN
    assert _loop_timer.heap_type(asyncio.SelectorEventLoop)
    assert _loop_timer.heap_type(bucketimer.EventLoop) == PURE


@pytest.mark.skipif(not PURE, reason="the pure backend's claims of timers on loops' heaps")
def test_loops_freed_with_timers_pending_leave_nothing_behind() -> None:
    """A long-lived loop keeps many timers pending while short-lived loops
    come and go, each leaving two pending: their claims go with them (swept
    as a later loop's first timer finds twice as many claims as the last
    sweep left, so memory stays bounded and a sweep's cost is paid by the
    claims it found), ``stats()`` counts them cancelled, and a loop made
    where a freed one was (CPython reuses the address: the same id) is not
    taken for it."""
    tt = bucketimer.TimerThread()
    sched = tt._sched  # type: ignore[attr-defined]
    kept = asyncio.new_event_loop()

    async def arm(n: int) -> None:
        for _ in range(n):
            tt.call_later(30, print)

    try:
        kept.run_until_complete(arm(300))
        sizes = []
        for _ in range(400):
            short = asyncio.new_event_loop()
            short.run_until_complete(arm(2))
            short.close()
            del short  # (a closed loop is freed by reference counting)
            sizes.append(len(sched._claims))
        assert max(sizes) <= 2 * 300 + 2, max(sizes)
        # swept as the first short loop came (nothing to drop yet), then each
        # time 300 more claims of loops gone had piled up
        assert sizes.count(300 + 2) >= 3, sizes
        # a loop where a freed one was, its claims not yet swept: made until
        # CPython gives one the address (it reuses a freed block first)
        for _ in range(20):
            short = asyncio.new_event_loop()
            short.run_until_complete(arm(2))
            lid = id(short)
            short.close()
            del short
            later = asyncio.new_event_loop()
            later.run_until_complete(arm(2))
            reused = id(later) == lid
            s = tt.stats()
            assert (s["heap_size"], len(sched._claims)) == (302, 302), s
            later.close()
            del later
            if reused:
                break
        s = tt.stats()
        assert s["heap_size"] == 300 and len(sched._claims) == 300, s
        assert s["scheduled"] == s["cancelled"] + 300, s
        # (and the rule itself, whatever the allocator does: a claim whose
        # loop's record is dead is swept, though a loop alive may have that
        # loop's id by then)
        gone = asyncio.new_event_loop()
        record = weakref.ref(gone)
        gone.close()
        del gone
        assert record() is None
        sched._claims[0] = record
        tt.stats()
        assert 0 not in sched._claims and len(sched._claims) == 300
    finally:
        kept.close()
        tt.close()


def test_a_timer_on_a_debug_mode_loop_is_reported_as_asyncio_reports_one(tt, caplog) -> None:
    """In debug mode asyncio's default handler reads the running handle's
    ``_source_traceback`` as a traceback, and the pure backend keeps its
    timer's id there: while a TimerThread's timer runs it has none, so
    that what it reports, or raises, is reported as by a handle made
    before debug mode, and it keeps its id."""
    seen: list[int] = []

    def report() -> None:
        seen.append(handles[0].id)
        asyncio.get_running_loop().call_exception_handler({"message": "reported"})

    def boom() -> None:
        raise ZeroDivisionError("boom")

    handles: list[Any] = []

    async def main() -> None:
        asyncio.get_running_loop().set_debug(True)
        handles.append(tt.call_later(0, report))
        handles.append(tt.call_later(0.001, boom))
        await asyncio.sleep(0.05)

    with caplog.at_level(logging.DEBUG, logger="asyncio"):
        asyncio.run(main())
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    firsts = [r.getMessage().splitlines()[0] for r in errors]
    assert len(firsts) == 2 and firsts[0] == "reported", errors
    assert firsts[1].startswith(f"Exception in callback {boom.__qualname__}()"), errors
    assert errors[1].exc_info is not None and errors[1].exc_info[0] is ZeroDivisionError
    assert seen == [handles[0].id] and handles[0].id != handles[1].id
