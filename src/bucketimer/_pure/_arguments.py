"""Checking what call_later/call_at are given, with the native backend's
exceptions and messages (ext/schedule.c): a TimerThread's, and the drop-in
loop's on asyncio's path (both backends' ``loop.py`` paths)."""

from __future__ import annotations

import asyncio
import contextvars
import math
import numbers
from time import monotonic
from typing import Any

# Beyond this many seconds a deadline is "never" (the core's
# BT_SECONDS_RANGE): about 290 years of CLOCK_MONOTONIC in nanoseconds.
SECONDS_RANGE = 9.2e9
NEVER_NS = 2**63 - 1


def to_seconds(value: Any, what: str) -> float:
    """A real number of seconds as a float; a number too large for one is
    +/-inf, as the native backend takes it."""
    if isinstance(value, float):
        seconds = value
    elif isinstance(value, bool) or not _is_real(value):
        raise TypeError(f"{what} must be a real number, not {type(value).__name__}")
    else:
        try:
            seconds = float(value)
        except OverflowError:
            seconds = -math.inf if value < 0 else math.inf
    if math.isnan(seconds):
        raise ValueError(f"{what} must not be NaN")
    return seconds


def _is_real(value: Any) -> bool:
    return isinstance(value, numbers.Real) or hasattr(type(value), "__float__") or hasattr(
        type(value), "__index__"
    )


def deadline_ns(when: float) -> int:
    """The first nanosecond ``n`` of the monotonic clock with ``n / 1e9 >=
    when``: a callback reading ``time.monotonic()`` never sees a time before
    ``Handle.when()`` (docs/guarantees.rst, "Never early")."""
    if when >= SECONDS_RANGE:
        return NEVER_NS
    if when <= 0:
        return 0
    ns = math.ceil(when * 1e9)
    while ns / 1e9 < when:
        ns += 1
    return ns


def check_callback(callback: Any, context: Any) -> Any:
    if not callable(callback):
        raise TypeError(f"callback must be callable, not {type(callback).__name__}")
    if context is not None and type(context) is not contextvars.Context:
        raise TypeError(f"context must be a contextvars.Context, not {type(context).__name__}")
    return context


def check_loop(loop: Any) -> asyncio.AbstractEventLoop:
    if not isinstance(loop, asyncio.AbstractEventLoop):
        raise TypeError(f"loop must be an asyncio event loop or None, not {type(loop).__name__}")
    if loop.is_closed():
        raise RuntimeError("cannot schedule on a closed event loop")
    return loop


# What the native drop-in loop's call_at/call_later refuse
# (ext/scheduler_type.c), refused the same way on asyncio's path (debug
# mode, a virtual clock, the pure backend): asyncio's own None checks; a
# call_at deadline that is not a real number (asyncio takes it and fails
# later, inside the loop); a call_later delay that does not add to the
# clock, with a message naming it.  docs/asyncio.rst, "One contract",
# lists them.
def check_when(when: Any) -> None:
    if when is None:
        raise TypeError("when cannot be None")
    if not isinstance(when, (int, float)):
        to_seconds(when, "when")


def check_delay(delay: Any) -> None:
    if delay is None:
        raise TypeError("delay must not be None")
    try:
        when = monotonic() + delay
    except TypeError:
        raise TypeError(f"delay must be a real number, not {type(delay).__name__}") from None
    to_seconds(when, "delay")


def without_own_frame(handle: Any) -> Any:
    """A handle made in debug mode remembers the stack it was made on; as
    each of asyncio's own call_* methods does, drop the frame of the drop-in
    loop's method that made it, so the last one left is the caller's."""
    tb = getattr(handle, "_source_traceback", None)
    if tb:
        del tb[-1]
    return handle
