"""Races against a real timer thread.

Part 1 goes through the GIL-free cffi binding (``bucketimer._cffi``: every
call into the core releases the GIL, so the threads below really run the C
code at the same time).  N worker threads start behind a
``threading.Barrier`` and hammer one core with default options: schedule,
cancel, cancel twice, cancel later (racing the fire), cancel somebody else's
timer; one consumer thread waits on the port's eventfd with ``poll`` and
drains with ``bt_port_drain_ids``, and schedules new timers when it drains
certain ids (schedule from a callback).  Deadlines are "now + the same
constant + a few microseconds of jitter" (the RPC case), so the timers of all
threads land in the same few microseconds.

Part 2 is the same race through the public ``_core`` API: Python threads
calling ``tt.call_later`` / ``h.cancel()``, callbacks running on the
dispatcher thread and scheduling more.

Invariants, on every timer: it ran exactly once or exactly one cancel said
*cancelled*, never both, never neither; a repeated cancel never says
*cancelled*; it never ran before its deadline (the core's ``early_fires``,
counted at claim time against the deadline, and our own clock reading after
the drain); and once everything is accounted for the counters balance:
``scheduled == ran + cancelled``, ``reaped == cancelled`` (``dead == 0``),
``fired == posted``, nothing in the heap or the lists, and every slot back on
a free list (``slots_free == slots``).

Hypothesis chooses the mixes (threads, ops, cancel ratio, jitter, base delay,
spawn rate, consumer lag); a few examples by default, many with
``BUCKETIMER_SLOW_TESTS=1``.
"""

from __future__ import annotations

import random
import select
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import pytest
from _helpers import SLOW, cffi_core, check_ok, examples, run_python, wait_until
from hypothesis import currently_in_test_context, given, note
from hypothesis import strategies as st

import bucketimer
from bucketimer._cffi import ffi, lib

pytestmark = pytest.mark.timeout(600 if SLOW else 120)

CANCELLED = lib.BT_CANCELLED
TOO_LATE = lib.BT_TOO_LATE
UNKNOWN = lib.BT_UNKNOWN
DRAIN_MAX = 4096
MAX_DEPTH = 3  # schedule-from-callback chains stop here


def _mix(x: int) -> int:
    """A cheap integer hash both sides compute from the id alone."""
    x = (x * 0x9E3779B97F4A7C15) & 0xFFFF_FFFF_FFFF_FFFF
    return x >> 40


def stats_of(tt) -> dict:
    s = ffi.new("bt_stats *")
    lib.bt_get_stats(tt, s)
    d = {
        name: getattr(s, name)
        for name in (
            "scheduled", "cancelled", "fired", "posted", "ran", "wakeups", "passes",
            "eventfd_writes", "drains", "sweeps", "reaped", "heap_size", "list_size",
            "dead", "slots", "slots_free", "ports", "early_fires",
        )
    }
    d["lateness_hist"] = list(s.lateness_hist)
    return d


def balanced(s: dict) -> bool:
    """The core is quiescent: everything scheduled ran or was cancelled, and
    every cancelled slot was reaped back to a free list."""
    return (
        s["scheduled"] == s["ran"] + s["cancelled"]
        and s["reaped"] == s["cancelled"]
        and s["dead"] == 0
        and s["heap_size"] == 0
        and s["list_size"] == 0
        and s["slots_free"] == s["slots"]
    )


def check_counters(s: dict, *, scheduled: int, wins: int, runs: int, ports: int) -> None:
    assert s["early_fires"] == 0, s
    assert s["scheduled"] == scheduled, s
    assert s["cancelled"] == wins, s
    assert s["ran"] == runs, s
    assert sum(s["lateness_hist"]) == s["ran"], s
    assert s["scheduled"] == s["ran"] + s["cancelled"], s
    assert s["fired"] == s["posted"], s  # port timers only
    # fired = ran + (cancelled while waiting in the port)
    assert s["ran"] <= s["fired"] <= s["ran"] + s["cancelled"], s
    assert s["reaped"] == s["cancelled"] and s["dead"] == 0, s
    assert s["heap_size"] == 0 and s["list_size"] == 0, s
    assert s["slots_free"] == s["slots"], s
    if bucketimer.backend == "native":  # the pure backend has no ports
        assert s["ports"] == ports, s


# -- part 1: the GIL-free binding -------------------------------------------------


