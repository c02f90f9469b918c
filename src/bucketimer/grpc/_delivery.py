"""Where the interceptors' reports are delivered: one thread of bucketimer's
("bucketimer-grpc-reports") writes their log records and calls their hooks
and the metrics observers, in the order the reports were made, so that a
slow log handler or hook never holds the timer that ends another call on
time (docs/grpc.rst, "Reports").

The queue is bounded: past :data:`LIMIT` reports waiting, a new one is
dropped and counted, and the thread says how many it dropped (a WARNING on
``bucketimer.grpc``) once it catches up.  At exit it delivers what is
waiting, for up to :data:`EXIT_WAIT` seconds; a child process after
``fork()`` starts with an empty queue and a thread of its own.

Each report is delivered in a copy of the context it was made in: an
interceptor reports from the call's timer, whose callback runs in the
context the timer was armed in (the handler's), so an observer finds the
call's span there (``bucketimer.otel``'s span events).
"""

from __future__ import annotations

import atexit
import contextvars
import os
import queue
import threading
from collections.abc import Callable
from typing import Any

from ._records import logger

#: reports waiting beyond which new ones are dropped
LIMIT = 100_000
#: how long the interpreter's exit waits for the reports still waiting
EXIT_WAIT = 2.0

_Job = tuple[contextvars.Context, Callable[..., object], tuple[Any, ...]]


class _Delivery:
    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        #: an approximate count (its updates race, harmlessly): a bound, not a ledger
        self._waiting = 0
        self._dropped = 0

    def put(self, fn: Callable[..., object], *args: Any) -> None:
        """Deliver ``fn(*args)`` on the thread; never blocks."""
        if self._waiting >= LIMIT:
            self._dropped += 1
            return
        self._waiting += 1
        self._queue.put((contextvars.copy_context(), fn, args))
        if self._thread is None:
            self._start()

    def _start(self) -> None:
        with self._start_lock:
            if self._thread is not None:
                return
            t = threading.Thread(target=self._run, name="bucketimer-grpc-reports", daemon=True)
            try:
                t.start()
            except RuntimeError:  # the interpreter is shutting down: deliver here
                self._drain()
                return
            self._thread = t

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            self._waiting -= 1
            self._deliver(job)
            if self._dropped and self._queue.empty():
                dropped, self._dropped = self._dropped, 0
                logger.warning("bucketimer.grpc: %d reports dropped: more than %d were waiting",
                               dropped, LIMIT)

    def _drain(self) -> None:
        while True:
            try:
                job = self._queue.get_nowait()
            except queue.Empty:
                return
            self._waiting -= 1
            self._deliver(job)

    @staticmethod
    def _deliver(job: _Job) -> None:
        ctx, fn, args = job
        try:
            ctx.run(fn, *args)
        except Exception:  # a report never takes the thread down
            logger.exception("bucketimer.grpc: delivering a report failed")

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every report made before this call has been delivered;
        False if ``timeout`` seconds passed first."""
        if self._thread is None or not self._thread.is_alive():
            self._drain()
            return True
        if threading.current_thread() is self._thread:  # a hook asks: all before it is done
            return True
        done = threading.Event()
        self._waiting += 1  # past the bound too: a flush is never dropped
        self._queue.put((contextvars.Context(), done.set, ()))
        return done.wait(timeout)


_delivery = _Delivery()


def put(fn: Callable[..., object], *args: Any) -> None:
    """Deliver ``fn(*args)`` on the reports' thread, after what is waiting."""
    _delivery.put(fn, *args)


def flush(timeout: float | None = None) -> bool:
    """Wait until the reports made so far have been delivered (their log
    records written, their hooks called); False if ``timeout`` passed first."""
    return _delivery.flush(timeout)


def _after_fork() -> None:
    global _delivery
    _delivery = _Delivery()


os.register_at_fork(after_in_child=_after_fork)
atexit.register(lambda: _delivery.flush(EXIT_WAIT))
