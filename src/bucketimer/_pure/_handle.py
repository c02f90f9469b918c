"""Handle: one timer of the pure backend, and the states it goes through.

A timer is PENDING in its scheduler's heap, POSTED once due and handed to
its loop or the dispatcher, RUNNING once claimed right before its callback
is called; PENDING or POSTED may become CANCELLED (``cancel()``) or DROPPED
(its loop or TimerThread closed).  Every change happens under the
scheduler's lock, so exactly one of "ran" and "cancel() returned True"
happens to each timer (docs/guarantees.rst, "Cancel semantics").
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._outbox import Outbox
    from ._scheduler import Scheduler

PENDING, POSTED, RUNNING, CANCELLED, DROPPED = range(5)
_STATE_NAMES = ("pending", "posted", "running", "cancelled", "dropped")


class Handle:
    """What ``call_later``/``call_at`` return: ``cancel()`` is True exactly
    when the callback will never run."""

    __slots__ = ("_args", "_callback", "_context", "_deadline_ns", "_id", "_outbox", "_sched",
                 "_state", "_when", "__weakref__")

    def __init__(self, sched: Scheduler, timer_id: int, when: float, deadline_ns: int,
                 callback: Callable[..., object], args: tuple[Any, ...],
                 context: contextvars.Context | None, outbox: Outbox) -> None:
        self._sched = sched
        self._id = timer_id
        self._when = when
        self._deadline_ns = deadline_ns
        self._callback: Callable[..., object] | None = callback
        self._args: tuple[Any, ...] | None = args
        self._context = context
        self._outbox = outbox
        self._state = PENDING

    @property
    def id(self) -> int:
        return self._id

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        return self._outbox.loop

    @property
    def callback(self) -> Callable[..., object] | None:
        return self._callback

    @property
    def args(self) -> tuple[Any, ...] | None:
        return self._args

    def cancel(self) -> bool:
        """True if the callback will never run; False if it ran, is running,
        was cancelled before or was dropped."""
        return self._sched.cancel(self)

    def cancelled(self) -> bool:
        return self._state == CANCELLED

    def when(self) -> float:
        """The deadline, on the ``time.monotonic()`` clock."""
        return self._when

    def get_context(self) -> contextvars.Context | None:
        return self._context

    def _run(self) -> None:
        """Calls the callback (claimed by the caller) in its context."""
        callback, args = self._callback, self._args or ()
        assert callback is not None
        if self._context is None:
            callback(*args)
        else:
            self._context.run(callback, *args)

    def _release(self) -> None:
        """Once the timer has ended: let go of what the callback holds."""
        self._callback = None
        self._args = None

    def __repr__(self) -> str:
        cb = self._callback
        what = "" if cb is None else f" {getattr(cb, '__qualname__', cb)!s}"
        return (f"<bucketimer.Handle id={self._id} {_STATE_NAMES[self._state]}"
                f" when={self._when}{what}>")