@dataclass
class Mix:
    threads: int
    ops: int
    cancel_ratio: float
    twice_ratio: float      # of the cancels: cancel twice in a row
    later_ratio: float      # of the cancels: cancel a few ops later, racing the fire
    cross_ratio: float      # of the cancels: cancel a random id of anybody's
    delay_ns: int           # the common constant
    jitter_ns: int          # + randrange(jitter_ns + 1)
    spawn_mod: int          # the consumer schedules a child for ids with mix(id) % spawn_mod == 0
    consumer_lag_us: int    # the consumer sleeps this long after each drain
    seed: int


mixes = st.builds(
    Mix,
    threads=st.integers(2, 8),
    ops=st.integers(20, 2000 if SLOW else 500),
    cancel_ratio=st.sampled_from([0.0, 0.1, 0.5, 0.9, 1.0]) | st.floats(0, 1),
    twice_ratio=st.floats(0, 1),
    later_ratio=st.floats(0, 1),
    cross_ratio=st.floats(0, 1),
    delay_ns=st.sampled_from([0, 1_000, 20_000, 200_000, 2_000_000]),
    jitter_ns=st.sampled_from([0, 1, 5, 1_000, 5_000]),
    spawn_mod=st.sampled_from([0, 2, 3, 17]),
    consumer_lag_us=st.sampled_from([0, 0, 100, 2_000]),
    seed=st.integers(0, 2**32 - 1),
)


@dataclass
class Record:
    """What one thread saw.  Merged after the threads are joined."""

    scheduled: list = field(default_factory=list)   # (id, deadline)
    cancels: list = field(default_factory=list)     # (id, result)
    repeats: list = field(default_factory=list)     # (id, result) of a cancel repeated by the same thread
    errors: list = field(default_factory=list)


class RealCore:
    """A core with a real timer thread (default options) and one fd port."""

    def __init__(self) -> None:
        self.tt = cffi_core()
        pp = ffi.new("bt_port **")
        assert lib.bt_port_open(self.tt, 1, pp) == 0
        self.port = pp[0]
        self.fd = lib.bt_port_fd(self.port)
        assert self.fd >= 0
        self.destroyed = False

    def stats(self) -> dict:
        return stats_of(self.tt)

    def destroy(self) -> None:
        if not self.destroyed:
            self.destroyed = True
            lib.bt_stop(self.tt)
            lib.bt_destroy(self.tt)


class Consumer(threading.Thread):
    """The port's one consumer: poll(fd) with a timeout, drain the ids, and
    schedule a child timer for some of them (schedule from a callback)."""

    def __init__(self, core: RealCore, mix: Mix, pool: list) -> None:
        super().__init__(name="race-consumer", daemon=True)
        self.core = core
        self.mix = mix
        self.pool = pool  # ids anybody may cancel
        self.stop = threading.Event()
        # Held from a drain to the last child it schedules: a look at the
        # counts under it sees no batch half-handled (a drained timer counted
        # as run while the child it is about to schedule is not yet counted).
        self.busy = threading.Lock()
        self.ran: list = []          # (id, clock after the drain returned)
        self.children: dict = {}     # id -> depth, of the timers it scheduled
        self.rec = Record()
        self.rng = random.Random(mix.seed ^ 0xC0FFEE)

    def _spawns(self, tid: int) -> bool:
        m = self.mix.spawn_mod
        return bool(m) and self.children.get(tid, 0) < MAX_DEPTH and _mix(tid) % m == 0

    def run(self) -> None:
        lib_ = lib
        port, tt = self.core.port, self.core.tt
        buf = ffi.new("uint64_t[]", DRAIN_MAX)
        id_p = ffi.new("uint64_t *")
        poller = select.poll()
        poller.register(self.core.fd, select.POLLIN)
        lag = self.mix.consumer_lag_us / 1e6
        try:
            while not self.stop.is_set():
                poller.poll(5)
                with self.busy:
                    n = lib_.bt_port_drain_ids(port, buf, DRAIN_MAX)
                    if not n:
                        continue
                    now = lib_.bt_now_ns()
                    for tid in ffi.unpack(buf, n):
                        self.ran.append((tid, now))
                        if self._spawns(tid):
                            depth = self.children.get(tid, 0) + 1
                            deadline = lib_.bt_now_ns() + self.mix.delay_ns + self.rng.randrange(
                                self.mix.jitter_ns + 1
                            )
                            rc = lib_.bt_schedule_port(tt, deadline, port, ffi.NULL, id_p)
                            if rc:
                                self.rec.errors.append(("schedule", rc))
                                continue
                            cid = id_p[0]
                            self.children[cid] = depth
                            self.rec.scheduled.append((cid, deadline))
                            self.pool.append(cid)
                            if self.rng.random() < self.mix.cancel_ratio / 2:
                                self.rec.cancels.append((cid, lib_.bt_cancel(tt, cid)))
                                self.rec.repeats.append((cid, lib_.bt_cancel(tt, cid)))
                if lag:
                    time.sleep(lag)
        except BaseException as e:  # pragma: no cover - reported by the test
            self.rec.errors.append(("consumer", repr(e)))


