"""The standard suite: workloads, contenders, and how each is timed.

Every measurement is repeated in rounds; a record keeps every round's value
and their summary (median, quartiles, p10/p90, min, max).  Timed loops run
with the cyclic GC disabled and use ``time.perf_counter_ns``.

Contenders (the table's columns):

``bucketimer``
    ``bucketimer.TimerThread`` timers on the stock asyncio loop (or, with no
    loop, on its dispatcher thread); for the native rows, the bucketed C core.
``asyncio`` / ``uvloop`` / ``drop-in``
    That event loop's own ``call_later``/``call_at``/``asyncio.timeout()``;
    ``drop-in`` is ``bucketimer.loop`` when that module exists.
``threading.Timer`` / ``sched``
    The standard library's timers for code with no event loop.
``1-lock heap``
    The reference C timer of ``csrc/bench.c``: one mutex, one binary heap.
"""

from __future__ import annotations

import asyncio
import gc
import importlib
import math
import os
import platform
import queue
import random
import sched
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

perf_counter_ns = time.perf_counter_ns
monotonic_ns = time.monotonic_ns

# Column order of the table.
BUCKETIMER = "bucketimer"
ASYNCIO = "asyncio"
UVLOOP = "uvloop"
DROPIN = "drop-in"
THREADING_TIMER = "threading.Timer"
SCHED = "sched"
REF_HEAP = "1-lock heap"
CONTENDERS = (BUCKETIMER, ASYNCIO, UVLOOP, DROPIN, THREADING_TIMER, SCHED, REF_HEAP)

GROUPS = ("pairs", "timeout", "lateness", "noloop", "core")

PAIR_DELAY = 30.0  # s: the timer of a schedule+cancel pair never fires
PENDING_MIN, PENDING_MAX = 10.0, 3600.0  # s: deadlines of the pending timers


@dataclass(frozen=True)
class Suite:
    """Sizes of one suite.  ``SUITES`` holds the standard ones."""

    name: str
    rounds: int
    pairs: int  # schedule+cancel pairs per round, from Python
    batch: int  # pairs between two yields to the loop
    pending: tuple[int, ...]  # pending timers under the pairs rows
    timeouts: int  # timeout() enter+exit per round
    late_timers: int  # timers per lateness round
    late_window: float  # s over which their deadlines are spread
    noloop_pairs: int
    noloop_pending: int
    thread_timer_pairs: int  # threading.Timer starts a thread per timer
    thread_timer_late: int
    core_pairs: int  # pairs per thread per round, in C
    core_threads: tuple[int, ...]
    core_pending: int


SUITES: dict[str, Suite] = {
    # For tests: every code path, tiny sizes (a few seconds).
    "smoke": Suite("smoke", rounds=3, pairs=1000, batch=250, pending=(0, 1000),
                   timeouts=300, late_timers=40, late_window=0.02, noloop_pairs=1000,
                   noloop_pending=1000, thread_timer_pairs=10, thread_timer_late=10,
                   core_pairs=20_000, core_threads=(1, 2), core_pending=10_000),
    # `--quick`: the whole table in well under 30 s.
    "quick": Suite("quick", rounds=5, pairs=20_000, batch=1000, pending=(0, 10_000, 100_000),
                   timeouts=5000, late_timers=300, late_window=0.1, noloop_pairs=10_000,
                   noloop_pending=10_000, thread_timer_pairs=100, thread_timer_late=50,
                   core_pairs=300_000, core_threads=(1, 2, 4), core_pending=100_000),
    # The default: a few minutes.
    "full": Suite("full", rounds=9, pairs=100_000, batch=1000,
                  pending=(0, 10_000, 1_000_000), timeouts=20_000, late_timers=2000,
                  late_window=0.3, noloop_pairs=50_000, noloop_pending=10_000,
                  thread_timer_pairs=300, thread_timer_late=200, core_pairs=2_000_000,
                  core_threads=(1, 2, 4), core_pending=1_000_000),
}


def count_label(n: int) -> str:
    """1000000 -> '1M', 10000 -> '10k'."""
    for div, suffix in ((1_000_000, "M"), (1000, "k")):
        if n >= div and n % div == 0:
            return f"{n // div}{suffix}"
    return str(n)


# ---- statistics ----------------------------------------------------------------


