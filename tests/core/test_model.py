"""The native core in manual-clock mode against the pure-Python reference model.

A hypothesis ``RuleBasedStateMachine`` drives the C core through
``bucketimer._cffi`` (no thread: time moves only by ``bt_advance``) and
``reference.Reference`` (beside this file) side by side: schedule (port and native
timers, deadlines from a small set so that equal deadlines are common, and
relative to the clock), cancel, cancel twice, cancel stale and never-issued
ids, advance (small steps, big jumps, backwards), drain the ports, ask for the
next deadline.  They must agree exactly on the fired sequences, on every
cancel result and on the counters; no timer may fire before its deadline.
"""

from __future__ import annotations

import heapq

import pytest
import reference as ref_mod
from _helpers import cffi_core, destroy_cffi_core
from hypothesis import event, note
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from reference import CANCELLED, EARLIER, NEVER, TOO_LATE, UNKNOWN, Reference

from bucketimer import _cffi

# The C core through its cffi binding, against the reference model.
pytestmark = pytest.mark.native

ffi, lib = _cffi.ffi, _cffi.lib

INT64_MAX = (1 << 63) - 1
START = 1_000_000  # the manual clock's start, ns
NPORTS = 2
MAX_DRAIN = 1 << 12
# The core's defaults (bucketimer.h), for the set-ups that keep them.
DEFAULT_BUCKETS = lib.BT_DEFAULT_BUCKETS
DEFAULT_DRAIN_THRESHOLD = lib.BT_DEFAULT_DRAIN_THRESHOLD
DEFAULT_SWEEP_MIN = lib.BT_DEFAULT_SWEEP_MIN
# The machine's clock stops here: far enough below INT64_MAX that
# `now - deadline` cannot overflow for its most negative deadline (see
# test_lateness_does_not_overflow for what happens beyond).
END_OF_TIME = INT64_MAX - (1 << 41)
CANCEL_NAMES = {CANCELLED: "CANCELLED", TOO_LATE: "TOO_LATE", UNKNOWN: "UNKNOWN"}
POSTPONE_NAMES = {0: "POSTPONED", TOO_LATE: "TOO_LATE", UNKNOWN: "UNKNOWN", EARLIER: "EARLIER"}

# Absolute deadlines: few distinct values, so equal deadlines are common; some
# in the past of the start, one "never".
ABS_DEADLINES = st.sampled_from(
    [0, START - 1, START, START + 1, START + 5, START + 10, START + 50, START + 1000, -(1 << 40), INT64_MAX]
)
REL_DELTAS = st.integers(min_value=-5, max_value=40)


def _clamp(v: int) -> int:
    return max(-(1 << 62), min(INT64_MAX, v))


class Core:
    """A manual-clock core with NPORTS fd-less ports, through cffi."""

    def __init__(self, drain_threshold: int, sweep_min: int, buckets: int = DEFAULT_BUCKETS) -> None:
        self.tt = cffi_core(manual_clock=1, manual_start_ns=START, num_buckets=buckets,
                            drain_threshold=drain_threshold, sweep_min=sweep_min)
        self.ports = []
        for _ in range(NPORTS):
            p = ffi.new("bt_port **")
            assert lib.bt_port_open(self.tt, 0, p) == 0
            assert lib.bt_port_fd(p[0]) == -1
            self.ports.append(p[0])
        self._id = ffi.new("uint64_t *")
        self._ids = ffi.new("uint64_t[]", MAX_DRAIN)
        self._stats = ffi.new("bt_stats *")

    def schedule(self, deadline: int, port: int) -> int:
        rc = lib.bt_schedule_port(self.tt, deadline, self.ports[port], ffi.NULL, self._id)
        assert rc == 0, rc
        return int(self._id[0])

    def schedule_native(self, deadline: int, fn, arg=ffi.NULL) -> int:
        out = ffi.new("uint64_t *")
        rc = lib.bt_schedule_native(self.tt, deadline, fn, arg, out)
        assert rc == 0, rc
        return int(out[0])

    def cancel(self, core_id: int) -> int:
        return lib.bt_cancel(self.tt, core_id)

    def postpone(self, core_id: int, deadline: int) -> int:
        return lib.bt_postpone(self.tt, core_id, deadline)

    def advance(self, now: int) -> int:
        n = lib.bt_advance(self.tt, now)
        assert n >= 0, n
        return n

    def drain(self, port: int) -> list[int]:
        n = lib.bt_port_drain_ids(self.ports[port], self._ids, MAX_DRAIN)
        return [int(self._ids[i]) for i in range(n)]

    def now(self) -> int:
        return lib.bt_time_ns(self.tt)

    def next_deadline(self) -> int:
        return lib.bt_next_deadline(self.tt)

    def stats(self):
        lib.bt_get_stats(self.tt, self._stats)
        return self._stats

    def destroy(self) -> None:
        if self.tt is not None:
            assert lib.bt_stop(self.tt) == 0
            lib.bt_destroy(self.tt)
            self.tt = None


