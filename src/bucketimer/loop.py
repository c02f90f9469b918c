"""A drop-in asyncio event loop whose timers live in bucketimer's native core.

:class:`EventLoop` is ``asyncio.SelectorEventLoop`` with ``call_at`` and
``call_later`` served by a :class:`bucketimer.TimerThread`: every
``asyncio.sleep``, ``asyncio.timeout``, ``asyncio.wait_for`` and any
library's ``loop.call_later`` then costs an O(1) C call to arm and to
cancel, and the loop's own ``heapq`` of ``TimerHandle`` objects stays empty.
Timers that come due are posted back to the loop through an eventfd and run
in the loop's thread, in the ``contextvars.Context`` captured when they were
scheduled (see DESIGN.md, section 2).

Usage::

    asyncio.run(main(), loop_factory=bucketimer.loop.new_event_loop)  # 3.12+
    bucketimer.loop.install(); asyncio.run(main())                    # 3.11+

What differs from the stock loop, on purpose:

* ``call_at``/``call_later`` return a :class:`bucketimer.Handle` in its
  asyncio mode: ``when()``, ``cancel()`` (returns None), ``cancelled()``
  (True once ``cancel()`` was called) and ``get_context()`` behave as
  ``asyncio.TimerHandle``'s.  It is not an instance of ``asyncio.TimerHandle``
  and is not ordered by ``<`` (nothing in asyncio orders handles it did not
  put in its own heap).
* A timer never fires early (asyncio fires up to ``loop._clock_resolution``
  early), and equal deadlines fire in schedule order.
* In debug mode (``loop.set_debug(True)``, ``PYTHONASYNCIODEBUG=1``,
  ``asyncio.run(debug=True)``) timers go to the stock asyncio path, so that
  debug mode keeps all its checks: the thread check, the coroutine-callback
  check, source tracebacks and the slow-callback warning naming the callback.
* A subclass that overrides ``time()`` (a virtual clock) gets the stock
  timers too: the core's clock is CLOCK_MONOTONIC.

:class:`UVEventLoop` (when uvloop is installed) is the same on top of
``uvloop.Loop``.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Callable
from time import monotonic as _monotonic
from typing import Any

from . import _timers
from ._timers import TimerThread

__all__ = ["EventLoop", "EventLoopPolicy", "install", "new_event_loop"]

_base_time = asyncio.BaseEventLoop.time


class _NativeTimersMixin:
    """``call_at``/``call_later`` served by a bucketimer TimerThread.

    Mixed in before an asyncio loop class.  While the loop is not in debug
    mode (and its class keeps the stock ``time``/``call_at``/``call_later``)
    the two methods are replaced on the instance by C callables bound to
    (TimerThread, loop), so ``loop.call_later(d, cb)`` is one C call.
    """

    _bt_timer_thread: TimerThread | None = None
    _bt_scheduler_tt: TimerThread | None = None
    _bt_at: Any = None
    _bt_later: Any = None
    _bt_fast = False
    _bt_ready = False  # set_debug() runs inside the base __init__, before _bt_init

    def _bt_init(self, timer_thread: TimerThread | None) -> None:
        if timer_thread is not None and not isinstance(timer_thread, TimerThread):
            raise TypeError(
                f"timer_thread must be a bucketimer.TimerThread, not {type(timer_thread).__name__}"
            )
        self._bt_timer_thread = timer_thread
        self._bt_ready = True
        self._bt_update_fast_path()

    # -- which TimerThread ---------------------------------------------------

    @property
    def timer_thread(self) -> TimerThread:
        """The TimerThread serving this loop's timers (default: the process-wide one)."""
        tt = self._bt_timer_thread
        if tt is None:
            return _timers.default_timer_thread()
        return tt

    def _bt_native(self) -> bool:
        """True when timers go to the native core (not debug, stock clock)."""
        cls = type(self)
        return not self.get_debug() and cls.time is cls._bt_stock_time  # type: ignore[attr-defined]

    def _bt_update_fast_path(self) -> None:
        cls = type(self)
        want = (
            self._bt_native()
            and not self.is_closed()  # type: ignore[attr-defined]
            and cls.call_at is _NativeTimersMixin.call_at
            and cls.call_later is _NativeTimersMixin.call_later
        )
        d = self.__dict__
        tt = self.timer_thread
        if self._bt_scheduler_tt is not tt:
            self._bt_scheduler_tt = tt
            self._bt_at = tt._scheduler(self, True)
            self._bt_later = tt._scheduler(self, False)
        if want:
            d["call_at"] = self._bt_at
            d["call_later"] = self._bt_later
        else:
            d.pop("call_at", None)
            d.pop("call_later", None)
        self._bt_fast = want

    # -- the two methods -------------------------------------------------------

    def call_at(self, when: float, callback: Callable[..., object], *args: Any,
                context: Any = None) -> Any:
        """Like ``call_later()``, but uses an absolute time (``loop.time()`` clock)."""
        if when is None:
            raise TypeError("when cannot be None")
        if not self._bt_native():
            return super().call_at(when, callback, *args, context=context)  # type: ignore[misc]
        if self.is_closed():  # type: ignore[attr-defined]
            raise RuntimeError("Event loop is closed")
        self._bt_update_fast_path()
        return self._bt_at(when, callback, *args, context=context)

    def call_later(self, delay: float, callback: Callable[..., object], *args: Any,
                   context: Any = None) -> Any:
        """Arrange for ``callback(*args)`` to be called after ``delay`` seconds."""
        if delay is None:
            raise TypeError("delay must not be None")
        if not self._bt_native():
            return super().call_later(delay, callback, *args, context=context)  # type: ignore[misc]
        if type(self).call_at is not _NativeTimersMixin.call_at:
            # A subclass's call_at: go through it, as asyncio's call_later does.
            return self.call_at(self.time() + delay, callback, *args, context=context)  # type: ignore[attr-defined]
        if self.is_closed():  # type: ignore[attr-defined]
            raise RuntimeError("Event loop is closed")
        self._bt_update_fast_path()
        return self._bt_later(delay, callback, *args, context=context)

    # -- switches ----------------------------------------------------------------

    def set_debug(self, enabled: bool) -> None:
        super().set_debug(enabled)  # type: ignore[misc]
        if self._bt_ready:
            self._bt_update_fast_path()

    def close(self) -> None:
        d = self.__dict__
        d.pop("call_at", None)
        d.pop("call_later", None)
        self._bt_fast = False
        super().close()  # type: ignore[misc]


