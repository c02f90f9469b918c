"""The ``reset`` group: moving a deadline that is pending, as a server does
on every message -- ``Timeout.reschedule()`` (bucketimer's on the stock
loop, asyncio's on every loop) and a handle's cancel + re-arm (``h.cancel();
h = call_later(30, cb)``) -- with nothing and with many timers pending.
Per reset: its time, the Python-heap blocks it leaves allocated, and the
tombstones it leaves (cancelled entries still in a structure: ``len(
loop._scheduled)`` of a stock loop, ``stats()["dead"]`` of a TimerThread),
next to a schedule+cancel pair on the same loop (docs/performance.rst,
"Deadline resets")."""

from __future__ import annotations

import asyncio
import gc
import sys
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import bucketimer
from bucketimer._backend import DEFAULT_DRAIN_THRESHOLD

from ._contenders import ASYNCIO, BUCKETIMER, DROPIN, DROPIN_UV, new_loop
from ._pairs import PAIR_DELAY, fill, noop, pairs_round, settle
from ._records import count_label, make_record, summarize
from ._suite import taking_turns
from ._timing import Stopwatch

if TYPE_CHECKING:
    from ._runner import Runner

# Resets of one leftover probe: below the core's drain threshold
# (DEFAULT_DRAIN_THRESHOLD), so that its timer thread does not sweep
# them while they are counted.
PROBE = 1000
assert PROBE < DEFAULT_DRAIN_THRESHOLD

TimeoutFn = Callable[[float], AbstractAsyncContextManager[Any]]


