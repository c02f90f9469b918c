"""The process-wide default TimerThread of the pure backend, and what
happens to TimerThreads at fork() and at exit."""

from __future__ import annotations

import asyncio
import atexit
import contextvars
import os
import threading
import time
import types
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVarTuple, Unpack

from .._reporting import report_dropped_at_exit
from ._handle import Handle
from ._loop_timer import heap_type
from ._scheduler import _live
from ._timer_thread import TimerThread

_Ts = TypeVarTuple("_Ts")

_default: TimerThread | None = None
_default_lock = threading.Lock()


def default_timer_thread() -> TimerThread:
    """The process-wide TimerThread, created on first use (and anew after fork)."""
    global _default
    tt = _default
    if tt is None or tt.closed:
        with _default_lock:
            tt = _default
            if tt is None or tt.closed:
                tt = _default = TimerThread()
                _DefaultView._sched = tt._sched
    return tt


def deliver_due(loop: asyncio.AbstractEventLoop) -> None:
    """The default TimerThread's timers due for ``loop`` are handed to it
    before what the caller queues next (docs/design.rst, "Order on the
    loop"); none to wait for if there is no default yet."""
    tt = _default
    if tt is not None and not tt.closed:
        tt._sched.deliver_due(loop)


class _Closed:
    """A scheduler that is closed: what the view reads before there is a
    default TimerThread, and after fork()."""

    _closed = True


class _DefaultView(TimerThread):
    """The default TimerThread, whichever it is when called.
    ``bucketimer.call_later`` and ``call_at`` are TimerThread's own methods
    bound to this view, whose ``_sched`` is the default's (a class attribute,
    set as the default is made): a function in front of them cost a new
    loop's first timer about a quarter of asyncio's first ``call_later``
    (docs/performance.rst, "A short-lived loop").  A closed scheduler
    (none yet, the default closed, a fork) sends the call to
    ``default_timer_thread()``, which makes a new default."""

    _sched: Any = _Closed()

    def __init__(self) -> None:  # (nothing of its own to make)
        pass

    def _reopened(self) -> TimerThread:
        return default_timer_thread()

    def __del__(self, _warn: Any = None) -> None:  # (it closes nothing: it has nothing)
        pass

    def __repr__(self) -> str:
        return "<bucketimer's default TimerThread, whichever it is>"


def _module_function(method: Any, name: str) -> Any:
    """``method`` (TimerThread's) bound to the view, under the name a module
    function of that signature has: Python's argument errors name it so, as
    the native backend's do."""
    f = types.FunctionType(method.__code__, method.__globals__, name, method.__defaults__,
                           method.__closure__)
    f.__kwdefaults__ = method.__kwdefaults__
    f.__qualname__ = name
    f.__doc__ = f"``default_timer_thread().{name}(...)``."
    return types.MethodType(f, _DefaultView())


if TYPE_CHECKING:
    def call_later(delay: float, callback: Callable[[Unpack[_Ts]], object], /, *args: *_Ts,
                   loop: asyncio.AbstractEventLoop | None = None,
                   context: contextvars.Context | None = None) -> Handle:
        """``default_timer_thread().call_later(...)``."""

    def call_at(when: float, callback: Callable[[Unpack[_Ts]], object], /, *args: *_Ts,
                loop: asyncio.AbstractEventLoop | None = None,
                context: contextvars.Context | None = None) -> Handle:
        """``default_timer_thread().call_at(...)``."""
else:
    call_later = _module_function(TimerThread.call_later, "call_later")
    call_at = _module_function(TimerThread.call_at, "call_at")


def _after_fork_in_child() -> None:
    # Only the forking thread exists in the child: every inherited
    # TimerThread refuses work, and the default is made anew on first use.
    global _default, _default_lock
    _default = None
    _DefaultView._sched = _Closed()
    _default_lock = threading.Lock()
    for sched in _live.snapshot():
        sched.forget_after_fork()
    _live.clear()


# At exit, how long in all to wait for callbacks still running (the
# threads are daemons: the interpreter does not wait for them).
_EXIT_JOIN_BUDGET = 0.2


def _close_all_at_exit() -> None:
    deadline = time.monotonic() + _EXIT_JOIN_BUDGET
    dropped = 0
    for sched in _live.snapshot():
        dropped += sched.close(join_timeout=max(0.0, deadline - time.monotonic()))
    report_dropped_at_exit(dropped)


os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(_close_all_at_exit)

# The process's first timer finds the default TimerThread made and asyncio's
# loop class asked whether its timers may go on its heap, as on the native
# backend (docs/asyncio.rst, "The first timer"): both on its path cost it
# some 120 us, six times asyncio's first call_later.  Neither starts a
# thread: the scheduler's waits for the first timer that needs it.
# BUCKETIMER_LAZY_START=1 leaves them to that first timer.
if os.environ.get("BUCKETIMER_LAZY_START", "") in ("", "0"):
    heap_type(asyncio.SelectorEventLoop)
    default_timer_thread()
