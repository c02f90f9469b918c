"""asyncio timeouts whose timer lives in bucketimer's native core.

:func:`timeout`, :func:`timeout_at`, :class:`Timeout` and :func:`wait_for`
behave as ``asyncio.timeout``, ``asyncio.timeout_at``, ``asyncio.Timeout``
and ``asyncio.wait_for`` of the running Python version.  The difference is
where the timer lives: in the process-wide :class:`bucketimer.TimerThread`
(``bucketimer.default_timer_thread()``), so arming and disarming it is O(1)
C work instead of a ``heapq`` push of a Python ``TimerHandle`` and a
tombstone in the loop's heap.  A deadline already reached still goes to
``loop.call_soon``, as in asyncio, so it fires on the next loop iteration.

``Timeout`` is implemented in C (``ext/timeout_type.c``): its ``__aenter__`` and
``__aexit__`` return awaitables that do their work when awaited and never
suspend, so an ``async with`` that does not time out costs a handful of C
calls.  The versions differ only in what happens when a timeout expires:
3.11 and 3.12 turn exactly a ``CancelledError`` into ``TimeoutError``; 3.13
and later also turn subclasses of it, and put a ``TimeoutError`` into the
context chain of any other exception raised while handling the
cancellation.  The C type follows the running version's asyncio.

They work on any loop with ``add_reader`` (the stock selector loop, uvloop,
:class:`bucketimer.EventLoop`).
"""

from __future__ import annotations

import collections.abc
import functools
import math
import sys
from asyncio import futures
from collections.abc import Awaitable, Coroutine
from typing import Any, TypeVar

from . import _core
from ._timers import TimerThread, default_timer_thread
from ._wait_for import release_waiter, wait_for_311, wait_for_nonpositive

__all__ = ("Timeout", "timeout", "timeout_at", "wait_for")

_T = TypeVar("_T")

Timeout = _core.Timeout
timeout = _core.timeout
timeout_at = _core.timeout_at

def _call_at_for(loop: Any) -> Any:
    """The core's call_at for ``loop``; the loop's own where its clock is
    its own (a virtual clock, a patched ``time()``), whose timers follow it."""
    if _core._loop_clock_is_foreign(loop):
        return loop.call_at
    tt: TimerThread = default_timer_thread()
    return functools.partial(tt.call_at, loop=loop)


if sys.version_info >= (3, 12):
    # asyncio.wait_for as of 3.12: the awaitable is awaited in this task,
    # inside timeout().  On timeout it is cancelled and TimeoutError raised;
    # if it swallows the cancellation and returns a value, that value is
    # returned.  _core.wait_for is that coroutine written in C (see
    # ext/wait_for_type.c); timeout <= 0 runs wait_for_nonpositive.
    _core._set_wait_for_nonpositive(wait_for_nonpositive)
    collections.abc.Coroutine.register(_core.WaitFor)

    def wait_for(fut: Awaitable[_T], timeout: float | None) -> Coroutine[Any, Any, _T]:
        """Wait for ``fut`` to complete, with a timeout (``asyncio.wait_for``).

        The awaitable is awaited in the calling task inside
        :func:`timeout`: on timeout it is cancelled and ``TimeoutError``
        raised (if it swallows the cancellation and returns a value, that
        value is returned).  ``timeout=None`` waits without limit; ``<= 0``
        gives a coroutine no chance to run.  Returns a coroutine (a C one:
        ``asyncio.iscoroutine()`` is true of it, ``inspect.iscoroutine()``
        is not).
        """
        return _core.wait_for(fut, timeout)

else:

    def _arm(loop: Any, timeout: float, waiter: futures.Future[Any]) -> Any:
        when = loop.time() + timeout
        if when != when:  # NaN: asyncio's heap fires it at once, and so does this
            when = -math.inf
        return _call_at_for(loop)(when, release_waiter, waiter)

    def _disarm(timer: Any) -> None:
        timer.cancel()

    wait_for = wait_for_311(_arm, _disarm)  # type: ignore[assignment, unused-ignore]
    wait_for.__module__ = __name__