async def reschedule_round(timeout: TimeoutFn, n: int, batch: int) -> float:
    """ns per ``cm.reschedule(loop.time() + 30)`` of a pending timeout,
    yielding to the loop every ``batch`` resets (so that a loop's clean-up
    of what they left is inside the timing)."""
    loop = asyncio.get_running_loop()
    now = loop.time
    delay = PAIR_DELAY
    sleep = asyncio.sleep
    inner = range(batch)
    loops = max(1, n // batch)
    async with timeout(delay) as cm:
        reschedule = cm.reschedule
        with Stopwatch() as sw:
            for _ in range(loops):
                for _ in inner:
                    reschedule(now() + delay)
                await sleep(0)
    return sw.ns / (loops * batch)


async def deadline_round(n: int) -> float:
    """ns per ``loop.time() + 30``: the part of a reschedule row that
    computes the new deadline."""
    now = asyncio.get_running_loop().time
    delay = PAIR_DELAY
    with Stopwatch() as sw:
        for _ in range(n):
            now() + delay
    return sw.ns / n


async def rearm_round(call_later: Callable[..., Any], n: int, batch: int) -> float:
    """ns per ``h.cancel(); h = call_later(30, cb)`` of a pending handle,
    yielding to the loop every ``batch`` resets."""
    cb = noop
    delay = PAIR_DELAY
    sleep = asyncio.sleep
    inner = range(batch)
    loops = max(1, n // batch)
    h = call_later(delay, cb)
    with Stopwatch() as sw:
        for _ in range(loops):
            for _ in inner:
                h.cancel()
                h = call_later(delay, cb)
            await sleep(0)
    h.cancel()
    return sw.ns / (loops * batch)


#: Whether sys.getallocatedblocks() counts anything here: it counts
#: pymalloc's blocks only, so it reads 0 under PYTHONMALLOC=malloc.
BLOCKS_COUNTED = sys.getallocatedblocks() > 0


@dataclass
class Leftovers:
    """What one reset leaves behind, averaged over :data:`PROBE` resets done
    with no loop iteration in between (nothing cleans up meanwhile)."""

    # Python-heap blocks still allocated (sys.getallocatedblocks); None
    # where pymalloc is not the allocator (PYTHONMALLOC=malloc, as under a
    # sanitizer), which leaves that count at 0
    blocks: float | None
    # cancelled entries left in the loop's or the core's structure; None
    # where they cannot be seen (uvloop's timers are libuv's)
    tombstones: float | None


class Target:
    """A loop of contender ``name`` and where its timers go: bucketimer's
    API and the drop-in loop use the process-wide TimerThread (where
    ``bucketimer.timeout()`` puts its timers), the other loops their own
    heap.  ``tombstones()`` counts the cancelled entries that structure
    holds."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.loop = new_loop(name)
        self.tt: bucketimer.TimerThread | None = (
            bucketimer.default_timer_thread() if name in (BUCKETIMER, DROPIN, DROPIN_UV)
            else None)
        self.call_later: Callable[..., Any] = (
            self.tt.call_later if name == BUCKETIMER and self.tt is not None
            else self.loop.call_later)
        self.timeout: TimeoutFn = bucketimer.timeout if name == BUCKETIMER else asyncio.timeout

    def tombstones(self) -> int | None:
        """Cancelled entries left so far: in a TimerThread, those still
        there (``dead``) plus those its thread already removed (``reaped``),
        so that a sweep running meanwhile does not hide any; and in a stock
        loop, the length of its heap (cancelled handles stay in it until a
        loop iteration removes them), where the pure backend's timeouts
        leave theirs.  The pure backend's TimerThread keeps a timer armed in
        its running loop on that heap too, and counts it ``reaped`` once
        cancelled: there only the heap counts it."""
        scheduled = getattr(self.loop, "_scheduled", None)  # the stock loop's heap
        if self.tt is None:
            return len(scheduled) if scheduled is not None else None
        st = self.tt.stats()
        reaped = int(st["reaped"]) if bucketimer.backend == "native" else 0
        return int(st["dead"]) + reaped + len(scheduled or ())

    def run(self, coro: Awaitable[Any]) -> Any:
        return self.loop.run_until_complete(coro)

    async def leftovers(self, reset: Callable[[], Any]) -> Leftovers:
        """Runs ``reset()`` :data:`PROBE` times with nothing cleaning up in
        between."""
        await settle(self.tt)
        gc.collect()
        t0 = self.tombstones()
        gc.disable()
        try:
            b0 = sys.getallocatedblocks()
            for _ in range(PROBE):
                reset()
            b1 = sys.getallocatedblocks()
            t1 = self.tombstones()
        finally:
            gc.enable()
        tombs = None if t0 is None or t1 is None else (t1 - t0) / PROBE
        return Leftovers((b1 - b0) / PROBE if BLOCKS_COUNTED else None, tombs)

    async def timeout_leftovers(self) -> Leftovers:
        now = self.loop.time
        async with self.timeout(PAIR_DELAY) as cm:
            return await self.leftovers(lambda: cm.reschedule(now() + PAIR_DELAY))

    async def rearm_leftovers(self) -> Leftovers:
        box = [self.call_later(PAIR_DELAY, noop)]

        def rearm() -> None:
            box[0].cancel()
            box[0] = self.call_later(PAIR_DELAY, noop)

        result = await self.leftovers(rearm)
        box[0].cancel()
        return result


def levels(runner: Runner) -> tuple[int, ...]:
    """Nothing pending, and the most the pairs rows hold (1 M in the full suite)."""
    return (0, max(runner.suite.pending))


# (workload, label) of the two kinds of reset
KINDS = (("reset_timeout", "Timeout.reschedule(now + 30)"),
         ("reset_rearm", "h.cancel(); h = call_later(30, cb)"))


def steps(runner: Runner) -> int:
    return len(levels(runner)) * runner.suite.rounds * len(runner.loops)


def run(runner: Runner) -> None:
    s = runner.suite
    names = list(runner.loops)
    for pending in levels(runner):
        targets = {name: Target(name) for name in names}
        keep: list[Any] = []
        try:
            filled_tt = False
            for t in targets.values():
                if t.tt is not None and filled_tt:
                    continue  # one TimerThread serves bucketimer and drop-in
                keep += t.run(fill(t.call_later, pending, t.tt))
                filled_tt = filled_tt or t.tt is not None
            gc.collect()
            gc.freeze()
            samples: dict[tuple[str, str], list[float]] = {}
            left: dict[tuple[str, str], list[Leftovers]] = {}
            for name in taking_turns(names, s.rounds):
                t = targets[name]
                for workload, value in (
                        ("reset_timeout", t.run(reschedule_round(t.timeout, s.pairs, s.batch))),
                        ("reset_rearm", t.run(rearm_round(t.call_later, s.pairs, s.batch))),
                        ("pair", t.run(pairs_round(t.call_later, s.pairs, s.batch))),
                        ("deadline", t.run(deadline_round(s.pairs)))):
                    samples.setdefault((workload, name), []).append(value)
                for workload, lo in (("reset_timeout", t.run(t.timeout_leftovers())),
                                     ("reset_rearm", t.run(t.rearm_leftovers()))):
                    left.setdefault((name, workload), []).append(lo)
                runner.step(f"reset {count_label(pending)} {name}")
        finally:
            gc.unfreeze()
            for h in keep:
                h.cancel()
            for t in targets.values():
                t.run(settle(t.tt))
                t.loop.close()
        _add(runner, pending, names, samples, left)


def _add(runner: Runner, pending: int, names: list[str],
         samples: dict[tuple[str, str], list[float]],
         left: dict[tuple[str, str], list[Leftovers]]) -> None:
    pl = count_label(pending)
    for workload, label in KINDS:
        for name in names:
            runner.add(make_record(
                "reset", f"{workload}@{pending}", f"{label}, {pl} pending", name, "ns",
                "lower", samples[(workload, name)], per_round=runner.suite.pairs,
                pending=pending, pair=samples[("pair", name)],
                deadline=samples[("deadline", name)] if workload == "reset_timeout" else None))
        for field, unit, what in (("blocks", "blocks", "Python heap blocks left"),
                                  ("tombstones", "entries", "tombstones left")):
            for name in names:
                values = [getattr(lo, field) for lo in left[(name, workload)]]
                if None not in values:
                    runner.add(make_record(
                        "reset", f"{workload}_{field}@{pending}",
                        f"  {what} per reset, {pl} pending", name, unit, "lower",
                        values, per_round=PROBE, pending=pending))


def verdict(recs: list[dict[str, Any]]) -> list[str]:
    """Each bucketimer way of resetting against the target: no dearer than
    a schedule+cancel pair on the same loop, no heap block and no tombstone
    left."""
    by = {(r["workload"], r["contender"]): r for r in recs if r["group"] == "reset"}
    lines = []
    for name, workload, what in ((BUCKETIMER, "reset_timeout", "bucketimer Timeout.reschedule()"),
                                 (DROPIN, "reset_rearm", "drop-in cancel + re-arm"),
                                 (ASYNCIO, "reset_timeout", "asyncio Timeout.reschedule()")):
        parts = []
        for (w, c), r in sorted(by.items(), key=lambda kv: kv[1]["pending"]):
            if w != f"{workload}@{r['pending']}" or c != name:
                continue
            pend = r["pending"]
            pair = summarize(r["pair"])["median"]
            # reschedule(loop.time() + 30) pays for computing its argument,
            # which the pair row (call_later(30, ...)) does not: the ratio
            # is of the reset itself.
            clock = summarize(r["deadline"])["median"] if r.get("deadline") else 0.0
            reset = r["median"] - clock
            note = (f" ({r['median']:.0f} ns with computing now + 30: {clock:.0f} ns)"
                    if clock else "")
            blocks = by.get((f"{workload}_blocks@{pend}", name))
            tomb = by.get((f"{workload}_tombstones@{pend}", name))
            parts.append(
                f"{count_label(pend)} pending: {reset:.0f} ns = "
                f"{reset / pair:.2f}x its pair{note}"
                + (f", {blocks['median']:.2f} blocks" if blocks else "")
                + (f", {tomb['median']:.2f} tombstones" if tomb else ""))
        if parts:
            lines.append(f"reset, {what}: " + "; ".join(parts)
                         + " (target: <= 1x, 0 blocks, 0 tombstones).")
    return lines
