"""Dropped without ``close()``: every object bucketimer makes is collected as
asyncio's are, and gives back its threads and fds (docs/guarantees.rst,
"Dropped without close()").

Each test makes one kind of resource, uses it as a program would (timers run
and timers left pending), drops the last reference without closing it, and
does that :data:`ROUNDS` times; the process's fds, Python threads and OS
threads must come back to where they were (the default TimerThread, which
lives on, started before counting).  Where asyncio warns of what was not
closed (``ResourceWarning: unclosed event loop``), bucketimer's loop warns
the same; a TimerThread warns as a loop does.  The cyclic GC runs every
:data:`EVERY` rounds, as it would in a program that allocates.  On both
backends.

uvloop's own loop is not collected once it has run (its idle and check
handles hold it: a stock ``uvloop.Loop`` that ran a coroutine and was
dropped keeps its fds), so the uvloop loops are dropped before they run,
which uvloop collects, with bucketimer's timers armed on them.
"""

from __future__ import annotations

import asyncio
import gc
import os
import threading
import time
import warnings
import weakref
from collections.abc import Callable

import pytest
from _helpers import TIME_SCALE

import bucketimer
from bucketimer import loop as bt_loop

try:
    import uvloop
except ImportError:  # pragma: no cover
    uvloop = None

ROUNDS = 100
EVERY = 10

pytestmark = pytest.mark.timeout(120 * TIME_SCALE)


def _counts() -> tuple[int, int, int]:
    return (len(os.listdir("/proc/self/fd")), threading.active_count(),
            len(os.listdir("/proc/self/task")))


def _start_default() -> None:
    ran = threading.Event()
    bucketimer.call_later(0, ran.set)
    assert ran.wait(5)


def _settled() -> tuple[int, int, int]:
    """The counts once what earlier tests left behind is gone: collected,
    and the threads they woke exited (the same counts twice, 50 ms apart)."""
    last = None
    end = time.monotonic() + 5 * TIME_SCALE
    while time.monotonic() < end:
        gc.collect()
        if (now := _counts()) == last:
            break
        last = now
        time.sleep(0.05)
    return _counts()


def _growth(make_and_drop: Callable[[], None], *warned: str) -> tuple[int, ...]:
    """(fds, threads, OS threads) that :data:`ROUNDS` of ``make_and_drop``
    left, once the threads they woke have exited (waited for, a few seconds
    at most) and the count of fds holds still.  Each warning they gave is a ResourceWarning that starts with
    one of ``warned`` (none given: no warning at all)."""
    _start_default()
    before = _settled()
    texts: list[str] = []

    def note(message: object, category: type, *args: object, **kwargs: object) -> None:
        # the text only: a WarningMessage would keep its source alive
        texts.append(f"{category.__name__}: {message}")

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = note
        for i in range(ROUNDS):
            make_and_drop()
            if i % EVERY == EVERY - 1:
                gc.collect(1)  # the young generations: where the rounds' garbage is
        _start_default()
        gc.collect()
        end = time.monotonic() + 5 * TIME_SCALE
        # (until all are back, or for 5 s: on a loaded machine a closed
        # TimerThread's fd can go some polls after its thread has)
        while _counts() != before and time.monotonic() < end:
            time.sleep(0.05)
            gc.collect()
    if warned:
        assert texts and all(t.startswith(tuple(f"ResourceWarning: {w}" for w in warned))
                             for t in texts), texts
    else:
        assert texts == []
    return tuple(now - was for now, was in zip(_counts(), before))


def _given_back(make_and_drop: Callable[[], None], *warned: str) -> None:
    assert _growth(make_and_drop, *warned) == (0, 0, 0), "(fds, threads, OS threads) left"


def _noop(*args: object) -> None:
    pass


# -- TimerThreads ------------------------------------------------------------------


def test_a_timer_thread_that_ran_a_timer():
    def once() -> None:
        tt = bucketimer.TimerThread()
        ran = threading.Event()
        tt.call_later(0, ran.set)  # its dispatcher thread starts
        assert ran.wait(5)

    _given_back(once, "unclosed TimerThread")


def test_a_timer_thread_with_pending_timers():
    """A TimerThread nobody references (its handles included) is closed
    when collected: its pending timers are dropped, as close() drops them."""
    ran: list[int] = []

    def once() -> None:
        tt = bucketimer.TimerThread()
        tt.call_later(0, _noop)
        tt.call_later(1000, ran.append, 1)

    _given_back(once, "unclosed TimerThread")
    assert ran == []


def test_closed_default_timer_threads():
    """The default TimerThread, closed, is made anew on next use: the closed
    ones go, without a warning (they were closed)."""

    def once() -> None:
        _start_default()
        bucketimer.default_timer_thread().close()

    _given_back(once)


