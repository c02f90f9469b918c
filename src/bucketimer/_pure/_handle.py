"""Handle: one timer of the pure backend, and the states it goes through.

A timer is kept in one of two places, and its Handle says which:

* on its loop's own heap (``_home`` is its scheduler's dict of pending
  ones, ``_loop_timer.py``): a timer scheduled in its loop's thread while
  the loop runs.  The Handle is an ``asyncio.TimerHandle`` of that loop,
  pushed as ``loop.call_at`` pushes one; the loop runs it (``_run``).  Its
  claims -- running it, cancelling it, dropping it -- each pop it from
  ``_home`` first, one atomic ``dict.pop``, so exactly one of them
  happens.
* in its scheduler's heap (``_home`` the ``Outbox`` it goes to once due):
  every other timer.  It is
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
from typing import TYPE_CHECKING, Any

from .._reporting import report_to_loop

if TYPE_CHECKING:
    from ._outbox import Outbox
    from ._scheduler import Scheduler

PENDING, POSTED, RUNNING, CANCELLED, DROPPED = range(5)
# What the repr says of each state, in the native handle's words: a timer
# is pending until claimed, and has "ran" from then on.
_STATE_NAMES = ("pending", "pending", "ran", "cancelled", "dropped")

HIST_TOP = 47  # the lateness histogram's last bucket (HIST_BUCKETS - 1)

_monotonic = time.monotonic


class Handle(TimerHandle):
    """What ``call_later``/``call_at`` return: ``cancel()`` is True exactly
    when the callback will never run."""

    # (few: a timer's size is what the cycle collector walks and frees)
    __slots__ = ("_home", "_id", "_sched", "_state")

    # (asyncio's slots that typeshed leaves out; _when is what when() gives)
    _loop: Any
    _context: contextvars.Context
    _when: float
    _scheduled: bool
    _id: int
    _sched: Scheduler
    _state: int
    # on its loop's heap: its scheduler's claims of those pending (id -> the
    # loop's id); in the scheduler's heap: where it goes once due
    _home: dict[int, int] | Outbox

    # Handles compare by identity, as the native ones do (TimerHandle's
    # compare the deadline and the callback).
    __hash__ = object.__hash__
    __eq__ = object.__eq__

    # (made by arm() and scheduled(), never by a caller: object's __init__
    # is the cheapest way to a blank one)
    __init__ = object.__init__

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
        home = self._home
        if type(home) is not dict:
            return self._sched.cancel(self)
        if home.pop(self._id, None) is None:
            return False
        loop: Any = self._loop
        self._callback = self._args = None  # type: ignore[assignment]
        if loop._closed:  # its loop closed with it pending: that dropped it
            self._sched.loop_timer_dropped(self)
            return False
        self._state = CANCELLED
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
        """The deadline, on the ``time.monotonic()`` clock (an int given to
        ``call_at`` stays one)."""
        return self._when

    def get_context(self) -> contextvars.Context:
        return self._context

    def __lt__(self, other: Any) -> bool:
        # The loop's heap's order: the deadline, then, between two of these,
        # the order they were scheduled in (ids grow in it).
        a, b = self._when, other._when
        return a < b or (a == b and type(other) is Handle and self._id < other._id)

    def __repr__(self) -> str:
        # (as the native handle's: the deadline and callback of a pending
        # timer, the id of one that has ended or is running)
        state = _STATE_NAMES[self._state]
        cb = self._callback
        if self._state > POSTED or cb is None:
            return f"<bucketimer.Handle {state} id={self._id}>"
        return f"<bucketimer.Handle {state} when={self._when!r} {cb!r}>"

    # -- on its loop's heap -------------------------------------------------------

    def _run(self) -> None:
        """Called by the loop once the timer is due.  asyncio runs a timer up
        to its clock's resolution early: such a timer is called again then,
        so that a callback never sees ``time.monotonic() < when()``."""
        now = _monotonic()
        if now < self._when:
            loop = self._loop
            loop.call_at(self._when + loop._clock_resolution, self._run)
            return
        if self._home.pop(self._id, None) is None:  # type: ignore[union-attr]
            return  # cancelled from another thread, or dropped
        sched = self._sched
        if sched._closed:  # closed while this was being claimed
            sched.loop_timer_dropped(self, by_close=True)
            return
        self._state = RUNNING
        sched.lt_ran += 1
        late = now - self._when  # (inf for a deadline of -inf: the last bucket)
        late_ns = int(late * 1e9) if late < 1e9 else 1 << HIST_TOP
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




def scheduled(sched: Scheduler, timer_id: int, when: float,
              callback: Callable[..., object], args: tuple[Any, ...],
              context: contextvars.Context, outbox: Outbox) -> Handle:
    """A Handle for the scheduler's heap (PENDING)."""
    h: Any = Handle()
    h._sched = sched
    h._id = timer_id
    h._when = when
    h._callback = callback
    h._args = args
    h._context = context
    h._home = outbox
    h._loop = outbox.loop
    h._state = PENDING
    h._cancelled = h._scheduled = False
    h._repr = h._source_traceback = None
    return h  # type: ignore[no-any-return]