class CoreVsReference(RuleBasedStateMachine):
    """Drives the core and the reference model with the same operations."""

    timers = Bundle("timers")

    def __init__(self) -> None:
        super().__init__()
        self.core: Core | None = None
        self.ref: Reference | None = None
        self.ref_to_core: dict[int, int] = {}
        self.core_to_ref: dict[int, int] = {}
        self.core_events: list[tuple[object, int]] = []
        self.ref_events: list[tuple[object, int]] = []
        self.errors: list[str] = []
        self._native_cb = None

    # -- set-up --------------------------------------------------------------

    @initialize(
        drain_threshold=st.sampled_from([1, 2, 3, 5, DEFAULT_DRAIN_THRESHOLD]),
        sweep_min=st.sampled_from([1, 2, 2, 4, 4, 8, DEFAULT_SWEEP_MIN]),
    )
    def setup(self, drain_threshold: int, sweep_min: int) -> None:
        note(f"drain_threshold={drain_threshold} sweep_min={sweep_min}")
        self.core = Core(drain_threshold, sweep_min)
        self.ref = Reference(
            start_ns=START, drain_threshold=drain_threshold, sweep_min=sweep_min, nports=NPORTS
        )

        # A native timer, on the core side: it runs inside bt_advance, after
        # the core handed the ports what fired before it in this pass.  It
        # drains the ports (so the events give one global fire order), then
        # tries to cancel itself (it is running: TOO_LATE).
        @ffi.callback("void(void *, uint64_t)")
        def native(arg, core_id):
            try:
                core = self.core
                for p in range(NPORTS):
                    self.core_events.extend((p, self._ref_id(c)) for c in core.drain(p))
                tid = self._ref_id(core_id)
                self.core_events.append(("native", tid))
                if tid < 0 or self.ref.deadlines[tid] > core.now():
                    self.errors.append(f"native timer {core_id:#x} ran early or unknown")
                rc = core.cancel(core_id)
                if rc != TOO_LATE:
                    self.errors.append(f"native timer cancelled itself: {rc}")
            except BaseException as e:
                self.errors.append(repr(e))

        self._native_cb = native

    def _ref_native(self, ref: Reference, tid: int) -> None:
        for p in range(NPORTS):
            self.ref_events.extend((p, t) for t in ref.drain(p))
        self.ref_events.append(("native", tid))
        rc = ref.cancel(tid)
        assert rc == TOO_LATE

    def teardown(self) -> None:
        if self.core is not None:
            self.core.destroy()

    def _ref_id(self, core_id: int) -> int:
        return self.core_to_ref.get(core_id, -core_id)

    def _record(self, ref_id: int, core_id: int) -> int:
        assert core_id != 0
        assert core_id not in self.core_to_ref, "the core issued the same id twice"
        self.ref_to_core[ref_id] = core_id
        self.core_to_ref[core_id] = ref_id
        return ref_id

    # -- schedule ------------------------------------------------------------------

    @rule(target=timers, deadline=ABS_DEADLINES, port=st.integers(0, NPORTS - 1))
    def schedule_at(self, deadline: int, port: int) -> int:
        return self._record(self.ref.schedule(deadline, port), self.core.schedule(deadline, port))

    @rule(target=timers, delta=REL_DELTAS, port=st.integers(0, NPORTS - 1))
    def schedule_later(self, delta: int, port: int) -> int:
        deadline = _clamp(self.ref.now + delta)
        return self._record(self.ref.schedule(deadline, port), self.core.schedule(deadline, port))

    @rule(target=timers, deadline=ABS_DEADLINES | REL_DELTAS.map(lambda d: START + d))
    def schedule_native(self, deadline: int) -> int:
        return self._record(
            self.ref.schedule_native(deadline, self._ref_native),
            self.core.schedule_native(deadline, self._native_cb),
        )

    @rule(deadline=ABS_DEADLINES, n=st.integers(2, 6), port=st.integers(0, NPORTS - 1))
    def schedule_many_equal(self, deadline: int, n: int, port: int) -> None:
        for _ in range(n):
            self._record(self.ref.schedule(deadline, port), self.core.schedule(deadline, port))

    # -- cancel --------------------------------------------------------------------

    def _check_cancel(self, ref_id: int, core_rc: int, ref_rc: int) -> None:
        event(f"cancel: {CANCEL_NAMES[ref_rc]}")
        note(f"cancel #{ref_id}: core {CANCEL_NAMES.get(core_rc, core_rc)}, "
             f"model {CANCEL_NAMES[ref_rc]}")
        # What every correct core must agree on: did this cancel win?
        assert (core_rc == CANCELLED) == (ref_rc == CANCELLED), (
            f"cancel #{ref_id} (state {self.ref.state(ref_id)}): core says "
            f"{CANCEL_NAMES.get(core_rc, core_rc)}, model {CANCEL_NAMES[ref_rc]}"
        )
        # The exact three-way answer depends on when the core reaps; the model
        # mirrors csrc/pass.c there (see reference.py).
        assert core_rc == ref_rc, (
            f"cancel #{ref_id}: core says {CANCEL_NAMES.get(core_rc, core_rc)}, model "
            f"{CANCEL_NAMES[ref_rc]}: the reaping model in reference.py and the core disagree"
        )

    @rule(tid=timers)
    def cancel(self, tid: int) -> None:
        core_rc = self.core.cancel(self.ref_to_core[tid])
        ref_rc = self.ref.cancel(tid)
        self._check_cancel(tid, core_rc, ref_rc)

    @precondition(lambda self: self.ref is not None and self.ref.scheduled >= 2)
    @rule(tids=st.lists(timers, min_size=2, max_size=10))
    def cancel_many(self, tids: list[int]) -> None:
        # Many dead entries at once: what triggers heap sweeps.
        for tid in tids:
            self.cancel(tid)

    @rule(tid=timers)
    def cancel_twice(self, tid: int) -> None:
        for _ in range(2):
            core_rc = self.core.cancel(self.ref_to_core[tid])
            ref_rc = self.ref.cancel(tid)
            self._check_cancel(tid, core_rc, ref_rc)
        # After two cancels, neither can be CANCELLED twice.
        assert ref_rc != CANCELLED

    @rule(tid=timers, delta=st.one_of(st.integers(-20, -1), st.integers(0, 50),
                                      st.integers(0, 1 << 20)))
    def postpone(self, tid: int, delta: int) -> None:
        """bt_postpone by `delta` from the model's idea of the deadline:
        earlier ones must be refused, later ones move the timer."""
        deadline = _clamp(self.ref.deadlines[tid] + delta)
        core_rc = self.core.postpone(self.ref_to_core[tid], deadline)
        ref_rc = self.ref.postpone(tid, deadline)
        event(f"postpone: {POSTPONE_NAMES[ref_rc]}")
        assert core_rc == ref_rc, (
            f"postpone #{tid} to {deadline} (state {self.ref.state(tid)}): core says "
            f"{POSTPONE_NAMES.get(core_rc, core_rc)}, model {POSTPONE_NAMES[ref_rc]}"
        )

    @rule(tid=timers, steps=st.integers(1, 30))
    def postpone_repeatedly(self, tid: int, steps: int) -> None:
        # An idle timeout reset on every message, the clock moving meanwhile.
        for _ in range(steps):
            self.postpone(tid, 7)
            self._advance(min(self.ref.now + 3, END_OF_TIME))

    @rule(
        kind=st.sampled_from(
            ["zero", "tag0", "future_gen", "foreign_tag", "slot_out_of_range", "max"]
        ),
        slot=st.integers(0, 2047),
    )
    def cancel_never_issued(self, kind: str, slot: int) -> None:
        # An id is generation << 32 | tag << 26 | index (docs/design.rst rule
        # 1).  Learn this core's tag and a generation it issued, if any.
        issued = next(iter(self.core_to_ref), (1 << 32) | (1 << 26))
        gen, tag = issued >> 32, (issued >> 26) & 63
        core_id = {
            "zero": 0,
            "tag0": (gen << 32) | slot,  # tag 0 is never issued
            # A slot's generations start at the core's random first one and
            # count up: 16 before an issued one is reached only after 2^32 - 16
            # reuses of a slot.
            "future_gen": (((gen - 16) & 0xFFFF_FFFF) << 32) | (tag << 26) | slot,
            "foreign_tag": (gen << 32) | ((tag % 63 + 1) << 26) | slot,
            "slot_out_of_range": (gen << 32) | (tag << 26) | ((1 << 26) - 1 - slot),
            "max": (1 << 64) - 1,
        }[kind]
        assert core_id not in self.core_to_ref
        assert self.core.cancel(core_id) == UNKNOWN
        assert self.ref.cancel(-1) == UNKNOWN

    @rule(tid=timers)
    def cancel_by_stale_generation(self, tid: int) -> None:
        """The id of the previous generation of the same slot (never issued,
        for a slot on its first use)."""
        core_id = self.ref_to_core[tid]
        gen = core_id >> 32
        older = (((gen - 1) & 0xFFFF_FFFF) << 32) | (core_id & 0xFFFF_FFFF)
        old_ref = self.core_to_ref.get(older)
        event(f"stale generation: {'issued before' if old_ref else 'never issued'}")
        rc = self.core.cancel(older)
        # A newer generation of the slot exists, so the older id is recycled.
        assert old_ref is None or self.ref.cancel(old_ref) == UNKNOWN
        assert rc == UNKNOWN

    # -- time --------------------------------------------------------------------------

    def _advance(self, now: int) -> None:
        now = min(_clamp(now), END_OF_TIME)
        n = self.core.advance(now)
        fired = self.ref.advance(now)
        assert self.core.now() == self.ref.now
        assert n == len(fired), f"core fired {n}, model {fired}"
        if len({self.ref.deadlines[t] for t in fired}) < len(fired):
            event("advance fired equal deadlines")
        for tid in fired:
            assert self.ref.deadlines[tid] <= self.ref.now, "model fired early"

    @rule(step=st.integers(0, 12))
    def advance_small(self, step: int) -> None:
        self._advance(self.ref.now + step)

    @rule(step=st.integers(0, 1 << 40))
    def advance_big(self, step: int) -> None:
        self._advance(self.ref.now + step)

    @rule(back=st.integers(1, 100))
    def advance_backwards(self, back: int) -> None:
        self._advance(self.ref.now - back)  # the clock never goes back

    @precondition(lambda self: self.ref is not None and self.ref.now < END_OF_TIME)
    @rule(coin=st.integers(0, 7))
    def advance_to_end_of_time(self, coin: int) -> None:
        # Rare on purpose (rules are drawn about equally often): after it,
        # every timer but the INT64_MAX ones is due at once.
        if coin == 0:
            self._advance(END_OF_TIME)

    @rule(port=st.integers(0, NPORTS - 1))
    def drain(self, port: int) -> None:
        now = self.core.now()
        for c in self.core.drain(port):
            tid = self._ref_id(c)
            assert tid > 0, f"drained an id the core never issued: {c:#x}"
            assert self.ref.deadlines[tid] <= now, f"timer #{tid} ran before its deadline"
            self.core_events.append((port, tid))
        self.ref_events.extend((port, t) for t in self.ref.drain(port))
        assert self.core_events == self.ref_events

    @rule(step=st.integers(0, 60))
    def advance_and_drain(self, step: int) -> None:
        self._advance(min(self.ref.now + step, END_OF_TIME))
        for p in range(NPORTS):
            self.drain(p)

    @rule()
    def next_deadline(self) -> None:
        expected = self.ref.earliest_live_deadline()
        got = self.core.next_deadline()
        assert self.ref.next_deadline() == expected
        assert got == expected, f"bt_next_deadline {got}, earliest live deadline {expected}"

    # -- invariants ------------------------------------------------------------------

    @invariant()
    def no_callback_errors(self) -> None:
        if self.core is not None:
            assert not self.errors, self.errors

    @invariant()
    def same_fired_sequences(self) -> None:
        # Native timers drain the ports as they run, so events are compared
        # after every step, not only after drains.
        assert self.core_events == self.ref_events

    @invariant()
    def same_counters(self) -> None:
        if self.core is None:
            return
        s, r = self.core.stats(), self.ref
        got = {k: getattr(s, k) for k in (
            "scheduled", "cancelled", "fired", "posted", "ran", "passes", "drains", "sweeps",
            "reaped", "heap_size", "list_size", "dead", "postponed")}
        want = {k: getattr(r, k) for k in got}
        assert got == want
        assert s.slots - s.slots_free == r.live_slots, "slots in use vs. timers not recycled"
        assert s.early_fires == 0
        assert s.eventfd_writes == 0  # the ports have no fd
        if r.sweeps:
            event("swept the heap")
        if r.drains:
            event("threshold drain")


