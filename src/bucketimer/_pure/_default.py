"""The process-wide default TimerThread of the pure backend, and what
happens to TimerThreads at fork() and at exit."""

from __future__ import annotations

import asyncio
import atexit
import contextvars
import os
import threading
import time
from collections.abc import Callable
from typing import TypeVarTuple, Unpack

from .._reporting import report_dropped_at_exit
from ._handle import Handle
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
    return tt


def deliver_due(loop: asyncio.AbstractEventLoop) -> None:
    """The default TimerThread's timers due for ``loop`` are handed to it
    before what the caller queues next (docs/design.rst, "Order on the
    loop"); none to wait for if there is no default yet."""
    tt = _default
    if tt is not None and not tt.closed:
        tt._sched.deliver_due(loop)


def call_later(delay: float, callback: Callable[[Unpack[_Ts]], object], /, *args: *_Ts,
               loop: asyncio.AbstractEventLoop | None = None,
               context: contextvars.Context | None = None) -> Handle:
    """``default_timer_thread().call_later(...)``."""
    tt = _default
    if tt is None or tt._sched._closed:
        tt = default_timer_thread()
    if loop is None and context is None:  # (a call without keywords costs less)
        return tt.call_later(delay, callback, *args)
    return tt.call_later(delay, callback, *args, loop=loop, context=context)


def call_at(when: float, callback: Callable[[Unpack[_Ts]], object], /, *args: *_Ts,
            loop: asyncio.AbstractEventLoop | None = None,
            context: contextvars.Context | None = None) -> Handle:
    """``default_timer_thread().call_at(...)``."""
    tt = _default
    if tt is None or tt._sched._closed:
        tt = default_timer_thread()
    return tt.call_at(when, callback, *args, loop=loop, context=context)


def _after_fork_in_child() -> None:
    # Only the forking thread exists in the child: every inherited
    # TimerThread refuses work, and the default is made anew on first use.
    global _default, _default_lock
    _default = None
    _default_lock = threading.Lock()
    for sched in list(_live):
        sched.forget_after_fork()
    _live.clear()


# At exit, how long in all to wait for callbacks still running (the
# threads are daemons: the interpreter does not wait for them).
_EXIT_JOIN_BUDGET = 0.2


def _close_all_at_exit() -> None:
    deadline = time.monotonic() + _EXIT_JOIN_BUDGET
    dropped = 0
    for sched in list(_live):
        dropped += sched.close(join_timeout=max(0.0, deadline - time.monotonic()))
    report_dropped_at_exit(dropped)


os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(_close_all_at_exit)
