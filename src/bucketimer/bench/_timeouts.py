"""The ``timeout`` group: what ``async with timeout(30): pass`` and ``await
wait_for(coro(), 30)`` of a coroutine that returns at once cost, for
bucketimer's helpers on the stock loop, the pure backend's helpers (asyncio's,
with the order of due timers and the NaN deadline of the native ones) in its
column, and asyncio's on every other loop (docs/performance.rst, "What the
rows measure")."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Any

import bucketimer
from bucketimer._pure import aio as pure_aio

from ._contenders import BUCKETIMER, PURE, with_pure
from ._pairs import PAIR_DELAY
from ._records import make_record
from ._suite import taking_turns
from ._timing import Stopwatch

if TYPE_CHECKING:
    from ._runner import Runner

TimeoutFn = Callable[[float], AbstractAsyncContextManager[Any]]
WaitForFn = Callable[[Awaitable[int], float], Awaitable[int]]


async def timeout_round(cm: TimeoutFn, n: int) -> float:
    """ns per ``async with cm(30): pass``."""
    delay = PAIR_DELAY
    with Stopwatch() as sw:
        for _ in range(n):
            async with cm(delay):
                pass
    return sw.ns / n


async def returns_at_once() -> int:
    return 1


async def wait_for_round(wait_for: WaitForFn, n: int) -> float:
    """ns per ``await wait_for(coro(), 30)`` of a coroutine that returns at once."""
    coro = returns_at_once
    delay = PAIR_DELAY
    with Stopwatch() as sw:
        for _ in range(n):
            await wait_for(coro(), delay)
    return sw.ns / n


# (workload, label, bucketimer's helper, the pure backend's, asyncio's, the timed loop)
ROWS: tuple[tuple[str, str, Any, Any, Any, Callable[[Any, int], Awaitable[float]]], ...] = (
    ("timeout", "async with timeout(30): pass", bucketimer.timeout, pure_aio.timeout,
     asyncio.timeout, timeout_round),
    ("wait_for", "await wait_for(coro(), 30)", bucketimer.wait_for, pure_aio.wait_for,
     asyncio.wait_for, wait_for_round),
)


def steps(runner: Runner) -> int:
    return len(ROWS) * len(with_pure(runner.loops, runner.want)) * runner.suite.rounds


def run(runner: Runner) -> None:
    """Each contender on a loop of its own; the columns take turns round by
    round, so that a machine whose speed drifts during the run (a shared VM)
    moves every column of a round alike and the ratios stay meaningful."""
    s = runner.suite
    loops = {name: factory() for name, factory in with_pure(runner.loops, runner.want).items()}
    try:
        for workload, label, ours, pure, reference, round_fn in ROWS:
            fns = {name: ours if name == BUCKETIMER else pure if name == PURE else reference
                   for name in loops}
            for name, fn in fns.items():  # warm-up
                loops[name].run_until_complete(round_fn(fn, min(s.timeouts, 500)))
            samples: dict[str, list[float]] = {name: [] for name in fns}
            for name in taking_turns(list(fns), s.rounds):
                gc.collect()
                samples[name].append(
                    loops[name].run_until_complete(round_fn(fns[name], s.timeouts)))
                runner.step(f"{workload} {name}")
            for name in fns:
                runner.add(make_record("timeout", workload, label, name, "ns", "lower",
                                       samples[name], per_round=s.timeouts))
    finally:
        for loop in loops.values():
            loop.close()