# The expensive profile (BUCKETIMER_SLOW_TESTS=1) runs for minutes.
TestCoreVsReference = pytest.mark.timeout(3600)(CoreVsReference.TestCase)


# -- directed scenarios -----------------------------------------------------------------


def _pair(drain_threshold=DEFAULT_DRAIN_THRESHOLD, sweep_min=DEFAULT_SWEEP_MIN):
    return Core(drain_threshold, sweep_min), Reference(
        start_ns=START, drain_threshold=drain_threshold, sweep_min=sweep_min, nports=NPORTS
    )


def test_reference_equal_deadlines_fire_in_schedule_order():
    ref = Reference(start_ns=0)
    ids = [ref.schedule(d) for d in (5, 3, 5, 3, 5, 1)]
    assert ref.advance(4) == [ids[5], ids[1], ids[3]]
    assert ref.advance(5) == [ids[0], ids[2], ids[4]]
    assert ref.drain() == [ids[5], ids[1], ids[3], ids[0], ids[2], ids[4]]


def test_reference_cancel_semantics():
    ref = Reference(start_ns=0)
    a, b, c = ref.schedule(10), ref.schedule(10), ref.schedule(20)
    assert ref.cancel(a) == CANCELLED
    assert ref.cancel(a) == TOO_LATE  # cancelled, not reaped yet
    assert ref.advance(10) == [b]  # collect reaps a
    assert ref.cancel(a) == UNKNOWN
    assert ref.cancel(b) == CANCELLED  # posted: a cancel still wins
    assert ref.drain() == []
    assert ref.cancel(b) == UNKNOWN
    assert ref.advance(20) == [c]
    assert ref.drain() == [c]
    assert ref.cancel(c) == UNKNOWN  # ran and released
    assert ref.cancel(12345) == UNKNOWN
    assert ref.live_slots == 0 and ref.cancelled == 2 and ref.reaped == 2


