"""What a TimerThread holds: :meth:`TimerThread.pending` and
:func:`trace_timers` (docs/monitoring.rst, "Pending timers").

``pending()`` answers "which timers does this process hold, and whose are
they?": a snapshot of every timer scheduled and not yet run, cancelled or
dropped, grouped by callback.  Each backend lists its timers' handles
(``TimerThread._pending_handles()``: the native core walks its slots, the
pure one its heap and the batches it handed over); the rest is here, once
for both, and costs nothing until it is called.

``trace_timers(frames)`` records where each timer is scheduled from then
on, as ``tracemalloc`` records where memory is allocated: the backend hands
every new handle to :func:`_note`, which keeps that many frames of the
caller's stack beside it (weakly: the record goes with the handle).  Off,
the backends do nothing more per timer than test that no hook is set.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import heapq
import os
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._backend import TimerThread

__all__ = ["Pending", "PendingGroup", "PendingTimer", "trace_timers"]

#: the environment variable that turns :func:`trace_timers` on at import
ENV = "BUCKETIMER_TRACE_TIMERS"

# (filename, lineno, function) of each frame kept, innermost first
_Site = tuple[tuple[str, int, str], ...]

_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep
_frames = 0
_armed: weakref.WeakKeyDictionary[Any, _Site] = weakref.WeakKeyDictionary()
_sites: dict[_Site, _Site] = {}  # interned: a million timers armed in one place share one
_lock = threading.Lock()


@dataclasses.dataclass(frozen=True)
class PendingTimer:
    """One pending timer.  ``when``: its deadline (``time.monotonic()``
    seconds); ``loop``: the event loop it runs in (None: the TimerThread's
    dispatcher thread); ``armed``: where it was scheduled, innermost frame
    last, while :func:`trace_timers` was on (else None)."""

    when: float
    callback: Callable[..., object] | None
    args: tuple[Any, ...]
    loop: asyncio.AbstractEventLoop | None
    armed: traceback.StackSummary | None


@dataclasses.dataclass(frozen=True)
class PendingGroup:
    """The pending timers of one callback (:func:`callback_name`):
    ``count`` of them, due from ``earliest`` to ``latest``; ``timers``,
    the earliest ``limit`` of them."""

    callback: str
    count: int
    earliest: float
    latest: float
    timers: list[PendingTimer]


@dataclasses.dataclass(frozen=True)
class Pending:
    """What :meth:`TimerThread.pending` returns: ``count`` pending timers
    at ``time`` (``time.monotonic()``), in ``groups`` by callback, the
    largest first.  ``str()`` is a table of them."""

    time: float
    count: int
    groups: list[PendingGroup]

    def __str__(self) -> str:
        lines = [f"{self.count} pending timer{'s' * (self.count != 1)}"]
        for g in self.groups:
            lines.append(f"{g.count:>9}  {g.callback}, due in {g.earliest - self.time:.3f}"
                         f" to {g.latest - self.time:.3f} s")
            for t in g.timers:
                where = f" on {type(t.loop).__name__}" if t.loop is not None else ""
                armed = ", armed at:" if t.armed else ""
                lines.append(f"           due in {t.when - self.time:.3f} s{where}{armed}")
                lines.extend(f"             {os.path.basename(f.filename)}:{f.lineno} in {f.name}"
                             for f in t.armed or ())
        return "\n".join(lines)


def callback_name(callback: object) -> str:
    """What timers are grouped by: the qualified name of the function a
    callback runs, through bound methods and ``functools.partial``
    (``"myapp.conn.Connection._idle"``), or its type's for other callables."""
    for _ in range(100):
        if isinstance(callback, functools.partial):
            callback = callback.func
        elif hasattr(callback, "__func__"):  # a bound method
            callback = callback.__func__
        else:
            break
    qualname = getattr(callback, "__qualname__", None)
    module = getattr(callback, "__module__", None)
    if not isinstance(qualname, str):  # an object that is called: its class
        qualname, module = type(callback).__qualname__, type(callback).__module__
    elif module is None and hasattr(callback, "__self__"):  # a C method
        module = type(callback.__self__).__module__
    if module in (None, "builtins"):
        return qualname
    return f"{module}.{qualname}"


