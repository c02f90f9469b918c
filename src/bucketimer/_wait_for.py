"""``asyncio.wait_for`` as 3.11 has it, over either backend's timer, and the
``timeout <= 0`` path that every version shares.

3.11's algorithm: a coroutine runs in its own Task, and the caller's task
waits on a future that either the Task's end or the timer releases.  Each
backend's ``aio`` module makes its 3.11 ``wait_for`` with
:func:`wait_for_311`, giving how to arm and disarm that timer: the native
one arms the core's, the pure one pushes asyncio's ``TimerHandle`` on the
loop's heap (docs/design.rst, "The pure-Python backend").  Nothing here
imports either backend.
"""

from __future__ import annotations

import functools
import types
from asyncio import exceptions, futures, tasks
from asyncio.events import get_running_loop
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

_T = TypeVar("_T")
_Timer = TypeVar("_Timer")

_partial = functools.partial
_Coroutine = types.CoroutineType
_ensure_future = tasks.ensure_future
_CancelledError = exceptions.CancelledError


def release_waiter(waiter: futures.Future[Any], *args: Any) -> None:
    if not waiter.done():
        waiter.set_result(None)


def ensure_future(fut: Awaitable[_T], loop: Any) -> futures.Future[_T]:
    """``asyncio.ensure_future(fut, loop=loop)``; a coroutine's Task made
    directly, as asyncio's makes it after three calls that only find it is
    one (a coroutine the loop refuses is closed, as there)."""
    if type(fut) is not _Coroutine:
        return _ensure_future(fut, loop=loop)
    try:
        task: futures.Future[_T] = loop.create_task(fut)
    except RuntimeError:
        fut.close()
        raise
    return task


async def cancel_and_wait(fut: futures.Future[Any], loop: Any) -> None:
    """Cancel ``fut`` and wait until it has finished.

    The wait is on a separate future that ``fut``'s completion releases, so
    that this coroutine itself stays cancellable while it waits.
    """
    waiter = loop.create_future()
    cb = _partial(release_waiter, waiter)
    fut.add_done_callback(cb)
    try:
        fut.cancel()
        await waiter
    finally:
        fut.remove_done_callback(cb)


async def wait_for_nonpositive(fut: Awaitable[_T], loop: Any) -> _T:
    """``timeout <= 0``: the awaitable gets no chance to run.  Already done:
    its result.  Otherwise it is cancelled, and whatever it ends with is the
    answer, a cancellation becoming ``TimeoutError``."""
    fut = ensure_future(fut, loop)
    if fut.done():
        return fut.result()
    await cancel_and_wait(fut, loop)
    try:
        return fut.result()
    except _CancelledError as exc:
        raise TimeoutError from exc


def wait_for_311(arm: Callable[[Any, float, futures.Future[Any]], _Timer],
                 disarm: Callable[[_Timer], object],
                 ) -> Callable[[Awaitable[_T], float | None], Coroutine[Any, Any, _T]]:
    """3.11's ``wait_for`` whose timer ``arm(loop, timeout, waiter)`` arms
    (due ``timeout`` seconds from now, it calls ``release_waiter(waiter)``)
    and ``disarm(timer)`` cancels once the wait is over, however it ends."""

    async def wait_for(fut: Awaitable[_T], timeout: float | None) -> _T:
        """``asyncio.wait_for`` as of 3.11: a coroutine runs in its own Task,
        and this task waits for it or for the timer, whichever comes first.
        On timeout the Task is cancelled and awaited, then ``TimeoutError``
        is raised (unless the Task finished with a result meanwhile).  If
        this wait is cancelled, the Task is cancelled too."""
        loop = get_running_loop()
        if timeout is None:
            return await fut
        if timeout <= 0:
            return await wait_for_nonpositive(fut, loop)

        waiter = loop.create_future()
        timer = arm(loop, timeout, waiter)
        on_done = _partial(release_waiter, waiter)
        fut = ensure_future(fut, loop)
        fut.add_done_callback(on_done)
        try:
            try:
                await waiter
            except _CancelledError:
                # Cancelled from outside: take the inner task down with us,
                # unless it already finished (then its outcome wins).
                if fut.done():
                    return fut.result()
                fut.remove_done_callback(on_done)
                await cancel_and_wait(fut, loop)
                raise
            if fut.done():
                return fut.result()
            # The timer released the waiter: the task must not outlive us.
            fut.remove_done_callback(on_done)
            await cancel_and_wait(fut, loop)
            # A task that ignored the cancellation and returned, or raised
            # something else, reports that; a cancelled one times out.
            try:
                return fut.result()
            except _CancelledError as exc:
                raise TimeoutError from exc
        finally:
            disarm(timer)

    # (a coroutine takes its name from here: "coroutine 'wait_for' was never
    # awaited", as asyncio's says; the caller sets __module__)
    wait_for.__qualname__ = "wait_for"
    return wait_for
