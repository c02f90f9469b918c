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
    A column of the ``pairs`` and ``timeout`` groups, so that what the
    native core gives is seen beside what pip gives elsewhere.
``asyncio`` / ``uvloop`` / ``drop-in`` / ``drop-in uvloop``
    That event loop's own ``call_later``/``call_at``/``asyncio.timeout()``;
    ``drop-in`` is :class:`bucketimer.EventLoop`, ``drop-in uvloop`` is
    ``bucketimer.loop.UVEventLoop`` (uvloop with native timers).
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
native modules, or ``BUCKETIMER_NO_EXTENSIONS`` set) the ``bucketimer``
column *is* that backend: the ``pure Python`` column would repeat it, and
the core rows with their ``1-lock heap`` column measure a C core that is
not there, so :data:`NATIVE_ONLY` are left out and :data:`PURE_INSTALL_NOTE`
says what a native install adds.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from types import ModuleType

import bucketimer
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
PATCHED = "patched drop-in"
THREADING_TIMER = "threading.Timer"
SCHED = "sched"
REF_HEAP = "1-lock heap"
# Column order of the table.
CONTENDERS = (BUCKETIMER, PURE, ASYNCIO, UVLOOP, DROPIN, DROPIN_UV, PATCHED, THREADING_TIMER,
              SCHED, REF_HEAP)

# Each column's colour in every figure (matplotlib's tab10, one each).
COLORS = dict(zip(CONTENDERS, ("#1f77b4", "#8c564b", "#ff7f0e", "#2ca02c", "#9467bd",
                               "#17becf", "#d62728", "#bcbd22", "#e377c2", "#7f7f7f"),
                  strict=True))

# The columns only a native install has (see the module's docstring).
NATIVE_ONLY = (PURE, REF_HEAP)
PURE_INSTALL_NOTE = (
    "bucketimer runs its pure-Python backend here (bucketimer.backend is 'python'), so the "
    "bucketimer column is that backend; a native install (the CPython 3.11-3.15 wheels for "
    f"Linux x86_64, glibc) adds the C core under the bucketimer column, the '{PURE}' column "
    f"beside it, and the core rows with their '{REF_HEAP}' column")

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
    """``loops`` and, if wanted, the pure backend's column (on the stock
    loop) right after bucketimer's: the contenders of the groups that show it."""
    if PURE not in want:
        return loops
    out = dict(loops)
    out[PURE] = asyncio.new_event_loop
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
    if name in (UVLOOP, DROPIN_UV):
        if uvloop is None:
            raise RuntimeError(f"{name}: uvloop is not installed")
        if name == UVLOOP:
            loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
            return loop
        from bucketimer.loop import UVEventLoop

        return UVEventLoop(timer_thread=timer_thread)
    raise ValueError(f"not a loop contender: {name!r}")
