"""The drop-in loops and their counters, for the tests of libraries run on them.

:class:`NativeTimers` owns a TimerThread, makes drop-in loops served by it
(``loop_factory``, for ``asyncio.Runner``, ``anyio.run`` or anything that
takes one), runs coroutines on one (``run``) and asserts from the
TimerThread's counters that the loops' timers went through the native core,
none of them early, and that nothing reached a loop's own ``_scheduled``
heap.  The ``native`` fixture (``conftest.py``) gives one per drop-in loop
class.

The counters must show the timers of the library under test, so the harness
arms none on the loop: its time limits (:func:`within`, which ``run`` uses)
are ``threading.Timer`` watchdogs that cancel the waiting task from their
own thread, and a server that is not the library under test runs on a stock
loop in a thread of its own (:func:`aiohttp_served_elsewhere`).  Timers the
test's own code arms (a handler's ``asyncio.sleep``) are given to
``assert_native(own=...)``, which takes them off before it compares.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping
from typing import Any, TypeVar

import pytest

import bucketimer
import bucketimer.loop

COUNTERS = ("scheduled", "cancelled", "ran", "early_fires")
#: On the pure backend the drop-in loops keep the host loop's timers: the
#: libraries' behaviour on them is tested, the counters are not.
NATIVE = bucketimer.backend == "native"

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
        # TimerThread's C schedulers, set on the instance (on the pure
        # backend they stay the host loop's).
        assert loop.timer_thread is self.tt
        assert ("call_at" in vars(loop) and "call_later" in vars(loop)) == NATIVE
        self.loops.append(loop)
        return loop

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 60.0) -> T:
        """Runs ``coro`` on this object's drop-in loop (one loop for every
        call, like an ``asyncio.Runner``), failing after ``timeout`` s (a
        watchdog thread's limit: no loop timer, see :func:`within`)."""
        if self._runner is None:
            self._runner = asyncio.Runner(loop_factory=self.loop_factory)
        return self._runner.run(within(coro, timeout))

    @property
    def stock_uvloop(self) -> bool:
        """The last loop is stock uvloop, clock and timers (the pure
        backend's UVEventLoop)."""
        uvloop = sys.modules.get("uvloop")
        return not NATIVE and uvloop is not None and isinstance(self.loops[-1], uvloop.Loop)

    def assert_on_time(self, deadline: float, fired: float) -> None:
        """``fired``, the loop's time() when a timer's effect was seen, is
        at ``deadline`` or after it, by less than SLACK.  Stock uvloop's
        timers fire up to a millisecond before time() reaches when()
        (docs/guarantees.rst, "On the pure-Python backend")."""
        early = 0.002 if self.stock_uvloop else 0.0
        assert deadline - early <= fired < deadline + SLACK, (deadline, fired)

    def delta(self) -> dict[str, int]:
        """Counters since this object was made."""
        now = self.tt.stats()
        return {k: now[k] - self._start[k] for k in COUNTERS}

    def assert_native(self, *, own: Mapping[str, int] | None = None, min_scheduled: int = 1,
                      min_cancelled: int = 0, min_ran: int = 0) -> dict[str, int]:
        """The library's timers went through this TimerThread: at least
        ``min_scheduled`` of them, ``min_cancelled`` cancelled and
        ``min_ran`` run, counted after taking off ``own``, the timers the
        test's own code armed (e.g. ``{"scheduled": 5, "ran": 5}`` for five
        handler sleeps), which the test knows exactly.  None fired early, and
        (on a selector loop) nothing went to asyncio's own heap.  Returns the
        library's counts."""
        assert self.loops, "no loop was made"
        d = self.delta()
        if not NATIVE:  # the timers were the host loop's: nothing to count here
            assert d["scheduled"] == 0, d
            return d
        for k, n in (own or {}).items():
            assert d[k] >= n, f"the test's own timers alone should make {k} >= {n}: {d}"
            d[k] -= n
        assert d["scheduled"] >= min_scheduled, d
        assert d["cancelled"] >= min_cancelled, d
        assert d["ran"] >= min_ran, d
        assert d["early_fires"] == 0, d
        for loop in self.loops:
            scheduled = getattr(loop, "_scheduled", None)
            if scheduled is not None:  # uvloop keeps its timers in libuv
                assert list(scheduled) == [], scheduled
        return d

    def close(self) -> None:
        if self._runner is not None:
            self._runner.close()
        for loop in self.loops:
            if not loop.is_closed():
                loop.close()
        self.tt.close()


async def within(aw: Awaitable[T], timeout: float) -> T:
    """``await aw``, raising ``TimeoutError`` after ``timeout`` s: what
    ``asyncio.wait_for`` does, but without a timer on the running loop.  The
    deadline is a ``threading.Timer`` that cancels the task awaiting ``aw``
    from its own thread, so the harness's limits never show in the
    TimerThread's counters."""
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(aw)
    expired = False

    def expire() -> None:  # in the loop's thread
        nonlocal expired
        if not task.done():
            expired = True
            task.cancel()

    def from_the_watchdog() -> None:
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(expire)

    watchdog = threading.Timer(timeout, from_the_watchdog)
    watchdog.daemon = True
    watchdog.start()
    try:
        return await task
    except asyncio.CancelledError:
        if expired:
            raise TimeoutError(f"not done within {timeout} s") from None
        raise
    finally:
        watchdog.cancel()


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


@contextlib.asynccontextmanager
async def aiohttp_served_elsewhere(app: Any) -> AsyncIterator[str]:
    """:func:`aiohttp_served`, but on a stock asyncio loop running in a thread
    of its own: for a server that is not the library under test, whose
    timers (keep-alive, shutdown, its handlers' sleeps) must not show in the
    counters of the drop-in loop's TimerThread.  Its handlers run in that
    thread: they signal the test with ``threading.Event``."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="aiohttp-server", daemon=True)
    thread.start()

    async def there(coro: Coroutine[Any, Any, T]) -> T:
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, loop))

    served = aiohttp_served(app)
    try:
        url = await there(served.__aenter__())
        try:
            yield url
        finally:
            await there(served.__aexit__(None, None, None))
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(SLACK)
        assert not thread.is_alive(), "the server's loop did not stop"
        loop.close()
