#!/usr/bin/env python
"""Soak: run bucketimer hard for minutes, then check that nothing drifted.

    python tests/soak.py [--minutes M | --seconds S] [--seed N]

The duration defaults to 150 s, or to ``BUCKETIMER_SOAK_SECONDS``.  ``nox -s
soak`` runs it (``nox -s soak -- --minutes 30`` for a long one).  This file is
not collected by pytest (it is not ``test_*.py``); it exits 0 when every check
passed and 1 otherwise.

For the whole duration, at once:

* scheduler threads schedule bursts of timers on several TimerThreads (and the
  default one) -- due now, soon or already past, some delivered to a loop
  running in another thread -- and cancel a share of them at once or later;
  a few callbacks schedule a child (chains);
* loop threads open an event loop, schedule timers into it, then schedule a
  batch of a few hundred to a few thousand timers due right after the loop
  stops running, and close the loop as they fall due (docs/guarantees.rst,
  "Never deliver to a closed loop").  Loops use the replaced TimerThreads
  only: a TimerThread keeps each detached port's struct (about 500 bytes)
  until it is destroyed (docs/design.rst rule 11), growth by design that the
  default one, alive for the whole run, would show as a leak;
* a fork thread forks every few seconds; the child checks that the parent's
  TimerThreads refuse work and close at once, that a fresh TimerThread, the
  default one and an event loop work, and exits (under an alarm: a hang is a
  failure, not a stuck soak);
* a stats thread calls ``stats()`` all the time (it holds the core's ports
  mutex with the GIL released, the fork hazard of docs/guarantees.rst "Fork");
* a cffi thread schedules, cancels and drains port timers of a core through
  ``bucketimer._cffi``;
* a keeper thread retires the oldest TimerThread every 20 s: it stops feeding
  it, waits until it is at rest, checks it and closes it, and starts a new one.

Checks (a TimerThread "at rest": every timer due long ago and every callback
returned):

* counters balance: ``scheduled == ran + cancelled + dropped`` (core), and the
  Python side agrees, counter by counter: the core's scheduled, cancelled,
  ran and dropped equal what the soak counted (schedules that returned a
  handle, cancels that returned True, callbacks that ran), with a closed
  loop's timers counted by the core as cancelled where its close found them
  pending and as dropped where they waited in its port.  The soak counts
  each timer against where it goes -- the dispatcher, or one loop -- so its
  ``dropped`` is its own: the timers of closed loops that neither ran nor
  were cancelled, loop by loop; every dispatcher timer must have run or been
  cancelled, and every callback must have run where its timer was meant to
  go;
* every slot is free: ``slots_free + slots_retired == slots``, heap and bucket
  lists empty, ``dead == 0``; no early fire;
* forks: every child exited 0;
* RSS is flat: the median of the last five samples is within max(16 MiB, 10%)
  of the median of the samples taken in the 10 s after the warm-up (the first
  20% of the run, at least 10 s and at most 60 s);
* fds are flat: after the warm-up they never exceed the early post-warm-up
  peak by more than 8, and after shutdown the count is what it was at start.
  These two need 8 samples (one every 2 s) after the warm-up: a run shorter
  than about 25 s reports them "not checked (run too short)", and does not
  count them as passed; CI's ``--seconds 40`` makes about 15;
* no worker raised, no callback error was reported.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import os
import random
import signal
import statistics
import sys
import threading
import time
import traceback
import warnings

from _helpers import cffi_core, cffi_port, destroy_cffi_core, rss_bytes

import bucketimer
from bucketimer._cffi import ffi, lib

MAX_DELAY = 0.05  # s: every timer the soak schedules is due within this
RETIRE_EVERY = 20.0  # s: a TimerThread's life
POOL = 3  # TimerThreads alive at once, besides the default one
SETTLE_TIMEOUT = 20.0  # s: for a TimerThread to come to rest
SAMPLE_EVERY = 2.0  # s: RSS and fd samples
MIN_SAMPLES = 8  # after the warm-up, for the RSS and fd checks
MiB = 1024 * 1024


def _mallinfo_in_use() -> int:
    """Bytes malloc has handed out and not got back (glibc mallinfo2), or -1."""
    try:
        import ctypes

        class MallInfo2(ctypes.Structure):
            _fields_ = [(n, ctypes.c_size_t) for n in (
                "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                "uordblks", "fordblks", "keepcost")]

        libc = ctypes.CDLL(None)
        libc.mallinfo2.restype = MallInfo2
        m = libc.mallinfo2()
        return m.uordblks + m.hblkhd
    except (AttributeError, OSError):
        return -1


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def fd_targets() -> dict[int, str]:
    out = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            out[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:  # the listing's own fd, closed by now
            pass
    return out


#: Where a timer goes: the dispatcher thread (None) or a loop (its serial,
#: which the soak sets as the loop's ``soak_dest``).
Dest = int | None


def dest_of(loop: asyncio.AbstractEventLoop | None) -> Dest:
    return None if loop is None else loop.soak_dest  # type: ignore[attr-defined]


class Gen:
    """One TimerThread in the soak, and what the soak counted for it, per
    destination (:data:`Dest`)."""

    def __init__(self, name: str, tt: bucketimer.TimerThread) -> None:
        self.name = name
        self.tt = tt
        self.lock = threading.Lock()
        self.dests: dict[Dest, list[int]] = {}  # [scheduled, ran, cancelled]
        self.misplaced = 0  # callbacks that ran elsewhere than their timer's destination
        self.active = 0  # schedulers inside a burst
        self.retiring = False

    def enter(self) -> bool:
        """A burst of schedules may start (not retiring); pair with leave()."""
        with self.lock:
            if self.retiring:
                return False
            self.active += 1
            return True

    def leave(self) -> None:
        with self.lock:
            self.active -= 1

    def count(self, dest: Dest, scheduled: int = 0, cancelled: int = 0, ran: int = 0) -> None:
        with self.lock:
            c = self.dests.get(dest)
            if c is None:
                c = self.dests[dest] = [0, 0, 0]
            c[0] += scheduled
            c[1] += ran
            c[2] += cancelled

    def tally(self) -> dict:
        """What the soak counted.  ``dropped`` is counted on its own, loop by
        loop: the timers of each loop that neither ran nor were cancelled
        (once the TimerThread is at rest, its loops are closed).
        ``unfinished`` counts dispatcher timers that neither ran nor were
        cancelled, ``overdone`` destinations whose timers ran or were
        cancelled more often than they were scheduled: both must be 0."""
        t = {"scheduled": 0, "ran": 0, "cancelled": 0, "dropped": 0, "unfinished": 0,
             "overdone": 0}
        with self.lock:
            t["misplaced"] = self.misplaced
            for dest, (scheduled, ran, cancelled) in self.dests.items():
                t["scheduled"] += scheduled
                t["ran"] += ran
                t["cancelled"] += cancelled
                left = scheduled - ran - cancelled
                if left < 0:
                    t["overdone"] += 1
                elif dest is None:
                    t["unfinished"] += left
                else:
                    t["dropped"] += left
        return t


def _ran(gen: Gen, depth: int, dest: Dest) -> None:
    # A callback runs in its loop's thread (as that loop's callback), or on
    # the dispatcher thread, where no loop runs.
    where = dest_of(asyncio._get_running_loop())
    gen.count(dest, ran=1)
    if where != dest:
        with gen.lock:
            gen.misplaced += 1
    if depth and gen.enter():
        try:
            # From a loop's callback, a timer goes to that loop.
            gen.tt.call_later(random.uniform(0, MAX_DELAY / 2), _ran, gen, depth - 1, where)
            gen.count(where, scheduled=1)
        finally:
            gen.leave()


class Soak:
    def __init__(self, seconds: float, seed: int) -> None:
        self.seconds = seconds
        self.seed = seed
        self.warmup = min(max(10.0, 0.2 * seconds), 60.0)
        self.stop = threading.Event()
        self.errors: list[str] = []
        self.lock = threading.Lock()
        self.pool: list[Gen] = []
        self.generations = 0
        self.retired: list[tuple[str, dict]] = []
        self.loops: list[asyncio.AbstractEventLoop] = []  # running, for loop= schedules
        self.loop_serial = 0
        self.loops_closed = 0
        self.loop_batches = 0
        self.forks = 0
        self.forks_ok = 0
        self.samples: list[tuple[float, int, int]] = []
        self.cffi = {"scheduled": 0, "cancelled": 0, "ran": 0}
        self.start = 0.0

    # -- bookkeeping ------------------------------------------------------------

    def error(self, what: str) -> None:
        with self.lock:
            self.errors.append(what)
        print(f"ERROR: {what}", file=sys.stderr, flush=True)

    def new_gen(self) -> Gen:
        self.generations += 1
        return Gen(f"tt{self.generations}", bucketimer.TimerThread())

    def pick(self, rng: random.Random, for_loops: bool = False) -> Gen:
        """A TimerThread to use; for loops, a replaced one (see the module
        docstring)."""
        with self.lock:
            choices = self.pool if for_loops else self.pool + [self.default]
            return rng.choice(choices)

    def totals(self) -> dict:
        with self.lock:
            gens = self.pool + [self.default]
            retired = list(self.retired)
        t = {"scheduled": 0, "ran": 0, "cancelled": 0, "dropped": 0}
        for g in gens:
            s = g.tt.stats()
            for k in t:
                t[k] += s[k]
        for _, s in retired:
            for k in t:
                t[k] += s[k]
        return t

    def worker(self, fn, *args) -> threading.Thread:
        def run() -> None:
            try:
                fn(*args)
            except BaseException:
                self.error(f"{fn.__name__} raised:\n{traceback.format_exc()}")

        t = threading.Thread(target=run, name=fn.__name__, daemon=True)
        t.start()
        return t

    # -- workers ----------------------------------------------------------------

    def scheduler(self, idx: int) -> None:
        rng = random.Random(self.seed * 1000 + idx)
        later: list[tuple[object, Gen, Dest]] = []
        while not self.stop.is_set():
            loop = None
            if rng.random() < 0.2:
                with self.lock:
                    loop = rng.choice(self.loops) if self.loops else None
            gen = self.pick(rng, for_loops=loop is not None)
            if gen.enter():
                try:
                    self.burst(gen, rng, loop, later)
                finally:
                    gen.leave()
            half = len(later) // 2
            for h, g, dest in later[:half]:
                if h.cancel():
                    g.count(dest, cancelled=1)
            del later[:half]
            time.sleep(rng.uniform(0.002, 0.01))
        for h, g, dest in later:
            if h.cancel():
                g.count(dest, cancelled=1)

    def burst(self, gen: Gen, rng: random.Random, loop, later: list) -> None:
        dest = dest_of(loop)
        for _ in range(rng.randint(50, 300)):
            r = rng.random()
            delay = 0.0 if r < 0.2 else -0.001 if r < 0.25 else rng.uniform(0, MAX_DELAY)
            depth = 2 if rng.random() < 0.03 else 0
            try:
                if loop is None:
                    h = gen.tt.call_later(delay, _ran, gen, depth, dest)
                else:
                    h = gen.tt.call_later(delay, _ran, gen, depth, dest, loop=loop)
            except RuntimeError:
                if loop is not None and loop.is_closed():
                    return  # it closed under us: allowed
                raise
            gen.count(dest, scheduled=1)
            c = rng.random()
            if c < 0.15:
                if h.cancel():
                    gen.count(dest, cancelled=1)
            elif c < 0.35:
                later.append((h, gen, dest))

    def loop_worker(self, idx: int) -> None:
        rng = random.Random(self.seed * 1000 + 100 + idx)
        while not self.stop.is_set():
            loop = asyncio.new_event_loop()
            with self.lock:
                self.loop_serial += 1
                loop.soak_dest = self.loop_serial  # type: ignore[attr-defined]
            loop.set_exception_handler(
                lambda lp, ctx: self.error(f"loop callback error: {ctx.get('message')}")
            )
            state: dict = {}
            loop.run_until_complete(self.loop_body(loop, rng, state))
            with self.lock:
                self.loops.remove(loop)
            # The batch falls due now: close as the timer thread posts it.
            close_at = state.get("due", 0.0) + rng.uniform(-0.001, 0.003)
            while time.monotonic() < close_at:
                pass
            loop.close()
            with self.lock:
                self.loops_closed += 1
                self.loop_batches += "due" in state

    async def loop_body(self, loop, rng: random.Random, state: dict) -> None:
        with self.lock:
            self.loops.append(loop)
        gen = self.pick(rng, for_loops=True)
        if not gen.enter():
            await asyncio.sleep(0.005)
            return
        dest = dest_of(loop)
        try:
            # Scheduled in the loop's thread: they go to the loop.
            for _ in range(rng.randint(5, 40)):
                gen.tt.call_later(rng.uniform(0, MAX_DELAY / 5), _ran, gen, 0, dest)
                gen.count(dest, scheduled=1)
                if rng.random() < 0.3:
                    await asyncio.sleep(rng.uniform(0, 0.003))
            due = time.monotonic() + 0.008
            n = rng.randint(200, 3000)
            for _ in range(n):
                gen.tt.call_at(due, _ran, gen, 0, dest)
            gen.count(dest, scheduled=n)
            state["due"] = due
        finally:
            gen.leave()
        await asyncio.sleep(rng.uniform(0, 0.006))

    def forker(self) -> None:
        rng = random.Random(self.seed * 1000 + 200)
        while not self.stop.wait(rng.uniform(2.0, 4.0)):
            with self.lock:
                inherited = [g.tt for g in self.pool + [self.default]]
            pid = os.fork()
            if pid == 0:
                code = 99
                try:
                    code = _child(inherited)
                finally:
                    os._exit(code)
            end = time.monotonic() + 30
            status = None
            while status is None:
                wpid, st = os.waitpid(pid, os.WNOHANG)
                if wpid:
                    status = os.waitstatus_to_exitcode(st)
                elif time.monotonic() > end:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    status = "hung 30 s"
                else:
                    time.sleep(0.01)
            with self.lock:
                self.forks += 1
                self.forks_ok += status == 0
            if status != 0:
                self.error(f"fork child: exit {status} ({_CHILD_CODES.get(status, '?')})")

    def stats_hammer(self) -> None:
        rng = random.Random(self.seed * 1000 + 300)
        while not self.stop.is_set():
            self.pick(rng).tt.stats()
            time.sleep(0.0005)

    def cffi_worker(self) -> None:
        core = cffi_core()
        port = cffi_port(core)
        rng = random.Random(self.seed * 1000 + 400)
        idp = ffi.new("uint64_t *")
        buf = ffi.new("uint64_t[]", 1024)
        pending: list[int] = []
        c = self.cffi
        while not self.stop.is_set():
            for _ in range(200):
                now = lib.bt_now_ns()
                assert lib.bt_schedule_port(core, now + rng.randrange(0, 2_000_000), port,
                                            ffi.NULL, idp) == 0
                c["scheduled"] += 1
                if rng.random() < 0.4:
                    pending.append(idp[0])
            rng.shuffle(pending)
            for i in pending[:100]:
                c["cancelled"] += lib.bt_cancel(core, i) == lib.BT_CANCELLED
            del pending[:100]
            c["ran"] += lib.bt_port_drain_ids(port, buf, 1024)
            time.sleep(0.002)
        for i in pending:
            c["cancelled"] += lib.bt_cancel(core, i) == lib.BT_CANCELLED
        s = ffi.new("bt_stats *")
        end = time.monotonic() + SETTLE_TIMEOUT
        while True:
            c["ran"] += lib.bt_port_drain_ids(port, buf, 1024)
            lib.bt_get_stats(core, s)
            if (s.scheduled == s.ran + s.cancelled and s.slots_free + s.slots_retired == s.slots
                    and s.heap_size == 0 and s.list_size == 0):
                break
            if time.monotonic() > end:
                break
            time.sleep(0.01)
        got = {k: getattr(s, k) for k in ("scheduled", "ran", "cancelled", "dropped", "slots",
                                           "slots_free", "slots_retired", "heap_size",
                                           "list_size", "early_fires")}
        # Its port never closes: nothing may be dropped.
        self.check_rest("cffi core", got, dict(c, dropped=0))
        destroy_cffi_core(core)

    def keeper(self) -> None:
        while not self.stop.wait(RETIRE_EVERY / POOL):
            with self.lock:
                old = self.pool.pop(0)
                self.pool.append(self.new_gen())
            self.retire(old)

    # -- rest and checks -----------------------------------------------------------

    def settle(self, gen: Gen) -> dict:
        """Stops feeding gen and waits until it is at rest; returns its stats."""
        with gen.lock:
            gen.retiring = True
        end = time.monotonic() + SETTLE_TIMEOUT
        while True:
            with gen.lock:
                active = gen.active
            mine = gen.tally()
            s = gen.tt.stats()
            if (not active and _at_rest(s) and s["ran"] == mine["ran"]
                    and s["scheduled"] == mine["scheduled"]):
                break
            if time.monotonic() > end:
                break
            time.sleep(0.01)
        self.check_rest(gen.name, s, mine)
        return s

    def check_rest(self, name: str, s: dict, mine: dict) -> None:
        problems = []
        if s["scheduled"] != s["ran"] + s["cancelled"] + s["dropped"]:
            problems.append("scheduled != ran + cancelled + dropped")
        for k in ("scheduled", "ran"):
            if s[k] != mine[k]:
                problems.append(f"core {k} {s[k]} != counted {mine[k]}")
        # A closed loop's timers the soak counts as dropped: the core counts
        # those still pending at the close as cancelled (its loop's close
        # cancelled them) and those already in the port as dropped
        # (docs/design.rst, rule 10).  So the core's cancels are the soak's
        # and some of its drops, and together they match.
        if s["cancelled"] + s["dropped"] != mine["cancelled"] + mine["dropped"]:
            problems.append(f"core cancelled+dropped {s['cancelled'] + s['dropped']} != counted "
                            f"{mine['cancelled'] + mine['dropped']}")
        if s["cancelled"] < mine["cancelled"] or s["dropped"] > mine["dropped"]:
            problems.append(f"core cancelled {s['cancelled']} < counted {mine['cancelled']} or "
                            f"core dropped {s['dropped']} > counted {mine['dropped']}")
        if mine.get("unfinished"):
            problems.append(f"{mine['unfinished']} dispatcher timers neither ran nor were cancelled")
        if mine.get("overdone"):
            problems.append(f"{mine['overdone']} destinations ran or cancelled more timers "
                            "than they were given")
        if mine.get("misplaced"):
            problems.append(f"{mine['misplaced']} callbacks ran elsewhere than their destination")
        if s["slots_free"] + s["slots_retired"] != s["slots"]:
            problems.append("slots not all free")
        if s["heap_size"] or s["list_size"]:
            problems.append("heap or lists not empty")
        if s.get("dead", 0):
            problems.append("dead entries left")
        if s["early_fires"]:
            problems.append("early fires")
        if problems:
            self.error(f"{name} at rest: {'; '.join(problems)}: {_brief(s)}")

    def retire(self, gen: Gen) -> None:
        s = self.settle(gen)
        gen.tt.close()
        after = gen.tt.stats()
        if after["scheduled"] != after["ran"] + after["cancelled"] + after["dropped"]:
            self.error(f"{gen.name} after close: counters do not balance: {_brief(after)}")
        with self.lock:
            self.retired.append((gen.name, s))

    # -- the run -------------------------------------------------------------------

    def run(self) -> bool:
        logging.getLogger("bucketimer").addHandler(_ErrorCounter(self))
        # 3.12+ warns that fork() with threads may deadlock the child: the
        # soak forks with threads on purpose, and its children stay clear of
        # everything but bucketimer (each under an alarm).
        warnings.filterwarnings("ignore", r"This process .* is multi-threaded",
                                DeprecationWarning)
        # The default TimerThread and its dispatcher exist for the whole run;
        # the fd count at start includes them.
        self.default = Gen("default", bucketimer.default_timer_thread())
        warm = threading.Event()
        self.default.tt.call_later(0, warm.set)
        self.default.count(None, scheduled=1, ran=1)
        warm.wait(5)
        gc.collect()
        fds_start = fd_count()
        self.fd_start_targets = fd_targets()
        self.pool = [self.new_gen() for _ in range(POOL)]
        print(f"bucketimer soak: {self.seconds:.0f} s (warm-up {self.warmup:.0f} s), seed "
              f"{self.seed}, pid {os.getpid()}: 2 scheduler and 2 loop threads, {POOL} "
              f"TimerThreads replaced every {RETIRE_EVERY:.0f} s and the default one, a fork "
              f"every 2-4 s, stats() and a cffi core all the time", flush=True)
        if self.seconds < self.min_seconds_for_samples():
            print(f"(shorter than {self.min_seconds_for_samples():.0f} s: RSS and fds during the "
                  f"run will not be checked)", flush=True)
        self.start = time.monotonic()
        threads = [self.worker(self.scheduler, i) for i in range(2)]
        threads += [self.worker(self.loop_worker, i) for i in range(2)]
        threads += [self.worker(f) for f in (self.forker, self.stats_hammer, self.keeper)]
        cffi_thread = self.worker(self.cffi_worker)
        next_print = 10.0
        while True:
            elapsed = time.monotonic() - self.start
            if elapsed >= self.seconds:
                break
            self.samples.append((elapsed, rss_bytes(), fd_count()))
            if elapsed >= next_print:
                self.progress(elapsed)
                next_print += 10.0
            time.sleep(min(SAMPLE_EVERY, self.seconds - elapsed))
        self.samples.append((time.monotonic() - self.start, rss_bytes(), fd_count()))
        self.progress(time.monotonic() - self.start)
        self.stop.set()
        for t in threads + [cffi_thread]:
            t.join(60)
            if t.is_alive():
                self.error(f"{t.name} did not stop")
        while self.pool:
            self.retire(self.pool.pop())  # (no name left holding it: its core's fds go with it)
        d = self.settle(self.default)
        with self.lock:
            self.retired.append(("default", d))
        # A loop whose close raced its first timer from another thread is
        # found by its TimerThread's audit, about once a second.
        end = time.monotonic() + 5.0
        while True:
            gc.collect()
            fds_end = fd_count()
            if fds_end <= fds_start or time.monotonic() > end:
                break
            time.sleep(0.1)
        return self.report(fds_start, fds_end)

    def progress(self, elapsed: float) -> None:
        t = self.totals()
        _, rss, fds = self.samples[-1]
        print(f"[{elapsed:5.0f} s] timers {t['scheduled']:,} (ran {t['ran']:,}, cancelled "
              f"{t['cancelled']:,}, dropped {t['dropped']:,}) | loops closed "
              f"{self.loops_closed:,} | forks {self.forks_ok}/{self.forks} | TimerThreads "
              f"retired {len(self.retired)} | rss {rss / MiB:.1f} MB (malloc in use "
              f"{_mallinfo_in_use() / MiB:.1f}, Python blocks {sys.getallocatedblocks():,}) "
              f"| fds {fds}", flush=True)

    def min_seconds_for_samples(self) -> float:
        """How long a run must be for MIN_SAMPLES samples after the warm-up."""
        return self.warmup + (MIN_SAMPLES - 1) * SAMPLE_EVERY + 1.0

    def report(self, fds_start: int, fds_end: int) -> bool:
        # (passed, what); passed is None for a check the run could not make
        checks: list[tuple[bool | None, str]] = []
        t = self.totals()
        ok_errors = not self.errors
        checks.append((ok_errors, f"workers, callbacks and rest checks: {len(self.errors)} errors"))
        checks.append((
            ok_errors and t["scheduled"] == t["ran"] + t["cancelled"] + t["dropped"],
            f"counters balance on {len(self.retired)} TimerThreads: {t['scheduled']:,} scheduled "
            f"= {t['ran']:,} ran + {t['cancelled']:,} cancelled + {t['dropped']:,} dropped "
            f"(and the Python side, counting each, agrees); cffi core: "
            f"{self.cffi['scheduled']:,} scheduled",
        ))
        checks.append((self.loops_closed > 0 and self.loop_batches > 0,
                       f"{self.loops_closed:,} loops closed while a batch of their timers fell due"))
        checks.append((self.forks > 0 and self.forks_ok == self.forks,
                       f"forks: {self.forks_ok} of {self.forks} children exited 0"))
        after = [s for s in self.samples if s[0] >= self.warmup]
        if len(after) >= MIN_SAMPLES:
            base_window = [s for s in after if s[0] < self.warmup + 10.0] or after[:3]
            base = statistics.median(s[1] for s in base_window)
            last = statistics.median(s[1] for s in after[-5:])
            limit = max(16 * MiB, 0.10 * base)
            slope = _slope([(s[0], s[1]) for s in after]) * 60 / MiB
            checks.append((last - base <= limit,
                           f"RSS flat: {base / MiB:.1f} MB after warm-up, {last / MiB:.1f} MB at "
                           f"the end ({(last - base) / MiB:+.1f} MB, limit +{limit / MiB:.1f} MB; "
                           f"trend {slope:+.2f} MB/min)"))
            early_peak = max(s[2] for s in base_window)
            peak = max(s[2] for s in after)
            checks.append((peak <= early_peak + 8,
                           f"fds flat during the run: peak {peak} after warm-up (early peak "
                           f"{early_peak}, limit {early_peak + 8})"))
        else:
            why = (f"not checked (run too short): {len(after)} samples after the "
                   f"{self.warmup:.0f} s warm-up, {MIN_SAMPLES} needed (a run of at least "
                   f"{self.min_seconds_for_samples():.0f} s)")
            checks.append((None, f"RSS flat: {why}"))
            checks.append((None, f"fds flat during the run: {why}"))
        extra = sorted(set(fd_targets().items()) - set(self.fd_start_targets.items()))
        checks.append((fds_end == fds_start,
                       f"fds after shutdown: {fds_end} (at start: {fds_start})"
                       + (f"; new: {extra}" if extra else "")))
        print("checks:")
        for ok, what in checks:
            print(f"  {'----' if ok is None else 'ok  ' if ok else 'FAIL'} {what}")
        passed = all(ok is not False for ok, _ in checks)
        skipped = sum(ok is None for ok, _ in checks)
        print(("PASS" if passed else "FAIL")
              + (f" ({skipped} checks not made: run too short)" if skipped else ""), flush=True)
        return passed


def _at_rest(s: dict) -> bool:
    return (s["scheduled"] == s["ran"] + s["cancelled"] + s["dropped"]
            and s["slots_free"] + s["slots_retired"] == s["slots"]
            and s["heap_size"] == 0 and s["list_size"] == 0 and s["dead"] == 0)


def _brief(s: dict) -> str:
    keys = ("scheduled", "ran", "cancelled", "dropped", "slots", "slots_free", "slots_retired",
            "heap_size", "list_size", "dead", "early_fires")
    return ", ".join(f"{k} {s[k]}" for k in keys if k in s)


def _slope(points: list[tuple[float, float]]) -> float:
    n = len(points)
    mx = sum(p[0] for p in points) / n
    my = sum(p[1] for p in points) / n
    den = sum((p[0] - mx) ** 2 for p in points)
    return sum((p[0] - mx) * (p[1] - my) for p in points) / den if den else 0.0


class _ErrorCounter(logging.Handler):
    def __init__(self, soak: Soak) -> None:
        super().__init__(logging.ERROR)
        self.soak = soak

    def emit(self, record: logging.LogRecord) -> None:
        self.soak.error(f"logged: {record.getMessage()}")


_CHILD_CODES = {
    10: "an inherited TimerThread is not closed",
    11: "an inherited TimerThread accepted a timer",
    12: "a fresh TimerThread's timer did not fire",
    13: "the default TimerThread in a loop did not work",
    14: "an exception",
    -signal.SIGALRM: "hung (alarm)",
}


def _child(inherited: list) -> int:
    """In a forked child: nothing of the parent's may block or run here."""
    signal.alarm(20)
    try:
        for tt in inherited:
            if not tt.closed:
                return 10
            try:
                tt.call_later(0, print)
            except RuntimeError:
                pass
            else:
                return 11
            tt.stats()
            tt.close()
        fresh = bucketimer.TimerThread()
        ev = threading.Event()
        fresh.call_later(0.001, ev.set)
        if not ev.wait(5):
            return 12

        async def main() -> int:
            fut = asyncio.get_running_loop().create_future()
            bucketimer.call_later(0.001, fut.set_result, 7)
            return await asyncio.wait_for(fut, 5)

        if asyncio.run(main()) != 7:
            return 13
        fresh.close()
        return 0
    except BaseException:
        return 14


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    g = p.add_mutually_exclusive_group()
    g.add_argument("--minutes", type=float)
    g.add_argument("--seconds", type=float)
    p.add_argument("--seed", type=int, default=1)
    a = p.parse_args(argv)
    seconds = (a.seconds if a.seconds is not None
               else a.minutes * 60 if a.minutes is not None
               else float(os.environ.get("BUCKETIMER_SOAK_SECONDS", "150")))
    return 0 if Soak(seconds, a.seed).run() else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
