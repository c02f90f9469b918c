"""``bucketimer.aio`` on the pure backend: asyncio's own timeouts.

:func:`timeout`, :func:`timeout_at` and :class:`Timeout` are asyncio's of
the running Python, their timers the loop's, with one addition: a deadline
already reached first hands the loop the default TimerThread's timers due
for it, so they run before the expiry, as on the native backend
(docs/design.rst, "Order on the loop").  :func:`wait_for` is asyncio's (it
only arms deadlines still ahead).
"""

from __future__ import annotations

import asyncio
from asyncio import events, timeouts, wait_for

from ._default import deliver_due

__all__ = ("Timeout", "timeout", "timeout_at", "wait_for")

# (private in typeshed, which also marks Timeout final; at run time a class)
_ENTERED = timeouts._State.ENTERED  # type: ignore[attr-defined]


class Timeout(timeouts.Timeout):  # type: ignore[misc]
    """``asyncio.Timeout``; a deadline already reached comes after the
    TimerThread's timers due by then."""

    def reschedule(self, when: float | None) -> None:
        if when is not None and self._state is _ENTERED:  # type: ignore[attr-defined]
            _deliver_if_reached(when)
        super().reschedule(when)


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


# asyncio's own names, for what reads them (repr, docs)
timeout.__doc__ = asyncio.timeout.__doc__
timeout_at.__doc__ = asyncio.timeout_at.__doc__
