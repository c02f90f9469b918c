"""The ``core`` group: the C core alone, schedule+cancel loops in C on 1..N
Python threads at once through ``bucketimer.bench._cbench`` (the kit's cffi
module, which releases the GIL), the bucketed core against the reference
single-lock heap of ``csrc/bench/bench.c`` (docs/performance.rst, "The
native core on several threads")."""

from __future__ import annotations

import os
import queue
import threading
from typing import TYPE_CHECKING, Any

from ._contenders import BUCKETIMER, REF_HEAP, native_backend
from ._pairs import PAIR_DELAY, PENDING_MAX, PENDING_MIN
from ._records import count_label, make_record

if TYPE_CHECKING:
    from ._runner import Runner

# pairs per thread of the warm-up run (slots allocated, caches hot)
WARMUP_PAIRS = 100_000


class NativeCore:
    """A bucketed core (bt_create) or a reference heap (bt_ref_create), made
    and driven through one module's ``ffi`` and ``lib``: each cffi module
    links its own copy of the core."""

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


class WorkerPool:
    """Long-lived threads for the native rows.

    The same threads serve every measurement: the core picks a bucket by
    calling thread (round robin on first use), so fresh threads would
    eventually share buckets by wrap-around."""

    def __init__(self, n: int) -> None:
        self.jobs: list[queue.SimpleQueue[Any]] = [queue.SimpleQueue() for _ in range(n)]
        self.results: queue.SimpleQueue[tuple[int, int, BaseException | None]] = \
            queue.SimpleQueue()
        self.threads = [threading.Thread(target=self._work, args=(i, q), daemon=True,
                                         name=f"bench-core-{i}")
                        for i, q in enumerate(self.jobs)]
        for t in self.threads:
            t.start()

    def _work(self, index: int, jobs: queue.SimpleQueue[Any]) -> None:
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

    def run(self, n: int, core: NativeCore, delay_ns: int, pairs: int) -> int:
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
        return int(last - first)

    def close(self) -> None:
        for q in self.jobs:
            q.put(None)
        for t in self.threads:
            t.join()


def _cbench() -> tuple[Any, Any] | str:
    """(ffi, lib) of the kit's cffi module, or why it cannot load (it needs
    cffi's backend, which the ``bench`` and ``cffi`` extras install)."""
    try:
        from ._cbench import ffi, lib
    except ImportError as e:
        return f"{e}"
    return ffi, lib


def steps(runner: Runner) -> int:
    s = runner.suite
    if not native_backend() or isinstance(_cbench(), str):
        return 0
    return s.rounds * (1 + len(s.core_threads))


def run(runner: Runner) -> None:
    if not native_backend():  # no C core to measure: the runner's note says so
        return
    s = runner.suite
    loaded = _cbench()
    if isinstance(loaded, str):
        runner.notes.append(f"bucketimer.bench._cbench cannot load ({loaded}): no core rows, "
                            f"so no '{REF_HEAP}' column (pip install cffi)")
        return
    ffi, lib = loaded
    impls = [BUCKETIMER] + ([REF_HEAP] if REF_HEAP in runner.want else [])
    delay = int(PAIR_DELAY * 1e9)
    pool = WorkerPool(max(s.core_threads))
    try:
        cores = {name: NativeCore(ffi, lib, name) for name in impls}
        try:
            for core in cores.values():  # warm-up: slots allocated, caches hot
                pool.run(max(s.core_threads), core, delay, min(s.core_pairs, WARMUP_PAIRS))
            rates: dict[tuple[str, int], list[float]] = {}
            for r in range(s.rounds):
                for nt in s.core_threads:
                    order = impls if r % 2 == 0 else impls[::-1]
                    for name in order:
                        wall = pool.run(nt, cores[name], delay, s.core_pairs)
                        rates.setdefault((name, nt), []).append(nt * s.core_pairs / wall * 1e9)
                    runner.step(f"core {nt} threads")
        finally:
            for core in cores.values():
                core.close()
        for nt in s.core_threads:
            for name in impls:
                runner.add(make_record(
                    "core", f"core@{nt}", f"core pairs/s, {nt} thread{'s' if nt > 1 else ''}",
                    name, "pairs/s", "higher", rates[(name, nt)], per_round=s.core_pairs,
                    threads=nt, pending=0))
        base_nt = s.core_threads[0]
        for nt in s.core_threads[1:]:
            for name in impls:
                ratio = [a / b for a, b in zip(rates[(name, nt)], rates[(name, base_nt)])]
                runner.add(make_record(
                    "core", f"core_scaling@{nt}",
                    f"core scaling, {nt} threads / {base_nt}", name, "x", "higher", ratio,
                    per_round=s.core_pairs, threads=nt, pending=0))
        # Pending timers in the core: the heap pays O(log n) with cache misses.
        pl = s.core_pending
        rates_p: dict[str, list[float]] = {}
        fresh = {name: NativeCore(ffi, lib, name) for name in impls}
        try:
            for core in fresh.values():
                core.fill(pl, PENDING_MIN, PENDING_MAX)
                pool.run(1, core, delay, min(s.core_pairs, WARMUP_PAIRS))
            n = max(1, s.core_pairs // 2)
            for _ in range(s.rounds):
                for name in impls:
                    wall = pool.run(1, fresh[name], delay, n)
                    rates_p.setdefault(name, []).append(n / wall * 1e9)
                runner.step("core pending")
        finally:
            for core in fresh.values():
                core.close()
        for name in impls:
            runner.add(make_record(
                "core", "core_pending", f"core pairs/s, 1 thread, {count_label(pl)} pending",
                name, "pairs/s", "higher", rates_p[name], per_round=n, threads=1, pending=pl))
    finally:
        pool.close()