class EventLoop(_NativeTimersMixin, asyncio.SelectorEventLoop):  # type: ignore[misc,valid-type]
    """``asyncio.SelectorEventLoop`` whose ``call_at``/``call_later`` use bucketimer.

    ``EventLoop(selector=None, *, timer_thread=None)``; ``timer_thread``
    defaults to :func:`bucketimer.default_timer_thread`.
    """

    _bt_stock_time = _base_time

    def __init__(self, selector: selectors.BaseSelector | None = None, *,
                 timer_thread: TimerThread | None = None) -> None:
        super().__init__(selector)
        self._bt_init(timer_thread)


def new_event_loop() -> EventLoop:
    """A new :class:`EventLoop` (pass as ``asyncio.run(..., loop_factory=...)``)."""
    return EventLoop()


class EventLoopPolicy(asyncio.DefaultEventLoopPolicy):  # type: ignore[misc,valid-type]
    """The default asyncio policy, making :class:`EventLoop` loops."""

    _loop_factory = EventLoop


def install() -> None:
    """``asyncio.set_event_loop_policy(EventLoopPolicy())``."""
    asyncio.set_event_loop_policy(EventLoopPolicy())


try:  # the same on top of uvloop
    import uvloop as _uvloop
except ImportError:  # pragma: no cover - uvloop is optional
    _uvloop = None

if _uvloop is not None:

    class UVEventLoop(_NativeTimersMixin, _uvloop.Loop):  # type: ignore[misc,valid-type]
        """``uvloop.Loop`` whose ``call_at``/``call_later`` use bucketimer.

        ``UVEventLoop(*, timer_thread=None)``.  ``time()`` is
        ``time.monotonic()``, the core's clock, instead of uvloop's cached
        millisecond libuv clock (which lags it by up to a loop iteration and
        makes ``call_at(loop.time() + d)`` fire early).
        """

        def time(self) -> float:
            """``time.monotonic()``: the clock of the native timers."""
            return _monotonic()

        _bt_stock_time = time

        def __init__(self, *, timer_thread: TimerThread | None = None) -> None:
            super().__init__()
            self._bt_init(timer_thread)

    def new_uv_event_loop() -> UVEventLoop:
        """A new :class:`UVEventLoop`."""
        return UVEventLoop()

    class UVEventLoopPolicy(_uvloop.EventLoopPolicy):  # type: ignore[misc,valid-type]
        """uvloop's policy, making :class:`UVEventLoop` loops."""

        def _loop_factory(self) -> UVEventLoop:
            return UVEventLoop()

    __all__ += ["UVEventLoop", "UVEventLoopPolicy", "new_uv_event_loop"]
