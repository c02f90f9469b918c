"""Outbox: where a scheduler's due timers go.

:class:`LoopOutbox` hands each pass's batch for one loop to that loop in a
single ``call_soon_threadsafe``; :class:`DispatcherOutbox` hands batches of
timers that belong to no loop to a thread of its own.  Either way the
batch's timers are claimed one by one (POSTED -> RUNNING, under the
scheduler's lock) right before each is called, so a ``cancel()`` that lands
while a timer waits in the batch still wins.
"""

from __future__ import annotations

import asyncio
import math
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .._reporting import loop_reporter, report_slow_callback, report_to_log

if TYPE_CHECKING:
    from ._handle import QueuedHandle
    from ._scheduler import Scheduler

Batch = list["QueuedHandle"]


class Outbox:
    """Runs batches of due timers; subclasses say where."""

    loop: asyncio.AbstractEventLoop | None = None
    # on_slow(callback, args, seconds, threshold) after a callback that ran
    # slow_after seconds or longer; None: callbacks are not timed.
    on_slow: Callable[[object, tuple[Any, ...] | None, float, float], None] | None = None
    slow_after = math.inf

    def __init__(self, sched: Scheduler, report: Callable[[Any, BaseException], None]) -> None:
        self._sched = sched
        self._report = report

    def submit(self, batch: Batch) -> bool:
        """Hands ``batch`` over (timer thread, scheduler lock not held);
        False if nobody will ever run it."""
        raise NotImplementedError

    def run(self, batch: Batch) -> None:
        """Claims and calls each timer of ``batch`` in order."""
        self._sched.batch_started(batch)
        for i, handle in enumerate(batch):
            if not self._sched.claim(handle):
                continue
            on_slow = self.on_slow
            if on_slow is not None:
                callback, args, start = handle.callback, handle.args, time.monotonic()
            try:
                handle._call()
            except (SystemExit, KeyboardInterrupt):
                self._resubmit(batch[i + 1 :])
                raise
            except BaseException as exc:
                self._report(handle, exc)
            finally:
                handle._release()
            if on_slow is not None:
                took = time.monotonic() - start
                if took >= self.slow_after:
                    on_slow(callback, args, took, self.slow_after)

    def _resubmit(self, rest: Batch) -> None:
        """What a KeyboardInterrupt/SystemExit from a callback leaves of the
        batch runs later, as asyncio's loop runs the rest of its ready queue."""
        if rest and not self.submit(rest):
            self._sched.drop(rest)


class LoopOutbox(Outbox):
    """A loop's timers, run in that loop's thread."""

    def __init__(self, sched: Scheduler, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(sched, loop_reporter(loop))
        self.loop = loop

    def submit(self, batch: Batch) -> bool:
        assert self.loop is not None
        try:
            self.loop.call_soon_threadsafe(self.run, batch)
        except RuntimeError:  # the loop is closed
            return False
        return True


class DispatcherOutbox(Outbox):
    """Timers of no loop, run on the ``bucketimer-dispatcher`` thread,
    started on the first batch; callbacks that raise are logged."""

    def __init__(self, sched: Scheduler) -> None:
        super().__init__(sched, report_to_log)
        self._queue: queue.SimpleQueue[Batch | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()

    @property
    def started(self) -> bool:
        return self._thread is not None

    def submit(self, batch: Batch) -> bool:
        self._start()
        self._queue.put(batch)
        return True

    def time_callbacks(self, slow_after: float | None) -> None:
        """Times each callback against ``slow_after`` (None: times none)."""
        self.slow_after = math.inf if slow_after is None else slow_after
        self.on_slow = None if slow_after is None else report_slow_callback

    def _start(self) -> None:
        with self._start_lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._serve, name="bucketimer-dispatcher", daemon=True
                )
                self._thread.start()

    def _serve(self) -> None:
        while (batch := self._queue.get()) is not None:
            try:
                self.run(batch)
            except BaseException as exc:  # KeyboardInterrupt/SystemExit from a callback
                report_to_log(None, exc)

    def stop(self, join_timeout: float) -> None:
        """Ends the thread after what it was given (whose timers the closed
        scheduler refuses to claim); joins it unless called from it."""
        with self._start_lock:
            t = self._thread
        if t is None:
            return
        self._queue.put(None)
        if t is not threading.current_thread():
            t.join(join_timeout)

