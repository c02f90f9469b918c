"""A loop under timer load, beyond a single pair: timers that do fire
(sequential sleeps, many tasks sleeping at random), a churn of cancelled
timers (the longest loop iteration it causes and the memory it keeps), and
a mass cancel of a million pending timers.  The pytest-benchmark wrappers in
``benchmarks/`` time these; the table does not show them."""

from __future__ import annotations

import asyncio
import gc
import os
import random
import time
from collections.abc import Callable
from typing import Any

from ._pairs import PAIR_DELAY, noop


def rss_mb() -> float:
    """This process's resident set size, in MiB."""
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


async def sequential_sleeps(n: int, delay: float = 0.001) -> None:
    """``n`` sequential ``asyncio.sleep(delay)``: each arms a timer that fires."""
    for _ in range(n):
        await asyncio.sleep(delay)


async def random_sleepers(tasks: int, rounds: int, max_delay: float = 0.010) -> None:
    """``tasks`` tasks, each sleeping ``rounds`` random 0..``max_delay`` s."""

    async def one(seed: int) -> None:
        rnd = random.Random(seed)
        for _ in range(rounds):
            await asyncio.sleep(rnd.uniform(0, max_delay))

    await asyncio.gather(*(one(i) for i in range(tasks)))


async def cancel_churn(call_later: Callable[..., Any], n: int, batch: int = 1000
                       ) -> dict[str, float]:
    """``n`` ``call_later(30)`` + ``cancel()`` in batches of ``batch``, one
    loop iteration per batch: the longest gap between iterations not spent
    in the batches themselves (bookkeeping stalls) and the RSS growth per
    million cancelled timers."""
    gc.collect()
    rss0 = rss_mb()
    worst_gap = 0.0
    delay = PAIR_DELAY
    for _ in range(n // batch):
        for _ in range(batch):
            call_later(delay, noop).cancel()
        t_batch_end = time.perf_counter()
        await asyncio.sleep(0)  # one loop iteration
        worst_gap = max(worst_gap, time.perf_counter() - t_batch_end)
    return {"worst_iteration_ms": round(worst_gap * 1e3, 3),
            "rss_mb_per_million": round((rss_mb() - rss0) * 1_000_000 / n, 1)}


async def mass_cancel(call_later: Callable[..., Any], n: int) -> dict[str, float]:
    """``n`` timers pending, all cancelled at once, then one loop iteration:
    how long that iteration takes (asyncio rebuilds its heap of cancelled
    handles there) and the RSS left per million once they are cancelled."""
    gc.collect()
    rss0 = rss_mb()
    handles = [call_later(PAIR_DELAY + i * 1e-6, noop) for i in range(n)]
    for h in handles:
        h.cancel()
    del handles
    t0 = time.perf_counter()
    await asyncio.sleep(0)
    next_iteration = time.perf_counter() - t0
    await asyncio.sleep(0.01)
    gc.collect()
    return {"next_iteration_ms": round(next_iteration * 1e3, 3),
            "rss_mb_after": round((rss_mb() - rss0) * 1_000_000 / n, 1)}