def test_reference_mirrors_heapq_of_deadline_seq_id():
    """The model's order is exactly a heapq of (deadline, seq, id)."""
    import random

    rnd = random.Random(7)
    ref = Reference(start_ns=0)
    heap = []
    for seq in range(500):
        d = rnd.randrange(50)
        tid = ref.schedule(d)
        heapq.heappush(heap, (d, seq, tid))
    expected = [heapq.heappop(heap)[2] for _ in range(len(heap))]
    assert ref.advance(100) == expected
    assert ref.drain() == expected


def test_equal_deadlines_core_order():
    core, ref = _pair()
    try:
        order = []
        for i in range(300):
            d = START + 10 * (i % 7)
            order.append((d, i, core.schedule(d, 0)))
            ref.schedule(d, 0)
        assert core.advance(START + 100) == 300
        assert core.drain(0) == [c for _, _, c in sorted(order)]
    finally:
        core.destroy()


def test_cancel_after_post_wins_and_stale_id_cannot_touch_new_timer():
    core, _ = _pair()
    try:
        a = core.schedule(START + 1, 0)
        assert core.advance(START + 1) == 1  # a is POSTED now
        assert core.cancel(a) == CANCELLED
        assert core.cancel(a) == TOO_LATE
        assert core.drain(0) == []  # released without running
        assert core.cancel(a) == UNKNOWN
        b = core.schedule(START + 5, 0)
        assert b & 0xFFFF_FFFF == a & 0xFFFF_FFFF, "LIFO free list: b reuses a's slot"
        assert b >> 32 == ((a >> 32) + 1) & 0xFFFF_FFFF
        assert core.cancel(a) == UNKNOWN  # stale: must not cancel b
        assert core.advance(START + 5) == 1
        assert core.drain(0) == [b]
        s = core.stats()
        assert (s.scheduled, s.cancelled, s.fired, s.ran, s.early_fires) == (2, 1, 2, 1, 0)
    finally:
        core.destroy()