# -- loops ---------------------------------------------------------------------------


async def _use() -> None:
    """What a program does on a loop: timeouts entered and left, timers of
    bucketimer's that ran, and timers, a timeout and a task left pending
    when the loop is dropped."""
    loop = asyncio.get_running_loop()
    async with bucketimer.timeout(10):
        await asyncio.sleep(0)
    await bucketimer.wait_for(asyncio.sleep(0), 10)
    ran = asyncio.Event()
    bucketimer.call_later(0, ran.set)
    await ran.wait()
    bucketimer.call_later(1000, _noop)
    loop.call_later(1000, _noop)

    async def stuck() -> None:
        async with bucketimer.timeout(1000):
            await asyncio.sleep(1000)

    loop.create_task(stuck())
    await asyncio.sleep(0)


LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "stock loop": asyncio.new_event_loop,
    "drop-in loop": bt_loop.new_event_loop,
}


@pytest.mark.parametrize("patched", [False, True], ids=["helpers", "patch_asyncio"])
@pytest.mark.parametrize("kind", sorted(LOOPS))
def test_a_loop_with_pending_timers(kind, patched):
    """Dropped unclosed, with pending timers (its own, the helpers', the
    default TimerThread's for it) and a pending task: collected with all of
    them, its fds closed, warned as asyncio warns; the TimerThread that
    served it lives on and keeps nothing of it."""
    make = LOOPS[kind]
    made: list[weakref.ref[asyncio.AbstractEventLoop]] = []

    def once() -> None:
        loop = make()
        made.append(weakref.ref(loop))
        loop.run_until_complete(_use())
        # the pending task's "was destroyed but it is pending!" goes to the
        # loop's exception handler: not this test's subject
        loop.set_exception_handler(lambda loop, context: None)

    if patched:
        bucketimer.patch_asyncio()
    try:
        _given_back(once, "unclosed event loop", "unclosed <socket")
    finally:
        if patched:
            bucketimer.unpatch_asyncio()
    assert [r for r in made if r() is not None] == []
    assert _loops_known(bucketimer.default_timer_thread()) == {}


def _loops_known(tt: bucketimer.TimerThread) -> dict[object, object]:
    """What ``tt`` keeps per loop: the native record of ports, or the pure
    scheduler's outboxes and the claims of its timers on loops' heaps.  The
    pure scheduler drops the claims of loops gone at its next sweep, made
    by ``stats()`` or by a later loop's timer once they doubled."""
    if bucketimer.backend == "native":
        return dict(tt._ports)  # type: ignore[attr-defined]
    tt.stats()
    known: dict[object, object] = dict(tt._sched._loops)  # type: ignore[attr-defined]
    known.update(tt._sched._claims)  # type: ignore[attr-defined]
    return known


@pytest.mark.skipif(uvloop is None, reason="uvloop is not installed")
@pytest.mark.parametrize("kind", ["uvloop", "drop-in uvloop"])
def test_a_uvloop_with_pending_timers(kind):
    """A uvloop loop dropped before it ran, with timers of bucketimer's armed
    on it from outside: collected with them, leaving what a stock uvloop
    loop with a timer of its own leaves."""
    make = uvloop.new_event_loop if kind == "uvloop" else bt_loop.new_uv_event_loop

    def plain() -> None:
        uvloop.new_event_loop().call_later(1000, _noop)

    def once() -> None:
        loop = make()
        bucketimer.call_later(1000, _noop, loop=loop)
        loop.call_later(1000, _noop)

    plain()  # what uvloop makes once, for its first loop
    assert _growth(once) == _growth(plain)


def test_a_loop_served_by_its_own_timer_thread():
    """A drop-in loop with a TimerThread of its own, both dropped together."""

    def once() -> None:
        loop = bt_loop.EventLoop(timer_thread=bucketimer.TimerThread())
        loop.run_until_complete(_use())
        loop.set_exception_handler(lambda loop, context: None)

    # (a loop collected unclosed in a cycle may have its self-pipe's sockets
    # finalised first, as asyncio's own does: they warn too)
    _given_back(once, "unclosed event loop", "unclosed TimerThread", "unclosed <socket")


def test_handles_and_timeouts_of_a_closed_loop():
    """A loop closed with pending timers: what its code held (the handles,
    an entered Timeout), let go afterwards, keeps no fd or thread."""

    def once() -> None:
        loop = bt_loop.new_event_loop()
        kept: list[object] = []

        async def main() -> None:
            kept.append(loop.call_later(1000, _noop))
            kept.append(bucketimer.call_later(1000, _noop))
            cm = bucketimer.timeout(1000)
            await cm.__aenter__()
            kept.append(cm)

        loop.run_until_complete(main())
        loop.close()

    _given_back(once)
