"""A timer due in the core reaches the loop before a timeout entered after
its deadline passed, as in asyncio's heap (docs/design.rst, "Order on the
loop"), however late the timer thread is.

The timer thread is held (``TimerThread._test_hold``, a test-only hook: it
starts no pass, as a thread waiting for a CPU would) while the task is held
past the deadline between two ``async with``: CPython's
``test_timeouts.test_nested_timeouts`` on a busy machine, made
deterministic.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest
from _impls import IMPLS, STOCK_POLL_LOOKS

import bucketimer
from bucketimer import aio

# How long the thread stays held: a timer thread that waited this long for
# a CPU.  The loop must not run ahead of it in the meantime.
HELD_FOR = 0.3


@pytest.fixture
def held() -> Iterator[threading.Timer]:
    """Holds the default TimerThread's thread; lets it go after HELD_FOR
    from when the test starts the timer, and at the end in any case."""
    tt = bucketimer.default_timer_thread()
    tt._test_hold(True)
    release = threading.Timer(HELD_FOR, tt._test_hold, (False,))
    try:
        yield release
    finally:
        release.cancel()
        tt._test_hold(False)


def test_nested_timeouts_with_the_timer_thread_held(run, held):
    async def main():
        loop = asyncio.get_running_loop()
        cancelled = False
        with pytest.raises(TimeoutError):
            deadline = loop.time() + 0.01
            async with aio.timeout_at(deadline) as cm1:
                time.sleep(0.03)  # the task held past the deadline
                held.start()
                try:
                    async with aio.timeout_at(deadline) as cm2:
                        await asyncio.sleep(10)
                except asyncio.CancelledError:
                    cancelled = True
                    raise
        # Only the outer one raises; both expired.
        return cancelled, cm1.expired(), cm2.expired()

    assert run(main()) == (True, True, True)


def test_a_due_timer_runs_before_a_passed_timeout_fires(run, held):
    """A plain timer of the loop, due before a timeout is entered with a
    deadline already passed, runs first: the order of their deadlines."""
    assert due_timer_then_passed_timeout(run, held) == ["timer", "timeout"]


def due_timer_then_passed_timeout(run, held) -> list[str]:
    order = []

    async def main():
        loop = asyncio.get_running_loop()
        tt = bucketimer.default_timer_thread()
        tt.call_at(loop.time() + 0.005, order.append, "timer", loop=loop)
        time.sleep(0.02)
        held.start()
        try:
            async with aio.timeout(0):
                await asyncio.sleep(10)
        except TimeoutError:
            order.append("timeout")

    run(main())
    return order


def test_a_timer_due_while_a_callback_holds_the_loop_waits_for_the_next_iteration(run, t, request):
    """asyncio's selector loop moves a timer to its ready queue in the first
    iteration whose poll came after its deadline, so a task that held the
    loop past a timeout's deadline and then yielded runs again before that
    timeout expires.  On the drop-in loop a drain already queued for that
    iteration (a callback due before it) leaves the timeout's timer, due
    after the iteration's poll, to the next one.  (uvloop runs such a timer
    first; the helpers there do as asyncio's own timeout does.)"""

    def program(helpers: Any) -> list[str]:
        async def main():
            loop = asyncio.get_running_loop()
            loop.call_later(0, lambda: None)  # due at once: a drain this iteration
            time.sleep(0.02)  # ... which the timer thread has posted by the poll
            out = []

            async def task():
                async with helpers.timeout(None) as cm:
                    cm.reschedule(loop.time() + 0.02)
                    time.sleep(0.06)  # the deadline passes while the task holds the loop
                    await asyncio.sleep(0)
                out.append(f"left normally, expired={cm.expired()}")

            try:
                await loop.create_task(task())
            except TimeoutError:
                out.append("TimeoutError")
            return out

        return run(main())

    expected = program(IMPLS["asyncio"])
    if request.node.callspec.params["run"] != "uvloop":
        assert expected == ["left normally, expired=False"]
    assert program(t) == expected