def test_drain_threshold_and_sweep_match_the_model():
    """Exercises request_collect and heap sweeps, which bound garbage."""
    core, ref = _pair(drain_threshold=8, sweep_min=16)
    try:
        ids = []
        for i in range(200):
            d = START + 1000 + i
            ids.append((ref.schedule(d, 0), core.schedule(d, 0)))
        for r, c in ids[::3] + ids[1::3]:
            assert core.cancel(c) == ref.cancel(r) == CANCELLED
        # 16 more schedules: two more threshold collects, then a sweep
        for i in range(16):
            d = START + 5000 + i
            ids.append((ref.schedule(d, 0), core.schedule(d, 0)))
        s = core.stats()
        assert (s.drains, s.sweeps, s.reaped, s.heap_size, s.list_size, s.dead) == (
            ref.drains, ref.sweeps, ref.reaped, ref.heap_size, ref.list_size, ref.dead)
        # 27 from schedules (216 // 8), 16 from cancels (134 // 8)
        assert ref.drains == 216 // 8 + 134 // 8
        assert ref.sweeps >= 1 and ref.dead < ref.heap_size
        for r, c in ids:
            assert core.cancel(c) == ref.cancel(r)
        assert core.advance(START + 10_000) == len(ref.advance(START + 10_000)) == 0
        assert core.stats().slots - core.stats().slots_free == ref.live_slots == 0
    finally:
        core.destroy()