def worker(core: RealCore, mix: Mix, index: int, barrier: threading.Barrier, pool: list, rec: Record) -> None:
    rng = random.Random(mix.seed * 31 + index)
    tt, port = core.tt, core.port
    id_p = ffi.new("uint64_t *")
    backlog: list = []  # ids to cancel a few ops later
    now_ns, schedule, cancel = lib.bt_now_ns, lib.bt_schedule_port, lib.bt_cancel
    delay, jitter = mix.delay_ns, mix.jitter_ns
    try:
        barrier.wait()
        for _ in range(mix.ops):
            deadline = now_ns() + delay + (rng.randrange(jitter + 1) if jitter else 0)
            rc = schedule(tt, deadline, port, ffi.NULL, id_p)
            if rc:
                rec.errors.append(("schedule", rc))
                continue
            tid = id_p[0]
            rec.scheduled.append((tid, deadline))
            pool.append(tid)
            if rng.random() < mix.cancel_ratio:
                r = rng.random()
                if r < mix.cross_ratio and pool:
                    # Somebody's timer (perhaps ours, perhaps a child, perhaps
                    # long gone: then the answer is TOO_LATE or UNKNOWN).
                    other = pool[rng.randrange(len(pool))]
                    rec.cancels.append((other, cancel(tt, other)))
                elif r < mix.cross_ratio + (1 - mix.cross_ratio) * mix.later_ratio:
                    backlog.append(tid)
                else:
                    rec.cancels.append((tid, cancel(tt, tid)))
                    if rng.random() < mix.twice_ratio:
                        rec.repeats.append((tid, cancel(tt, tid)))
            if backlog and (len(backlog) > 8 or rng.random() < 0.3):
                old = backlog.pop(0)
                rec.cancels.append((old, cancel(tt, old)))
                if rng.random() < mix.twice_ratio:
                    rec.repeats.append((old, cancel(tt, old)))
        for old in backlog:
            rec.cancels.append((old, cancel(tt, old)))
    except BaseException as e:  # pragma: no cover - reported by the test
        rec.errors.append(("worker", repr(e)))


def run_mix(mix: Mix) -> dict:
    core = RealCore()
    pool: list = []
    consumer = Consumer(core, mix, pool)
    consumer.start()
    barrier = threading.Barrier(mix.threads)
    recs = [Record() for _ in range(mix.threads)]
    threads = [
        threading.Thread(target=worker, args=(core, mix, i, barrier, pool, recs[i]), daemon=True)
        for i in range(mix.threads)
    ]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
            assert not t.is_alive(), "a worker hung"
        recs.append(consumer.rec)

        def accounted() -> bool:
            # Everything scheduled (children included) ran or lost to a cancel,
            # and the core reaped every cancelled slot.  Read between two of
            # the consumer's batches: with nothing pending none can follow.
            with consumer.busy:
                n_sched = sum(len(r.scheduled) for r in recs)
                n_wins = sum(1 for r in recs for _, res in r.cancels + r.repeats
                             if res == CANCELLED)
                return len(consumer.ran) + n_wins == n_sched and balanced(core.stats())

        ok = wait_until(accounted, timeout=20, interval=0.002)
        consumer.stop.set()
        consumer.join(10)
        assert not consumer.is_alive(), "the consumer hung"
        # Nothing may come after quiescence.
        assert lib.bt_port_drain_ids(core.port, ffi.new("uint64_t[]", 16), 16) == 0
        s_running = core.stats()
        lib.bt_stop(core.tt)
        s = core.stats()
        assert s == s_running, "counters moved after quiescence"
        assert ok, f"the core did not quiesce: {s}"

        for r in recs:
            assert not r.errors, r.errors
        scheduled = [x for r in recs for x in r.scheduled]
        deadline_of = dict(scheduled)
        assert len(deadline_of) == len(scheduled), "an id was handed out twice"
        assert all(tid != 0 for tid in deadline_of)

        runs = Counter(tid for tid, _ in consumer.ran)
        assert set(runs) <= set(deadline_of), "a drained id was never scheduled"
        twice = [tid for tid, n in runs.items() if n > 1]
        assert not twice, f"ran more than once: {twice[:5]}"
        for tid, at in consumer.ran:
            assert at >= deadline_of[tid], f"{tid:#x} ran {deadline_of[tid] - at} ns early"

        wins = Counter()
        for r in recs:
            for tid, res in r.cancels + r.repeats:
                assert res in (CANCELLED, TOO_LATE, UNKNOWN), res
                if res == CANCELLED:
                    wins[tid] += 1
            for tid, res in r.repeats:
                assert res != CANCELLED, f"a repeated cancel of {tid:#x} said CANCELLED"
        assert set(wins) <= set(deadline_of)
        for tid in deadline_of:
            assert wins[tid] <= 1, f"{tid:#x}: {wins[tid]} cancels won"
            assert runs[tid] + wins[tid] == 1, (
                f"{tid:#x}: ran {runs[tid]} times and {wins[tid]} cancels won"
            )
        check_counters(
            s,
            scheduled=len(scheduled),
            wins=sum(wins.values()),
            runs=sum(runs.values()),
            ports=2,  # ours and the core's orphan port
        )
        if currently_in_test_context():
            note(f"scheduled={len(scheduled)} ran={sum(runs.values())} cancelled={sum(wins.values())} "
                 f"children={len(consumer.children)} stats={ {k: v for k, v in s.items() if k != 'lateness_hist'} }")
        return s
    finally:
        consumer.stop.set()
        consumer.join(10)
        if not consumer.is_alive() and not any(t.is_alive() for t in threads):
            core.destroy()
        # else: leak it rather than free memory a live thread uses


