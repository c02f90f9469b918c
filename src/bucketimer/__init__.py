"""bucketimer: native, brpc-style bucketed timers for Python.

One native timer thread per :class:`TimerThread` keeps every pending timer;
scheduling and cancelling are O(1) from any thread and never touch a Python
heap.  Timers that fire are posted to the asyncio loop that owns them (through
an eventfd) or to a dispatcher thread.

* :class:`TimerThread`, :func:`call_later`, :func:`call_at`: timers from any
  thread, with or without a running loop.
* :func:`timeout`, :func:`timeout_at`, :class:`Timeout`, :func:`wait_for`:
  asyncio's, with the timer in the core.
* :func:`patch_asyncio`, :func:`unpatch_asyncio`: ``asyncio.timeout``,
  ``asyncio.timeout_at`` and ``asyncio.wait_for`` become those, for every
  caller that looks them up at call time.
* :func:`run`, :class:`EventLoop`, :func:`new_event_loop`: a drop-in
  asyncio loop whose ``call_at``/``call_later`` are native
  (:func:`install` and :class:`EventLoopPolicy` too, where asyncio still has
  event loop policies).
* :meth:`TimerThread.pending`, :func:`trace_timers`: the timers a
  TimerThread holds, by callback, and where they were scheduled
  (docs/monitoring.rst).
* ``backend``: ``"native"``, or ``"python"`` where the compiled modules
  are missing or ``BUCKETIMER_NO_EXTENSIONS`` is set (docs/design.rst,
  "The pure-Python backend").
* ``bucketimer.grpc`` (the ``grpc`` extra): interceptors;
  ``bucketimer.bench``: the benchmark kit.
"""

import sys as _sys
from types import ModuleType as _ModuleType
from typing import Any as _Any

from . import _pending, loop
from ._backend import (
    Handle,
    Timeout,
    TimerThread,
    backend,
    call_at,
    call_later,
    default_timer_thread,
    monotonic_ns,
    timeout,
    timeout_at,
    wait_for,
)
from ._backend import aio as aio
from ._patch import patch_asyncio, unpatch_asyncio
from ._pending import Pending, PendingGroup, PendingTimer, trace_timers
from ._stats import Stats
from ._version import __version__ as __version__
from .loop import EventLoop, install, new_event_loop, run

__all__ = [
    "EventLoop",
    "Handle",
    "Pending",
    "PendingGroup",
    "PendingTimer",
    "Stats",
    "Timeout",
    "TimerThread",
    "backend",
    "call_at",
    "call_later",
    "default_timer_thread",
    "install",
    "monotonic_ns",
    "new_event_loop",
    "patch_asyncio",
    "run",
    "timeout",
    "timeout_at",
    "trace_timers",
    "unpatch_asyncio",
    "wait_for",
]

if _sys.version_info < (3, 14):
    __all__ += ["EventLoopPolicy"]

_pending._from_environment()  # BUCKETIMER_TRACE_TIMERS


def __getattr__(name: str) -> _Any:
    # Made on first use: from 3.14 asyncio deprecates the policy system.
    if name == "EventLoopPolicy":
        return loop._policy(name, stacklevel=2)
    raise AttributeError(f"module 'bucketimer' has no attribute '{name}'")


def __dir__() -> list[str]:
    # The API, its public submodules imported so far and the module's own
    # dunders: not the names its code imports, nor its private modules.
    public = {name for name, value in globals().items()
              if name.startswith("__") or (isinstance(value, _ModuleType) and name[0] != "_"
                                           and value.__name__.startswith(f"{__name__}."))}
    return sorted({*__all__, "__version__", *public})
