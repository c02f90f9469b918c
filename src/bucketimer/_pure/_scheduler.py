"""Scheduler: the timers of one TimerThread, and the thread that fires
those no loop keeps.

A timer scheduled inside its running loop lives on that loop's own heap
(``_loop_timer.py``), its claim in the scheduler's dict of them.  Every
other timer (no loop, a loop in another thread, a loop with a clock or heap
of its own) is in the scheduler's ``heapq`` keyed
``(deadline_ns, id)``: ids grow in the order timers were scheduled, so
equal deadlines fire in that order.  The thread, started with the first
such timer, waits on a ``threading.Condition`` for the earliest deadline;
each pass pops every due timer (PENDING -> POSTED) under the lock, then,
with the lock released, hands each outbox its batch in one call.
Cancelled timers stay in the heap until they reach its top or a sweep
rebuilds it.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import threading
import weakref
from collections.abc import Callable
from heapq import heappush
from time import monotonic_ns
from typing import Any

from .._stats import Stats
from ._arguments import deadline_ns, to_seconds
from ._handle import CANCELLED, DROPPED, PENDING, POSTED, RUNNING, Handle, QueuedHandle, scheduled
from ._loop_timer import SCHEDULERS, loop_closing, timers_on
from ._outbox import Batch, DispatcherOutbox, LoopOutbox, Outbox

HIST_BUCKETS = 48
# What one timer adds to ``lateness_sum`` at most, in ns: the last bucket's start.
_LATE_SUM_CAP = 2 ** (HIST_BUCKETS - 2)
# A heap with more cancelled entries than this, and more of them than live
# ones, is rebuilt (the same rule as asyncio's own timer heap).
_SWEEP_MIN = 64
# The claims of loop timers are swept for those of loops that closed or went
# once a timer comes from a loop other than the last one and there are this
# many, or twice as many as the last sweep left (amortized O(1) per claim).
_SWEEP_CLAIMS = 256

# ``reaped``: cancelled timers let go of (popped from the heap, swept, or
# passed over in a batch); at rest it equals ``cancelled``.
# _sleeping_until while the thread is not waiting (it reads the heap before
# it waits again), and while it waits with no timer to wait for.
_AWAKE = -1
_IDLE = 2**64

_COUNTERS = ("scheduled", "cancelled", "fired", "posted", "ran", "dropped", "wakeups",
             "passes", "eventfd_writes", "drains", "sweeps", "reaped", "early_fires")


#: called with each new Handle while ``bucketimer.trace_timers()`` is on
_armed_hook: Callable[[Handle], object] | None = None


def set_armed_hook(hook: Callable[[Handle], object] | None) -> None:
    global _armed_hook
    _armed_hook = hook


class Scheduler:
    """The state one :class:`bucketimer.TimerThread` of the pure backend keeps."""

    def __init__(self, buckets: int) -> None:
        self._buckets = buckets
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        # passes taken but not yet handed over; deliver_due waits for them
        self._submitting = 0
        self._submitted = threading.Condition(self._lock)
        self._heap: list[tuple[int, int, QueuedHandle]] = []
        self._ids = itertools.count(1)
        self._dead = 0  # heap entries no longer PENDING (cancelled, or dropped with their loop)
        self._closed = False
        self._held = False  # TimerThread._test_hold
        # The deadline the timer thread sleeps until (its heap's top, maybe a
        # cancelled timer's; _AWAKE while it is not waiting): only a timer
        # due before it needs a wake (the core's rule 4, docs/design.rst).
        self._sleeping_until = _AWAKE
        # keyed by id(loop) (each outbox holds its loop): a loop's __hash__
        # and __eq__ may be Python code, which must not run under the lock
        # (closing this TimerThread from there would deadlock)
        self._loops: dict[int, LoopOutbox] = {}
        self._dispatcher = DispatcherOutbox(self)
        self._inflight: dict[int, Batch] = {}  # posted batches not yet started
        self._counts = dict.fromkeys(_COUNTERS, 0)
        self._hist = [0] * HIST_BUCKETS
        self._late_sum = 0
        # The thread serves timers of its heap only: started with the first one.
        self._thread: threading.Thread | None = None
        # Loop timers: the claims of those pending (the timer's id -> its
        # loop's record, ``_loop_timer.py``), and counted where it costs
        # least: run (by their loop's thread), ended unrun by their loop's or
        # this scheduler's close.  stats() works out the rest: scheduled from
        # the ids (each loop timer draws one), pending from the claims,
        # cancelled from those.
        self._claims: dict[int, weakref.ref[Any]] = {}
        self.lt_ran = 0
        self._lt_unrun_due = 0
        # The record of the loop of the last loop timer (a new one is what
        # tells of loops that came and, perhaps, went), and how many claims
        # make the next sweep due.
        self._last_rec: weakref.ref[Any] | None = None
        self._sweep_at = _SWEEP_CLAIMS
        _live.add(self)

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def dispatcher(self) -> DispatcherOutbox:
        """Where this scheduler's timers of no loop run."""
        return self._dispatcher

    # -- scheduling and cancelling (any thread) ----------------------------------

    def schedule(self, deadline_ns: int, when: float, callback: Callable[..., object],
                 args: tuple[Any, ...], context: Any,
                 loop: asyncio.AbstractEventLoop | None) -> Handle:
        new_loop = None  # a loop seen for the first time: its close is watched
        with self._lock:
            if self._closed:
                raise RuntimeError("TimerThread is closed")
            outbox: Outbox
            if loop is None:
                outbox = self._dispatcher
            else:
                found = self._loops.get(id(loop))
                if found is None:
                    found = self._loops[id(loop)] = LoopOutbox(self, loop)
                    new_loop = loop
                outbox = found
            timer_id = next(self._ids)
            handle = scheduled(self, timer_id, when, callback, args, context, outbox)
            heap = self._heap
            heappush(heap, (deadline_ns, timer_id, handle))
            self._counts["scheduled"] += 1
            if self._thread is None:
                self._start_thread()
            elif deadline_ns < self._sleeping_until:
                self._sleeping_until = _AWAKE  # one notify per wake is enough
                self._wake.notify()
        if _armed_hook is not None:
            _armed_hook(handle)
        if new_loop is not None:  # (it sets an attribute of the loop: not under the lock)
            _watch_close(new_loop, weakref.ref(self))
        return handle

    def pending(self) -> list[Handle]:
        """The handles of the timers scheduled and neither run, cancelled
        nor dropped: in the heap, handed over and not yet started, or on
        their loop's heap (read from there as it is now)."""
        with self._lock:
            out: list[Handle] = [entry[2] for entry in self._heap if entry[2]._state == PENDING]
            out += [h for batch in self._inflight.values() for h in batch if h._state == POSTED]
        claims = self._claims
        for loop in self._claim_loops():
            if not loop._closed:
                out += [t for t in timers_on(loop)
                        if t._repr is self and t._source_traceback in claims]
        return out

    def _start_thread(self) -> None:
        """Starts the timer thread (lock held: it waits for the lock, then
        reads the heap)."""
        self._thread = threading.Thread(target=self._serve, name="bucketimer-timer", daemon=True)
        self._thread.start()

    def loop_timer_dropped(self, timer: Handle, by_close: bool = False) -> None:
        """A claimed loop timer that will never run: counted as the core counts
        a timer its loop's or its TimerThread's close ended (docs/design.rst,
        "Counters"): ``cancelled`` when it was pending, ``dropped`` when its
        loop had taken it due (off its heap) and not run it."""
        timer._repr = DROPPED
        timer._release()
        if not by_close and not timer._scheduled:
            self._lt_unrun_due += 1  # (else a cancelled one, for stats())

    def cancel(self, handle: QueuedHandle) -> bool:
        with self._lock:
            state = handle._state
            if state != PENDING and state != POSTED:
                return False
            handle._state = CANCELLED
            self._counts["cancelled"] += 1
            if state == PENDING:
                self._dead += 1
                if self._dead > _SWEEP_MIN:
                    self._sweep_if_mostly_dead()
        handle._release()
        return True

    def _sweep_if_mostly_dead(self) -> None:
        heap = self._heap
        if self._dead > _SWEEP_MIN and self._dead * 2 > len(heap):
            live = []
            reaped = 0
            for entry in heap:
                state = entry[2]._state
                if state == PENDING:
                    live.append(entry)
                elif state == CANCELLED:
                    reaped += 1
            self._dead -= len(heap) - len(live)  # (what _discard does, for each)
            self._counts["reaped"] += reaped
            heapq.heapify(live)
            self._heap = live
            self._counts["sweeps"] += 1

    def _discard(self, handle: QueuedHandle) -> None:
        """A heap entry that is no longer PENDING left the heap."""
        self._dead -= 1
        if handle._state == CANCELLED:
            self._counts["reaped"] += 1

    # -- the timer thread ------------------------------------------------------------

    def _serve(self) -> None:
        while True:
            with self._lock:
                batches = self._wait_for_due()
                if batches is None:
                    return
                self._submitting += 1
            try:
                self._submit(batches)
            finally:
                with self._lock:
                    self._submitting -= 1
                    self._submitted.notify_all()

    def _submit(self, batches: dict[Outbox, Batch]) -> None:
        """Hands each outbox its batch (lock not held)."""
        for outbox, batch in batches.items():
            if not outbox.submit(batch):
                self.drop(batch)

    def deliver_due(self, loop: asyncio.AbstractEventLoop) -> None:
        """Hands over every timer due now before the caller, in ``loop``'s
        thread, queues a callback that must come after them
        (docs/design.rst, "Order on the loop").  A pass the thread took is
        waited for until it is handed over; what is due and not yet taken,
        the caller takes itself."""
        with self._lock:
            if id(loop) not in self._loops:
                return
            while self._submitting and not self._closed:
                self._submitted.wait()
            heap = self._heap
            now = monotonic_ns()
            if self._closed or not heap or heap[0][0] > now:
                return
            batches = self._take_due(now)
        self._submit(batches)

    def _wait_for_due(self) -> dict[Outbox, Batch] | None:
        """Sleeps until a timer is due (lock held); None once closed."""
        while not self._closed:
            heap = self._heap
            while heap and heap[0][2]._state != PENDING:
                self._discard(heapq.heappop(heap)[2])
            now = monotonic_ns()
            if heap and heap[0][0] <= now and not self._held:
                return self._take_due(now)
            if not heap or self._held:
                timeout = None
                self._sleeping_until = _IDLE
            else:
                timeout = min((heap[0][0] - now) / 1e9, threading.TIMEOUT_MAX)
                self._sleeping_until = heap[0][0]
            self._wake.wait(timeout)
            self._sleeping_until = _AWAKE
            self._counts["wakeups"] += 1
        return None

    def _take_due(self, now: int) -> dict[Outbox, Batch]:
        """Pops every timer due at ``now`` into one batch per outbox."""
        self._counts["passes"] += 1
        batches: dict[Outbox, Batch] = {}
        heap = self._heap
        while heap and heap[0][0] <= now:
            handle = heapq.heappop(heap)[2]
            if handle._state != PENDING:
                self._discard(handle)
                continue
            handle._state = POSTED
            batches.setdefault(handle._home, []).append(handle)
        for batch in batches.values():
            self._inflight[id(batch)] = batch
            self._counts["fired"] += len(batch)
            self._counts["posted"] += len(batch)
        self._counts["eventfd_writes"] += len(batches)
        return batches

    def hold(self, held: bool) -> None:
        """Test only (``TimerThread._test_hold``): the thread takes no due
        timer while held."""
        with self._lock:
            self._held = held
            self._wake.notify()

    # -- the consumers (a loop's thread, the dispatcher) ----------------------------

    def batch_started(self, batch: Batch) -> None:
        with self._lock:
            self._inflight.pop(id(batch), None)
            self._counts["drains"] += 1

    def claim(self, handle: QueuedHandle) -> bool:
        """POSTED -> RUNNING right before the call; False if it was cancelled
        meanwhile or its TimerThread closed (then it is dropped)."""
        with self._lock:
            if handle._state != POSTED:
                if handle._state == CANCELLED:
                    self._counts["reaped"] += 1
                return False
            if self._closed:
                self._drop_one(handle, "cancelled")
                return False
            handle._state = RUNNING
            self._counts["ran"] += 1
            lateness = monotonic_ns() - deadline_ns(to_seconds(handle._when, "when"))
            if lateness < 0:
                self._counts["early_fires"] += 1
            self._hist[min(max(lateness, 0).bit_length(), HIST_BUCKETS - 1)] += 1
            if lateness > 0:
                self._late_sum += min(lateness, _LATE_SUM_CAP)
        return True

    def drop(self, batch: Batch) -> None:
        """Timers nobody will run (their loop closed): released unrun."""
        with self._lock:
            self._inflight.pop(id(batch), None)
            for handle in batch:
                if handle._state == POSTED:
                    self._drop_one(handle)
                elif handle._state == CANCELLED:
                    self._counts["reaped"] += 1
        for handle in batch:
            if handle._state == DROPPED:
                handle._release()

    def _drop_one(self, handle: QueuedHandle, counter: str = "dropped") -> None:
        """Ends a timer unrun.  Counted as the core counts it (docs/design.rst,
        "Counters"): ``dropped`` when its loop closed after it was handed
        over, ``cancelled`` when its loop closed before it was due or its
        TimerThread closed."""
        handle._state = DROPPED
        self._counts[counter] += 1

    def loop_closed(self, loop: asyncio.AbstractEventLoop) -> None:
        """A loop is closing: every timer of it not yet running is dropped,
        those it was handed and has not started (its ready queue is about to
        be thrown away) and those still pending (they stay in the heap, dead,
        until they reach its top or a sweep)."""
        with self._lock:
            outbox = self._loops.pop(id(loop), None)
            if outbox is None:
                return
            batches = [b for b in self._inflight.values() if b and b[0]._home is outbox]
            pending = [e[2] for e in self._heap if e[2]._home is outbox and e[2]._state == PENDING]
            for handle in pending:
                self._drop_one(handle, "cancelled")
            self._dead += len(pending)
        for handle in pending:
            handle._release()
        for batch in batches:
            self.drop(batch)

    # -- lifecycle -------------------------------------------------------------------

    def close(self, join_timeout: float) -> int:
        """Drops every timer not yet running and stops the threads; returns
        how many of those dropped belonged to no loop."""
        with self._lock:
            if self._closed:
                return 0
            self._closed = True
            dropped = [entry[2] for entry in self._heap if entry[2]._state == PENDING]
            dropped += [h for b in self._inflight.values() for h in b if h._state == POSTED]
            for handle in dropped:
                self._drop_one(handle, "cancelled")
            for entry in self._heap:
                if entry[2]._state != PENDING:
                    self._discard(entry[2])
            self._heap.clear()
            self._inflight.clear()
            self._loops.clear()
            # (a loop timer stays on its loop's heap, to be passed over there;
            # one the loop is about to run drops itself, seeing this closed)
            claims = self._claims
            for loop in self._claim_loops():
                for timer in timers_on(loop):
                    if timer._repr is self and claims.pop(timer._source_traceback, None) is not None:
                        self.loop_timer_dropped(timer, by_close=True)
            claims.clear()  # (those of loops that closed or went)
            self._wake.notify_all()
            self._submitted.notify_all()
        no_loop = sum(handle._home is self._dispatcher for handle in dropped)
        for handle in dropped:
            handle._release()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(join_timeout)
        self._dispatcher.stop(join_timeout)
        return no_loop

    def forget_after_fork(self) -> None:
        """In a child of fork(): the threads are gone and the lock may be
        held by one of them; refuse all work from now on."""
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._submitting = 0
        self._submitted = threading.Condition(self._lock)
        for entry in self._heap:
            entry[2]._state = DROPPED
        for loop in self._claim_loops():
            for timer in timers_on(loop):
                if (timer._repr is self
                        and self._claims.pop(timer._source_traceback, None) is not None):
                    timer._repr = DROPPED
        self._claims.clear()
        self._heap.clear()
        self._inflight.clear()
        self._loops.clear()
        self._closed = True

    def loop_seen(self, rec: weakref.ref[Any]) -> None:
        """A loop timer's loop is not the last one's: loops come and go, and
        the claims of timers left pending on those that closed or went are
        swept once there are ``_SWEEP_CLAIMS`` of all, or twice as many as
        the last sweep left (a short-lived loop's end costs nothing, and a
        long-lived one's timers are scanned only as often as they doubled)."""
        self._last_rec = rec
        if len(self._claims) >= self._sweep_at:
            self._sweep_claims()

    def _sweep_claims(self) -> None:
        """Drops the claims of timers whose loop closed or was freed with
        them pending: that ended them (``stats()`` counts them cancelled).
        A freed loop's record is dead, whatever loop has its address now."""
        claims = self._claims
        for key, rec in list(claims.items()):
            loop = rec()
            if loop is None or loop._closed:
                claims.pop(key, None)
        self._sweep_at = max(2 * len(claims), _SWEEP_CLAIMS)

    def _claim_loops(self) -> list[Any]:
        """The loops alive that have timers of this scheduler's claimed on
        their heaps (a copy taken at once: other threads may add claims)."""
        recs = {id(rec): rec for rec in list(self._claims.values())}
        return [loop for loop in (rec() for rec in recs.values()) if loop is not None]

    def stats(self) -> Stats:
        self._sweep_claims()
        with self._lock:
            counts = dict(self._counts)
            hist = list(self._hist)
            late_sum = self._late_sum
            dead = self._dead
            # where timers are posted: the loops served, and the dispatcher
            ports = len(self._loops) + self._dispatcher.started
            # a loop timer is posted to its loop, and let go of if cancelled,
            # as it is claimed
            ran, dropped = self.lt_ran, self._lt_unrun_due
            scheduled = _issued(self._ids)
            pending = len(self._claims)
            cancelled = scheduled - counts["scheduled"] - ran - dropped - pending
            heap_size = pending + len(self._heap)
        return Stats(
            scheduled=scheduled, cancelled=counts["cancelled"] + cancelled, postponed=0,
            fired=counts["fired"] + ran, posted=counts["posted"] + ran, ran=counts["ran"] + ran,
            dropped=counts["dropped"] + dropped, wakeups=counts["wakeups"],
            passes=counts["passes"], eventfd_writes=counts["eventfd_writes"],
            drains=counts["drains"], sweeps=counts["sweeps"],
            reaped=counts["reaped"] + cancelled, heap_size=heap_size, list_size=0, dead=dead,
            slots=0, slots_free=0, slots_retired=0, ports=ports, buckets=self._buckets,
            early_fires=counts["early_fires"], lateness_sum=late_sum, lateness_hist=hist,
        )


def _issued(ids: itertools.count[int]) -> int:
    """How many ids ``ids`` (counting from 1) has handed out (its repr is
    ``count(next)``)."""
    return int(repr(ids)[6:-1]) - 1


def _watch_close(loop: asyncio.AbstractEventLoop, ref: weakref.ref[Scheduler]) -> None:
    """Wraps ``loop.close`` so that the loop's queued timers are dropped
    before its ready queue goes (a loop class without an instance dict
    keeps its close: its timers are dropped when it refuses them)."""
    if getattr(type(loop), "_bt_closes_ports", False):  # its close() calls loop_closed
        return
    orig_close = loop.close

    def close() -> None:
        sched = ref()
        if not loop.is_running():
            loop_closing(loop)
            if sched is not None:
                sched.loop_closed(loop)
        orig_close()

    try:
        loop.close = close  # type: ignore[method-assign]
    except (AttributeError, TypeError):
        pass


# Every scheduler alive: closed at exit and forgotten in a child of fork().
_live = SCHEDULERS