def test_next_deadline_skips_cancelled_and_posted():
    core, _ = _pair()
    try:
        assert core.next_deadline() == NEVER
        a = core.schedule(START + 10, 0)
        core.schedule(START + 20, 1)
        assert core.next_deadline() == START + 10
        assert core.cancel(a) == CANCELLED
        assert core.next_deadline() == START + 20
        assert core.advance(START + 20) == 1
        assert core.next_deadline() == NEVER  # posted, not pending
        assert core.drain(1) != []
    finally:
        core.destroy()


def test_native_callbacks_run_in_order_on_the_advancing_thread():
    import threading

    core, _ = _pair()
    seen = []

    @ffi.callback("void(void *, uint64_t)")
    def cb(arg, core_id):
        seen.append((int(ffi.cast("intptr_t", arg)), int(core_id), threading.get_ident(),
                     lib.bt_time_ns(core.tt), core.cancel(core_id)))

    try:
        ids = [core.schedule_native(START + d, cb, ffi.cast("void *", i))
               for i, d in enumerate([30, 10, 30, 20, 10])]
        assert core.advance(START + 25) == 3
        assert core.advance(START + 30) == 2
        assert [s[0] for s in seen] == [1, 4, 3, 0, 2]
        assert [s[1] for s in seen] == [ids[i] for i in (1, 4, 3, 0, 2)]
        assert {s[2] for s in seen} == {threading.get_ident()}
        assert [s[3] for s in seen] == [START + 25] * 3 + [START + 30] * 2
        assert {s[4] for s in seen} == {TOO_LATE}  # running: too late
        assert [core.cancel(i) for i in ids] == [UNKNOWN] * 5  # done and recycled
        s = core.stats()
        assert (s.fired, s.posted, s.ran, s.early_fires) == (5, 0, 5, 0)
    finally:
        core.destroy()