def test_a_timer_due_while_a_callback_holds_the_loop_runs_after_a_passed_timeout(run, t, request):
    """The same rule where a timeout is entered with its deadline passed: its
    expiry, queued in this iteration, runs before a loop timer that fell due
    while this iteration's callback held the loop (asyncio moves that timer
    at the next iteration's start, after the expiry).  The helpers ask the
    core for the timers due, and queue their drain before the expiry, only
    up to the iteration's poll.  A run whose task began after the loop
    timer's deadline (a machine that paused the loop 20 ms between two
    iterations) is void: that timer was due at the poll before the task, and
    runs first everywhere.  It runs again, up to three times."""

    def program(helpers: Any) -> list[object] | None:
        async def main():
            loop = asyncio.get_running_loop()
            seen: list[object] = []
            cms: list[Any] = []
            due = loop.time() + 0.02  # no later than the timer's deadline
            loop.call_later(0.02, lambda: seen.append(cms[0].expired() if cms else "first"))

            async def task():
                if loop.time() >= due:
                    return None
                time.sleep(0.06)  # the loop timer falls due meanwhile
                async with helpers.timeout(0) as cm:
                    cms.append(cm)
                    await asyncio.sleep(10)

            try:
                if await loop.create_task(task()) is None:
                    return None
            except TimeoutError:
                return seen
            raise AssertionError("the timeout did not expire")

        return run(main())

    for _ in range(3):
        expected, got = program(IMPLS["asyncio"]), program(t)
        if expected is not None and got is not None:
            break
    else:
        pytest.fail("the task began after the loop timer's deadline in three runs (a stalled machine)")
    if request.node.callspec.params["run"] != "uvloop":
        assert expected == [True]
    assert got == expected


# -- deadlines that pass between two iterations --------------------------------------
#
# asyncio runs a timer in the first iteration whose poll comes after its
# deadline, however short the deadline: the loop, not a thread, looks at
# the heap.  bucketimer's timers do the same on asyncio's selector loops
# (the drop-in loop, and a stock loop once bucketimer's timers go to it):
# the poll runs the pass for the loop's port when one of its timers may be
# due (docs/design.rst, "Order on the loop").  On uvloop, whose poll has no
# such hook, such a timer waits for the timer thread (docs/asyncio.rst,
# "Deliberate differences").

#: (name, loop factory, patch_asyncio?, helpers): every mode on asyncio's
#: selector loop; "stock asyncio" is the reference.
SELECTOR_MODES = [
    ("stock asyncio", asyncio.SelectorEventLoop, False, IMPLS["asyncio"]),
    ("helpers on the stock loop", asyncio.SelectorEventLoop, False, IMPLS["bucketimer"]),
    ("drop-in loop", bucketimer.EventLoop, False, IMPLS["asyncio"]),
    ("patch_asyncio()", asyncio.SelectorEventLoop, True, None),
    ("patch_asyncio() + drop-in loop", bucketimer.EventLoop, True, None),
]
#: the modes whose poll looks at what is due: a stock loop's only where
#: bucketimer may wrap its selector
POLL_LOOKS = {"helpers on the stock loop": STOCK_POLL_LOOKS, "patch_asyncio()": STOCK_POLL_LOOKS}


def _skip_where_the_poll_does_not_look(mode: tuple[Any, ...]) -> None:
    if not POLL_LOOKS.get(mode[0], True):
        pytest.skip("BUCKETIMER_PUBLIC_API: the stock loop's selector is not wrapped, so its "
                    "timers run when the timer thread posts them (docs/asyncio.rst, "
                    "\"One contract\")")


def _in_mode(mode: tuple[Any, ...], main: Any) -> Any:
    """Runs main(helpers) in ``mode``; patched modes look the helpers up on
    the asyncio package."""
    _, factory, patched, helpers = mode
    if patched:
        bucketimer.patch_asyncio()
    try:
        with asyncio.Runner(loop_factory=factory) as runner:
            return runner.run(main(asyncio if patched else helpers))
    finally:
        if patched:
            bucketimer.unpatch_asyncio()


