"""asyncio integration benchmarks: bucketimer's helpers and drop-in loop vs the stock ones.

Run (the bench nox session does this)::

    pytest benchmarks/bench_aio.py --benchmark-only --benchmark-disable-gc

Each group puts the contenders side by side in one process on the same kind
of loop; compare within a group, never across runs.  The workloads are the
kit's (``bucketimer.bench``); groups:

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
import os
import random
import statistics
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from _figures import per_op
from _kinds import HOST_LOOPS, LOOP_KINDS

import bucketimer
from bucketimer.bench.workloads import (
    PairsTarget,
    cancel_churn,
    lateness_round,
    mass_cancel,
    random_sleepers,
    sequential_sleeps,
    sync_pairs,
    timeout_round,
    via_call_later,
    wait_for_round,
)

QUICK = bool(os.environ.get("BUCKETIMER_BENCH_QUICK"))

HELPERS = {
    "asyncio": (asyncio.timeout, asyncio.wait_for),
    "bucketimer": (bucketimer.timeout, bucketimer.wait_for),
}
MakeLoop = Callable[[str], asyncio.AbstractEventLoop]


def _bench_round(benchmark: Any, loop: asyncio.AbstractEventLoop,
                 round_fn: Callable[[Any, int], Awaitable[float]], fn: Any, n: int) -> None:
    """Times ``round_fn(fn, n)`` (one task, n calls); reports per-call time."""
    benchmark.extra_info["calls_per_round"] = n
    benchmark.pedantic(lambda: loop.run_until_complete(round_fn(fn, n)),
                       rounds=20, warmup_rounds=2, iterations=1)
    benchmark.extra_info["per_call_us"] = per_op(benchmark, n, 1e6)


# -- 1. helpers --------------------------------------------------------------------------


@pytest.mark.parametrize("impl", sorted(HELPERS))
@pytest.mark.parametrize("host", HOST_LOOPS)
def test_timeout_enter_exit(benchmark: Any, make_loop: MakeLoop, host: str, impl: str) -> None:
    """``async with timeout(30): pass`` (target: bucketimer >= 5x asyncio)."""
    benchmark.group = f"timeout-enter-exit[{host}]"
    _bench_round(benchmark, make_loop(host), timeout_round, HELPERS[impl][0], 2000)


@pytest.mark.parametrize("impl", sorted(HELPERS))
@pytest.mark.parametrize("host", HOST_LOOPS)
def test_wait_for_finishing(benchmark: Any, make_loop: MakeLoop, host: str, impl: str) -> None:
    """``await wait_for(returns_at_once(), 30)`` (target: >= 5x asyncio)."""
    benchmark.group = f"wait_for-finishing[{host}]"
    _bench_round(benchmark, make_loop(host), wait_for_round, HELPERS[impl][1], 1000)


# -- 2. drop-in call_later + cancel --------------------------------------------------------

PENDING = [0, 10_000] + ([] if QUICK else [1_000_000])


@pytest.mark.parametrize("kind", sorted(LOOP_KINDS))
@pytest.mark.parametrize("pending", PENDING)
def test_call_later_cancel(benchmark: Any, kind: str, pending: int) -> None:
    """``loop.call_later(30, cb).cancel()`` with ``pending`` other timers
    (target: drop-in >= 15x stock, flat from 0 to 1 M within 1.2x)."""
    benchmark.group = f"call_later-cancel[{pending} pending]"
    n = 2000
    target = PairsTarget(LOOP_KINDS[kind], pending)
    try:
        call_later = target.call_later
        target.inside(lambda: benchmark.pedantic(
            sync_pairs, args=(call_later, n), rounds=30, warmup_rounds=2, iterations=1))
    finally:
        target.close()
    benchmark.extra_info["per_call_ns"] = per_op(benchmark, n, 1e9)


# -- 3. precision -------------------------------------------------------------------------------

N_PRECISION = 2_000 if QUICK else 10_000
PRECISION_CASES = ["asyncio", "bucketimer-helper", "bucketimer-loop"] + (
    ["uvloop", "bucketimer-helper-on-uvloop", "bucketimer-uvloop"] if "uvloop" in LOOP_KINDS
    else [])


def _summarise(benchmark: Any, late_ns: list[int]) -> dict[str, float]:
    s = sorted(x / 1e9 for x in late_ns)
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


@pytest.mark.parametrize("case", PRECISION_CASES)
def test_precision(benchmark: Any, make_loop: MakeLoop, case: str) -> None:
    """Lateness of 10 000 timers at random 0-50 ms (targets: 0 early, p50 <=
    100 us, p99 <= 1 ms idle, p50 better than asyncio's and uvloop's).

    The deadline is a time.monotonic() instant in every case; the loops get
    it as ``call_later(deadline - time.monotonic())``, the helper case as
    ``default_timer_thread().call_at(deadline)`` on the host loop.  The
    window starts 100 ms out so that scheduling 10 000 timers (up to ~30 ms
    on the stock loop) does not itself count as lateness.
    """
    benchmark.group = "precision"
    host = {"bucketimer-helper": "asyncio", "bucketimer-helper-on-uvloop": "uvloop"}.get(case, case)
    loop = make_loop(host)
    call_at = (bucketimer.default_timer_thread().call_at if case.startswith("bucketimer-helper")
               else via_call_later(loop.call_later))
    result: dict[str, list[int]] = {}

    def run() -> None:
        result["late"] = loop.run_until_complete(
            lateness_round(call_at, N_PRECISION, 0.050, random.Random(42), lead=0.100))

    benchmark.pedantic(run, rounds=1, iterations=1)
    _summarise(benchmark, result["late"])


# -- 4. fire-heavy workloads ---------------------------------------------------------------------

N_SEQ = 1_000 if QUICK else 10_000
TASKS, ROUNDS = (200, 20) if QUICK else (1_000, 100)


@pytest.mark.parametrize("kind", sorted(LOOP_KINDS))
def test_fire_heavy_sequential_sleeps(benchmark: Any, make_loop: MakeLoop, kind: str) -> None:
    """10 000 sequential ``asyncio.sleep(0.001)`` (drop-in must be <= 1.5x stock)."""
    benchmark.group = "fire-heavy: 10k sequential sleep(1ms)"
    loop = make_loop(kind)
    benchmark.pedantic(lambda: loop.run_until_complete(sequential_sleeps(N_SEQ)),
                       rounds=1, iterations=1)
    benchmark.extra_info["per_sleep_us"] = per_op(benchmark, N_SEQ, 1e6)


@pytest.mark.parametrize("kind", sorted(LOOP_KINDS))
def test_fire_heavy_many_tasks(benchmark: Any, make_loop: MakeLoop, kind: str) -> None:
    """1 000 tasks each sleeping random 0-10 ms, 100 rounds (<= 1.5x stock)."""
    benchmark.group = "fire-heavy: 1000 tasks x 100 random sleeps"
    loop = make_loop(kind)
    benchmark.pedantic(lambda: loop.run_until_complete(random_sleepers(TASKS, ROUNDS)),
                       rounds=3, iterations=1)


# -- 2b. loop stalls and RSS from cancelled timers ------------------------------------------------

N_CHURN = 100_000 if QUICK else 1_000_000


def _bench_once(benchmark: Any, loop: asyncio.AbstractEventLoop,
                make: Callable[[], Awaitable[dict[str, float]]], what: str) -> None:
    """Times one run of ``make()`` and keeps the figures it returns."""
    result: dict[str, float] = {}

    async def body() -> None:
        result.update(await make())

    benchmark.pedantic(lambda: loop.run_until_complete(body()), rounds=1, iterations=1)
    benchmark.extra_info.update(result)
    print(f"\n  {what} {benchmark.name}: {result}")


@pytest.mark.parametrize("kind", sorted(LOOP_KINDS))
def test_cancel_churn_stalls_and_rss(benchmark: Any, make_loop: MakeLoop, kind: str) -> None:
    """1 M call_later(30)+cancel in batches of 1 000, one loop iteration per
    batch: the longest gap between iterations not spent in our own batches
    (bookkeeping stalls; target < 1 ms) and the RSS growth per million
    cancelled timers (target: bounded by the core's drain threshold)."""
    benchmark.group = "cancel-churn"
    loop = make_loop(kind)
    _bench_once(benchmark, loop, lambda: cancel_churn(loop.call_later, N_CHURN),
                "cancel-churn")


@pytest.mark.parametrize("kind", sorted(LOOP_KINDS))
def test_mass_cancel_stall(benchmark: Any, make_loop: MakeLoop, kind: str) -> None:
    """1 M timers pending, all cancelled at once, then one loop iteration:
    how long that iteration takes (asyncio rebuilds its heap of cancelled
    handles there) and the RSS left once they are cancelled."""
    benchmark.group = "mass-cancel"
    loop = make_loop(kind)
    _bench_once(benchmark, loop, lambda: mass_cancel(loop.call_later, N_CHURN),
                "mass-cancel")
