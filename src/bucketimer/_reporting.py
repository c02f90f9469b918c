"""How a failing timer callback is reported, on either backend: to its loop's
exception handler exactly as asyncio reports a failing handle, or (no loop)
on the ``bucketimer`` logger; and what the dispatcher thread reports on that
logger: a callback that held it too long, timers dropped at exit."""

from __future__ import annotations

import asyncio
import logging
import math
import numbers
import types
from collections.abc import Callable, Iterable
from typing import Any

logger = logging.getLogger("bucketimer")


def report_to_loop(loop: asyncio.AbstractEventLoop, handle: Any, exc: BaseException) -> None:
    """Report a failing callback exactly as asyncio reports a failing handle."""
    cb = describe_callback(handle.callback, handle.args or ())
    loop.call_exception_handler(
        {"message": f"Exception in callback {cb}", "exception": exc, "handle": handle}
    )


def describe_callback(func: object, args: Iterable[Any], *, debug: bool = False) -> str:
    """asyncio's text for a callback (from a private helper it has had since
    3.7; its signature differs between versions), else ``repr(func)``.
    From 3.13 asyncio shows the arguments only in debug mode (``debug``);
    before, always."""
    try:
        from asyncio.format_helpers import _format_callback_source
    except ImportError:  # pragma: no cover
        return repr(func)
    if debug:
        try:
            return _format_callback_source(func, args, debug=True)  # type: ignore[call-arg, unused-ignore]
        except TypeError:  # before it took ``debug``: the arguments always shown
            pass
    return _format_callback_source(func, args)


def report_to_log(handle: Any, exc: BaseException) -> None:
    logger.error("Exception in timer callback %r", handle, exc_info=exc)


def loop_reporter(loop: asyncio.AbstractEventLoop) -> Callable[[Any, BaseException], None]:
    """``report_to_loop`` bound to ``loop`` (ext/attach.c makes the same)."""
    return types.MethodType(report_to_loop, loop)


#: ``TimerThread.slow_callback_duration``'s default, as asyncio's loop's.
SLOW_CALLBACK_DURATION = 0.1


def check_slow_callback_duration(value: object) -> float | None:
    """``slow_callback_duration`` as given (seconds, or None: never report),
    checked as every delay is."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(
            f"slow_callback_duration must be a number of seconds or None, "
            f"not {type(value).__name__}")
    seconds = float(value)
    if math.isnan(seconds) or seconds < 0:
        raise ValueError(f"slow_callback_duration must be >= 0 seconds, not {value!r}")
    return seconds


def report_slow_callback(callback: object, args: tuple[Any, ...] | None, seconds: float,
                         threshold: float) -> None:
    """A no-loop callback held the dispatcher thread ``seconds``: one WARNING
    once it returned (the other no-loop timers of its TimerThread waited)."""
    what = describe_callback(callback, args or (), debug=True)
    logger.warning(
        "Executing timer callback %s took %.3f seconds on the bucketimer dispatcher thread; "
        "no-loop timers share that thread: run blocking work elsewhere (e.g. an executor)",
        what, seconds,
        extra={"timer_callback": what, "timer_elapsed": seconds, "timer_threshold": threshold},
    )


def report_dropped_at_exit(count: int) -> None:
    """What the interpreter's exit dropped of the timers that belong to no loop."""
    if count:
        logger.warning(
            "%d pending timer%s dropped at exit without running (no-loop timers run on a "
            "daemon thread: wait for the ones that must run before the program ends)",
            count, "" if count == 1 else "s", extra={"timer_dropped": count},
        )
