"""A pure-Python reference model of the native core in manual-clock mode.

The property tests beside it (``test_model.py``) drive the C core through
``bucketimer._cffi`` and this model side by side and require them to agree on
everything observable: which timers fire, in which order, what every
``bt_cancel`` answers, what ``bt_next_deadline`` says, and the counters.

What it models
--------------
Timers live in a :mod:`heapq` of ``(deadline_ns, seq, id)``: ``seq`` is the
schedule order, so equal deadlines fire in schedule order (docs/design.rst rule 7),
and a timer is due when ``deadline_ns <= now`` (rule 6: never early).  Like the
core, the model

* keeps newly scheduled timers in a *list* (the core's bucket list) until the
  next *collect*, which moves the live ones into the heap and recycles the
  cancelled ones; a schedule first recycles the newest entry of the list if
  it was cancelled;
* collects on :meth:`advance` and :meth:`next_deadline`, on a schedule
  that makes the list length a nonzero multiple of ``drain_threshold``, and on
  every ``drain_threshold``-th winning cancel (the core's ``request_collect``;
  it does not fire anything);
* deletes lazily: a cancelled timer stays in the heap until it reaches the top
  (then it is popped whether due or not) or until a *sweep*, which happens
  after a collect when the heap holds at least ``sweep_min`` entries and the
  cancelled-but-not-recycled timers (anywhere, port queues included), less
  those the previous sweep could not find, are more than half of it;
* posts a due port timer to its port's queue (state ``POSTED``); a cancel
  still wins there (rule 2); :meth:`drain` runs the posted timers that were
  not cancelled, in (deadline, seq) order whichever passes posted them (a
  port's order, ``csrc/port.c``), and recycles everything it takes;
* runs a due *native* timer at once, inside :meth:`advance`, by calling the
  function given to :meth:`schedule_native` with ``(model, id)``; while it
  runs, a cancel of it answers ``TOO_LATE``; after it returns, it is recycled.

Cancel answers three ways, exactly as ``bt_cancel`` does:

``CANCELLED`` (0)
    the timer was ``PENDING`` or ``POSTED``: this call won, it never runs.
``TOO_LATE`` (1)
    it is running, or it was cancelled and the core has not recycled its slot
    yet (a second cancel).
``UNKNOWN`` (2)
    never issued, or its slot was recycled: it ran and was released by a
    drain, it was a native timer that returned, or it was a cancelled timer
    the core reaped (at a collect, at the top of the heap, in a sweep, or at a
    drain of its port).  After that the core's slot has a new generation, so
    the old id can never touch a newer timer.

Whether a second cancel answers ``TOO_LATE`` or ``UNKNOWN`` depends on exactly
when the core reaps, which is an implementation choice of ``csrc/pass.c``
(``collect``, ``fire_due``, ``maybe_sweep``, ``bt__settle_top``,
``bt_timer_release``).  The model mirrors those reaping points; if the core
changes when it reaps, this model (not the tests' other assertions) is what to
update.  ``cancel(id) == CANCELLED`` is the part every correct core must match.

Assumptions: one scheduling thread (the core's bucket is chosen by the calling
thread, so one thread means one bucket list), and no port is detached.  The
model's ids are its own (1, 2, 3, ...; never reused); a test maps them to the
core's versioned ids.

Counters kept with the same meaning as ``bt_stats``: ``scheduled``,
``cancelled``, ``fired``, ``posted``, ``ran``, ``passes``, ``drains``,
``sweeps``, ``reaped``, plus :attr:`heap_size`, :attr:`list_size`,
:attr:`dead` and :attr:`live_slots` (slots in use: ``slots - slots_free``).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field

from bucketimer import _core

__all__ = [
    "CANCELLED",
    "CANCELLED_STATE",
    "EARLIER",
    "POSTPONED",
    "NEVER",
    "PENDING",
    "POSTED",
    "RUNNING",
    "TOO_LATE",
    "UNKNOWN",
    "Reference",
    "Timer",
]

#: ``bt_cancel`` results (``enum bt_cancel_result``).
CANCELLED = 0
POSTPONED = 0  # what bt_postpone answers when it won
TOO_LATE = 1
UNKNOWN = 2
EARLIER = 3

#: "No deadline": ``INT64_MAX``, what ``bt_next_deadline`` answers when
#: nothing is pending.
NEVER = (1 << 63) - 1

#: Timer states (the core's ``enum bt__state``, less FREE and DONE: a slot that
#: is FREE is simply absent from the model, and the core never leaves a timer
#: in DONE once its consumer released it).
PENDING = "pending"
POSTED = "posted"
RUNNING = "running"
CANCELLED_STATE = "cancelled"

NativeFn = Callable[["Reference", int], None]


@dataclass
class Timer:
    """One timer whose slot the core has not recycled yet."""

    id: int
    deadline: int
    seq: int
    port: int | None  # None: a native timer
    fn: NativeFn | None = None
    state: str = PENDING
    where: str = "list"  # "list" | "heap" | "port" | "running"
    moved_to: int | None = None  # a postpone not applied yet (deadline: the key)


@dataclass
class Reference:
    """The model.  ``drain_threshold`` and ``sweep_min`` are the core's
    ``bt_options`` fields of the same name (and take the same defaults)."""

    start_ns: int = 0
    drain_threshold: int = _core.DEFAULT_DRAIN_THRESHOLD
    sweep_min: int = _core.DEFAULT_SWEEP_MIN
    nports: int = 1

    now: int = field(init=False)
    # counters, as in bt_stats
    scheduled: int = field(init=False, default=0)
    cancelled: int = field(init=False, default=0)
    fired: int = field(init=False, default=0)
    posted: int = field(init=False, default=0)
    ran: int = field(init=False, default=0)
    passes: int = field(init=False, default=0)
    drains: int = field(init=False, default=0)
    sweeps: int = field(init=False, default=0)
    reaped: int = field(init=False, default=0)
    postponed: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        if self.drain_threshold <= 0 or self.sweep_min <= 0:
            raise ValueError("drain_threshold and sweep_min must be positive (as the core's defaults are)")
        self.now = self.start_ns
        self._seq = 0
        self._next_id = 1
        self._known: dict[int, Timer] = {}  # every timer whose slot is in use
        self._list: list[Timer] = []  # scheduled since the last collect
        self._heap: list[tuple[int, int, int]] = []  # (deadline, seq, id)
        self._ports: list[list[Timer]] = [[] for _ in range(self.nports)]
        self.deadlines: dict[int, int] = {}  # id -> deadline, for every id ever issued
        self._advancing = False
        self._sweep_base = 0  # dead entries the last sweep could not find

    # -- observers ------------------------------------------------------------

    @property
    def heap_size(self) -> int:
        """Entries in the heap, live and cancelled (``bt_stats.heap_size``)."""
        return len(self._heap)

    @property
    def list_size(self) -> int:
        """Entries waiting in the bucket list (``bt_stats.list_size``)."""
        return len(self._list)

    @property
    def dead(self) -> int:
        """Cancelled timers whose slot is not recycled yet (``bt_stats.dead``)."""
        return sum(1 for t in self._known.values() if t.state == CANCELLED_STATE)

    @property
    def live_slots(self) -> int:
        """Slots in use: ``bt_stats.slots - bt_stats.slots_free``."""
        return len(self._known)

    def state(self, tid: int) -> str | None:
        """The timer's state, or None once its slot is recycled (or never issued)."""
        t = self._known.get(tid)
        return t.state if t else None

    def earliest_live_deadline(self) -> int:
        """The deadline of the earliest PENDING timer, or NEVER (read only)."""
        ds = [t.deadline if t.moved_to is None else t.moved_to
              for t in self._known.values() if t.state == PENDING]
        return min(ds, default=NEVER)

    # -- the API ---------------------------------------------------------------

    def schedule(self, deadline_ns: int, port: int = 0) -> int:
        """``bt_schedule_port``: returns the new timer's id."""
        if not 0 <= port < self.nports:
            raise ValueError(f"no port {port}")
        return self._schedule(deadline_ns, port, None)

    def schedule_native(self, deadline_ns: int, fn: NativeFn) -> int:
        """``bt_schedule_native``: ``fn(model, id)`` runs inside :meth:`advance`."""
        return self._schedule(deadline_ns, None, fn)

    def cancel(self, tid: int) -> int:
        """``bt_cancel``: CANCELLED, TOO_LATE or UNKNOWN.  Every
        ``drain_threshold``-th winning cancel asks for a collect (and maybe a
        sweep), as the core's ``bt_cancel`` does, unless an advance is running
        (the core's ``trylock`` then leaves the work to it)."""
        t = self._known.get(tid)
        if t is None:
            return UNKNOWN
        if t.state in (PENDING, POSTED):
            t.state = CANCELLED_STATE
            self.cancelled += 1
            if self.cancelled % self.drain_threshold == 0:
                self._request_collect()
            return CANCELLED
        return TOO_LATE

    def postpone(self, tid: int, deadline_ns: int) -> int:
        """``bt_postpone``: POSTPONED (0), TOO_LATE, UNKNOWN, or EARLIER when
        ``deadline_ns`` is before the timer's current deadline (its
        schedule's, or the last postpone's, applied or not).  The move is
        applied when the timer is collected, or popped at its old key."""
        t = self._known.get(tid)
        if t is None:
            return UNKNOWN
        if t.state != PENDING:
            return TOO_LATE
        if deadline_ns < (t.deadline if t.moved_to is None else t.moved_to):
            return EARLIER
        t.moved_to = deadline_ns
        self.deadlines[tid] = deadline_ns
        self.postponed += 1
        return POSTPONED

    def advance(self, now_ns: int) -> list[int]:
        """``bt_advance``: moves the clock to ``now_ns`` (never backwards),
        collects, maybe sweeps, then fires everything due in (deadline,
        schedule order).  Returns the ids fired (posted or run natively), in
        order; ``len()`` of it is what ``bt_advance`` returns."""
        self.now = max(self.now, now_ns)
        now = self.now
        self._advancing = True
        try:
            return self._advance(now)
        finally:
            self._advancing = False

    def _advance(self, now: int) -> list[int]:
        self._collect()
        self._maybe_sweep()
        fired: list[int] = []
        while self._heap:
            deadline, _seq, tid = self._heap[0]
            t = self._known[tid]
            if t.state == CANCELLED_STATE:
                heapq.heappop(self._heap)  # lazy deletion, due or not
                self._reap(t)
                continue
            if deadline > now:
                break
            heapq.heappop(self._heap)
            assert t.state == PENDING, t
            if t.moved_to is not None:  # popped at its old key: back at the new one
                self._apply_move(t)
                continue
            fired.append(tid)
            self.fired += 1
            if t.port is not None:
                t.state = POSTED
                t.where = "port"
                self._ports[t.port].append(t)
                self.posted += 1
            else:
                t.state = RUNNING
                t.where = "running"
                assert t.fn is not None
                try:
                    t.fn(self, tid)
                finally:
                    self.ran += 1
                    del self._known[tid]
        self.passes += 1
        return fired

    def drain(self, port: int = 0) -> list[int]:
        """``bt_port_drain_ids``: the ids of the posted timers that were not
        cancelled (they "run"), in (deadline, seq) order; every timer taken
        is recycled."""
        out: list[int] = []
        queue, self._ports[port] = self._ports[port], []
        queue.sort(key=lambda t: (t.deadline, t.seq))
        for t in queue:
            if t.state == POSTED:
                out.append(t.id)
                self.ran += 1
                del self._known[t.id]
            else:
                assert t.state == CANCELLED_STATE, t
                self._reap(t)
        return out

    def next_deadline(self) -> int:
        """``bt_next_deadline`` in manual-clock mode: collects, drops cancelled
        entries from the top of the heap, returns the top's deadline (or
        NEVER).  Never sweeps."""
        self._collect()
        while self._heap:
            t = self._known[self._heap[0][2]]
            if t.state == CANCELLED_STATE:
                heapq.heappop(self._heap)
                self._reap(t)
            elif t.moved_to is not None:
                heapq.heappop(self._heap)
                self._apply_move(t)
            else:
                return t.deadline
        return NEVER

    def queued(self, port: int = 0) -> list[int]:
        """Ids waiting in a port's queue (posted, possibly cancelled since)."""
        return [t.id for t in self._ports[port]]

    # -- internals ---------------------------------------------------------------

    def _schedule(self, deadline_ns: int, port: int | None, fn: NativeFn | None) -> int:
        tid = self._next_id
        self._next_id += 1
        t = Timer(tid, deadline_ns, self._seq, port, fn)
        self._seq += 1
        self._known[tid] = t
        self.deadlines[tid] = deadline_ns
        if self._list and self._list[-1].state == CANCELLED_STATE:
            # The core reaps a cancelled newest entry of the list before a
            # schedule, and the schedule reuses its slot.
            self._reap(self._list.pop())
        self._list.append(t)
        self.scheduled += 1
        n = len(self._list)
        if n >= self.drain_threshold and n % self.drain_threshold == 0:
            self._request_collect()
        return tid

    def _request_collect(self) -> None:
        """The core's request_collect: collect and maybe sweep, no firing;
        skipped when an advance holds the core (a native callback)."""
        if self._advancing:
            return
        self._collect()
        self._maybe_sweep()
        self.drains += 1

    def _reap(self, t: Timer) -> None:
        """The core recycles a cancelled timer's slot: its id goes stale."""
        assert t.state == CANCELLED_STATE, t
        del self._known[t.id]
        self.reaped += 1

    def _apply_move(self, t: Timer) -> None:
        """The core applies a postpone: the key becomes its new deadline (the
        schedule order, its first one's), and it goes into the heap there."""
        assert t.moved_to is not None
        t.deadline, t.moved_to = t.moved_to, None
        heapq.heappush(self._heap, (t.deadline, t.seq, t.id))

    def _collect(self) -> None:
        lst, self._list = self._list, []
        for t in lst:
            if t.state == CANCELLED_STATE:
                self._reap(t)
            elif t.moved_to is not None:
                t.where = "heap"
                self._apply_move(t)
            else:
                t.where = "heap"
                heapq.heappush(self._heap, (t.deadline, t.seq, t.id))

    def _maybe_sweep(self) -> None:
        # The core's estimate of dead entries counts cancelled timers anywhere
        # (port queues too); what a finished sweep could not find becomes a
        # base that later decisions subtract.
        size = len(self._heap)
        if size < self.sweep_min:
            return
        dead = self.dead
        if dead < self._sweep_base:
            self._sweep_base = dead
        if (dead - self._sweep_base) * 2 <= size:
            return
        kept = []
        for entry in self._heap:
            t = self._known[entry[2]]
            if t.state == CANCELLED_STATE:
                self._reap(t)
            else:
                kept.append(entry)
        heapq.heapify(kept)
        self._heap = kept
        self.sweeps += 1
        self._sweep_base = self.dead
