"""The ``noloop`` group: timers for code without an event loop --
bucketimer's dispatcher thread against ``threading.Timer`` (a thread per
timer) and ``sched.scheduler`` (a linear-search ``cancel``): what a
schedule+cancel pair costs and how late timers fire (docs/performance.rst,
"What the rows measure")."""

from __future__ import annotations

import random
import sched
import threading
import time
from typing import TYPE_CHECKING

import bucketimer

from ._contenders import BUCKETIMER, SCHED, THREADING_TIMER
from ._lateness import add_lateness
from ._pairs import PAIR_DELAY, PENDING_MAX, PENDING_MIN, noop, sync_pairs
from ._records import count_label, make_record
from ._timing import Stopwatch

if TYPE_CHECKING:
    from ._runner import Runner

monotonic_ns = time.monotonic_ns

# s a lateness round may take beyond its window before it is a failure
FIRE_LIMIT = 10.0


def sched_pairs(sc: sched.scheduler, n: int) -> float:
    """ns per ``sc.cancel(sc.enter(30, 1, cb))``."""
    enter, cancel = sc.enter, sc.cancel
    cb = noop
    delay = PAIR_DELAY
    with Stopwatch() as sw:
        for _ in range(n):
            cancel(enter(delay, 1, cb))
    return sw.ns / n


def thread_timer_pairs(n: int) -> float:
    """threading.Timer: start() creates a thread; cancel() ends it."""
    Timer = threading.Timer
    cb = noop
    made = []
    with Stopwatch() as sw:
        for _ in range(n):
            t = Timer(PAIR_DELAY, cb)
            t.start()
            t.cancel()
            made.append(t)
    for t in made:
        t.join()
    return sw.ns / n


class _Collector:
    """Lateness collection from callbacks on other threads."""

    def __init__(self, n: int) -> None:
        self.lat: list[int] = []
        self.left = n
        self.lock = threading.Lock()
        self.done = threading.Event()
        if n == 0:
            self.done.set()

    def fired(self, when_ns: int) -> None:
        late = monotonic_ns() - when_ns
        with self.lock:
            self.lat.append(late)
            self.left -= 1
            if self.left == 0:
                self.done.set()


def _deadlines(n: int, window: float, rng: random.Random) -> list[int]:
    base = monotonic_ns() + 2_000_000
    span = int(window * 1e9)
    return [base + int(span * rng.random()) for _ in range(n)]


def bt_lateness(tt: bucketimer.TimerThread, n: int, window: float,
                rng: random.Random) -> list[int]:
    """ns late of n timers on ``tt``'s dispatcher thread."""
    c = _Collector(n)
    for when_ns in _deadlines(n, window, rng):
        tt.call_at(when_ns / 1e9, c.fired, when_ns)
    if not c.done.wait(window + FIRE_LIMIT):
        raise RuntimeError("bucketimer dispatcher: timers did not fire")
    return c.lat


def thread_timer_lateness(n: int, window: float, rng: random.Random) -> list[int]:
    c = _Collector(n)
    timers = []
    for when_ns in _deadlines(n, window, rng):
        t = threading.Timer(max(0.0, (when_ns - monotonic_ns()) / 1e9), c.fired, (when_ns,))
        t.start()
        timers.append(t)
    if not c.done.wait(window + FIRE_LIMIT):
        raise RuntimeError("threading.Timer: timers did not fire")
    for t in timers:
        t.join()
    return c.lat


def sched_lateness(n: int, window: float, rng: random.Random) -> list[int]:
    """sched.scheduler.run() on its own thread, events entered up front (sched
    does not notice events added during its sleep)."""
    c = _Collector(n)
    sc = sched.scheduler(time.monotonic, time.sleep)
    for when_ns in _deadlines(n, window, rng):
        sc.enterabs(when_ns / 1e9, 1, c.fired, (when_ns,))
    th = threading.Thread(target=sc.run, name="bench-sched")
    th.start()
    th.join(window + FIRE_LIMIT)
    if not c.done.is_set():
        raise RuntimeError("sched: events did not fire")
    return c.lat


def steps(runner: Runner) -> int:
    return 3 * runner.suite.rounds


def run(runner: Runner) -> None:
    """Rounds interleave the contenders, so that drift hits all alike."""
    s = runner.suite
    want_tt = THREADING_TIMER in runner.want
    want_sched = SCHED in runner.want
    pairs: dict[str, list[float]] = {BUCKETIMER: []}
    if want_tt:
        pairs[THREADING_TIMER] = []
    if want_sched:
        pairs[SCHED] = []
    pend: dict[str, list[float]] = {BUCKETIMER: [], **({SCHED: []} if want_sched else {})}
    late: dict[str, list[list[int]]] = {k: [] for k in pairs}
    n_sched = max(10, s.noloop_pairs // 50)  # sched's cancel is O(n)
    with bucketimer.TimerThread() as tt:
        for _ in range(s.rounds):
            pairs[BUCKETIMER].append(sync_pairs(tt.call_later, s.noloop_pairs))
            if want_sched:
                sc = sched.scheduler(time.monotonic, time.sleep)
                pairs[SCHED].append(sched_pairs(sc, s.noloop_pairs))
            if want_tt:
                pairs[THREADING_TIMER].append(thread_timer_pairs(s.thread_timer_pairs))
            runner.step("no-loop pairs")
        with bucketimer.TimerThread() as tt2:
            rng = random.Random(7)
            span = PENDING_MAX - PENDING_MIN
            keep = [tt2.call_later(PENDING_MIN + span * rng.random(), noop)
                    for _ in range(s.noloop_pending)]
            sc = sched.scheduler(time.monotonic, time.sleep)
            rng = random.Random(7)
            for _ in range(s.noloop_pending if want_sched else 0):
                sc.enter(PENDING_MIN + span * rng.random(), 1, noop)
            for _ in range(s.rounds):
                pend[BUCKETIMER].append(sync_pairs(tt2.call_later, s.noloop_pairs))
                if want_sched:
                    pend[SCHED].append(sched_pairs(sc, n_sched))
                runner.step("no-loop pairs, pending")
            del keep
        for r in range(s.rounds):
            late[BUCKETIMER].append(bt_lateness(tt, s.late_timers, s.late_window,
                                                random.Random(r)))
            if want_sched:
                late[SCHED].append(sched_lateness(s.late_timers, s.late_window,
                                                  random.Random(r)))
            if want_tt:
                late[THREADING_TIMER].append(thread_timer_lateness(
                    s.thread_timer_late, s.late_window, random.Random(r)))
            runner.step("no-loop lateness")
    for name, samples in pairs.items():
        n = s.thread_timer_pairs if name == THREADING_TIMER else s.noloop_pairs
        runner.add(make_record("noloop", "noloop_pairs@0", "pairs, no loop, 0 pending", name,
                               "ns", "lower", samples, per_round=n, pending=0))
    pl = count_label(s.noloop_pending)
    for name, samples in pend.items():
        n = n_sched if name == SCHED else s.noloop_pairs
        runner.add(make_record("noloop", "noloop_pairs@pending",
                               f"pairs, no loop, {pl} pending", name, "ns", "lower", samples,
                               per_round=n, pending=s.noloop_pending))
    for name, rounds in late.items():
        n = s.thread_timer_late if name == THREADING_TIMER else s.late_timers
        add_lateness(runner, "noloop", "noloop_", name, rounds, n)
