"""The drop-in loop under anyio's asyncio backend: cancel scopes with deadlines.

anyio arms a scope's deadline with ``loop.call_at`` and disarms it with the
handle's ``cancel()`` when the scope exits or its deadline moves, so on the
drop-in loop every deadline is a native timer; each test checks that on the
TimerThread's counters (``anyio.run`` arms no loop timer of its own, so they
count anyio's).  What is pinned, as anyio documents it:
``fail_after`` raises ``TimeoutError`` and ``move_on_after`` goes on, each at
its deadline and never before; ``deadline`` is ``current_time() + delay``;
``cancel_called`` says the scope was cancelled and ``cancelled_caught`` that
the scope stopped the cancellation itself; a scope in time disarms its timer;
moving a deadline re-arms it.  Nested with :func:`bucketimer.timeout`, in
both orders, whichever deadline comes first wins and the other one stays out
of it: an anyio scope never swallows the Timeout's cancellation, and the
Timeout never turns an anyio cancellation into ``TimeoutError``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from _native_loop import LONG, NativeTimers

anyio = pytest.importorskip("anyio")

import bucketimer  # noqa: E402

# A timeout that must fire.
SHORT = 0.2


def run(native: NativeTimers, fn: Callable[[], Awaitable[Any]]) -> Any:
    """``anyio.run(fn)`` on the asyncio backend, on a drop-in loop."""
    return anyio.run(fn, backend="asyncio", backend_options={"loop_factory": native.loop_factory})


def assert_deadline(deadline: float, before: float, after: float, delay: float) -> None:
    """``deadline`` is ``current_time() + delay``, read between before and after."""
    assert before + delay <= deadline <= after + delay, (before, deadline, after)


def test_fail_after_raises_timeout_error_at_its_deadline(native: NativeTimers) -> None:
    async def main() -> tuple[Any, float, float, float]:
        before = anyio.current_time()
        with pytest.raises(TimeoutError):
            with anyio.fail_after(SHORT) as scope:
                after = anyio.current_time()
                await anyio.sleep(LONG)
        return scope, before, after, anyio.current_time()

    scope, before, after, ended = run(native, main)
    assert_deadline(scope.deadline, before, after, SHORT)
    native.assert_on_time(scope.deadline, ended)
    assert scope.cancel_called and scope.cancelled_caught
    # The deadline fired; the one-hour sleep was disarmed.
    native.assert_native(min_scheduled=2, min_cancelled=1, min_ran=1)


def test_fail_after_in_time_disarms_its_timer(native: NativeTimers) -> None:
    async def main() -> Any:
        with anyio.fail_after(LONG) as scope:
            await anyio.sleep(0.01)
        return scope

    scope = run(native, main)
    assert not scope.cancel_called and not scope.cancelled_caught
    # The sleep ran; the one-hour deadline was cancelled when the scope exited.
    native.assert_native(min_scheduled=2, min_cancelled=1, min_ran=1)


def test_move_on_after_goes_on_at_its_deadline(native: NativeTimers) -> None:
    async def main() -> tuple[Any, float, float, float, str]:
        before = anyio.current_time()
        with anyio.move_on_after(SHORT) as scope:
            after = anyio.current_time()
            await anyio.sleep(LONG)
        return scope, before, after, anyio.current_time(), "went on"

    scope, before, after, ended, went_on = run(native, main)
    assert went_on == "went on"
    assert_deadline(scope.deadline, before, after, SHORT)
    native.assert_on_time(scope.deadline, ended)
    assert scope.cancel_called and scope.cancelled_caught
    native.assert_native(min_scheduled=2, min_cancelled=1, min_ran=1)


def test_move_on_after_in_time(native: NativeTimers) -> None:
    async def main() -> Any:
        with anyio.move_on_after(LONG) as scope:
            await anyio.sleep(0)
        return scope

    scope = run(native, main)
    assert not scope.cancel_called and not scope.cancelled_caught
    native.assert_native(min_scheduled=1, min_cancelled=1)


def test_moving_a_deadline_rearms_the_timer(native: NativeTimers) -> None:
    async def main() -> tuple[Any, float, float]:
        with anyio.move_on_after(LONG) as scope:
            await anyio.sleep(0)
            moved = anyio.current_time() + SHORT
            scope.deadline = moved
            await anyio.sleep(LONG)
        return scope, moved, anyio.current_time()

    scope, moved, ended = run(native, main)
    assert scope.deadline == moved
    native.assert_on_time(moved, ended)
    assert scope.cancel_called and scope.cancelled_caught
    # The one-hour deadline and sleep were cancelled, the moved deadline ran.
    native.assert_native(min_scheduled=3, min_cancelled=2, min_ran=1)


def test_a_deadline_cancels_every_task_of_a_task_group(native: NativeTimers) -> None:
    cancelled: list[int] = []

    async def sleeper(i: int) -> None:
        try:
            await anyio.sleep(LONG)
        except anyio.get_cancelled_exc_class():
            cancelled.append(i)
            raise

    async def main() -> Any:
        with anyio.move_on_after(SHORT) as scope:
            async with anyio.create_task_group() as tg:
                for i in range(3):
                    tg.start_soon(sleeper, i)
        return scope

    scope = run(native, main)
    assert sorted(cancelled) == [0, 1, 2]
    assert scope.cancel_called and scope.cancelled_caught
    native.assert_native(min_scheduled=4, min_cancelled=3, min_ran=1)


# -- nested with bucketimer.timeout ----------------------------------------------------


def default_tt_delta() -> Callable[[], dict[str, int]]:
    """bucketimer.timeout arms on the default TimerThread: its counters since now."""
    tt = bucketimer.default_timer_thread()
    start = tt.stats()

    def delta() -> dict[str, int]:
        now = tt.stats()
        return {k: now[k] - start[k] for k in ("scheduled", "cancelled", "ran")}

    return delta


def test_anyio_scope_outside_fires_first(native: NativeTimers) -> None:
    """move_on_after(SHORT) around timeout(LONG): anyio's deadline wins; the
    Timeout neither expires nor turns the cancellation into TimeoutError."""
    bt_delta = default_tt_delta()

    async def main() -> tuple[Any, Any]:
        with anyio.move_on_after(SHORT) as scope:
            async with bucketimer.timeout(LONG) as t:
                await anyio.sleep(LONG)
        return scope, t

    scope, t = run(native, main)
    assert scope.cancel_called and scope.cancelled_caught
    assert not t.expired()
    native.assert_native(min_scheduled=2, min_cancelled=1, min_ran=1)
    d = bt_delta()
    if bucketimer.backend == "native":  # bucketimer.timeout's timer is in the core
        assert d["scheduled"] >= 1 and d["cancelled"] >= 1, d


def test_bucketimer_timeout_inside_fires_first(native: NativeTimers) -> None:
    """move_on_after(LONG) around timeout(SHORT): the Timeout raises
    TimeoutError, which the anyio scope lets through; anyio never cancelled,
    and the task is not left cancelling."""
    bt_delta = default_tt_delta()

    async def main() -> tuple[Any, Any, float, float, int]:
        with anyio.move_on_after(LONG) as scope:
            with pytest.raises(TimeoutError):
                async with bucketimer.timeout(SHORT) as t:
                    when = t.when()
                    await anyio.sleep(LONG)
            ended = asyncio.get_running_loop().time()
            await anyio.sleep(0)  # not cancelled again
        task = asyncio.current_task()
        assert task is not None
        return scope, t, when, ended, task.cancelling()

    scope, t, when, ended, cancelling = run(native, main)
    assert t.expired()
    native.assert_on_time(when, ended)
    assert not scope.cancel_called and not scope.cancelled_caught
    assert cancelling == 0
    native.assert_native(min_scheduled=2, min_cancelled=2)
    d = bt_delta()
    if bucketimer.backend == "native":  # bucketimer.timeout's timer is in the core
        assert d["scheduled"] >= 1 and d["ran"] >= 1, d


def test_bucketimer_timeout_outside_fires_first(native: NativeTimers) -> None:
    """timeout(SHORT) around move_on_after(LONG): the anyio scope does not
    swallow the Timeout's cancellation (not an anyio one); TimeoutError
    comes out of the Timeout."""
    bt_delta = default_tt_delta()
    scopes: list[Any] = []

    async def main() -> Any:
        with pytest.raises(TimeoutError):
            async with bucketimer.timeout(SHORT) as t:
                with anyio.move_on_after(LONG) as scope:
                    scopes.append(scope)
                    await anyio.sleep(LONG)
                pytest.fail("the anyio scope swallowed the Timeout's cancellation")
        return t

    t = run(native, main)
    (scope,) = scopes
    assert t.expired()
    assert not scope.cancel_called and not scope.cancelled_caught
    native.assert_native(min_scheduled=2, min_cancelled=2)
    d = bt_delta()
    if bucketimer.backend == "native":  # bucketimer.timeout's timer is in the core
        assert d["scheduled"] >= 1 and d["ran"] >= 1, d


def test_anyio_scope_inside_fires_first(native: NativeTimers) -> None:
    """timeout(LONG) around move_on_after(SHORT): the anyio scope catches its
    own cancellation; the Timeout goes on unexpired.  anyio's effective
    deadline is its own scope's: it does not see asyncio-level timeouts."""
    bt_delta = default_tt_delta()

    async def main() -> tuple[Any, Any, float, str]:
        async with bucketimer.timeout(LONG) as t:
            with anyio.move_on_after(SHORT) as scope:
                effective = anyio.current_effective_deadline()
                await anyio.sleep(LONG)
            await anyio.sleep(0)
            after = "went on"
        return scope, t, effective, after

    scope, t, effective, after = run(native, main)
    assert after == "went on"
    assert effective == scope.deadline
    assert scope.cancel_called and scope.cancelled_caught
    assert not t.expired()
    native.assert_native(min_scheduled=2, min_cancelled=1, min_ran=1)
    d = bt_delta()
    if bucketimer.backend == "native":  # bucketimer.timeout's timer is in the core
        assert d["scheduled"] >= 1 and d["cancelled"] >= 1, d


def test_timeout_wall_clock_matches_the_loop_clock(native: NativeTimers) -> None:
    """anyio's current_time() is the loop's time(), the core's clock: a
    deadline set in it fires, through the core, once ``time.monotonic()``
    has reached it, and not much later."""

    async def main() -> tuple[float, float, float, float, float]:
        a = time.monotonic()
        b = anyio.current_time()
        c = time.monotonic()
        with anyio.move_on_after(SHORT) as scope:
            await anyio.sleep(LONG)
        return a, b, c, scope.deadline, time.monotonic()

    a, b, c, deadline, fired = run(native, main)
    if native.stock_uvloop:
        # libuv's millisecond clock (docs/guarantees.rst, "On the pure-Python backend")
        assert b - 0.002 <= c
    else:
        assert a <= b <= c
    native.assert_on_time(deadline, fired)
    # The deadline fired through the core; the one-hour sleep was disarmed.
    native.assert_native(min_scheduled=2, min_cancelled=1, min_ran=1)
