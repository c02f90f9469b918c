"""TimerThread of the pure backend: the public face of a :class:`Scheduler`."""

from __future__ import annotations

import asyncio
import contextvars
import math
import time
import warnings
import weakref
from asyncio.base_events import BaseEventLoop
from asyncio.events import _get_running_loop
from collections.abc import Callable
from heapq import heappush
from typing import Any, TypeVarTuple, Unpack

from .. import _pending
from .._reporting import SLOW_CALLBACK_DURATION, check_slow_callback_duration
from .._stats import Stats
from ._arguments import SECONDS_RANGE, check_callback, check_loop, deadline_ns, to_seconds
from ._handle import Handle
from ._loop_timer import HEAP_TYPES, arm, keeps_heap
from ._scheduler import Scheduler

monotonic = time.monotonic
_base_time = BaseEventLoop.time
ceil = math.ceil
copy_context = contextvars.copy_context
_weakref = weakref.ref
_LOWEST = -SECONDS_RANGE

_Ts = TypeVarTuple("_Ts")

# The native core's limits, kept so that code written for one backend is
# accepted by the other (the pure one has no buckets to size).
DEFAULT_BUCKETS = 13
MAX_BUCKETS = 256
DEFAULT_DRAIN_THRESHOLD = 4096
MIN_DRAIN_THRESHOLD = 16
MAX_DRAIN_THRESHOLD = 2**31 - 1  # the native backend's C int


