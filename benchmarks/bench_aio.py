"""asyncio integration benchmarks: bucketimer's helpers and drop-in loop vs the stock ones.

Run (the bench nox session does this)::

    pytest benchmarks/bench_aio.py --benchmark-only --benchmark-disable-gc

Each group puts the contenders side by side in one process on the same kind
of loop; compare within a group, never across runs.  Groups:

* ``timeout-enter-exit[<loop>]``: ``async with X.timeout(30): pass``.
* ``wait_for-finishing[<loop>]``: ``await X.wait_for(coro_that_returns(), 30)``.
* ``call_later-cancel[<pending>]``: ``loop.call_later(30, cb).cancel()`` with
  0 / 10 000 / 1 000 000 other timers pending, on each loop.
* ``precision``: lateness of 10 000 timers at random 0-50 ms delays (one
  round each; p50/p99/max/early in ``extra_info`` and printed).
* ``fire-heavy``: 10 000 sequential ``asyncio.sleep(0.001)``; 1 000 tasks
  each sleeping random 0-10 ms, 100 rounds.
* ``cancel-churn``: 1 000 000 ``call_later(30)`` + ``cancel()`` on a running
  loop: the longest loop iteration and the RSS growth per million cancelled
  timers (``extra_info``).

``BUCKETIMER_BENCH_QUICK=1`` shrinks the long workloads (for a smoke run).
"""

from __future__ import annotations

import asyncio
import gc
import os
import random
import statistics
import time

import pytest

import bucketimer
from bucketimer import aio
from bucketimer import loop as bt_loop

try:
    import uvloop
except ImportError:  # pragma: no cover
    uvloop = None

QUICK = bool(os.environ.get("BUCKETIMER_BENCH_QUICK"))

# Reference loops and the contenders.
LOOPS = {"asyncio": asyncio.SelectorEventLoop, "bucketimer-loop": bt_loop.EventLoop}
if uvloop is not None:
    LOOPS["uvloop"] = uvloop.new_event_loop
    LOOPS["bucketimer-uvloop"] = bt_loop.UVEventLoop
HOST_LOOPS = ["asyncio"] + (["uvloop"] if uvloop is not None else [])

HELPERS = {
    "asyncio": (asyncio.timeout, asyncio.wait_for),
    "bucketimer": (aio.timeout, aio.wait_for),
}


def _noop() -> None:
    pass


@pytest.fixture
def make_loop():
    loops = []

    def make(kind):
        lp = LOOPS[kind]()
        loops.append(lp)
        return lp

    yield make
    for lp in loops:
        lp.close()


def _bench_async(benchmark, loop, body, n):
    """Times ``n`` awaits of ``body()`` inside one task; reports per-call time."""

    async def batch():
        for _ in range(n):
            await body()

    def run():
        loop.run_until_complete(batch())

    benchmark.extra_info["calls_per_round"] = n
    benchmark.pedantic(run, rounds=20, warmup_rounds=2, iterations=1)
    benchmark.extra_info["per_call_us"] = benchmark.stats.stats.median / n * 1e6


# -- 1. helpers --------------------------------------------------------------------------


@pytest.mark.parametrize("impl", sorted(HELPERS))
@pytest.mark.parametrize("host", HOST_LOOPS)
def test_timeout_enter_exit(benchmark, make_loop, host, impl):
    """``async with timeout(30): pass`` (target: bucketimer >= 5x asyncio)."""
    benchmark.group = f"timeout-enter-exit[{host}]"
    timeout = HELPERS[impl][0]
    loop = make_loop(host)

    async def body():
        async with timeout(30):
            pass

    _bench_async(benchmark, loop, body, 2000)


@pytest.mark.parametrize("impl", sorted(HELPERS))
@pytest.mark.parametrize("host", HOST_LOOPS)
def test_wait_for_finishing(benchmark, make_loop, host, impl):
    """``await wait_for(returns_at_once(), 30)`` (target: >= 5x asyncio)."""
    benchmark.group = f"wait_for-finishing[{host}]"
    wait_for = HELPERS[impl][1]
    loop = make_loop(host)

    async def returns_at_once():
        return 1

    async def body():
        await wait_for(returns_at_once(), 30)

    _bench_async(benchmark, loop, body, 1000)


# -- 2. drop-in call_later + cancel --------------------------------------------------------

