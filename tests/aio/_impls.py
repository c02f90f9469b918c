"""The two implementations under test, asyncio's helpers (the reference) and
bucketimer's, and the loops they run on."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import types
from collections.abc import Callable
from typing import Any

import bucketimer
from bucketimer import aio
from bucketimer import loop as bt_loop
from bucketimer._backend import NATIVE

try:
    import uvloop
except ImportError:  # pragma: no cover
    uvloop = None

if NATIVE:
    from bucketimer._timers import _public_api_forced
else:
    def _public_api_forced(name: str) -> bool:
        return False

PY312 = sys.version_info >= (3, 12)
#: Whether bucketimer may wrap a stock loop's selector (its poll then looks
#: at the core, as the drop-in loop's does): not with BUCKETIMER_PUBLIC_API,
#: where a deadline that passes between two iterations waits for the timer
#: thread (docs/asyncio.rst, "One contract").
STOCK_POLL_LOOKS = bucketimer.backend == "python" or not _public_api_forced("loop_selector")
# 3.13 (not 3.12.1) puts a TimeoutError into the chain of an exception raised
# while handling the timeout's CancelledError.
INSERTS_TIMEOUT_ERROR = hasattr(asyncio.timeouts.Timeout, "_insert_timeout_error")

IMPLS = {
    "asyncio": types.SimpleNamespace(
        name="asyncio",
        timeout=asyncio.timeout,
        timeout_at=asyncio.timeout_at,
        Timeout=asyncio.Timeout,
        wait_for=asyncio.wait_for,
    ),
    "bucketimer": types.SimpleNamespace(
        name="bucketimer",
        timeout=aio.timeout,
        timeout_at=aio.timeout_at,
        Timeout=aio.Timeout,
        wait_for=aio.wait_for,
    ),
}

LOOPS: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {
    "stock": asyncio.SelectorEventLoop,
    "bucketimer-loop": bt_loop.EventLoop,
}
if uvloop is not None:
    LOOPS["uvloop"] = uvloop.new_event_loop


def no_warning() -> Any:
    return contextlib.nullcontext()
