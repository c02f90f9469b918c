"""``bucketimer.aio`` on the pure backend: asyncio's own timeouts.

:func:`timeout`, :func:`timeout_at`, :class:`Timeout` and :func:`wait_for`
are asyncio's objects of the running Python, so their semantics are
asyncio's by construction; their timers are the loop's.
"""

from asyncio import Timeout, timeout, timeout_at, wait_for

__all__ = ("Timeout", "timeout", "timeout_at", "wait_for")
