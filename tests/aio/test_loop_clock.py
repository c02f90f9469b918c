"""The helpers follow the running loop's clock.

A loop whose ``time()`` is not the stock monotonic one (a subclass's
override, a ``time`` set on the instance, a class patched after the helpers
first saw it, a time-travel plugin) gets asyncio's path for that call: the
timeout's timer goes to ``loop.call_at``, so it falls due by the clock the
loop's own timers (``asyncio.sleep``) follow.  Each case runs the helpers
directly and under ``patch_asyncio()``, against asyncio's own as the
reference, on both backends.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import pytest
from _impls import IMPLS

import bucketimer

pytestmark = pytest.mark.timeout(60)

JUMP = 100.0  # seconds the virtual clock jumps; every deadline is well inside it


class JumpLoop(asyncio.SelectorEventLoop):
    """A virtual clock: real time plus an offset the test moves."""

    offset = 0.0

    def time(self) -> float:
        return super().time() + self.offset


@contextlib.contextmanager
def patched() -> Iterator[Any]:
    """asyncio's names under patch_asyncio(): what a patched program calls."""
    bucketimer.patch_asyncio()
    try:
        yield asyncio
    finally:
        bucketimer.unpatch_asyncio()


@pytest.fixture(params=["asyncio", "bucketimer", "patched"])
def helpers(request: pytest.FixtureRequest) -> Iterator[Any]:
    if request.param == "patched":
        with patched() as mod:
            yield mod
    else:
        yield IMPLS[request.param]


def run_on(loop: asyncio.AbstractEventLoop, coro: Any) -> Any:
    try:
        return loop.run_until_complete(coro)  # pytest-timeout is the watchdog
    finally:
        loop.close()


# -- the three helpers on a clock that jumps ------------------------------------------


def jump(loop: Any) -> None:
    loop.offset += JUMP


async def expires_after_jump(helpers: Any, enter: Callable[[Any, Any], Any],
                             move: Callable[[Any], None] = jump) -> float:
    """The time, real seconds, until the timeout raised once the clock jumped
    past its deadline while the task slept on the loop's own timer."""
    loop = asyncio.get_running_loop()
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        async with enter(helpers, loop):
            move(loop)
            await asyncio.sleep(5.0)
    return time.monotonic() - t0


ENTERS = {
    "timeout": lambda h, loop: h.timeout(JUMP / 2),
    "timeout_at": lambda h, loop: h.timeout_at(loop.time() + JUMP / 2),
}


@pytest.mark.parametrize("enter", sorted(ENTERS))
def test_timeout_follows_a_virtual_clock(helpers, enter):
    elapsed = run_on(JumpLoop(), expires_after_jump(helpers, ENTERS[enter]))
    assert elapsed < 2.5  # at once: the deadline passed on the loop's clock


def test_reschedule_follows_a_virtual_clock(helpers):
    async def main() -> float:
        loop = asyncio.get_running_loop()
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            async with helpers.timeout(None) as cm:
                cm.reschedule(loop.time() + JUMP / 2)
                cm.reschedule(loop.time() + JUMP / 4)  # earlier: re-armed
                cm.reschedule(loop.time() + JUMP / 3)  # later: moved
                jump(loop)
                await asyncio.sleep(5.0)
        return time.monotonic() - t0

    assert run_on(JumpLoop(), main()) < 2.5


def test_wait_for_follows_a_virtual_clock(helpers):
    async def main() -> float:
        loop = asyncio.get_running_loop()

        async def slow() -> str:
            jump(loop)
            await asyncio.sleep(5.0)
            return "late"

        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            await helpers.wait_for(slow(), JUMP / 2)
        return time.monotonic() - t0

    assert run_on(JumpLoop(), main()) < 2.5


# -- other ways a loop's clock is replaced ------------------------------------------------


def test_time_patched_on_the_instance(helpers):
    loop = asyncio.new_event_loop()
    real = loop.time()

    def move(lp: Any) -> None:
        lp.time.return_value = real + JUMP

    async def main() -> float:
        with mock.patch.object(loop, "time", return_value=real):
            return await expires_after_jump(helpers, ENTERS["timeout"], move)

    assert run_on(loop, main()) < 2.5


def test_time_set_on_the_instance_then_removed(helpers):
    loop = asyncio.new_event_loop()
    offset = [0.0]
    base = loop.time

    async def main() -> None:
        loop.time = lambda: base() + offset[0]  # type: ignore[method-assign]
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            async with helpers.timeout(JUMP / 2):
                offset[0] = JUMP
                await asyncio.sleep(5.0)
        assert time.monotonic() - t0 < 2.5
        del loop.time  # the stock clock again: a real timeout times out in real time
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            async with helpers.timeout(0.05):
                await asyncio.sleep(5.0)
        assert 0.05 <= time.monotonic() - t0 < 2.5

    run_on(loop, main())


def test_time_patched_on_the_class_after_the_helpers_saw_it(helpers):
    class Late(asyncio.SelectorEventLoop):
        pass

    offset = [0.0]

    async def main() -> None:
        # seen first with the stock clock: a real timeout, in real time
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            async with helpers.timeout(0.01):
                await asyncio.sleep(5.0)
        assert time.monotonic() - t0 < 2.5
        # then the class gets a virtual clock: the next timeout follows it
        Late.time = lambda self: asyncio.BaseEventLoop.time(self) + offset[0]  # type: ignore[method-assign]
        try:
            t0 = time.monotonic()
            with pytest.raises(TimeoutError):
                async with helpers.timeout(JUMP / 2):
                    offset[0] = JUMP
                    await asyncio.sleep(5.0)
            assert time.monotonic() - t0 < 2.5
        finally:
            del Late.time

    run_on(Late(), main())


def test_stock_clock_keeps_native_timers():
    """The check costs nothing in behaviour: on the stock clock the timers
    are still the core's."""
    if bucketimer.backend != "native":
        pytest.skip("the pure backend's helpers are asyncio's own")
    tt = bucketimer.default_timer_thread()

    async def main() -> int:
        before = tt.stats()["scheduled"]
        async with bucketimer.timeout(30):
            await asyncio.sleep(0)
        await bucketimer.wait_for(asyncio.sleep(0), 30)
        return tt.stats()["scheduled"] - before

    assert run_on(asyncio.new_event_loop(), main()) >= 2


# -- a time-travel plugin from PyPI --------------------------------------------------------


def test_looptime_fast_forwards_the_helpers(helpers):
    """looptime (a pytest plugin that fast-forwards a loop's clock while it
    is idle) swaps the loop's class for one with its own ``time()``."""
    looptime = pytest.importorskip("looptime")
    loop = asyncio.new_event_loop()
    looptime.patch_event_loop(loop)

    async def main() -> tuple[float, float]:
        lp = asyncio.get_running_loop()
        t0, v0 = time.monotonic(), lp.time()
        with pytest.raises(TimeoutError):
            async with helpers.timeout(1000):
                await asyncio.sleep(5000)
        with pytest.raises(TimeoutError):
            await helpers.wait_for(asyncio.sleep(5000), 2000)
        return time.monotonic() - t0, lp.time() - v0

    real, virtual = run_on(loop, main())
    assert real < 5  # fast-forwarded, not waited for
    assert virtual == pytest.approx(3000)  # each timeout fired at its virtual deadline
