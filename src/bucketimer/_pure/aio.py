"""``bucketimer.aio`` on the pure backend: asyncio's own timeouts.

:func:`timeout`, :func:`timeout_at` and :class:`Timeout` are asyncio's of
the running Python, their timers the loop's, with these differences, each
the native backend's too: a deadline already reached first hands the loop
the default TimerThread's timers due for it that its thread keeps (a
loop's own timers are on its heap already), so they run before the expiry
(docs/design.rst, "Order on the loop"); a NaN deadline expires on the next
turn, as asyncio's heap runs it up to 3.12 (from 3.13 asyncio's loop passes
it to ``select()``, which raises); a reschedule made by code that
arming the expiry runs wins over that arming, leaving one timer armed, for
the deadline ``when()`` says (asyncio keeps the first arming's timer and
leaves the second armed too); and a reschedule to a later deadline keeps
the armed timer, which re-arms for it when its own deadline comes (asyncio
cancels it and makes another).  ``reschedule``, ``__aenter__`` and the usual
way out of ``__aexit__`` are written out, which also makes them cost less
than asyncio's (which arms and disarms a timer by four calls more).
:func:`wait_for` is 3.11's algorithm up to 3.11 (``_wait_for.py``, which
the native backend's shares), its timer pushed on the loop's heap as
``Timeout``'s is; from 3.12 it is asyncio's coroutine around this
:func:`timeout`.
"""

from __future__ import annotations

import asyncio
import sys
from asyncio import events, tasks, timeouts
from asyncio.events import TimerHandle
from collections.abc import Awaitable
from types import TracebackType
from typing import Any, TypeVar

from .._wait_for import release_waiter, wait_for_311
from ._default import deliver_due
from ._loop_timer import HEAP_CALL_LATER, HEAP_TYPES, cancel, heap_type, push

__all__ = ("Timeout", "timeout", "timeout_at", "wait_for")

_T = TypeVar("_T")

# asyncio's own, before patch_asyncio() can make asyncio.wait_for this module's
_asyncio_wait_for = tasks.wait_for

# (private in typeshed, which also marks Timeout final; at run time a class)
_CREATED = timeouts._State.CREATED  # type: ignore[attr-defined]
_ENTERED = timeouts._State.ENTERED  # type: ignore[attr-defined]
_EXPIRING = timeouts._State.EXPIRING  # type: ignore[attr-defined]
_EXITED = timeouts._State.EXITED  # type: ignore[attr-defined]
_asyncio_reschedule = timeouts.Timeout.reschedule
_asyncio_aexit = timeouts.Timeout.__aexit__
_current_task = tasks.current_task
# asyncio's TimerHandle, typed Any: a test of type(h) against it leaves h's
# private members (undeclared in typeshed) readable
_TimerHandle: Any = TimerHandle
_get_running_loop = events.get_running_loop

# asyncio's Timeout arms its expiry, self._on_timeout, into
# self._timeout_handler (3.11-3.15, which this module relies on).
# __aenter__ refuses a second entry from 3.11.7 (earlier 3.11s do not): it
# is written out here where asyncio's does.
_ENTERED_TWICE = "Timeout has already been entered"
_ENTRY_CHECKED = _ENTERED_TWICE in timeouts.Timeout.__aenter__.__code__.co_consts


