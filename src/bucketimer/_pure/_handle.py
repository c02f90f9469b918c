"""Handle: one timer of the pure backend, and the states it goes through.

A timer is kept in one of two places, and its class says which:

* :class:`Handle`, on its loop's own heap (``_loop_timer.py``): a timer
  scheduled in its loop's thread while the loop runs.  It is an
  ``asyncio.TimerHandle`` of that loop, no bigger, pushed as
  ``loop.call_at`` pushes one; the loop runs it (``_run``).  Its claims --
  running it, cancelling it, dropping it -- each pop its ``id()`` from its
  scheduler's dict of pending ones first, one atomic ``dict.pop``, so
  exactly one of them happens.
* :class:`QueuedHandle`, in its scheduler's heap: every other timer.  It
  is PENDING in the heap, POSTED once due and handed to its loop or the
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
    when the callback will never run.

    This class is a timer on its loop's heap, and adds no slot to asyncio's
    ``TimerHandle``: the loop's heap sifts through thousands of them, and
    each byte and object more per timer costs every pair there
    (docs/performance.rst, "The pure-Python backend against asyncio").  Two
    slots of asyncio's that this class never uses for asyncio's purpose
    hold its own state: ``_repr`` (a cache of a debug-mode repr) its
    scheduler while it is pending and its end (RUNNING, CANCELLED,
    DROPPED) once claimed; ``_source_traceback`` (where a debug-mode handle
    was made, which this one never has) its id, the key of its claim.  A
    timer in its scheduler's heap is a :class:`QueuedHandle`.
    """

    __slots__ = ()

    # (asyncio's slots that typeshed leaves out; _when is what when() gives)
    _loop: Any
    _context: contextvars.Context
    _when: float
    _scheduled: bool
    _repr: Any  # its Scheduler while pending, then RUNNING, CANCELLED or DROPPED
    _source_traceback: Any  # its id

    # Handles compare by identity, as the native ones do (TimerHandle's
    # compare the deadline and the callback).
    __hash__ = object.__hash__
    __eq__ = object.__eq__

    # (made by arm() and scheduled(), never by a caller: object's __init__
    # is the cheapest way to a blank one)
    __init__ = object.__init__

    @property
    def id(self) -> int:
        tid: int | None = self._source_traceback
        return _RUNNING_IDS.get(self, 0) if tid is None else tid

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
        sched = self._repr
        if type(sched) is int or sched._claims.pop(self._source_traceback, None) is None:
            return False
        loop: Any = self._loop
        self._callback = self._args = None  # type: ignore[assignment]
        if loop._closed:  # its loop closed with it pending: that dropped it
            sched.loop_timer_dropped(self)
            return False
        self._repr = CANCELLED
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
        return self._repr is CANCELLED

    def when(self) -> float:
        """The deadline, on the ``time.monotonic()`` clock (an int given to
        ``call_at`` stays one)."""
        return self._when

    def get_context(self) -> contextvars.Context:
        return self._context

    def __lt__(self, other: Any) -> bool:
        # asyncio's order: the deadline alone, so that equal deadlines run
        # in the heap's order (docs/asyncio.rst, "One contract"; a tie-break
        # by schedule order cost 5-10% of a pair, docs/design.rst, "The
        # pure-Python backend").
        return self._when < other._when  # type: ignore[no-any-return]

    def __repr__(self) -> str:
        # (as the native handle's: the deadline and callback of a pending
        # timer, the id of one that has ended or is running)
        end = self._repr
        cb = self._callback
        if type(end) is int or cb is None:
            state = _STATE_NAMES[end] if type(end) is int else "pending"
            return f"<bucketimer.Handle {state} id={self.id}>"
        return f"<bucketimer.Handle pending when={self._when!r} {cb!r}>"

    def _run(self) -> None:
        """Called by the loop once the timer is due.  asyncio runs a timer up
        to its clock's resolution early: such a timer is called again then,
        so that a callback never sees ``time.monotonic() < when()``."""
        now = _monotonic()
        if now < self._when:
            loop = self._loop
            loop.call_at(self._when + loop._clock_resolution, self._run)
            return
        sched = self._repr
        if type(sched) is int or sched._claims.pop(self._source_traceback, None) is None:
            return  # cancelled from another thread, or dropped
        if sched._closed:  # closed while this was being claimed
            sched.loop_timer_dropped(self, by_close=True)
            return
        self._repr = RUNNING
        sched.lt_ran += 1
        late = now - self._when  # (inf for a deadline of -inf: the last bucket)
        late_ns = int(late * 1e9) if late < 1e9 else 1 << HIST_TOP
        sched._hist[min(late_ns.bit_length() if late_ns > 0 else 0, HIST_TOP)] += 1
        # In debug mode asyncio's exception handler reads the running
        # handle's _source_traceback as a traceback: while it runs, it has
        # none, and its id is kept aside.
        debug = self._loop._debug
        if debug:
            _RUNNING_IDS[self] = self._source_traceback
            self._source_traceback = None
        try:
            self._context.run(self._callback, *self._args)  # type: ignore[arg-type]
        except (SystemExit, KeyboardInterrupt):
            raise
        except BaseException as exc:
            report_to_loop(self._loop, self, exc)
        finally:
            self._callback = self._args = None  # type: ignore[assignment]
            if debug:
                self._source_traceback = _RUNNING_IDS.pop(self)

    def _release(self) -> None:
        """Once the timer has ended: let go of what the callback holds."""
        self._callback = self._args = None  # type: ignore[assignment]


