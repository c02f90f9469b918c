"""bucketimer: native, brpc-style bucketed timers for Python.

One native timer thread per :class:`TimerThread` keeps every pending timer;
scheduling and cancelling are O(1) from any thread and never touch a Python
heap.  Timers that fire are posted to the asyncio loop that owns them (through
an eventfd) or to a dispatcher thread.

* :class:`TimerThread`, :func:`call_later`, :func:`call_at`: timers from any
  thread, with or without a running loop.
* :func:`timeout`, :func:`timeout_at`, :class:`Timeout`, :func:`wait_for`:
  asyncio's, with the timer in the core.
* :class:`EventLoop`, :func:`new_event_loop`, :class:`EventLoopPolicy`,
  :func:`install`: a drop-in asyncio loop whose ``call_at``/``call_later``
  are native.
* ``bucketimer.grpc`` (the ``grpc`` extra): interceptors;
  ``bucketimer.bench``: the benchmark kit.
"""

from ._core import monotonic_ns
from ._timers import Handle, TimerThread, call_at, call_later, default_timer_thread
from .aio import Timeout, timeout, timeout_at, wait_for
from .loop import EventLoop, EventLoopPolicy, install, new_event_loop

__all__ = [
    "EventLoop",
    "EventLoopPolicy",
    "Handle",
    "Timeout",
    "TimerThread",
    "call_at",
    "call_later",
    "default_timer_thread",
    "install",
    "monotonic_ns",
    "new_event_loop",
    "timeout",
    "timeout_at",
    "wait_for",
]

__version__ = "0.1.0"