PENDING = [0, 10_000] + ([] if QUICK else [1_000_000])


@pytest.mark.parametrize("kind", sorted(LOOPS))
@pytest.mark.parametrize("pending", PENDING)
def test_call_later_cancel(benchmark, make_loop, kind, pending):
    """``loop.call_later(30, cb).cancel()`` with ``pending`` other timers
    (target: drop-in >= 15x stock, flat from 0 to 1 M within 1.2x)."""
    benchmark.group = f"call_later-cancel[{pending} pending]"
    loop = make_loop(kind)
    n = 2000

    async def setup_and_measure():
        keep = [loop.call_later(3600 + i * 1e-6, _noop) for i in range(pending)]
        call_later = loop.call_later

        def run():
            for _ in range(n):
                call_later(30, _noop).cancel()

        benchmark.pedantic(run, rounds=30, warmup_rounds=2, iterations=1)
        for h in keep:
            h.cancel()
        if pending >= 100_000:
            # Let the core reap what was just cancelled before the next
            # benchmark: it does so in one go on the timer thread, and the
            # timers of the next benchmark would wait behind that work.
            await asyncio.sleep(0.5)

    loop.run_until_complete(setup_and_measure())
    benchmark.extra_info["per_call_ns"] = benchmark.stats.stats.median / n * 1e9


# -- 3. precision -------------------------------------------------------------------------------

N_PRECISION = 2_000 if QUICK else 10_000


def _lateness_run(loop, schedule):
    """Schedules N timers at random deadlines over a 50 ms window
    (time.monotonic clock) with ``schedule(deadline, cb, deadline)`` and
    returns their lateness in seconds."""
    rnd = random.Random(42)
    late = []

    def cb(deadline):
        late.append(time.monotonic() - deadline)

    async def main():
        # The window starts 100 ms out so that scheduling 10 000 timers (up
        # to ~30 ms on the stock loop) does not itself count as lateness.
        start = time.monotonic() + 0.100
        for _ in range(N_PRECISION):
            d = start + rnd.uniform(0, 0.050)
            schedule(d, cb, d)
        while len(late) < N_PRECISION:
            await asyncio.sleep(0.01)

    loop.run_until_complete(main())
    return late


def _summarise(benchmark, late):
    s = sorted(late)
    q = statistics.quantiles(s, n=100)
    info = {
        "p50_us": round(statistics.median(s) * 1e6, 1),
        "p99_us": round(q[98] * 1e6, 1),
        "max_us": round(s[-1] * 1e6, 1),
        "early": sum(1 for x in s if x < 0),
        "n": len(s),
    }
    benchmark.extra_info.update(info)
    print(f"\n  precision {benchmark.name}: {info}")
    return info


PRECISION_CASES = ["asyncio", "bucketimer-helper", "bucketimer-loop"] + (
    ["uvloop", "bucketimer-helper-on-uvloop", "bucketimer-uvloop"] if uvloop is not None else []
)


@pytest.mark.parametrize("case", PRECISION_CASES)
def test_precision(benchmark, make_loop, case):
    """Lateness of 10 000 timers at random 0-50 ms (targets: 0 early, p50 <=
    100 us, p99 <= 1 ms idle, p50 better than asyncio's and uvloop's).

    The deadline is a time.monotonic() instant in every case; the loops get
    it as ``call_later(deadline - time.monotonic())``, the helper case as
    ``default_timer_thread().call_at(deadline, loop=loop)`` on the host loop.
    """
    benchmark.group = "precision"
    host = {"bucketimer-helper": "asyncio", "bucketimer-helper-on-uvloop": "uvloop"}.get(case, case)
    loop = make_loop(host)
    if case.startswith("bucketimer-helper"):
        tt = bucketimer.default_timer_thread()

        def schedule(d, cb, arg):
            tt.call_at(d, cb, arg, loop=loop)

    else:
        # call_later(delay): what asyncio.sleep and every library do; it also
        # spares uvloop's stock loop a conversion from its own cached clock
        # (loop.time()), which would otherwise make it look earlier still.
        call_later = loop.call_later
        monotonic = time.monotonic

        def schedule(d, cb, arg):
            call_later(d - monotonic(), cb, arg)

    result = {}

    def run():
        result["late"] = _lateness_run(loop, schedule)

    benchmark.pedantic(run, rounds=1, iterations=1)
    _summarise(benchmark, result["late"])


