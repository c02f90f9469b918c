"""How a failing timer callback is reported, on either backend: to its loop's
exception handler exactly as asyncio reports a failing handle, or (no loop)
on the ``bucketimer`` logger."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from typing import Any

logger = logging.getLogger("bucketimer")


def report_to_loop(loop: asyncio.AbstractEventLoop, handle: Any, exc: BaseException) -> None:
    """Report a failing callback exactly as asyncio reports a failing handle."""
    cb = describe_callback(handle.callback, handle.args or ())
    loop.call_exception_handler(
        {"message": f"Exception in callback {cb}", "exception": exc, "handle": handle}
    )


def describe_callback(func: object, args: Iterable[Any]) -> str:
    """asyncio's text for a callback (from a private helper it has had since
    3.7; its signature differs between versions), else ``repr(func)``."""
    try:
        from asyncio.format_helpers import _format_callback_source
    except ImportError:  # pragma: no cover
        return repr(func)
    return _format_callback_source(func, args)


def report_to_log(handle: Any, exc: BaseException) -> None:
    logger.error("Exception in timer callback %r", handle, exc_info=exc)


def loop_reporter(loop: asyncio.AbstractEventLoop) -> Callable[[Any, BaseException], None]:
    def report(handle: Any, exc: BaseException) -> None:
        report_to_loop(loop, handle, exc)

    return report
