"""The drop-in loops and their counters, for the tests of libraries run on them.

:class:`NativeTimers` owns a TimerThread, makes drop-in loops served by it
(``loop_factory``, for ``asyncio.Runner``, ``anyio.run`` or anything that
takes one), runs coroutines on one (``run``) and asserts from the
TimerThread's counters that the loops' timers went through the native core,
none of them early, and that nothing reached a loop's own ``_scheduled``
heap.  The ``native`` fixture (``conftest.py``) gives one per drop-in loop
class.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, TypeVar

import pytest

import bucketimer
import bucketimer.loop

COUNTERS = ("scheduled", "cancelled", "ran", "early_fires")

# A timeout that must not fire during a test.
LONG = 3600.0
# How late an expected event may be: upper bounds only (a timer never fires
# early, so the lower bound is the deadline itself), generous enough for a
# loaded 2-CPU machine and ASan.
SLACK = 10.0

T = TypeVar("T")

LoopFactory = Callable[[bucketimer.TimerThread], asyncio.AbstractEventLoop]


def _selector(tt: bucketimer.TimerThread) -> asyncio.AbstractEventLoop:
    return bucketimer.EventLoop(timer_thread=tt)


def _uvloop(tt: bucketimer.TimerThread) -> asyncio.AbstractEventLoop:
    return bucketimer.loop.UVEventLoop(timer_thread=tt)


#: ``pytest.mark.parametrize`` values: each drop-in loop class.
LOOPS = [
    pytest.param(_selector, id="EventLoop"),
    pytest.param(
        _uvloop,
        id="UVEventLoop",
        marks=pytest.mark.skipif(
            not hasattr(bucketimer.loop, "UVEventLoop"), reason="uvloop is not installed"
        ),
    ),
]


class NativeTimers:
    """A TimerThread and the drop-in loops it serves."""

    def __init__(self, factory: LoopFactory = _selector) -> None:
        self.tt = bucketimer.TimerThread()
        self._factory = factory
        self.loops: list[asyncio.AbstractEventLoop] = []
        self._runner: asyncio.Runner | None = None
        self._start = self.tt.stats()

    def loop_factory(self) -> asyncio.AbstractEventLoop:
        loop = self._factory(self.tt)
        # Not in debug mode, the loop's call_at/call_later are this
        # TimerThread's C schedulers, set on the instance.
        assert loop.timer_thread is self.tt
        assert "call_at" in vars(loop) and "call_later" in vars(loop)
        self.loops.append(loop)
        return loop

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
        """Runs ``coro`` on this object's drop-in loop (one loop for every
        call, like an ``asyncio.Runner``), failing after ``timeout`` s."""
        if self._runner is None:
            self._runner = asyncio.Runner(loop_factory=self.loop_factory)
        return self._runner.run(asyncio.wait_for(coro, timeout))

    def delta(self) -> dict[str, int]:
        """Counters since this object was made."""
        now = self.tt.stats()
        return {k: now[k] - self._start[k] for k in COUNTERS}

    def assert_native(self, *, min_scheduled: int = 1, min_cancelled: int = 0,
                      min_ran: int = 0) -> dict[str, int]:
        """The loops' timers went through this TimerThread, none early, and
        (on a selector loop) nothing went to asyncio's own heap."""
        assert self.loops, "no loop was made"
        for loop in self.loops:
            scheduled = getattr(loop, "_scheduled", None)
            if scheduled is not None:  # uvloop keeps its timers in libuv
                assert list(scheduled) == [], scheduled
        d = self.delta()
        assert d["scheduled"] >= min_scheduled, d
        assert d["cancelled"] >= min_cancelled, d
        assert d["ran"] >= min_ran, d
        assert d["early_fires"] == 0, d
        return d

    def close(self) -> None:
        if self._runner is not None:
            self._runner.close()
        for loop in self.loops:
            if not loop.is_closed():
                loop.close()
        self.tt.close()


@contextlib.asynccontextmanager
async def aiohttp_served(app: Any) -> AsyncIterator[str]:
    """Runs the aiohttp ``app`` on 127.0.0.1 (a free port); yields its base
    URL.  The handler of a request whose client disconnects is cancelled."""
    from aiohttp import web

    runner = web.AppRunner(app, handler_cancellation=True)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        host, port = runner.addresses[0][:2]
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()