# -- 4. fire-heavy workloads ---------------------------------------------------------------------

N_SEQ = 1_000 if QUICK else 10_000
TASKS, ROUNDS = (200, 20) if QUICK else (1_000, 100)


@pytest.mark.parametrize("kind", sorted(LOOPS))
def test_fire_heavy_sequential_sleeps(benchmark, make_loop, kind):
    """10 000 sequential ``asyncio.sleep(0.001)`` (drop-in must be <= 1.5x stock)."""
    benchmark.group = "fire-heavy: 10k sequential sleep(1ms)"
    loop = make_loop(kind)

    async def main():
        for _ in range(N_SEQ):
            await asyncio.sleep(0.001)

    benchmark.pedantic(lambda: loop.run_until_complete(main()), rounds=1, iterations=1)
    benchmark.extra_info["per_sleep_us"] = benchmark.stats.stats.median / N_SEQ * 1e6


@pytest.mark.parametrize("kind", sorted(LOOPS))
def test_fire_heavy_many_tasks(benchmark, make_loop, kind):
    """1 000 tasks each sleeping random 0-10 ms, 100 rounds (<= 1.5x stock)."""
    benchmark.group = "fire-heavy: 1000 tasks x 100 random sleeps"
    loop = make_loop(kind)

    async def one(seed):
        rnd = random.Random(seed)
        for _ in range(ROUNDS):
            await asyncio.sleep(rnd.uniform(0, 0.010))

    async def main():
        await asyncio.gather(*(one(i) for i in range(TASKS)))

    benchmark.pedantic(lambda: loop.run_until_complete(main()), rounds=3, iterations=1)


# -- 2b. loop stalls and RSS from cancelled timers ------------------------------------------------

N_CHURN = 100_000 if QUICK else 1_000_000


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.parametrize("kind", sorted(LOOPS))
def test_cancel_churn_stalls_and_rss(benchmark, make_loop, kind):
    """1 M call_later(30)+cancel in batches of 1 000, one loop iteration per
    batch: the longest gap between iterations not spent in our own batches
    (bookkeeping stalls; target < 1 ms) and the RSS growth per million
    cancelled timers (target: bounded by the core's drain threshold)."""
    benchmark.group = "cancel-churn"
    loop = make_loop(kind)
    batch = 1000
    result = {}

    async def main():
        call_later = loop.call_later
        gc.collect()
        rss0 = _rss_mb()
        worst_gap = 0.0
        for _ in range(N_CHURN // batch):
            for _ in range(batch):
                call_later(30, _noop).cancel()
            t_batch_end = time.perf_counter()
            await asyncio.sleep(0)  # one loop iteration
            gap = time.perf_counter() - t_batch_end
            worst_gap = max(worst_gap, gap)
        result["worst_iteration_ms"] = round(worst_gap * 1e3, 3)
        result["rss_mb_per_million"] = round((_rss_mb() - rss0) * 1_000_000 / N_CHURN, 1)

    benchmark.pedantic(lambda: loop.run_until_complete(main()), rounds=1, iterations=1)
    benchmark.extra_info.update(result)
    print(f"\n  cancel-churn {kind}: {result}")


@pytest.mark.parametrize("kind", sorted(LOOPS))
def test_mass_cancel_stall(benchmark, make_loop, kind):
    """1 M timers pending, all cancelled at once, then one loop iteration:
    how long that iteration takes (asyncio rebuilds its heap of cancelled
    handles there) and the RSS left once they are cancelled."""
    benchmark.group = "mass-cancel"
    loop = make_loop(kind)
    result = {}

    async def main():
        call_later = loop.call_later
        gc.collect()
        rss0 = _rss_mb()
        handles = [call_later(30 + i * 1e-6, _noop) for i in range(N_CHURN)]
        for h in handles:
            h.cancel()
        del handles
        t0 = time.perf_counter()
        await asyncio.sleep(0)
        result["next_iteration_ms"] = round((time.perf_counter() - t0) * 1e3, 3)
        await asyncio.sleep(0.01)
        gc.collect()
        result["rss_mb_after"] = round((_rss_mb() - rss0) * 1_000_000 / N_CHURN, 1)

    benchmark.pedantic(lambda: loop.run_until_complete(main()), rounds=1, iterations=1)
    benchmark.extra_info.update(result)
    print(f"\n  mass-cancel {kind}: {result}")
