"""What a short-lived loop pays: a new loop's first timer, and a loop's whole life.

Programs that run ``asyncio.run()`` per request, per test or per notebook
cell pay for whatever bucketimer does once per loop.  Two tables, each
column a fresh loop per sample, the columns taking turns sample by sample
in a new order each round (so that neither a drift of the machine's speed
nor what the sample before left in the allocator favours a column: in a
fixed order, one column's code ran up to 0.3 µs slower than the same code
in another column):

* **the first timer**: the time of the first ``call_later(30, cb)`` made
  inside a new running loop: asyncio's ``loop.call_later`` on the stock
  loop, the drop-in loop's, ``bucketimer.call_later`` on the stock loop and
  the default TimerThread's ``call_later`` there;
* **a loop's life**: ``asyncio.run()`` (or ``bucketimer.run()``) of a
  coroutine that arms one ``timeout(30)`` and yields once: what the first
  table leaves out (making the loop, closing it) is in this one.

    python benchmarks/first_timer.py [--loops N]           # native, if built
    BUCKETIMER_NO_EXTENSIONS=1 python benchmarks/first_timer.py

Medians of N samples per column (default 1000); the ratio is asyncio's
median over the column's (above 1: cheaper than asyncio).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import random
import statistics
import sys
import time
from collections.abc import Callable, Coroutine, Mapping
from typing import Any

import bucketimer


def _noop() -> None:
    pass


def _first_timer(kind: str) -> int:
    """ns of the first ``call_later`` inside a new running loop."""
    loop = bucketimer.new_event_loop() if kind == "drop-in" else asyncio.SelectorEventLoop()

    async def first() -> int:
        if kind == "bucketimer.call_later":
            call_later: Callable[..., Any] = bucketimer.call_later
        elif kind == "TimerThread.call_later":
            call_later = bucketimer.default_timer_thread().call_later
        else:
            call_later = loop.call_later
        t0 = time.perf_counter_ns()
        h = call_later(30, _noop)
        t1 = time.perf_counter_ns()
        h.cancel()
        return t1 - t0

    try:
        return loop.run_until_complete(first())
    finally:
        loop.close()


FIRST_TIMER = {
    "asyncio loop.call_later": "asyncio",
    "drop-in loop.call_later": "drop-in",
    "bucketimer.call_later (stock loop)": "bucketimer.call_later",
    "TimerThread.call_later (stock loop)": "TimerThread.call_later",
}


async def _asyncio_timeout() -> None:
    async with asyncio.timeout(30):
        await asyncio.sleep(0)


async def _bucketimer_timeout() -> None:
    async with bucketimer.timeout(30):
        await asyncio.sleep(0)


def _life(run: Callable[[Coroutine[Any, Any, None]], None],
          main: Callable[[], Coroutine[Any, Any, None]]) -> Callable[[], int]:
    def sample() -> int:
        t0 = time.perf_counter_ns()
        run(main())
        return time.perf_counter_ns() - t0
    return sample


LIFE = {
    "asyncio.run, asyncio.timeout": _life(asyncio.run, _asyncio_timeout),
    "asyncio.run, bucketimer.timeout": _life(asyncio.run, _bucketimer_timeout),
    "bucketimer.run, bucketimer.timeout": _life(bucketimer.run, _bucketimer_timeout),
}


def measure(samples: Mapping[str, Callable[[], int]], loops: int) -> dict[str, float]:
    """Median ns per column, the columns taking turns in a shuffled order
    (the same each run); one warm-up each."""
    for sample in samples.values():
        sample()
    taken: dict[str, list[int]] = {name: [] for name in samples}
    order = list(samples.items())
    rng = random.Random(0)
    for _ in range(loops):
        rng.shuffle(order)
        for name, sample in order:
            taken[name].append(sample())
    return {name: statistics.median(ns) for name, ns in taken.items()}


def table(title: str, medians: dict[str, float]) -> str:
    base = next(iter(medians.values()))
    lines = [f"{title:40} {'median':>10} {'vs asyncio':>11}"]
    for name, ns in medians.items():
        lines.append(f"{name:40} {ns / 1e3:8.2f} µs {base / ns:10.2f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--loops", type=int, default=1000, help="samples per column (1000)")
    args = p.parse_args(argv)
    # (the process's first timer starts nothing: import started the timer
    # thread in the background, unless BUCKETIMER_LAZY_START=1)
    process_first = _first_timer("bucketimer.call_later")
    print(f"{bucketimer.backend} backend, Python {sys.version.split()[0]}, "
          f"{args.loops} loops per column; the process's first bucketimer.call_later: "
          f"{process_first / 1e3:.1f} µs")
    first = {name: functools.partial(_first_timer, kind) for name, kind in FIRST_TIMER.items()}
    print(table("the first timer of a new loop", measure(first, args.loops)))
    print(table("a loop's life (run + 1 timeout)", measure(LIFE, args.loops)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