@examples(default=100, slow=2000)
@given(mix=mixes)
@pytest.mark.native
def test_cffi_race_mix(mix):
    run_mix(mix)


@pytest.mark.parametrize("threads", [2, 8])
@pytest.mark.native
def test_cffi_race_clustered_everyone_cancels_twice(threads):
    """The RPC case at its worst: every timer is "now + 50 us", all threads
    cancel at once and again, while the deadline passes under them."""
    run_mix(Mix(threads=threads, ops=600, cancel_ratio=1.0, twice_ratio=1.0, later_ratio=0.5,
                cross_ratio=0.2, delay_ns=50_000, jitter_ns=0, spawn_mod=0, consumer_lag_us=0,
                seed=threads))


@pytest.mark.native
def test_cffi_race_cancels_land_while_posted():
    """A slow consumer: timers sit POSTED in the port while the workers cancel
    them; those cancels must win and the consumer must not report them."""
    # Some cancels must land after the post (fired counts those, ran does not).
    # With a 3 ms lag and immediate deadlines a run almost always shows it; on
    # a machine busy enough to reorder everything, another seed will.
    runs = []
    for seed in range(7, 17):
        s = run_mix(Mix(threads=4, ops=400, cancel_ratio=0.8, twice_ratio=0.5, later_ratio=1.0,
                        cross_ratio=0.0, delay_ns=0, jitter_ns=0, spawn_mod=0,
                        consumer_lag_us=3_000, seed=seed))
        runs.append(s)
        if s["fired"] > s["ran"]:
            break
    assert runs[-1]["fired"] > runs[-1]["ran"], runs


@pytest.mark.native
def test_cffi_race_schedule_from_callback_chains():
    """Most drained ids spawn a child (up to depth 3) while workers keep
    scheduling and cancelling ids of everybody, children included."""
    run_mix(Mix(threads=4, ops=300, cancel_ratio=0.5, twice_ratio=0.5, later_ratio=0.3,
                cross_ratio=0.7, delay_ns=1_000, jitter_ns=5, spawn_mod=2, consumer_lag_us=0,
                seed=11))


# -- part 2: the public API (_core), callbacks on the dispatcher thread --------------


@dataclass
class PyMix:
    threads: int
    ops: int
    cancel_ratio: float
    twice_ratio: float
    cross_ratio: float
    delay: float
    jitter: float
    spawn_every: int  # 0: never; else every spawn_every-th callback schedules a child
    seed: int


py_mixes = st.builds(
    PyMix,
    threads=st.integers(2, 8),
    ops=st.integers(20, 1000 if SLOW else 300),
    cancel_ratio=st.floats(0, 1),
    twice_ratio=st.floats(0, 1),
    cross_ratio=st.floats(0, 1),
    delay=st.sampled_from([0.0, 0.0001, 0.001, 0.005]),
    jitter=st.sampled_from([0.0, 1e-6, 5e-6]),
    spawn_every=st.sampled_from([0, 2, 7]),
    seed=st.integers(0, 2**32 - 1),
)


