"""The ``lateness`` group: how late timers fire in a running loop (callback
start minus deadline, so it includes the loop's wake-up), and how many fire
early (docs/performance.rst, "What the rows measure")."""

from __future__ import annotations

import asyncio
import gc
import random
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import bucketimer

from ._contenders import BUCKETIMER
from ._records import HIST_BUCKETS, log2_hist, make_record, quantile

if TYPE_CHECKING:
    from ._runner import Runner

monotonic_ns = time.monotonic_ns

# s from the start of a round to its first deadline
LEAD = 0.002


async def lateness_round(call_at: Callable[..., Any], n: int, window: float,
                         rng: random.Random, lead: float = LEAD) -> list[int]:
    """Schedules n timers with ``call_at(deadline_s, cb, deadline_ns)`` at
    random deadlines over ``window`` s, starting ``lead`` s from now, and
    returns each one's lateness in ns (negative: it fired early)."""
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    lat: list[int] = []
    left = [n]

    def fired(when_ns: int) -> None:
        lat.append(monotonic_ns() - when_ns)
        left[0] -= 1
        if left[0] == 0 and not done.done():
            done.set_result(None)

    base = monotonic_ns() + int(lead * 1e9)
    span = int(window * 1e9)
    gc.disable()
    try:
        for _ in range(n):
            when_ns = base + int(span * rng.random())
            call_at(when_ns / 1e9, fired, when_ns)
        await asyncio.wait_for(done, lead + window + 10.0)
    finally:
        gc.enable()
    return lat


def via_call_later(call_later: Callable[..., Any]) -> Callable[..., Any]:
    """A ``call_at`` on a time.monotonic() deadline made with ``call_later(
    deadline - now)``: what ``asyncio.sleep`` and every library do (it also
    spares uvloop a conversion from its own cached millisecond clock)."""
    monotonic = time.monotonic

    def call_at(when: float, cb: Callable[..., Any], *args: Any) -> Any:
        return call_later(when - monotonic(), cb, *args)

    return call_at


def add_lateness(runner: Runner, group: str, prefix: str, name: str,
                 rounds: list[list[int]], per_round: int) -> None:
    """The p50/p99(/max) rows of the lateness of ``rounds``; in a loop also
    the early fires."""
    where = "no loop" if group == "noloop" else "in a loop"
    hist = [0] * HIST_BUCKETS
    for lat in rounds:
        log2_hist(lat, hist)
    for q, key in ((0.5, "p50"), (0.99, "p99"), (1.0, "max")):
        if prefix and key == "max":
            continue
        samples = [quantile(sorted(lat), q) for lat in rounds]
        runner.add(make_record(group, f"{prefix}lateness_{key}", f"lateness {key}, {where}",
                               name, "ns", "lower", samples, per_round=per_round,
                               hist=hist if key == "p50" else None))
    if not prefix:
        early = [sum(1 for x in lat if x < 0) for lat in rounds]
        runner.add(make_record(group, f"{prefix}early_fires", "early fires (of all timers)",
                               name, "count", "lower", early, per_round=per_round,
                               total=sum(early), timers=sum(len(x) for x in rounds)))


def steps(runner: Runner) -> int:
    return len(runner.loops) * runner.suite.rounds


def run(runner: Runner) -> None:
    """Each contender in turn on a fresh loop (bucketimer: a TimerThread of
    its own on the stock loop), ``rounds`` rounds each."""
    s = runner.suite
    for name, factory in runner.loops.items():
        loop = factory()
        tt = bucketimer.TimerThread() if name == BUCKETIMER else None
        call_at = tt.call_at if tt is not None else loop.call_at

        async def rounds(name: str = name, call_at: Callable[..., Any] = call_at
                         ) -> list[list[int]]:
            out = []
            for r in range(s.rounds):
                gc.collect()
                out.append(await lateness_round(call_at, s.late_timers, s.late_window,
                                                random.Random(r)))
                runner.step(f"lateness {name}")
            return out

        try:
            result = loop.run_until_complete(rounds())
        finally:
            if tt is not None:
                tt.close()
            loop.close()
        add_lateness(runner, "lateness", "", name, result, s.late_timers)