def test_manual_core_refuses_after_stop():
    core, _ = _pair()
    try:
        a = core.schedule(START + 1, 0)
        assert lib.bt_stop(core.tt) == 0
        assert lib.bt_is_stopped(core.tt)
        out = ffi.new("uint64_t *")
        assert lib.bt_schedule_port(core.tt, START, core.ports[0], ffi.NULL, out) < 0
        assert lib.bt_advance(core.tt, START + 10) < 0
        assert lib.bt_drop_all(core.tt, ffi.NULL, ffi.NULL) == 1
        assert core.cancel(a) == TOO_LATE  # dropped (cancelled by the core)
    finally:
        core.destroy()


def test_advance_refused_with_a_real_thread():
    tt = cffi_core()
    try:
        assert lib.bt_advance(tt, 10) < 0
    finally:
        destroy_cffi_core(tt)


def test_timer_at_int64_max_fires_at_int64_max():
    core, _ = _pair()
    try:
        a = core.schedule(INT64_MAX, 0)
        b = core.schedule(START, 0)
        assert core.next_deadline() == START
        assert core.advance(INT64_MAX - 1) == 1
        assert core.drain(0) == [b]
        assert core.next_deadline() == INT64_MAX  # a is still pending
        assert core.advance(INT64_MAX) == 1
        assert core.drain(0) == [a]
        assert core.stats().early_fires == 0
    finally:
        core.destroy()


@pytest.mark.parametrize("native", [False, True], ids=["port", "native"])
def test_lateness_does_not_overflow(native):
    core, _ = _pair()
    ran = []

    @ffi.callback("void(void *, uint64_t)")
    def cb(arg, core_id):
        ran.append(int(core_id))

    try:
        if native:
            core.schedule_native(-(1 << 62), cb)
        else:
            core.schedule(-(1 << 62), 0)
        assert core.advance(INT64_MAX) == 1
        assert len(core.drain(0)) + len(ran) == 1
        s = core.stats()
        assert s.early_fires == 0
        assert s.lateness_hist[47] == 1  # the last bucket takes everything later
    finally:
        core.destroy()


@pytest.mark.parametrize("name", ["CANCELLED", "TOO_LATE", "UNKNOWN"])
def test_reference_constants_match_the_header(name):
    assert getattr(ref_mod, name) == getattr(lib, "BT_" + name)