def quantile(sorted_values: Sequence[float], q: float) -> float:
    """Linear-interpolation quantile of already sorted values."""
    n = len(sorted_values)
    if n == 0:
        return math.nan
    pos = (n - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, n - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def summarize(samples: Iterable[float]) -> dict[str, float]:
    v = sorted(float(x) for x in samples)
    if not v:
        nan = math.nan
        return {k: nan for k in ("median", "p10", "p25", "p75", "p90", "min", "max", "mean")}
    return {
        "median": quantile(v, 0.5),
        "p10": quantile(v, 0.1),
        "p25": quantile(v, 0.25),
        "p75": quantile(v, 0.75),
        "p90": quantile(v, 0.9),
        "min": v[0],
        "max": v[-1],
        "mean": sum(v) / len(v),
    }


def log2_hist(values_ns: Iterable[int], hist: list[int] | None = None) -> list[int]:
    """The core's lateness histogram format: bucket i counts [2^(i-1), 2^i) ns,
    bucket 0 counts values <= 0."""
    h = hist if hist is not None else [0] * 48
    for v in values_ns:
        i = 0 if v <= 0 else min(int(v).bit_length(), 47)
        h[i] += 1
    return h


def make_record(group: str, workload: str, label: str, contender: str, unit: str,
                better: str, samples: Sequence[float], *, per_round: int = 0,
                pending: int | None = None, threads: int | None = None,
                note: str = "", **extra: Any) -> dict[str, Any]:
    """One table cell: a workload measured on one contender."""
    rec: dict[str, Any] = {
        "group": group, "workload": workload, "label": label, "contender": contender,
        "unit": unit, "better": better, "rounds": len(samples), "per_round": per_round,
        "pending": pending, "threads": threads,
    }
    rec.update(summarize(samples))
    rec["samples"] = [float(x) for x in samples]
    rec["ratio"] = math.nan  # contender / bucketimer, filled in by add_ratios
    rec["note"] = note
    rec.update(extra)
    return rec


def add_ratios(records: list[dict[str, Any]]) -> None:
    """Sets each record's ratio: its median over bucketimer's on the same row."""
    base = {r["workload"]: r["median"] for r in records if r["contender"] == BUCKETIMER}
    for r in records:
        b = base.get(r["workload"])
        if r["unit"] in ("x", "count") or b is None or not b or math.isnan(b):
            r["ratio"] = math.nan
        else:
            r["ratio"] = r["median"] / b


# ---- machine information ----------------------------------------------------------


def _version(dist: str) -> str | None:
    try:
        from importlib import metadata

        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or ""


def machine_info() -> dict[str, Any]:
    """Platform, CPUs, Python and package versions: stored with every result."""
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count()
    import bucketimer

    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": usable,
        "python": sys.version.split()[0],
        "python_implementation": platform.python_implementation(),
        "bucketimer": getattr(bucketimer, "__version__", None),
        "packages": {d: _version(d) for d in
                     ("bucketimer", "cffi", "uvloop", "tqdm", "matplotlib", "pandas", "numpy")},
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "loadavg": _loadavg(),
    }


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


# ---- optional modules --------------------------------------------------------------


