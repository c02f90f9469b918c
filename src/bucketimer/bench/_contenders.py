"""The contenders (the table's columns) and what each one runs on.

``bucketimer``
    bucketimer's own API on the stock asyncio loop: ``TimerThread`` timers
    (or, with no loop, its dispatcher thread), ``bucketimer.timeout()`` and
    ``wait_for()``; for the native rows, the bucketed C core.
``pure Python``
    bucketimer's pure-Python backend (``bucketimer.backend == "python"``, what
    a system with no native wheel runs) on the stock loop: its
    ``TimerThread`` timers; its ``timeout()``/``wait_for()`` (asyncio's, with
    the native helpers' order of due timers and NaN deadline).
``asyncio`` / ``uvloop`` / ``drop-in`` / ``drop-in uvloop``
    That event loop's own ``call_later``/``call_at``/``asyncio.timeout()``;
    ``drop-in`` is :class:`bucketimer.EventLoop`, ``drop-in uvloop`` is
    ``bucketimer.loop.UVEventLoop`` (uvloop with native timers).
``pure drop-in``
    :class:`bucketimer.EventLoop` of the pure-Python backend (asyncio's heap
    behind the drop-in loop's ``call_at``/``call_later``): what
    ``bucketimer.run()`` gives a program where no native wheel exists.
    With ``pure Python``, a column of the ``pairs`` and ``timeout`` groups,
    so that what the native core gives is seen beside what pip gives
    elsewhere.
``patched drop-in``
    Stock asyncio code (``asyncio.timeout()``) after
    :func:`bucketimer.patch_asyncio`, on the drop-in loop: what a service
    gets from two lines at start-up and no change to its code.
``threading.Timer`` / ``sched``
    The standard library's timers for code with no event loop.
``1-lock heap``
    The reference C timer of ``csrc/bench.c``: one mutex, one binary heap.

uvloop is the one optional contender: without it, its column is missing.
Where the pure-Python backend runs (``bucketimer.backend == "python"``: no
native modules, or ``BUCKETIMER_NO_EXTENSIONS`` set) the ``bucketimer`` and
``drop-in`` columns *are* that backend: the ``pure Python`` and ``pure
drop-in`` columns would repeat them, and the core rows with their ``1-lock
heap`` column measure a C core that is not there, so :data:`NATIVE_ONLY`
are left out and :data:`PURE_INSTALL_NOTE` says what a native install adds.

:data:`STANDS_IN_FOR` says which column each of bucketimer's takes the place
of (the one a row's mark and a table's verdict compare it with), and
:func:`describe` what each column runs, for the legend under every table.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import ModuleType

import bucketimer
from bucketimer._pure._loop import EventLoop as PureEventLoop
from bucketimer.loop import EventLoop

uvloop: ModuleType | None
try:
    import uvloop
except ImportError:
    uvloop = None

BUCKETIMER = "bucketimer"
PURE = "pure Python"
ASYNCIO = "asyncio"
UVLOOP = "uvloop"
DROPIN = "drop-in"
DROPIN_UV = "drop-in uvloop"
PURE_DROPIN = "pure drop-in"
PATCHED = "patched drop-in"
THREADING_TIMER = "threading.Timer"
SCHED = "sched"
REF_HEAP = "1-lock heap"
# Column order of the table.
CONTENDERS = (BUCKETIMER, PURE, ASYNCIO, UVLOOP, DROPIN, PURE_DROPIN, DROPIN_UV, PATCHED,
              THREADING_TIMER, SCHED, REF_HEAP)

# Each column's colour in every figure (matplotlib's tab10, and one more).
COLORS = dict(zip(CONTENDERS, ("#1f77b4", "#8c564b", "#ff7f0e", "#2ca02c", "#9467bd",
                               "#c5b0d5", "#17becf", "#d62728", "#bcbd22", "#e377c2",
                               "#7f7f7f"),
                  strict=True))

# The columns only a native install has (see the module's docstring).
NATIVE_ONLY = (PURE, PURE_DROPIN, REF_HEAP)
PURE_INSTALL_NOTE = (
    "bucketimer runs its pure-Python backend here (bucketimer.backend is 'python'), so the "
    "bucketimer and drop-in columns are that backend; a native install (the CPython 3.11-3.15 "
    "wheels for Linux x86_64, glibc) adds the C core under them, the "
    f"'{PURE}' and '{PURE_DROPIN}' columns beside them, and the core rows with their "
    f"'{REF_HEAP}' column")

# The column each of bucketimer's takes the place of: what a program would
# run without it.  The bucketimer column of the rows with no loop stands in
# for the faster of threading.Timer and sched, of the core rows for the
# 1-lock heap.
STANDS_IN_FOR = {BUCKETIMER: ASYNCIO, PURE: ASYNCIO, DROPIN: ASYNCIO, PURE_DROPIN: ASYNCIO,
                 PATCHED: ASYNCIO, DROPIN_UV: UVLOOP}
_STANDS_IN_FOR_BY_GROUP: dict[str, dict[str, tuple[str, ...]]] = {
    "noloop": {BUCKETIMER: (THREADING_TIMER, SCHED)}, "core": {BUCKETIMER: (REF_HEAP,)}}


def stands_in_for(group: str, column: str) -> tuple[str, ...]:
    """The columns ``column`` of a ``group`` row is measured against (its
    mark compares it with the best of them); none for one of theirs."""
    by_group = _STANDS_IN_FOR_BY_GROUP.get(group, {})
    if column in by_group:
        return by_group[column]
    ref = STANDS_IN_FOR.get(column)
    return (ref,) if ref else ()


# What each column runs, as the legend under a table says it; {what} is the
# group's operation (``call_later``, ``timeout()``...).
_DESCRIPTIONS = {
    BUCKETIMER: "bucketimer's {what} on the stock asyncio loop",
    PURE: "the same, on bucketimer's pure-Python backend",
    ASYNCIO: "asyncio's own {what} on its stock loop",
    UVLOOP: "asyncio's {what} on uvloop",
    DROPIN: "bucketimer.EventLoop (the drop-in loop), asyncio's {what} on it",
    PURE_DROPIN: "the drop-in loop of bucketimer's pure-Python backend, asyncio's {what} on it",
    DROPIN_UV: "bucketimer.loop.UVEventLoop, asyncio's {what} on it",
    PATCHED: "asyncio's {what} after bucketimer.patch_asyncio(), on the drop-in loop",
    THREADING_TIMER: "a threading.Timer per timer",
    SCHED: "sched.scheduler, run by a thread of its own",
    REF_HEAP: "the reference C timer: one mutex around one binary heap",
}
# The operation of each group's rows
_WHAT = {"pairs": "call_later", "timeout": "timeout()/wait_for()", "lateness": "call_at",
         "noloop": "timers", "core": "C core", "reset": "deadline resets",
         "service": "timeout()"}
_PURE_BACKEND_DESCRIPTIONS = {
    BUCKETIMER: "bucketimer's {what} on the stock asyncio loop, its pure-Python backend",
    DROPIN: "bucketimer.EventLoop of the pure-Python backend, asyncio's {what} on it",
}


def describe(group: str, column: str, pure_backend: bool = False) -> str:
    """What ``column`` runs in the rows of ``group`` (``pure_backend``: the
    run's bucketimer was its pure-Python backend)."""
    if column == BUCKETIMER and group == "core":
        return "the bucketed C core"
    if column == BUCKETIMER and group == "noloop":
        return "a TimerThread's dispatcher thread" + (
            " (pure-Python backend)" if pure_backend else "")
    text = (_PURE_BACKEND_DESCRIPTIONS if pure_backend else {}).get(
        column, _DESCRIPTIONS.get(column, column))
    return text.format(what=_WHAT.get(group, "timers"))

LoopFactory = Callable[[], asyncio.AbstractEventLoop]


def native_backend() -> bool:
    """Whether bucketimer's API runs on the native core here."""
    return bucketimer.backend == "native"


def loop_factories() -> dict[str, LoopFactory]:
    """The event loop of each loop contender, in column order; uvloop's only
    when it is installed."""
    loops: dict[str, LoopFactory] = {BUCKETIMER: asyncio.new_event_loop,
                                     ASYNCIO: asyncio.new_event_loop}
    if uvloop is not None:
        loops[UVLOOP] = uvloop.new_event_loop
    loops[DROPIN] = EventLoop
    return loops


def with_pure(loops: dict[str, LoopFactory], want: set[str]) -> dict[str, LoopFactory]:
    """``loops`` and, if wanted, the pure backend's columns (its timers on
    the stock loop, its drop-in loop) in column order: the contenders of
    the groups that show them."""
    out = dict(loops)
    if PURE in want:
        out[PURE] = asyncio.new_event_loop
    if PURE_DROPIN in want:
        out[PURE_DROPIN] = PureEventLoop
    return {name: out[name] for name in CONTENDERS if name in out}


def pure_timer_thread() -> bucketimer.TimerThread:
    """A TimerThread of the pure-Python backend, whichever backend runs."""
    from bucketimer._pure._timer_thread import TimerThread

    return TimerThread()  # type: ignore[return-value]


def new_loop(name: str, timer_thread: bucketimer.TimerThread | None = None
             ) -> asyncio.AbstractEventLoop:
    """A new event loop of the loop contender ``name`` (``bucketimer`` runs on
    the stock loop, ``patched drop-in`` on the drop-in loop: patching asyncio
    is its caller's job); a drop-in loop takes its timers from ``timer_thread``
    (default: the process-wide one).  uvloop's raise ``RuntimeError`` when
    uvloop is not installed."""
    if name in (BUCKETIMER, PURE, ASYNCIO):
        return asyncio.new_event_loop()
    if name in (DROPIN, PATCHED):
        return EventLoop(timer_thread=timer_thread)
    if name == PURE_DROPIN:
        return PureEventLoop()
    if name in (UVLOOP, DROPIN_UV):
        if uvloop is None:
            raise RuntimeError(f"{name}: uvloop is not installed")
        if name == UVLOOP:
            loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
            return loop
        from bucketimer.loop import UVEventLoop

        return UVEventLoop(timer_thread=timer_thread)
    raise ValueError(f"not a loop contender: {name!r}")
