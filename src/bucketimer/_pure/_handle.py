"""Handle: one timer of the pure backend, and the states it goes through.

A timer is kept in one of two places, and its Handle says which:

* on its loop's own heap (``_pending`` is the loop's dict of pending
  timers, ``_loop_timer.py``): a timer scheduled in its loop's thread while
  the loop runs.  The Handle is an ``asyncio.TimerHandle`` of that loop,
  pushed as ``loop.call_at`` pushes one; the loop runs it (``_run``).  Its
  claims -- running it, cancelling it, dropping it -- each pop it from
  ``_pending`` first, one atomic ``dict.pop``, so exactly one of them
  happens.
* in its scheduler's heap (``_pending`` None): every other timer.  It is
  PENDING in the heap, POSTED once due and handed to its loop or the
  dispatcher, RUNNING once claimed right before its callback is called
  (``_call``); PENDING or POSTED may become CANCELLED (``cancel()``) or
  DROPPED (its loop or TimerThread closed).  Every change happens under
  the scheduler's lock.

Either way exactly one of "ran" and "cancel() returned True" happens to
each timer (docs/guarantees.rst, "Cancel semantics").
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from asyncio.events import TimerHandle, _get_running_loop
from collections.abc import Callable
from heapq import heappush
from typing import TYPE_CHECKING, Any

from .._reporting import report_to_loop

if TYPE_CHECKING:
    from ._outbox import Outbox
    from ._scheduler import Scheduler

PENDING, POSTED, RUNNING, CANCELLED, DROPPED = range(5)
_STATE_NAMES = ("pending", "posted", "running", "cancelled", "dropped")

HIST_TOP = 47  # the lateness histogram's last bucket (HIST_BUCKETS - 1)

_monotonic = time.monotonic


class Handle(TimerHandle):
    """What ``call_later``/``call_at`` return: ``cancel()`` is True exactly
    when the callback will never run."""

    __slots__ = ("_at", "_deadline_ns", "_id", "_outbox", "_pending", "_sched", "_state")

    # (asyncio's slots that typeshed leaves out)
    _loop: Any
    _context: contextvars.Context
    # when() as asked for (an int given to call_at stays one)
    _at: float
    _id: int
    _sched: Scheduler
    _state: int
    # on its loop's heap: the loop's pending timers; else None
    _pending: dict[int, Scheduler] | None
    # in the scheduler's heap: the deadline, rounded up to a nanosecond, and
    # where it goes once due
    _deadline_ns: int
    _outbox: Outbox

    # Handles compare by identity, as the native ones do (TimerHandle's
    # compare the deadline and the callback).
    __hash__ = object.__hash__
    __eq__ = object.__eq__

    def __init__(self) -> None:  # pragma: no cover - made by arm() and scheduled()
        raise TypeError("a Handle is made by call_later() or call_at()")

    @property
    def id(self) -> int:
        return self._id

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        loop: asyncio.AbstractEventLoop | None = self._loop
        return loop

    @property
    def callback(self) -> Callable[..., object] | None:
        return self._callback

    @property
    def args(self) -> tuple[Any, ...] | None:
        return self._args  # type: ignore[return-value]

    def cancel(self) -> bool:  # type: ignore[override]
        """True if the callback will never run; False if it ran, is running,
        was cancelled before or was dropped."""
        pending = self._pending
        if pending is None:
            return self._sched.cancel(self)
        if pending.pop(self._id, None) is None:
            return False
        loop: Any = self._loop
        self._callback = self._args = None  # type: ignore[assignment]
        if loop._closed:  # its loop closed with it pending: that dropped it
            self._sched.loop_timer_dropped(self)
            return False
        self._state = CANCELLED
        self._sched.lt_cancelled += 1
        if _get_running_loop() is not loop:
            try:
                loop.call_soon_threadsafe(_off_the_heap, self)
            except RuntimeError:  # the loop closed meanwhile: its heap is gone
                pass
            return True
        # (asyncio's TimerHandle.cancel and the loop's
        # _timer_handle_cancelled, inline)
        self._cancelled = True
        if self._scheduled:
            self._loop._timer_cancelled_count += 1
        return True

    def cancelled(self) -> bool:
        return self._state == CANCELLED

    def when(self) -> float:
        """The deadline, on the ``time.monotonic()`` clock."""
        return self._at

    def get_context(self) -> contextvars.Context:
        return self._context

    def __lt__(self, other: Any) -> bool:
        # The loop's heap's order: the deadline, then, between two of these,
        # the order they were scheduled in (ids grow in it).
        a, b = self._when, other._when
        if a != b:
            return a < b  # type: ignore[no-any-return]
        return type(other) is Handle and self._id < other._id

    def __repr__(self) -> str:
        cb = self._callback
        what = "" if cb is None else f" {getattr(cb, '__qualname__', cb)!s}"
        return (f"<bucketimer.Handle id={self._id} {_STATE_NAMES[self._state]}"
                f" when={self._at}{what}>")

    # -- on its loop's heap -------------------------------------------------------

    def _run(self) -> None:
        """Called by the loop once the timer is due.  asyncio runs a timer up
        to its clock's resolution early: such a timer goes back on the heap,
        so that a callback never sees ``time.monotonic() < when()``."""
        now = _monotonic()
        if now < self._at:
            loop = self._loop
            self._when = self._at + loop._clock_resolution
            heappush(loop._scheduled, self)
            self._scheduled = True
            return
        if self._pending.pop(self._id, None) is None:  # type: ignore[union-attr]
            return  # cancelled from another thread, or dropped
        sched = self._sched
        if sched._closed:  # closed while this was being claimed
            sched.loop_timer_dropped(self, by_close=True)
            return
        self._state = RUNNING
        sched.lt_ran += 1
        late_ns = int((now - self._at) * 1e9)
        sched._hist[min(late_ns.bit_length() if late_ns > 0 else 0, HIST_TOP)] += 1
        try:
            self._context.run(self._callback, *self._args)  # type: ignore[arg-type]
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException as exc:
            report_to_loop(self._loop, self, exc)
        finally:
            self._callback = self._args = None  # type: ignore[assignment]

    # -- in its scheduler's heap ----------------------------------------------------

    def _call(self) -> None:
        """Calls the callback (claimed by the caller) in its context."""
        callback, args = self._callback, self._args or ()
        assert callback is not None
        self._context.run(callback, *args)

    def _release(self) -> None:
        """Once the timer has ended: let go of what the callback holds."""
        self._callback = self._args = None  # type: ignore[assignment]


def _off_the_heap(timer: Handle) -> None:
    """In the loop's thread: a timer another thread cancelled leaves the
    heap as asyncio's cancelled timers do."""
    if not timer._cancelled:
        timer._cancelled = True
        timer._loop._timer_handle_cancelled(timer)


_new = object.__new__


def scheduled(sched: Scheduler, timer_id: int, when: float, deadline_ns: int,
              callback: Callable[..., object], args: tuple[Any, ...],
              context: contextvars.Context, outbox: Outbox) -> Handle:
    """A Handle for the scheduler's heap (PENDING)."""
    h: Any = _new(Handle)
    h._sched = sched
    h._id = timer_id
    h._at = h._when = when
    h._deadline_ns = deadline_ns
    h._callback = callback
    h._args = args
    h._context = context
    h._outbox = outbox
    h._loop = outbox.loop
    h._pending = None
    h._state = PENDING
    h._cancelled = h._scheduled = False
    h._repr = h._source_traceback = None
    return h  # type: ignore[no-any-return]
