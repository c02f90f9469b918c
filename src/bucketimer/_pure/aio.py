"""``bucketimer.aio`` on the pure backend: asyncio's own timeouts.

:func:`timeout`, :func:`timeout_at` and :class:`Timeout` are asyncio's of
the running Python, their timers the loop's, with one addition: a deadline
already reached first hands the loop the default TimerThread's timers due
for it, so they run before the expiry, as on the native backend
(docs/design.rst, "Order on the loop"); and a NaN deadline expires on the
next turn, as asyncio's heap runs it up to 3.12 (from 3.13 asyncio's loop
passes it to ``select()``, which raises).  :func:`wait_for` is asyncio's up
to 3.11; from 3.12 it is asyncio's coroutine around this :func:`timeout`.
"""

from __future__ import annotations

import asyncio
import math
import sys
from asyncio import events, tasks, timeouts
from collections.abc import Awaitable
from typing import Any, TypeVar

from . import _default as _default_module
from ._default import deliver_due

__all__ = ("Timeout", "timeout", "timeout_at", "wait_for")

_T = TypeVar("_T")

# asyncio's own, before patch_asyncio() can make asyncio.wait_for this module's
_asyncio_wait_for = tasks.wait_for

# (private in typeshed, which also marks Timeout final; at run time a class)
_ENTERED = timeouts._State.ENTERED  # type: ignore[attr-defined]
_asyncio_reschedule = timeouts.Timeout.reschedule


# asyncio's Timeout queues a reached deadline's expiry with
# call_soon(self._on_timeout) into self._timeout_handler (3.11-3.15); where
# that holds, a reschedule checks for due timers only when the expiry was
# queued so, else it reads the loop's clock first.
_HANDLER_KNOWN = callable(getattr(timeouts.Timeout, "_on_timeout", None))


class Timeout(timeouts.Timeout):  # type: ignore[misc]
    """``asyncio.Timeout``; a deadline already reached comes after the
    TimerThread's timers due by then, and a NaN one expires at once."""

    def reschedule(self, when: float | None) -> None:
        if when is not None and self._state is _ENTERED:  # type: ignore[attr-defined]
            if type(when) is float and when != when:  # NaN: due at once
                _deliver_if_reached(-math.inf)
                _asyncio_reschedule(self, -math.inf)
                self._when = when
                return
            if _default_module._default is not None:  # else no timer to put first
                if not _HANDLER_KNOWN:
                    _deliver_if_reached(when)
                else:
                    _asyncio_reschedule(self, when)
                    me: Any = self  # (typeshed does not declare asyncio's private members)
                    # call_soon's handle (reached) has no when(), any loop's call_at's has
                    if not hasattr(me._timeout_handler, "when"):
                        self._expire_after_due()
                    return
        _asyncio_reschedule(self, when)

    def _expire_after_due(self) -> None:
        """The expiry just queued goes behind the timers due by now."""
        me: Any = self  # (typeshed does not declare asyncio's private members)
        loop = events.get_running_loop()
        me._timeout_handler.cancel()
        deliver_due(loop)
        me._timeout_handler = loop.call_soon(me._on_timeout)


def _deliver_if_reached(when: float) -> None:
    loop = events._get_running_loop()
    if loop is None:
        return
    try:
        reached = when <= loop.time()
    except Exception:  # asyncio's reschedule raises it, in its own order
        return
    if reached:
        deliver_due(loop)


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
    wait_for = _asyncio_wait_for


# asyncio's own names, for what reads them (repr, docs)
timeout.__doc__ = asyncio.timeout.__doc__
timeout_at.__doc__ = asyncio.timeout_at.__doc__
wait_for.__doc__ = _asyncio_wait_for.__doc__