class QueuedHandle(Handle):
    """A timer in its scheduler's heap: PENDING there, POSTED once due and
    handed to its loop or the dispatcher, RUNNING once claimed right before
    its callback is called (``_call``); PENDING or POSTED may become
    CANCELLED (``cancel()``) or DROPPED (its loop or TimerThread closed).
    Every change happens under the scheduler's lock."""

    # (few: a timer's size is what the cycle collector walks and frees)
    __slots__ = ("_home", "_id", "_sched", "_state")

    _id: int
    _sched: Scheduler
    _state: int
    _home: Outbox  # where it goes once due

    @property
    def id(self) -> int:
        return self._id

    def cancel(self) -> bool:  # type: ignore[override]
        """True if the callback will never run; False if it ran, is running,
        was cancelled before or was dropped."""
        return self._sched.cancel(self)

    def cancelled(self) -> bool:
        return self._state == CANCELLED

    def __repr__(self) -> str:
        state = _STATE_NAMES[self._state]
        cb = self._callback
        if self._state > POSTED or cb is None:
            return f"<bucketimer.Handle {state} id={self._id}>"
        return f"<bucketimer.Handle {state} when={self._when!r} {cb!r}>"

    def _call(self) -> None:
        """Calls the callback (claimed by the caller) in its context."""
        callback, args = self._callback, self._args or ()
        assert callback is not None
        self._context.run(callback, *args)


# A program sees one Handle class, as on the native backend, where one type
# serves both places: this subclass is a layout, not another API.
QueuedHandle.__name__ = QueuedHandle.__qualname__ = "Handle"


# The ids of timers running on a debug-mode loop (``Handle._run``).
_RUNNING_IDS: dict[Handle, int] = {}


def _off_the_heap(timer: Handle) -> None:
    """In the loop's thread: a timer another thread cancelled leaves the
    heap as asyncio's cancelled timers do."""
    if not timer._cancelled:
        timer._cancelled = True
        timer._loop._timer_handle_cancelled(timer)


def scheduled(sched: Scheduler, timer_id: int, when: float,
              callback: Callable[..., object], args: tuple[Any, ...],
              context: contextvars.Context, outbox: Outbox) -> QueuedHandle:
    """A handle for the scheduler's heap (PENDING)."""
    h: Any = QueuedHandle()
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