@pytest.mark.parametrize("mode", SELECTOR_MODES, ids=[m[0] for m in SELECTOR_MODES])
def test_a_wait_for_shorter_than_an_iteration_times_out_as_on_asyncio(mode):
    """``wait_for(coroutine, 1e-6)``: a coroutine that needs K >= 2 loop
    iterations never finishes first on stock asyncio, whose next iteration
    runs the timeout's timer; 300 tries for each K, in every mode whose
    poll looks at what is due."""
    _skip_where_the_poll_does_not_look(mode)

    async def main(helpers: Any) -> dict[int, int]:
        async def needs(k: int) -> str:
            for _ in range(k):
                await asyncio.sleep(0)
            return "done"

        timed_out = {}
        for k in (2, 3, 5, 10):
            timed_out[k] = 0
            for _ in range(300):
                try:
                    await helpers.wait_for(needs(k), 1e-6)
                except TimeoutError:
                    timed_out[k] += 1
        return timed_out

    assert _in_mode(mode, main) == {2: 300, 3: 300, 5: 300, 10: 300}


def _tries(once: Callable[[list[str]], Awaitable[None]], n: int = 50) -> Any:
    """A ``main(helpers)`` for :func:`_in_mode` that runs ``once(order)`` ``n``
    times, each with a fresh list its callbacks append to, and counts each
    order seen (``{"BA": 50}``)."""

    async def main(helpers: Any) -> dict[str, int]:
        seen: dict[str, int] = {}
        for _ in range(n):
            order: list[str] = []
            await once(order)
            seen["".join(order)] = seen.get("".join(order), 0) + 1
        return seen

    return main


@pytest.mark.parametrize("mode", SELECTOR_MODES, ids=[m[0] for m in SELECTOR_MODES])
def test_due_timers_from_separate_passes_run_in_deadline_order(mode):
    """A timer due at once, then (the loop's thread busy, the timer thread
    posting each in a pass of its own) one with an earlier deadline already
    passed: both run in the next iteration, the earlier deadline first, as
    asyncio's heap has them; 50 tries."""

    async def once(order: list[str]) -> None:
        loop = asyncio.get_running_loop()
        loop.call_later(0, order.append, "A")
        time.sleep(0.003)
        loop.call_at(loop.time() - 1, order.append, "B")
        time.sleep(0.003)
        for _ in range(2):
            await asyncio.sleep(0)

    assert _in_mode(mode, _tries(once)) == {"BA": 50}


@pytest.mark.parametrize("mode", SELECTOR_MODES, ids=[m[0] for m in SELECTOR_MODES])
def test_a_due_timer_armed_after_the_poll_runs_in_the_next_iteration(mode):
    """A timer due at an iteration's poll runs in that iteration; one that a
    callback of the iteration arms, already due and with an earlier
    deadline, runs in the next, after it: asyncio moved the first to its
    ready queue at the poll and pushes the second on its heap after.  The
    callback holds the loop while the timer thread posts the second beside
    the first; 50 tries."""
    _skip_where_the_poll_does_not_look(mode)

    def arm_an_earlier_one(order: list[str]) -> None:
        loop = asyncio.get_running_loop()
        loop.call_at(loop.time() - 1, order.append, "B")
        time.sleep(0.003)

    async def once(order: list[str]) -> None:
        loop = asyncio.get_running_loop()
        loop.call_soon(arm_an_earlier_one, order)
        loop.call_later(0, order.append, "A")
        for _ in range(3):
            await asyncio.sleep(0)

    assert _in_mode(mode, _tries(once)) == {"AB": 50}


@pytest.mark.parametrize("mode", SELECTOR_MODES, ids=[m[0] for m in SELECTOR_MODES])
def test_a_timer_of_a_loops_first_iteration_with_bucketimer_waits_for_the_next_poll(mode):
    """A stock loop's poll is watched from bucketimer's first timer for it,
    which comes mid-iteration, after a poll nobody saw.  A timeout entered
    then, whose deadline passes while the task holds the loop, has not
    expired when the task, after a passed timeout queued the loop's drain,
    yields once and leaves it: asyncio runs its timer in the next
    iteration, after the task."""
    _skip_where_the_poll_does_not_look(mode)

    async def main(helpers: Any) -> bool:
        async with helpers.timeout(0.02) as cm:
            time.sleep(0.04)
            async with helpers.timeout(-1):
                pass
            await asyncio.sleep(0)
        return bool(cm.expired())

    assert _in_mode(mode, main) is False