def pending(self: TimerThread, limit: int = 10) -> Pending:
    """A snapshot of this TimerThread's pending timers -- scheduled and not
    yet run, cancelled or dropped -- by callback (:class:`Pending`), each
    group with its ``limit`` earliest timers.  O(pending timers), on the
    calling thread; nothing is done for it before it is called.  Timers
    scheduled, run or cancelled while it looks may be in it or not."""
    if isinstance(limit, bool) or not isinstance(limit, int):
        raise TypeError(f"limit must be an int, not {type(limit).__name__}")
    if limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    now = time.monotonic()
    by_callback: dict[str, list[Any]] = {}
    names: dict[Any, str] = {}  # a Python function's code -> its name
    for handle in self._pending_handles():
        cb = handle.callback
        if cb is None:  # it ended since the walk
            continue
        code = getattr(getattr(cb, "__func__", cb), "__code__", None)
        if code is None:
            name = callback_name(cb)
        else:
            name = names.get(code) or names.setdefault(code, callback_name(cb))
        by_callback.setdefault(name, []).append(handle)
    groups = []
    for name, handles in by_callback.items():
        whens = [h.when() for h in handles]
        earliest = heapq.nsmallest(limit, range(len(handles)), key=whens.__getitem__)
        groups.append(PendingGroup(name, len(handles), min(whens), max(whens),
                                   [_timer(handles[i], whens[i]) for i in earliest]))
    groups.sort(key=lambda g: (-g.count, g.callback))
    return Pending(now, sum(g.count for g in groups), groups)


def _timer(handle: Any, when: float) -> PendingTimer:
    site = _armed.get(handle)
    armed = None
    if site is not None:
        armed = traceback.StackSummary.from_list(
            [traceback.FrameSummary(f, n, name) for f, n, name in reversed(site)])
    return PendingTimer(when, handle.callback, handle.args or (), handle.loop, armed)


def trace_timers(frames: int = 10) -> None:
    """From now on, record where each timer is scheduled: the ``frames``
    innermost frames of the caller's stack, bucketimer's own left out
    (:attr:`PendingTimer.armed`).  ``0`` stops recording (what is recorded
    stays with its timers).  The environment variable
    ``BUCKETIMER_TRACE_TIMERS=N`` does the same when bucketimer is
    imported.  It costs a few microseconds per timer scheduled, and memory
    for each place timers are armed from, not for each timer."""
    global _frames
    if isinstance(frames, bool) or not isinstance(frames, int):
        raise TypeError(f"frames must be an int, not {type(frames).__name__}")
    if frames < 0:
        raise ValueError(f"frames must be >= 0, got {frames}")
    _frames = frames
    hook = _note if frames else None
    from . import _backend  # (the backends import this module)

    if _backend.NATIVE:
        from . import _core

        _core._set_armed_hook(hook)
    else:
        from ._pure import _scheduler

        _scheduler.set_armed_hook(hook)


def _note(handle: object) -> None:
    """The backends' hook: ``handle`` was just scheduled, here."""
    f: FrameType | None = sys._getframe(1)
    while f is not None and f.f_code.co_filename.startswith(_PACKAGE):
        f = f.f_back
    site: list[tuple[str, int, str]] = []
    while f is not None and len(site) < _frames:
        code = f.f_code
        site.append((code.co_filename, f.f_lineno or code.co_firstlineno, code.co_name))
        f = f.f_back
    key = tuple(site)
    with _lock:
        _armed[handle] = _sites.setdefault(key, key)


def _from_environment() -> None:
    value = os.environ.get(ENV, "")
    if value:
        try:
            frames = int(value)
        except ValueError:
            raise ValueError(f"{ENV} must be a number of frames, got {value!r}") from None
        trace_timers(frames)