class Timeout(timeouts.Timeout):  # type: ignore[misc]
    """``asyncio.Timeout``; a deadline already reached comes after the
    TimerThread's timers due by then, a NaN one expires at once, and a
    reschedule made by code that arming runs (``loop.time()``, the loop's
    ``call_at``) wins over that arming, as on the native backend."""

    # asyncio's __init__ and the usual way out of __aexit__ (3.11-3.15),
    # and __aenter__ (3.11.7-3.15), with the states read as the module's names

    def __init__(self, when: float | None) -> None:
        me: Any = self
        me._state = _CREATED
        me._timeout_handler = None
        me._task = None
        me._when = when

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc_val: BaseException | None, exc_tb: TracebackType | None,
                        ) -> None:
        me: Any = self
        if me._state is not _ENTERED:  # expired: asyncio's way out
            await _asyncio_aexit(self, exc_type, exc_val, exc_tb)
            return None
        _disarm(me)
        me._state = _EXITED
        return None

    if _ENTRY_CHECKED:

        async def __aenter__(self) -> Timeout:
            me: Any = self
            if me._state is not _CREATED:
                raise RuntimeError(_ENTERED_TWICE)
            task = _current_task()
            if task is None:
                raise RuntimeError("Timeout should be used inside a task")
            me._state = _ENTERED
            me._task = task
            me._cancelling = task.cancelling()
            self.reschedule(me._when)
            return self

    def reschedule(self, when: float | None) -> None:
        me: Any = self  # (typeshed does not declare asyncio's private members)
        if me._state is not _ENTERED:
            _asyncio_reschedule(self, when)  # asyncio's RuntimeError
            return
        # Python code may run below (the old deadline's __del__, loop.time(),
        # the comparison, a handle's cancel(), call_at): a reschedule or exit
        # made there overtakes this one (it changed the state or the
        # deadline), which then leaves the expiry as that call left it.
        me._when = when
        if when is None:
            _disarm(me)
            return
        loop: Any = _get_running_loop()
        reached = when <= loop.time()
        if type(when) is float and when != when:  # NaN: due at once
            reached = True
        if me._when is not when or me._state is not _ENTERED:
            return
        handler = me._timeout_handler
        if handler is not None:
            # A later deadline not yet reached keeps the timer armed on the
            # loop's heap: it re-arms for this one when its own comes
            # (_on_timeout), as the core moves a timer in place
            # (docs/design.rst, "A later deadline moves a timer in place"):
            # no new timer, and none cancelled left in the heap.
            if (not reached and type(handler) is _TimerHandle
                    and (type(when) is float or type(when) is int)
                    and (type(armed := handler._when) is float or type(armed) is int)
                    and armed <= when and handler._loop is loop and type(loop) in HEAP_TYPES
                    and not loop._debug):
                return
            me._timeout_handler = None  # (_disarm(), inline)
            if type(handler) is _TimerHandle and not handler._loop._debug:
                cancel(handler)
            else:
                handler.cancel()
            if me._when is not when or me._state is not _ENTERED or (
                    me._timeout_handler is not None):
                return
        if reached:
            deliver_due(loop)
            handler = loop.call_soon(me._on_timeout)
        elif (type(when) is float or type(when) is int) and (
                type(loop) in HEAP_TYPES or heap_type(type(loop))) and not loop._debug:
            # asyncio's heap, in one call that runs no Python code of the caller's
            me._timeout_handler = push(loop, when, me._on_timeout, (), None)
            return
        else:
            handler = loop.call_at(when, me._on_timeout)
        if me._when is not when or me._state is not _ENTERED or me._timeout_handler is not None:
            handler.cancel()  # what overtook it stands; this one never fires
            return
        me._timeout_handler = handler

    def _on_timeout(self) -> None:
        me: Any = self  # (typeshed does not declare asyncio's private members)
        if me._state is not _ENTERED:
            return
        fired = me._timeout_handler
        if (type(fired) is _TimerHandle and fired._when is not me._when
                and type(loop := fired._loop) in HEAP_TYPES):
            # armed for an earlier deadline, then postponed (reschedule):
            # armed again for the deadline it has now, unless that passed too
            when = me._when
            me._timeout_handler = None  # (it ran: what loop.time() may arm stands)
            if when > loop.time():
                if me._state is _ENTERED and me._timeout_handler is None and me._when is when:
                    me._timeout_handler = push(loop, when, me._on_timeout, (), None)
                return
            if (me._state is not _ENTERED or me._timeout_handler is not None
                    or me._when is not when):
                return  # (what loop.time() ran took it over)
            me._timeout_handler = fired
        me._task.cancel()
        if me._state is _ENTERED:
            me._state = _EXPIRING
        handler = me._timeout_handler
        me._timeout_handler = None  # dropped early, as asyncio does
        if handler is not fired:  # re-armed by cancel(): an expiring Timeout needs none
            handler.cancel()


def _disarm(me: Any) -> None:
    """Cancels a Timeout's timer, if it has one (``_disarm_handler()``,
    inline; ``reschedule`` has this inline)."""
    handler: Any = me._timeout_handler
    if handler is not None:
        me._timeout_handler = None
        if type(handler) is _TimerHandle and not handler._loop._debug:
            cancel(handler)
        else:
            handler.cancel()


def _disarm_handler(handler: Any) -> None:
    """``handler.cancel()``: asyncio's call, or ``_loop_timer.cancel`` for a
    timer of asyncio's heap outside debug mode."""
    if type(handler) is _TimerHandle and not handler._loop._debug:
        cancel(handler)
    else:
        handler.cancel()


def timeout(delay: float | None) -> Timeout:
    """``asyncio.timeout(delay)``."""
    loop = events.get_running_loop()
    return Timeout(loop.time() + delay if delay is not None else None)


def timeout_at(when: float | None) -> Timeout:
    """``asyncio.timeout_at(when)``."""
    return Timeout(when)


_timeout = timeout  # (wait_for's argument shadows the name)

if sys.version_info >= (3, 12):

    async def wait_for(fut: Awaitable[_T], timeout: float | None) -> _T:
        """``asyncio.wait_for`` as of 3.12, its timer this module's
        :func:`timeout` (``timeout <= 0`` is asyncio's own path)."""
        if timeout is not None and timeout <= 0:
            return await _asyncio_wait_for(fut, timeout)
        async with _timeout(timeout):
            return await fut

else:
    def _arm(loop: Any, timeout: float, waiter: asyncio.Future[Any]) -> TimerHandle:
        """``loop.call_later(timeout, release_waiter, waiter)``, pushed on
        asyncio's heap in one call where the loop's ``call_later`` is
        asyncio's own or the drop-in loop's, and would push it there."""
        call_later = loop.call_later
        if ((type(timeout) is float or type(timeout) is int)
                and getattr(call_later, "__func__", None) in HEAP_CALL_LATER
                and heap_type(type(loop)) and not loop._debug):
            return push(loop, loop.time() + timeout, release_waiter, (waiter,), None)
        timer: TimerHandle = call_later(timeout, release_waiter, waiter)
        return timer

    wait_for = wait_for_311(_arm, _disarm_handler)  # type: ignore[assignment, unused-ignore]
    wait_for.__module__ = __name__


# asyncio's own names, for what reads them (repr, docs)
timeout.__doc__ = asyncio.timeout.__doc__
timeout_at.__doc__ = asyncio.timeout_at.__doc__
wait_for.__doc__ = _asyncio_wait_for.__doc__
