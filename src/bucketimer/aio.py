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
from asyncio import events, exceptions, futures, tasks
from collections.abc import Awaitable, Coroutine
from typing import Any, TypeVar

from . import _core
from ._timers import TimerThread, default_timer_thread

__all__ = ("Timeout", "timeout", "timeout_at", "wait_for")

_T = TypeVar("_T")

Timeout = _core.Timeout
timeout = _core.timeout
timeout_at = _core.timeout_at

_get_running_loop = events.get_running_loop
_ensure_future = tasks.ensure_future


def _call_at_for(loop: Any) -> Any:
    """The core's call_at for ``loop``; the loop's own where its clock is
    its own (a virtual clock, a patched ``time()``), whose timers follow it."""
    if _core._loop_clock_is_foreign(loop):
        return loop.call_at
    tt: TimerThread = default_timer_thread()
    return functools.partial(tt.call_at, loop=loop)


def _release_waiter(waiter: futures.Future[Any], *args: Any) -> None:
    if not waiter.done():
        waiter.set_result(None)


async def _cancel_and_wait(fut: futures.Future[Any], loop: Any) -> None:
    """Cancel ``fut`` and wait until it has finished.

    The wait is on a separate future that ``fut``'s completion releases, so
    that this coroutine itself stays cancellable while it waits.
    """
    waiter = loop.create_future()
    cb = functools.partial(_release_waiter, waiter)
    fut.add_done_callback(cb)
    try:
        fut.cancel()
        await waiter
    finally:
        fut.remove_done_callback(cb)


async def _wait_for_nonpositive(fut: Awaitable[_T], loop: Any) -> _T:
    """``timeout <= 0``: the awaitable gets no chance to run.  Already done:
    its result.  Otherwise it is cancelled, and whatever it ends with is the
    answer, a cancellation becoming ``TimeoutError``."""
    fut = _ensure_future(fut, loop=loop)
    if fut.done():
        return fut.result()
    await _cancel_and_wait(fut, loop)
    try:
        return fut.result()
    except exceptions.CancelledError as exc:
        raise TimeoutError from exc


if sys.version_info >= (3, 12):
    # asyncio.wait_for as of 3.12: the awaitable is awaited in this task,
    # inside timeout().  On timeout it is cancelled and TimeoutError raised;
    # if it swallows the cancellation and returns a value, that value is
    # returned.  _core.wait_for is that coroutine written in C (see
    # ext/wait_for_type.c); timeout <= 0 runs _wait_for_nonpositive.
    _core._set_wait_for_nonpositive(_wait_for_nonpositive)
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

    async def wait_for(fut: Awaitable[_T], timeout: float | None) -> _T:  # type: ignore[misc, unused-ignore]
        """``asyncio.wait_for`` as of 3.11: a coroutine runs in its own Task,
        and this task waits for it or for the timer, whichever comes first.
        On timeout the Task is cancelled and awaited, then ``TimeoutError``
        is raised (unless the Task finished with a result meanwhile).  If
        this wait is cancelled, the Task is cancelled too."""
        loop = _get_running_loop()
        if timeout is None:
            return await fut
        if timeout <= 0:
            return await _wait_for_nonpositive(fut, loop)

        waiter = loop.create_future()
        when = loop.time() + timeout
        if when != when:  # NaN: asyncio's heap fires it at once, and so does this
            when = -math.inf
        timer = _call_at_for(loop)(when, _release_waiter, waiter)
        on_done = functools.partial(_release_waiter, waiter)
        fut = _ensure_future(fut, loop=loop)
        fut.add_done_callback(on_done)
        try:
            try:
                await waiter
            except exceptions.CancelledError:
                # Cancelled from outside: take the inner task down with us,
                # unless it already finished (then its outcome wins).
                if fut.done():
                    return fut.result()
                fut.remove_done_callback(on_done)
                await _cancel_and_wait(fut, loop)
                raise
            if fut.done():
                return fut.result()
            # The timer released the waiter: the task must not outlive us.
            fut.remove_done_callback(on_done)
            await _cancel_and_wait(fut, loop)
            # A task that ignored the cancellation and returned, or raised
            # something else, reports that; a cancelled one times out.
            try:
                return fut.result()
            except exceptions.CancelledError as exc:
                raise TimeoutError from exc
        finally:
            timer.cancel()
