"""bucketimer: native, brpc-style bucketed timers for Python.

One native timer thread per :class:`TimerThread` keeps every pending timer;
scheduling and cancelling are O(1) from any thread and never touch a Python
heap.  Timers that fire are posted to the asyncio loop that owns them (through
an eventfd) or to a dispatcher thread.
"""

from ._core import monotonic_ns
from ._timers import Handle, TimerThread, call_at, call_later, default_timer_thread

__all__ = [
    "Handle",
    "TimerThread",
    "call_at",
    "call_later",
    "default_timer_thread",
    "monotonic_ns",
]

__version__ = "0.1.0"
