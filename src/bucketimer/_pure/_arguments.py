"""Checking what call_later/call_at are given, with the native backend's
exceptions and messages (ext/schedule.c)."""

from __future__ import annotations

import asyncio
import contextvars
import math
import numbers
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
