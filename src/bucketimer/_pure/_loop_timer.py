"""A TimerThread's timer kept on its loop's own heap: which loops, and how.

On the pure backend a timer scheduled from inside a running asyncio loop
(its own thread, the loop given or running) is an ``asyncio.TimerHandle``
pushed on that loop's heap, as ``loop.call_at`` pushes one (:func:`arm`):
asyncio orders it with the loop's other timers, wakes for it and runs it,
and no thread of bucketimer's takes part.  It answers bucketimer's
:class:`Handle` API on top: ``cancel()`` says whether it won, ``when()`` is
what was asked for (``_handle.py``).

Only loops that keep asyncio's own heap and clock qualify
(:func:`keeps_heap`): a subclass of ``asyncio.BaseEventLoop`` whose
``_run_once`` is asyncio's, whose ``call_at`` pushes on the heap
(asyncio's, or one registered with :func:`heap_call_at`), and whose
``time`` is asyncio's ``time.monotonic()`` (neither overridden nor
replaced on the instance).  Any other loop's timers, and those scheduled
from another thread, go through the scheduler's thread.

Claims: a pending timer's id is a key of its scheduler's dict of
them (``Scheduler._claims``); running it, cancelling it and dropping it
each first pop it from there, one atomic ``dict.pop``, so exactly one of
them happens.  A cancel from another thread takes it off the loop's heap
through ``call_soon_threadsafe``: thread safety is paid by calls from other
threads only.  A claim's value is its loop's record: ``weakref.ref(loop)``,
the plain weak reference that CPython makes once per object and gives back
to every later call, so that no table of bucketimer's maps loops to records
and nothing of bucketimer's holds a loop: a loop is freed as asyncio's is.
Through the records a TimerThread's ``close()`` finds the timers it drops
and ``stats()`` the loops that closed; a loop closed or freed with timers
pending leaves claims whose loop is closed or whose record is dead, swept
as cancelled (``Scheduler.loop_seen``).  The timer itself is asyncio's
``TimerHandle`` and no bigger (``_handle.py``).  Nothing else is made per
loop, and nothing is set on it (docs/performance.rst, "A short-lived
loop").
"""

from __future__ import annotations

import contextvars
import heapq
import weakref
from asyncio import events
from asyncio.base_events import BaseEventLoop
from asyncio.events import TimerHandle
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from .._live import Live
from ._arguments import SECONDS_RANGE as _RANGE
from ._handle import Handle

if TYPE_CHECKING:
    from ._scheduler import Scheduler

_heappush = heapq.heappush
_base_time = BaseEventLoop.time
_base_run_once = BaseEventLoop._run_once  # type: ignore[attr-defined]

# call_at methods that push on the loop's heap, as asyncio's does.
_HEAP_CALL_AT: set[Any] = {BaseEventLoop.call_at}
# call_later methods that push there too when their class's call_at does.
HEAP_CALL_LATER: set[Any] = {BaseEventLoop.call_later}
# The loop classes seen, by whether their instances keep asyncio's heap
# (their clock aside).
HEAP_TYPES: set[type] = set()
_OTHER_TYPES: set[type] = set()


def heap_call_at(call_at: Callable[..., Any], call_later: Callable[..., Any]) -> None:
    """Registers a loop class's ``call_at`` and ``call_later`` as ones that
    push on asyncio's heap (the pure drop-in loop's, which check their
    arguments first).  A class refused before may qualify now; one that
    qualified still does."""
    _HEAP_CALL_AT.add(call_at)
    HEAP_CALL_LATER.add(call_later)
    _OTHER_TYPES.clear()


# asyncio's Handle and TimerHandle slots, 3.11 to 3.15: what their two
# __init__ set, and what a timer made here without them sets.  A CPython
# whose handles have others gets asyncio's own calls instead.
_ASYNCIO_SLOTS = {"_callback", "_args", "_cancelled", "_loop", "_source_traceback", "_repr",
                  "__weakref__", "_context", "_scheduled", "_when"}
SLOTS_KNOWN = {*events.Handle.__slots__, *TimerHandle.__slots__} == _ASYNCIO_SLOTS


def heap_type(cls: type) -> bool:
    """Whether instances of the loop class ``cls`` keep asyncio's heap: it
    runs asyncio's ``_run_once`` and its ``call_at`` pushes there."""
    if cls in HEAP_TYPES:
        return True
    if cls in _OTHER_TYPES:
        return False
    ok = (SLOTS_KNOWN and issubclass(cls, BaseEventLoop)
          and getattr(cls, "_run_once", None) is _base_run_once
          and getattr(cls, "call_at", None) in _HEAP_CALL_AT
          and cls.__dictoffset__ != 0)  # (an instance holds its timers' claims)
    (HEAP_TYPES if ok else _OTHER_TYPES).add(cls)
    return ok