def _try_import(name: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def find_timeout(attr: str = "timeout") -> Callable[..., Any] | None:
    """``bucketimer.aio.timeout`` (or another helper, ``attr``) when that
    module exists."""
    for name in ("bucketimer.aio", "bucketimer.asyncio"):
        mod = _try_import(name)
        fn = getattr(mod, attr, None) if mod is not None else None
        if callable(fn):
            return fn
    return None


def find_dropin_loop() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """A factory of the drop-in loop of ``bucketimer.loop`` when it exists."""
    mod = _try_import("bucketimer.loop")
    if mod is None:
        return None
    for attr in ("new_event_loop", "EventLoop", "Loop", "BucketimerEventLoop"):
        fn = getattr(mod, attr, None)
        if callable(fn):
            return fn
    policy = getattr(mod, "EventLoopPolicy", None)
    if policy is not None:
        return lambda: policy().new_event_loop()
    return None


def find_uvloop() -> Callable[[], asyncio.AbstractEventLoop] | None:
    mod = _try_import("uvloop")
    return getattr(mod, "new_event_loop", None) if mod is not None else None


# ---- the runner ----------------------------------------------------------------------


class Progress:
    """A tqdm.auto bar when tqdm is installed and wanted; else silent."""

    def __init__(self, total: int, enabled: bool, desc: str) -> None:
        self.bar = None
        if enabled:
            try:
                from tqdm.auto import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                self.bar = tqdm(total=total, desc=desc, unit="step", leave=False)

    def step(self, what: str, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(what, refresh=False)
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _noop(*args: Any) -> None:
    pass


class Runner:
    """Runs the workloads of one suite and collects their records."""

    def __init__(self, suite: Suite, groups: Sequence[str] = GROUPS,
                 contenders: Sequence[str] | None = None, progress: bool = True,
                 seed: int = 1234) -> None:
        self.suite = suite
        unknown = set(groups) - set(GROUPS)
        if unknown:
            raise ValueError(f"unknown workload groups: {sorted(unknown)}; known: {GROUPS}")
        self.groups = tuple(g for g in GROUPS if g in groups)
        self.records: list[dict[str, Any]] = []
        self.notes: list[str] = []
        self.rng = random.Random(seed)
        self.want = set(contenders) if contenders is not None else set(CONTENDERS)
        unknown = self.want - set(CONTENDERS)
        if unknown:
            raise ValueError(f"unknown contenders: {sorted(unknown)}; known: {CONTENDERS}")
        if BUCKETIMER not in self.want:
            raise ValueError("the bucketimer contender is the baseline of every ratio")
        self.loops: dict[str, Callable[[], asyncio.AbstractEventLoop]] = {}
        for name, factory in ((BUCKETIMER, asyncio.new_event_loop),
                              (ASYNCIO, asyncio.new_event_loop),
                              (UVLOOP, find_uvloop()), (DROPIN, find_dropin_loop())):
            if name not in self.want:
                continue
            if factory is None:
                what = "uvloop is not installed" if name == UVLOOP else \
                    "bucketimer.loop (the drop-in loop) is not available"
                self.notes.append(f"{what}: no '{name}' column")
                continue
            self.loops[name] = factory
        self.timeout_fn = find_timeout()
        self.wait_for_fn = find_timeout("wait_for")
        self._progress_enabled = progress
        self.progress: Progress | None = None

    # -- bookkeeping

    def _total_steps(self) -> int:
        s, nloops = self.suite, len(self.loops)
        steps = 0
        if "pairs" in self.groups:
            steps += len(s.pending) * nloops * s.rounds
        if "timeout" in self.groups:
            steps += 2 * nloops * s.rounds
        if "lateness" in self.groups:
            steps += nloops * s.rounds
        if "noloop" in self.groups:
            steps += 3 * s.rounds
        if "core" in self.groups:
            steps += s.rounds * (1 + (len(s.core_threads) if s.core_threads else 0))
        return steps

    def _step(self, what: str) -> None:
        if self.progress is not None:
            self.progress.step(what)

    def add(self, rec: dict[str, Any]) -> None:
        self.records.append(rec)

    def run(self) -> list[dict[str, Any]]:
        self.progress = Progress(self._total_steps(), self._progress_enabled,
                                 f"bucketimer.bench ({self.suite.name})")
        gc_was_enabled = gc.isenabled()
        try:
            if "pairs" in self.groups:
                self.run_pairs()
            if "timeout" in self.groups:
                self.run_timeouts()
            if "lateness" in self.groups:
                self.run_lateness()
            if "noloop" in self.groups:
                self.run_noloop()
            if "core" in self.groups:
                self.run_core()
        finally:
            if gc_was_enabled:
                gc.enable()
            self.progress.close()
        add_ratios(self.records)
        return self.records

    # -- event-loop helpers

    def _in_loop(self, name: str, body: Callable[[Any], Any]) -> Any:
        """Runs ``body(timers)`` as a coroutine on a fresh loop of contender
        ``name``; ``timers`` has call_later/call_at bound to what is measured."""
        loop = self.loops[name]()
        tt = None
        try:
            if name == BUCKETIMER:
                import bucketimer

                tt = bucketimer.TimerThread()
                timers = _Timers(tt.call_later, tt.call_at)
            else:
                timers = _Timers(loop.call_later, loop.call_at)
            return loop.run_until_complete(body(timers))
        finally:
            if tt is not None:
                tt.close()
            loop.close()

    # -- 1. schedule+cancel pairs in a running loop

    def run_pairs(self) -> None:
        """Pairs of every contender at every pending level.  Each (contender,
        level) has its own loop -- and, for bucketimer's columns, its own
        TimerThread -- all set up at once (~1.6 GB with a million pending
        per column), and they take turns round by round: both the ratios
        between columns and the flatness from 0 to 1 000 000 pending are
        read off rounds taken at the same moments, whatever the speed of a
        shared machine does meanwhile."""
        s = self.suite
        targets: dict[tuple[str, int], tuple[asyncio.AbstractEventLoop, Callable[..., Any], Any]] = {}
        keeps: dict[tuple[str, int], list[Any]] = {}
        owned_tts: list[Any] = []
        try:
            for name in self.loops:
                for pending in s.pending:
                    loop, call_later, tt = self._pairs_target(name, owned_tts)
                    targets[(name, pending)] = (loop, call_later, tt)
                    keeps[(name, pending)] = loop.run_until_complete(
                        _fill(call_later, pending, tt))
            gc.collect()
            gc.freeze()  # the pending handles: out of the collector's way
            for loop, call_later, _ in targets.values():  # warm-up
                loop.run_until_complete(_pairs_round(call_later, min(s.pairs, 2000), s.batch))
            samples: dict[tuple[str, int], list[float]] = {k: [] for k in targets}
            for key in _taking_turns(list(targets), s.rounds):
                loop, call_later, _ = targets[key]
                samples[key].append(
                    loop.run_until_complete(_pairs_round(call_later, s.pairs, s.batch)))
                self._step(f"pairs {count_label(key[1])} {key[0]}")
        finally:
            gc.unfreeze()
            # Cancel what was pending (untimed): nothing may linger in a
            # shared timer thread after these loops close.
            for key, (loop, _, tt) in targets.items():
                for h in keeps.pop(key, ()):
                    h.cancel()
                if not loop.is_closed():
                    loop.run_until_complete(_settle(tt))
                    loop.close()
            for tt in owned_tts:
                tt.close()
        for pending in s.pending:
            for name in self.loops:
                self.add(make_record("pairs", f"pairs@{pending}",
                                     f"pairs in a loop, {count_label(pending)} pending", name,
                                     "ns", "lower", samples[(name, pending)], per_round=s.pairs,
                                     pending=pending))

    def _pairs_target(self, name: str, owned_tts: list[Any]
                      ) -> tuple[asyncio.AbstractEventLoop, Callable[..., Any], Any]:
        """A fresh loop for contender ``name`` and the call_later measured on
        it; bucketimer's columns get a TimerThread of their own."""
        if name in (BUCKETIMER, DROPIN):
            import bucketimer

            tt = bucketimer.TimerThread()
            owned_tts.append(tt)
            if name == BUCKETIMER:
                return asyncio.new_event_loop(), tt.call_later, tt
            mod = _try_import("bucketimer.loop")
            cls = getattr(mod, "EventLoop", None) if mod is not None else None
            if cls is not None:
                loop = cls(timer_thread=tt)
                return loop, loop.call_later, tt
        loop = self.loops[name]()
        return loop, loop.call_later, getattr(loop, "timer_thread", None)

    # -- 2. timeout()

    def run_timeouts(self) -> None:
        """``async with timeout(30): pass`` and ``await wait_for(coro(), 30)``
        of a coroutine that returns at once: bucketimer's helpers on the
        stock loop, asyncio's on every loop.

        The columns take turns round by round (each on its own loop), so that
        a machine whose speed drifts during the run (a shared VM) moves every
        column of a round alike and the ratios stay meaningful."""
        s = self.suite
        rows = (("timeout", "async with timeout(30): pass", self.timeout_fn, asyncio.timeout,
                 _timeout_round),
                ("wait_for", "await wait_for(coro(), 30)", self.wait_for_fn, asyncio.wait_for,
                 _wait_for_round))
        loops = {name: factory() for name, factory in self.loops.items()}
        try:
            for workload, label, ours, reference, round_fn in rows:
                fns = {}
                for name in loops:
                    if name != BUCKETIMER:
                        fns[name] = reference
                    elif ours is not None:
                        fns[name] = ours
                    else:
                        self.notes.append(f"bucketimer.aio.{workload}() is not available: the "
                                          f"{workload}() row has no bucketimer column (nor ratios)")
                        for _ in range(s.rounds):
                            self._step(f"{workload} (skipped)")
                for name, fn in fns.items():  # warm-up
                    loops[name].run_until_complete(round_fn(fn, min(s.timeouts, 500)))
                samples: dict[str, list[float]] = {name: [] for name in fns}
                for name in _taking_turns(list(fns), s.rounds):
                    gc.collect()
                    samples[name].append(
                        loops[name].run_until_complete(round_fn(fns[name], s.timeouts)))
                    self._step(f"{workload} {name}")
                for name in fns:
                    self.add(make_record("timeout", workload, label, name, "ns", "lower",
                                         samples[name], per_round=s.timeouts))
        finally:
            for loop in loops.values():
                loop.close()

    # -- 3. firing lateness in a loop

    def run_lateness(self) -> None:
        s = self.suite
        for name in self.loops:
            rounds = self._in_loop(name, lambda t, n=name: self._lateness_coro(t, n))
            self._add_lateness("lateness", "", name, rounds, s.late_timers)

    def _add_lateness(self, group: str, prefix: str, name: str,
                      rounds: list[list[int]], per_round: int) -> None:
        where = "no loop" if group == "noloop" else "in a loop"
        hist = [0] * 48
        for lat in rounds:
            log2_hist(lat, hist)
        for q, key in ((0.5, "p50"), (0.99, "p99"), (1.0, "max")):
            if prefix and key == "max":
                continue
            samples = [quantile(sorted(lat), q) for lat in rounds]
            self.add(make_record(group, f"{prefix}lateness_{key}", f"lateness {key}, {where}",
                                 name, "ns", "lower", samples, per_round=per_round,
                                 hist=hist if key == "p50" else None))
        if not prefix:
            early = [sum(1 for x in lat if x < 0) for lat in rounds]
            self.add(make_record(group, f"{prefix}early_fires", "early fires (of all timers)",
                                 name, "count", "lower", early, per_round=per_round,
                                 total=sum(early), timers=sum(len(x) for x in rounds)))

    async def _lateness_coro(self, timers: _Timers, name: str) -> list[list[int]]:
        s = self.suite
        out = []
        for r in range(s.rounds):
            gc.collect()
            out.append(await _lateness_round(timers.call_at, s.late_timers, s.late_window,
                                             random.Random(r)))
            self._step(f"lateness {name}")
        return out

    # -- 4. timers with no loop

    def run_noloop(self) -> None:
        import bucketimer

        s = self.suite
        want_tt = THREADING_TIMER in self.want
        want_sched = SCHED in self.want
        pairs: dict[str, list[float]] = {BUCKETIMER: []}
        if want_tt:
            pairs[THREADING_TIMER] = []
        if want_sched:
            pairs[SCHED] = []
        pend: dict[str, list[float]] = {BUCKETIMER: [], **({SCHED: []} if want_sched else {})}
        late: dict[str, list[list[int]]] = {k: [] for k in pairs}
        with bucketimer.TimerThread() as tt:
            for _ in range(s.rounds):
                # Rounds interleave the contenders, so drift hits all alike.
                pairs[BUCKETIMER].append(_sync_pairs(tt.call_later, s.noloop_pairs))
                if want_sched:
                    sc = sched.scheduler(time.monotonic, time.sleep)
                    pairs[SCHED].append(_sched_pairs(sc, s.noloop_pairs))
                if want_tt:
                    pairs[THREADING_TIMER].append(_thread_timer_pairs(s.thread_timer_pairs))
                self._step("no-loop pairs")
            with bucketimer.TimerThread() as tt2:
                rng = random.Random(7)
                span = PENDING_MAX - PENDING_MIN
                keep = [tt2.call_later(PENDING_MIN + span * rng.random(), _noop)
                        for _ in range(s.noloop_pending)]
                sc = sched.scheduler(time.monotonic, time.sleep)
                rng = random.Random(7)
                for _ in range(s.noloop_pending if want_sched else 0):
                    sc.enter(PENDING_MIN + span * rng.random(), 1, _noop)
                n_sched = max(10, s.noloop_pairs // 50)  # sched's cancel is O(n)
                for _ in range(s.rounds):
                    pend[BUCKETIMER].append(_sync_pairs(tt2.call_later, s.noloop_pairs))
                    if want_sched:
                        pend[SCHED].append(_sched_pairs(sc, n_sched))
                    self._step("no-loop pairs, pending")
                del keep
            for r in range(s.rounds):
                late[BUCKETIMER].append(_bt_noloop_lateness(tt, s.late_timers, s.late_window,
                                                            random.Random(r)))
                if want_sched:
                    late[SCHED].append(_sched_lateness(s.late_timers, s.late_window,
                                                       random.Random(r)))
                if want_tt:
                    late[THREADING_TIMER].append(_thread_timer_lateness(
                        s.thread_timer_late, s.late_window, random.Random(r)))
                self._step("no-loop lateness")
        for name, samples in pairs.items():
            n = s.thread_timer_pairs if name == THREADING_TIMER else s.noloop_pairs
            self.add(make_record("noloop", "noloop_pairs@0", "pairs, no loop, 0 pending", name,
                                 "ns", "lower", samples, per_round=n, pending=0))
        pl = count_label(s.noloop_pending)
        for name, samples in pend.items():
            n = max(10, s.noloop_pairs // 50) if name == SCHED else s.noloop_pairs
            self.add(make_record("noloop", "noloop_pairs@pending",
                                 f"pairs, no loop, {pl} pending", name, "ns", "lower", samples,
                                 per_round=n, pending=s.noloop_pending))
        for name, rounds in late.items():
            n = s.thread_timer_late if name == THREADING_TIMER else s.late_timers
            self._add_lateness("noloop", "noloop_", name, rounds, n)

    # -- 5. the native core on its own, GIL released

    def run_core(self) -> None:
        s = self.suite
        try:
            from bucketimer._cffi import ffi, lib
        except ImportError as e:  # pragma: no cover - the wheel always has it
            self.notes.append(f"bucketimer._cffi is not importable ({e}): no core rows")
            return
        if not hasattr(lib, "bt_ref_bench_pairs_gated"):
            self.notes.append("bucketimer._cffi was built without bucketimer_bench.h: "
                              "no core rows")
            return
        impls = [BUCKETIMER] + ([REF_HEAP] if REF_HEAP in self.want else [])
        delay = int(PAIR_DELAY * 1e9)
        pool = _WorkerPool(max(s.core_threads))
        try:
            cores = {name: _NativeCore(ffi, lib, name) for name in impls}
            try:
                for core in cores.values():  # warm-up: slots allocated, caches hot
                    pool.run(max(s.core_threads), core, delay, min(s.core_pairs, 100_000))
                rates: dict[tuple[str, int], list[float]] = {}
                for r in range(s.rounds):
                    for nt in s.core_threads:
                        order = impls if r % 2 == 0 else impls[::-1]
                        for name in order:
                            core = cores[name]
                            wall = pool.run(nt, core, delay, s.core_pairs)
                            rates.setdefault((name, nt), []).append(nt * s.core_pairs / wall * 1e9)
                        self._step(f"core {nt} threads")
            finally:
                for core in cores.values():
                    core.close()
            for nt in s.core_threads:
                for name in impls:
                    self.add(make_record(
                        "core", f"core@{nt}", f"core pairs/s, {nt} thread{'s' if nt > 1 else ''}",
                        name, "pairs/s", "higher", rates[(name, nt)], per_round=s.core_pairs,
                        threads=nt, pending=0))
            base_nt = s.core_threads[0]
            for nt in s.core_threads[1:]:
                for name in impls:
                    ratio = [a / b for a, b in zip(rates[(name, nt)], rates[(name, base_nt)])]
                    self.add(make_record(
                        "core", f"core_scaling@{nt}",
                        f"core scaling, {nt} threads / {base_nt}", name, "x", "higher", ratio,
                        per_round=s.core_pairs, threads=nt, pending=0))
            # Pending timers in the core: the heap pays O(log n) with cache misses.
            pl = s.core_pending
            rates_p: dict[str, list[float]] = {}
            fresh = {name: _NativeCore(ffi, lib, name) for name in impls}
            try:
                for core in fresh.values():
                    core.fill(pl, PENDING_MIN, PENDING_MAX)
                    pool.run(1, core, delay, min(s.core_pairs, 100_000))
                n = max(1, s.core_pairs // 2)
                for _ in range(s.rounds):
                    for name in impls:
                        core = fresh[name]
                        wall = pool.run(1, core, delay, n)
                        rates_p.setdefault(name, []).append(n / wall * 1e9)
                    self._step("core pending")
            finally:
                for core in fresh.values():
                    core.close()
            for name in impls:
                self.add(make_record(
                    "core", "core_pending", f"core pairs/s, 1 thread, {count_label(pl)} pending",
                    name, "pairs/s", "higher", rates_p[name], per_round=n, threads=1, pending=pl))
        finally:
            pool.close()


class _Timers:
    __slots__ = ("call_at", "call_later")

    def __init__(self, call_later: Callable[..., Any], call_at: Callable[..., Any]) -> None:
        self.call_later = call_later
        self.call_at = call_at


# ---- timed loops ---------------------------------------------------------------------


async def _pairs_round(call_later: Callable[..., Any], n: int, batch: int) -> float:
    """ns per schedule+cancel pair, yielding to the loop every ``batch`` pairs
    (so a loop that cleans up cancelled timers between iterations does)."""
    cb = _noop
    delay = PAIR_DELAY
    sleep = asyncio.sleep
    inner = range(batch)
    loops = max(1, n // batch)
    gc.disable()
    try:
        t0 = perf_counter_ns()
        for _ in range(loops):
            for _ in inner:
                call_later(delay, cb).cancel()
            await sleep(0)
        t1 = perf_counter_ns()
    finally:
        gc.enable()
    return (t1 - t0) / (loops * batch)


def _taking_turns(keys: list[Any], rounds: int) -> Iterator[Any]:
    """Every key once per round, ``rounds`` times, each round starting one
    further along, so that no column always runs first (or last)."""
    for i in range(rounds):
        j = i % len(keys)
        yield from keys[j:] + keys[:j]


async def _fill(call_later: Callable[..., Any], pending: int, tt: Any) -> list[Any]:
    """``pending`` timers due 10 s to 1 h from now (never during a run)."""
    rng = random.Random(pending)
    span = PENDING_MAX - PENDING_MIN
    keep = [call_later(PENDING_MIN + span * rng.random(), _noop) for _ in range(pending)]
    await _settle(tt)  # let a timer thread take them in
    return keep


async def _settle(tt: Any, limit: float = 10.0) -> None:
    """Waits (untimed) until a bucketimer TimerThread has caught up: the
    timers just scheduled are in its heap and the ones just cancelled are
    swept.  Otherwise that work runs beside the next measurement and slows
    it down (it is the point of the design that it runs in the background,
    but it is not what a schedule+cancel pair costs)."""
    await asyncio.sleep(0.01)
    if tt is None or not hasattr(tt, "stats"):
        return
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        st = tt.stats()
        if st.get("dead", 0) < 4096 and st.get("list_size", 0) < 2 * 4096:
            return
        await asyncio.sleep(0.02)


async def _timeout_round(cm: Callable[[float], Any], n: int) -> float:
    gc.disable()
    try:
        t0 = perf_counter_ns()
        for _ in range(n):
            async with cm(PAIR_DELAY):
                pass
        t1 = perf_counter_ns()
    finally:
        gc.enable()
    return (t1 - t0) / n


async def _returns_at_once() -> int:
    return 1


async def _wait_for_round(wait_for: Callable[..., Any], n: int) -> float:
    coro = _returns_at_once
    gc.disable()
    try:
        t0 = perf_counter_ns()
        for _ in range(n):
            await wait_for(coro(), PAIR_DELAY)
        t1 = perf_counter_ns()
    finally:
        gc.enable()
    return (t1 - t0) / n


async def _lateness_round(call_at: Callable[..., Any], n: int, window: float,
                          rng: random.Random) -> list[int]:
    """Schedules n timers at random deadlines over ``window`` s and returns
    each one's lateness in ns (negative: it fired early)."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    lat: list[int] = []
    left = [n]

    def fired(when_ns: int) -> None:
        lat.append(monotonic_ns() - when_ns)
        left[0] -= 1
        if left[0] == 0 and not done.done():
            done.set_result(None)

    base = monotonic_ns() + 2_000_000
    span = int(window * 1e9)
    gc.disable()
    try:
        for _ in range(n):
            when_ns = base + int(span * rng.random())
            call_at(when_ns / 1e9, fired, when_ns)
        await asyncio.wait_for(done, window + 10.0)
    finally:
        gc.enable()
    return lat


def _sync_pairs(call_later: Callable[..., Any], n: int) -> float:
    cb = _noop
    delay = PAIR_DELAY
    gc.disable()
    try:
        t0 = perf_counter_ns()
        for _ in range(n):
            call_later(delay, cb).cancel()
        t1 = perf_counter_ns()
    finally:
        gc.enable()
    return (t1 - t0) / n


def _sched_pairs(sc: sched.scheduler, n: int) -> float:
    enter, cancel = sc.enter, sc.cancel
    cb = _noop
    delay = PAIR_DELAY
    gc.disable()
    try:
        t0 = perf_counter_ns()
        for _ in range(n):
            cancel(enter(delay, 1, cb))
        t1 = perf_counter_ns()
    finally:
        gc.enable()
    return (t1 - t0) / n


def _thread_timer_pairs(n: int) -> float:
    """threading.Timer: start() creates a thread; cancel() ends it."""
    Timer = threading.Timer
    cb = _noop
    made = []
    gc.disable()
    try:
        t0 = perf_counter_ns()
        for _ in range(n):
            t = Timer(PAIR_DELAY, cb)
            t.start()
            t.cancel()
            made.append(t)
        t1 = perf_counter_ns()
    finally:
        gc.enable()
    for t in made:
        t.join()
    return (t1 - t0) / n


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


def _bt_noloop_lateness(tt: Any, n: int, window: float, rng: random.Random) -> list[int]:
    c = _Collector(n)
    for when_ns in _deadlines(n, window, rng):
        tt.call_at(when_ns / 1e9, c.fired, when_ns)
    if not c.done.wait(window + 10.0):
        raise RuntimeError("bucketimer dispatcher: timers did not fire")
    return c.lat


def _thread_timer_lateness(n: int, window: float, rng: random.Random) -> list[int]:
    c = _Collector(n)
    timers = []
    for when_ns in _deadlines(n, window, rng):
        t = threading.Timer(max(0.0, (when_ns - monotonic_ns()) / 1e9), c.fired, (when_ns,))
        t.start()
        timers.append(t)
    if not c.done.wait(window + 10.0):
        raise RuntimeError("threading.Timer: timers did not fire")
    for t in timers:
        t.join()
    return c.lat


def _sched_lateness(n: int, window: float, rng: random.Random) -> list[int]:
    """sched.scheduler.run() on its own thread, events entered up front (sched
    does not notice events added during its sleep)."""
    c = _Collector(n)
    sc = sched.scheduler(time.monotonic, time.sleep)
    for when_ns in _deadlines(n, window, rng):
        sc.enterabs(when_ns / 1e9, 1, c.fired, (when_ns,))
    th = threading.Thread(target=sc.run, name="bench-sched")
    th.start()
    th.join(window + 10.0)
    if not c.done.is_set():
        raise RuntimeError("sched: events did not fire")
    return c.lat


# ---- the native core through cffi -------------------------------------------------


class _NativeCore:
    """A bucketed core (bt_create) or a reference heap (bt_ref_create)."""

    def __init__(self, ffi: Any, lib: Any, name: str) -> None:
        self.ffi, self.lib, self.name = ffi, lib, name
        if name == BUCKETIMER:
            opt = ffi.new("bt_options *")
            lib.bt_options_init(opt)
            out = ffi.new("bt_timer_thread **")
            rc = lib.bt_create(opt, out)
            self.gated_fn, self.fill_fn = lib.bt_bench_pairs_gated, lib.bt_bench_fill
        else:
            out = ffi.new("bt_ref_timer **")
            rc = lib.bt_ref_create(out)
            self.gated_fn, self.fill_fn = lib.bt_ref_bench_pairs_gated, lib.bt_ref_bench_fill
        if rc:
            raise OSError(-rc, f"{name}: creating the native core failed")
        self.ptr = out[0]

    def fill(self, n: int, lo_s: float, hi_s: float) -> None:
        rc = self.fill_fn(self.ptr, int(lo_s * 1e9), int(hi_s * 1e9), n, self.ffi.NULL)
        if rc:
            raise OSError(-rc, f"{self.name}: filling the core failed")

    def close(self) -> None:
        if self.ptr is None:
            return
        if self.name == BUCKETIMER:
            self.lib.bt_stop(self.ptr)
            self.lib.bt_destroy(self.ptr)
        else:
            self.lib.bt_ref_destroy(self.ptr)
        self.ptr = None


class _WorkerPool:
    """Long-lived threads for the native rows.

    The same threads serve every measurement: the core picks a bucket by
    calling thread (round robin on first use), so fresh threads would
    eventually share buckets by wrap-around."""

    def __init__(self, n: int) -> None:
        self.jobs = [queue.SimpleQueue() for _ in range(n)]
        self.results: queue.SimpleQueue = queue.SimpleQueue()
        self.threads = [threading.Thread(target=self._work, args=(i, q), daemon=True,
                                         name=f"bench-core-{i}")
                        for i, q in enumerate(self.jobs)]
        for t in self.threads:
            t.start()

    def _work(self, index: int, jobs: queue.SimpleQueue) -> None:
        while True:
            job = jobs.get()
            if job is None:
                return
            fn, args = job
            try:
                rv = fn(*args)  # cffi releases the GIL for the call
                self.results.put((index, rv, None))
            except BaseException as e:
                self.results.put((index, 0, e))

    def run(self, n: int, core: _NativeCore, delay_ns: int, pairs: int) -> int:
        """Runs ``pairs`` schedule+cancel pairs on each of n threads at once,
        started together by a gate in C; returns the wall time in ns from the
        first start to the last finish."""
        ffi = core.ffi
        gate = ffi.new("uint32_t *")
        starts = [ffi.new("int64_t *") for _ in range(n)]
        for i, q in enumerate(self.jobs[:n]):
            q.put((core.gated_fn, (core.ptr, delay_ns, pairs, gate, n, starts[i])))
        res = [self.results.get() for _ in range(n)]
        for _, rv, err in res:
            if err is not None:
                raise err
            if rv < 0:
                raise OSError(-rv, f"native benchmark loop failed: {os.strerror(-rv)}")
        first = min(starts[i][0] for i, _, _ in res)
        last = max(starts[i][0] + rv for i, rv, _ in res)
        return last - first

    def close(self) -> None:
        for q in self.jobs:
            q.put(None)
        for t in self.threads:
            t.join()


def suite_by_name(name: str, **overrides: Any) -> Suite:
    try:
        s = SUITES[name]
    except KeyError:
        raise ValueError(f"unknown suite {name!r}; known: {sorted(SUITES)}") from None
    return replace(s, **overrides) if overrides else s


def suite_dict(s: Suite) -> dict[str, Any]:
    return asdict(s)