class TimerThread:
    """One timer thread and the timers it keeps.

    ``TimerThread(buckets=13, *, drain_threshold=4096,
    slow_callback_duration=0.1)`` (the first two are checked as the native
    backend checks them, and otherwise unused).  Schedule from any thread
    with :meth:`call_later` / :meth:`call_at`; a timer scheduled inside a
    running event loop (or with ``loop=``) runs in that loop's thread, any
    other on this TimerThread's one dispatcher thread, where a callback that
    runs ``slow_callback_duration`` seconds or longer is logged.  A timer
    scheduled in its own loop's thread while it runs is kept on that loop's
    heap; the thread, started with the first timer that needs it, keeps the
    others.  :meth:`close` stops the thread; pending timers are dropped,
    never called.
    """

    def __init__(self, buckets: int = DEFAULT_BUCKETS, *,
                 drain_threshold: int = DEFAULT_DRAIN_THRESHOLD,
                 slow_callback_duration: float | None = SLOW_CALLBACK_DURATION) -> None:
        _int_option(buckets, "buckets", 1, MAX_BUCKETS)
        _int_option(drain_threshold, "drain_threshold", MIN_DRAIN_THRESHOLD, MAX_DRAIN_THRESHOLD)
        slow = check_slow_callback_duration(slow_callback_duration)
        self._sched = Scheduler(buckets)
        self._sched.dispatcher.time_callbacks(slow)
        self._slow_after = slow

    @property
    def slow_callback_duration(self) -> float | None:
        """Seconds a no-loop callback may hold the dispatcher thread before
        it is logged (a WARNING on the ``bucketimer`` logger once it
        returns); None logs none.  Settable at any time."""
        return self._slow_after

    @slow_callback_duration.setter
    def slow_callback_duration(self, value: float | None) -> None:
        self._slow_after = check_slow_callback_duration(value)
        self._sched.dispatcher.time_callbacks(self._slow_after)

    @property
    def closed(self) -> bool:
        return self._sched.closed

    def call_later(self, delay: float, callback: Callable[[Unpack[_Ts]], object], /,
                   *args: *_Ts, loop: asyncio.AbstractEventLoop | None = None,
                   context: contextvars.Context | None = None) -> Handle:
        """Run ``callback(*args)`` ``delay`` seconds from now."""
        sched = self._sched
        if sched._closed:
            return self._reopened().call_later(delay, callback, *args, loop=loop,
                                               context=context)
        # The common case, a float or int whose deadline is in range, skips
        # to_seconds; NaN, an int too large for a float and everything else
        # go through it, for its errors.  The range is tested on the float
        # deadline, not on the delay: an int compared with a float takes a
        # path of CPython's that is seldom in a cache, and a new loop's first
        # timer paid 0.3-0.7 us for it (docs/performance.rst, "A short-lived
        # loop").
        if type(delay) is float or type(delay) is int:
            try:
                seconds = monotonic() + delay
            except OverflowError:
                seconds = math.nan
        else:
            seconds = math.nan
        if _LOWEST < seconds < SECONDS_RANGE:
            # the commonest of all, inline: in a running loop that keeps it
            # on its heap (keeps_heap(), for the classes known to), and
            # arm() itself (a call costs a new loop's first timer 0.05 µs,
            # docs/performance.rst, "A short-lived loop")
            if loop is None and context is None and callable(callback):
                running: Any = _get_running_loop()
                if type(running) in HEAP_TYPES:
                    try:
                        stock_clock = running.time.__func__ is _base_time
                    except AttributeError:  # a time that is not a method
                        stock_clock = False
                    if stock_clock:
                        rec = _weakref(running)  # (the loop's one record)
                        if rec is not sched._last_rec:  # (loop_seen(), inline)
                            sched._last_rec = rec
                            if len(sched._claims) >= sched._sweep_at:
                                sched._sweep_claims()
                        tid = next(sched._ids)
                        sched._claims[tid] = rec
                        t: Any = Handle()
                        t._when = seconds
                        t._callback = callback
                        t._args = args
                        t._context = copy_context()
                        t._loop = running
                        t._cancelled = False
                        t._repr = sched
                        t._source_traceback = tid
                        heappush(running._scheduled, t)
                        t._scheduled = True
                        return t  # type: ignore[no-any-return]
            return self._schedule(seconds, callback, args, loop, context)
        seconds = to_seconds(delay, "delay")
        when = math.inf if seconds > SECONDS_RANGE else monotonic() + seconds
        return self._schedule(when, callback, args, loop, context)

    def call_at(self, when: float, callback: Callable[[Unpack[_Ts]], object], /,
                *args: *_Ts, loop: asyncio.AbstractEventLoop | None = None,
                context: contextvars.Context | None = None) -> Handle:
        """Run ``callback(*args)`` at ``when`` on the ``time.monotonic()`` clock."""
        if self._sched._closed:
            return self._reopened().call_at(when, callback, *args, loop=loop, context=context)
        seconds = to_seconds(when, "when")
        # when() gives back an int as it was given, as asyncio's TimerHandle does
        return self._schedule(seconds, callback, args, loop, context,
                              when if type(when) is int else seconds)

    def _schedule(self, seconds: float, callback: Callable[..., object], args: tuple[Any, ...],
                  loop: asyncio.AbstractEventLoop | None, context: Any,
                  when: float | None = None) -> Handle:
        if context is not None or not callable(callback):
            check_callback(callback, context)
        running = _get_running_loop()
        if loop is None:
            loop = running
        elif loop is not running:
            check_loop(loop)
        if context is None:  # the caller's, as asyncio's call_later takes it
            context = copy_context()
        if loop is running and loop is not None and keeps_heap(loop):
            h = arm(self._sched, loop, seconds, seconds if when is None else when,
                    callback, args, context)
            if h is not None:
                return h
        # deadline_ns(seconds), its usual case inline
        ns = ceil(seconds * 1e9) if 0.0 < seconds < SECONDS_RANGE else -1
        if ns < 0 or ns / 1e9 < seconds:
            ns = deadline_ns(seconds)
        return self._sched.schedule(ns, seconds if when is None else when,
                                    callback, args, context, loop)

    def _reopened(self) -> TimerThread:
        """Where a call to a closed TimerThread goes: nowhere (the default
        TimerThread's view makes a new default, ``_default.py``)."""
        raise RuntimeError("TimerThread is closed")

    def _check_open(self) -> None:
        """A closed TimerThread refuses before it looks at the arguments."""
        if self._sched.closed:
            raise RuntimeError("TimerThread is closed")

    def stats(self) -> Stats:
        """Counters (``bucketimer.Stats``); those of the native core's
        structures that the pure backend does not have are 0."""
        return self._sched.stats()

    def time(self) -> float:
        """``time.monotonic()``: the clock of ``call_at`` and ``Handle.when()``."""
        return time.monotonic()

    pending = _pending.pending

    def _pending_handles(self) -> list[Handle]:
        return self._sched.pending()

    def close(self) -> None:
        """Stop and join the timer thread; drop pending timers without calling them.

        After ``close()`` returns no callback of this TimerThread starts, and
        scheduling raises ``RuntimeError``.  A callback already running
        finishes.  Idempotent.
        """
        self._sched.close(join_timeout=1.0)

    def _test_hold(self, hold: bool) -> None:
        """Test only: while held, the timer thread takes no due timer, as
        one waiting for a CPU; ``close()`` lets it go."""
        self._check_open()
        self._sched.hold(bool(hold))

    def __enter__(self) -> TimerThread:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self, _warn: Any = warnings.warn) -> None:
        # Collected without close(), as asyncio's loop is: warned, then
        # closed (its threads stopped, its timers dropped).
        sched = getattr(self, "_sched", None)
        if sched is not None and not sched.closed:
            _warn(f"unclosed TimerThread {self!r}", ResourceWarning, source=self)
            sched.close(join_timeout=0.0)

    def __repr__(self) -> str:
        state = "closed" if self.closed else "running"
        return f"<bucketimer.TimerThread {state} (pure Python)>"


def _int_option(value: Any, what: str, lo: int, hi: int) -> None:
    """The native backend's check of an int option (ext/timer_thread_type.c)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an integer, not {type(value).__name__}")
    if not lo <= value <= hi:
        raise ValueError(f"{what} must be between {lo} and {hi}")