def run_py_mix(mix: PyMix) -> None:
    tt = bucketimer.TimerThread()
    lock = threading.Lock()
    handles: dict = {}      # key -> handle
    ran: list = []          # (key, time.monotonic() at the start of the callback)
    wins: Counter = Counter()
    repeat_wins: list = []
    pool: list = []         # keys anybody may cancel
    errors: list = []
    next_key = iter(range(1, 1 << 62)).__next__  # atomic under the GIL
    rng_cb = random.Random(mix.seed ^ 0xBEEF)
    n_cb = [0]

    def cb(key, depth):
        ran.append((key, time.monotonic()))
        n_cb[0] += 1
        if mix.spawn_every and depth < MAX_DEPTH and n_cb[0] % mix.spawn_every == 0:
            k = next_key()
            with lock:
                handles[k] = tt.call_later(mix.delay + rng_cb.random() * mix.jitter, cb, k, depth + 1)
            pool.append(k)

    def work(index: int, barrier: threading.Barrier) -> None:
        rng = random.Random(mix.seed * 31 + index)
        try:
            barrier.wait()
            for _ in range(mix.ops):
                k = next_key()
                # Publish the handle before the callback can look for it.
                with lock:
                    h = handles[k] = tt.call_later(mix.delay + rng.random() * mix.jitter, cb, k, 0)
                pool.append(k)
                if rng.random() < mix.cancel_ratio:
                    if rng.random() < mix.cross_ratio:
                        k = pool[rng.randrange(len(pool))]
                        with lock:
                            h = handles[k]
                    if h.cancel():
                        with lock:
                            wins[k] += 1
                    if rng.random() < mix.twice_ratio and h.cancel():
                        repeat_wins.append(k)
        except BaseException as e:  # pragma: no cover
            errors.append(repr(e))

    barrier = threading.Barrier(mix.threads)
    threads = [threading.Thread(target=work, args=(i, barrier), daemon=True) for i in range(mix.threads)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
            assert not t.is_alive()
        assert not errors, errors

        def accounted() -> bool:
            with lock:
                n = len(handles)
            return len(ran) + sum(wins.values()) == n and balanced(tt.stats())

        ok = wait_until(accounted, timeout=20, interval=0.002)
        s = tt.stats()
        assert ok, f"not quiescent: handles={len(handles)} ran={len(ran)} wins={sum(wins.values())} {s}"
        assert not repeat_wins, f"a repeated cancel returned True: {repeat_wins[:5]}"
        runs = Counter(k for k, _ in ran)
        assert not [k for k, n in runs.items() if n > 1], "a callback ran twice"
        for k, at in ran:
            assert at >= handles[k].when(), f"{k} ran {handles[k].when() - at} s early"
        for k, h in handles.items():
            assert runs[k] + wins[k] == 1, f"{k}: ran {runs[k]}, cancels won {wins[k]}"
            assert h.cancelled() == bool(wins[k])
            assert h.cancel() is False  # finished either way
        check_counters(s, scheduled=len(handles), wins=sum(wins.values()), runs=len(ran), ports=2)
    finally:
        tt.close()


@examples(default=40, slow=500)
@given(mix=py_mixes)
def test_core_api_race_mix(mix):
    run_py_mix(mix)


def test_core_api_race_clustered():
    """Eight threads, every timer at "now + 1 ms", most cancelled twice, some by
    another thread, a third of the callbacks scheduling more."""
    run_py_mix(PyMix(threads=8, ops=400, cancel_ratio=0.7, twice_ratio=1.0, cross_ratio=0.3,
                     delay=0.001, jitter=0.0, spawn_every=3, seed=3))


# Part 3: threads racing to a fresh loop's first timer.  Each opens a port
# for it; one records its own, the others find theirs lost and release it
# (ext/timer_thread_type.c, open_port).  On 3.11 that path once restored
# "no exception" through a shim that dereferenced NULL: a segfault in
# call_later(loop=...), so the race runs in a child process.
FIRST_TIMER_RACE = """
import asyncio, sys, threading, time
import bucketimer
sys.setswitchinterval(1e-6)  # a thread switch inside open_port, often
tt = bucketimer.TimerThread()
deadline = time.monotonic() + 4.0
loops = 0
while loops < 1500 and time.monotonic() < deadline:
    loop = asyncio.new_event_loop()
    barrier = threading.Barrier(4)
    def first_timer():
        barrier.wait()
        tt.call_later(10, print, loop=loop).cancel()
    threads = [threading.Thread(target=first_timer) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    loop.close()
    loops += 1
stats = tt.stats()
tt.close()
assert stats["scheduled"] == stats["cancelled"] == 4 * loops, stats
print(loops)
"""


def test_threads_racing_to_a_fresh_loops_first_timer():
    loops = int(check_ok(run_python(FIRST_TIMER_RACE, timeout=120)).strip())
    assert loops > 0
