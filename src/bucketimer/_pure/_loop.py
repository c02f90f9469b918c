"""The drop-in loop on the pure backend: asyncio's loop, timers on its heap.

``bucketimer.EventLoop`` on this backend is ``asyncio.SelectorEventLoop``
whose ``call_at``/``call_later`` keep asyncio's timers, in asyncio's heap,
after the drop-in loop's argument checks (docs/asyncio.rst, "One
contract"): what asyncio's two methods do, in one call instead of the four
of theirs (``call_later`` -> ``call_at`` -> ``_check_closed``).  Debug mode,
and a subclass's ``call_at``, take asyncio's own path.
``bucketimer.loop.UVEventLoop`` is ``uvloop.Loop`` with the same checks
before uvloop's own methods.  A TimerThread's timers scheduled inside the
loop live on its heap too (``_loop_timer.py``); its ``close()`` drops them
and those its TimerThreads keep for it.

The argument checks are the native drop-in loop's too (``loop.py``).
"""

from __future__ import annotations

import asyncio
import contextvars
import selectors
from asyncio.events import TimerHandle
from collections.abc import Callable
from typing import Any, TypeVarTuple, Unpack

from ._arguments import check_delay, check_when, without_own_frame
from ._default import default_timer_thread
from ._loop_timer import SLOTS_KNOWN, heap_call_at, loop_closing, push
from ._scheduler import _live
from ._timer_thread import TimerThread

_Ts = TypeVarTuple("_Ts")


def check_timer_thread(timer_thread: Any) -> None:
    if timer_thread is not None and not isinstance(timer_thread, TimerThread):
        raise TypeError(
            f"timer_thread must be a bucketimer.TimerThread, not {type(timer_thread).__name__}"
        )


class _PureTimers:
    """What the pure drop-in loops add to their base: the ``timer_thread``
    they were given (the default one otherwise), and a ``close()`` that
    drops the TimerThreads' timers of the loop first."""

    _bt_timer_thread: TimerThread | None = None  # an instance attribute only when given
    _bt_closes_ports = True  # close() drops what the TimerThreads keep for it

    def __new__(cls, *args: Any, timer_thread: TimerThread | None = None, **kwargs: Any) -> Any:
        # Refused before a loop exists: a half-made one would complain when
        # collected.
        check_timer_thread(timer_thread)
        return super().__new__(cls)

    @property
    def timer_thread(self) -> TimerThread:
        """The TimerThread serving this loop's timers (default: the process-wide one)."""
        tt = self._bt_timer_thread
        return default_timer_thread() if tt is None else tt

    def close(self) -> None:
        if not self.is_running():  # type: ignore[attr-defined]
            loop_closing(self)
            for sched in _live.snapshot():
                sched.loop_closed(self)  # type: ignore[arg-type]
        super().close()  # type: ignore[misc]


class EventLoop(_PureTimers, asyncio.SelectorEventLoop):
    """``asyncio.SelectorEventLoop`` whose ``call_at``/``call_later`` check
    their arguments as bucketimer's native drop-in loop does.

    ``EventLoop(selector=None, *, timer_thread=None)``; ``timer_thread``
    defaults to :func:`bucketimer.default_timer_thread`.
    """

    # Whether call_later may push on the heap itself: not when a subclass
    # overrides call_at, which call_later then goes through, as asyncio's does
    # (nor where asyncio's handles are not the ones push() knows).
    _bt_own_call_at = SLOTS_KNOWN

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._bt_own_call_at = SLOTS_KNOWN and cls.call_at is EventLoop.call_at

    def __init__(self, selector: selectors.BaseSelector | None = None, *,
                 timer_thread: TimerThread | None = None) -> None:
        super().__init__(selector)
        if timer_thread is not None:
            self._bt_timer_thread = timer_thread

    def call_at(self, when: float, callback: Callable[[Unpack[_Ts]], object], *args: *_Ts,
                context: contextvars.Context | None = None) -> TimerHandle:
        """Like ``call_later()``, but uses an absolute time (``loop.time()`` clock)."""
        if type(when) is not float and type(when) is not int:
            check_when(when)
        me: Any = self  # (typeshed does not declare asyncio's private members)
        if me._debug or not SLOTS_KNOWN:
            timer: TimerHandle = without_own_frame(
                super().call_at(when, callback, *args, context=context))
            return timer
        if me._closed:
            raise RuntimeError("Event loop is closed")
        return push(self, when, callback, args, context)

    def call_later(self, delay: float, callback: Callable[[Unpack[_Ts]], object], *args: *_Ts,
                   context: contextvars.Context | None = None) -> TimerHandle:
        """Arrange for ``callback(*args)`` to be called after ``delay`` seconds."""
        if type(delay) is not float and type(delay) is not int:
            check_delay(delay)
        me: Any = self
        if me._debug or not self._bt_own_call_at:
            timer: TimerHandle = without_own_frame(
                self.call_at(self.time() + delay, callback, *args, context=context))
            return timer
        if me._closed:
            raise RuntimeError("Event loop is closed")
        return push(self, self.time() + delay, callback, args, context)


heap_call_at(EventLoop.call_at, EventLoop.call_later)


def uv_event_loop_class(base: type) -> type:
    """``UVEventLoop`` on the pure backend: ``uvloop.Loop`` (``base``) whose
    ``call_at``/``call_later`` check their arguments first."""

    class UVEventLoop(_PureTimers, base):  # type: ignore[misc]
        """``uvloop.Loop`` whose ``call_at``/``call_later`` check their
        arguments as bucketimer's native drop-in loop does.

        ``UVEventLoop(*, timer_thread=None)``.  Its timers and ``time()``
        are uvloop's own, as they fire as stock uvloop's do (up to a
        millisecond before ``time()`` reaches ``when()``).
        """

        def __init__(self, *, timer_thread: TimerThread | None = None) -> None:
            super().__init__()
            if timer_thread is not None:
                self._bt_timer_thread = timer_thread

        def call_at(self, when: float, callback: Callable[..., object], *args: Any,
                    context: Any = None) -> Any:
            """Like ``call_later()``, but uses an absolute time (``loop.time()`` clock)."""
            if type(when) is not float and type(when) is not int:
                check_when(when)
            return without_own_frame(super().call_at(when, callback, *args, context=context))

        def call_later(self, delay: float, callback: Callable[..., object], *args: Any,
                       context: Any = None) -> Any:
            """Arrange for ``callback(*args)`` to be called after ``delay`` seconds."""
            if type(delay) is not float and type(delay) is not int:
                check_delay(delay)
            return without_own_frame(super().call_later(delay, callback, *args, context=context))

    UVEventLoop.__module__ = "bucketimer.loop"
    UVEventLoop.__qualname__ = "UVEventLoop"
    return UVEventLoop


EventLoop.__module__ = "bucketimer.loop"