def keeps_heap(loop: Any) -> bool:
    """Whether a TimerThread's timers for ``loop`` may live on its heap:
    asyncio's heap and ``time.monotonic()`` clock (the class and the
    instance asked each time: a clock patched on either is seen).
    ``TimerThread.call_later`` has the same test inline, for the classes
    known to keep the heap."""
    return heap_type(type(loop)) and getattr(loop.time, "__func__", None) is _base_time


_new = object.__new__
_copy_context = contextvars.copy_context


def push(loop: Any, when: Any, callback: Callable[..., object], args: tuple[Any, ...],
         context: contextvars.Context | None) -> TimerHandle:
    """``loop.call_at(when, callback, *args, context=context)`` of a loop of
    :func:`heap_type` outside debug mode, in one call where asyncio's makes
    five (``call_at``, ``_check_closed``, the two ``__init__``,
    ``get_debug``): the same ``TimerHandle``, pushed on the same heap.  The
    caller has checked that the loop is open."""
    t: Any = _new(TimerHandle)
    t._context = _copy_context() if context is None else context
    t._loop = loop
    t._callback = callback
    t._args = args
    t._cancelled = False
    t._repr = None
    t._source_traceback = None
    t._when = when
    _heappush(loop._scheduled, t)
    t._scheduled = True
    return t  # type: ignore[no-any-return]


def cancel(timer: Any) -> None:
    """``timer.cancel()`` of a ``TimerHandle`` of a loop of :func:`heap_type`
    outside debug mode, in one call where asyncio's makes four
    (``cancel``, ``_timer_handle_cancelled``, ``Handle.cancel``,
    ``get_debug``)."""
    if not timer._cancelled:
        timer._cancelled = True
        if timer._scheduled:
            timer._loop._timer_cancelled_count += 1
        timer._callback = timer._args = None


# Every scheduler alive (``_scheduler.py`` adds each): those a closing
# drop-in loop tells.
SCHEDULERS: Live[Scheduler] = Live()

_weakref = weakref.ref
_weakref_count = weakref.getweakrefcount


def timers_on(loop: Any) -> Iterator[Handle]:
    """The TimerThreads' timers on ``loop``'s heap and in its ready queue
    (read from another thread too: each is a copy taken at once)."""
    for handle in (*list(loop._scheduled), *list(loop._ready)):
        if type(handle) is Handle:
            yield handle


def loop_closing(loop: Any) -> None:
    """``loop`` is about to close (the pure drop-in loop's ``close()``): its
    TimerThreads' timers are dropped, and counted as the core counts those
    of a loop's close."""
    if not heap_type(type(loop)) or not _weakref_count(loop):
        return  # (no timer of a TimerThread's is on its heap)
    for timer in timers_on(loop):
        sched = timer._repr
        if type(sched) is not int and sched._claims.pop(timer._source_traceback, None) is not None:
            sched.loop_timer_dropped(timer)


def arm(sched: Scheduler, loop: Any, seconds: float, when: float,
        callback: Callable[..., object], args: tuple[Any, ...],
        context: contextvars.Context) -> Handle | None:
    """A timer due at ``seconds`` (``when()`` gives ``when``), pushed on
    ``loop``'s heap; called in the loop's thread while it runs.  None (the
    caller's scheduler thread takes the timer) for an int ``when`` too
    large for a float.  ``TimerThread.call_later`` has it inline."""
    if type(when) is int and not -_RANGE <= when <= _RANGE:
        return None  # (one too large for a float: asyncio's heap cannot take it)
    rec = _weakref(loop)  # (made by the loop's first; the same one after)
    if rec is not sched._last_rec:
        sched.loop_seen(rec)
    tid = next(sched._ids)
    sched._claims[tid] = rec
    t: Any = Handle()
    t._when = when
    t._callback = callback
    t._args = args
    t._context = context
    t._loop = loop
    t._cancelled = False
    t._repr = sched
    t._source_traceback = tid
    _heappush(loop._scheduled, t)
    t._scheduled = True
    return t  # type: ignore[no-any-return]


__all__ = ["HEAP_CALL_LATER", "HEAP_TYPES", "SCHEDULERS", "SLOTS_KNOWN", "arm", "cancel",
           "heap_call_at", "heap_type", "keeps_heap", "loop_closing", "push", "timers_on"]
