"""The ``pairs`` group: what a schedule+cancel pair costs from Python inside
a running loop, with 0 to 1 M other timers pending (docs/performance.rst,
"What the rows measure").  Almost every timer a deadline arms is cancelled
before it fires, so this pair is the cost that matters."""

from __future__ import annotations

import asyncio
import gc
import random
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

import bucketimer
from bucketimer._backend import DEFAULT_DRAIN_THRESHOLD

from ._contenders import BUCKETIMER, DROPIN, DROPIN_UV, PURE, new_loop, pure_timer_thread, with_pure
from ._records import count_label, make_record
from ._suite import taking_turns
from ._timing import Stopwatch

if TYPE_CHECKING:
    from ._runner import Runner

_T = TypeVar("_T")

PAIR_DELAY = 30.0  # s: the timer of a schedule+cancel pair never fires
PENDING_MIN, PENDING_MAX = 10.0, 3600.0  # s: deadlines of the pending timers
# Below these the core has taken in what was scheduled and swept what was
# cancelled (its drain threshold per bucket).
SETTLED_DEAD = DEFAULT_DRAIN_THRESHOLD
SETTLED_LIST = 2 * SETTLED_DEAD


def noop(*args: Any) -> None:
    pass


async def pairs_round(call_later: Callable[..., Any], n: int, batch: int) -> float:
    """ns per ``call_later(30, cb).cancel()`` pair, yielding to the loop every
    ``batch`` pairs (so a loop that cleans up cancelled timers between
    iterations does, inside the timing)."""
    cb = noop
    delay = PAIR_DELAY
    sleep = asyncio.sleep
    inner = range(batch)
    loops = max(1, n // batch)
    with Stopwatch() as sw:
        for _ in range(loops):
            for _ in inner:
                call_later(delay, cb).cancel()
            await sleep(0)
    return sw.ns / (loops * batch)


def sync_pairs(call_later: Callable[..., Any], n: int) -> float:
    """ns per ``call_later(30, cb).cancel()``, ``n`` in a row with no yield
    (in a running loop when called from its coroutine, else with none)."""
    cb = noop
    delay = PAIR_DELAY
    with Stopwatch() as sw:
        for _ in range(n):
            call_later(delay, cb).cancel()
    return sw.ns / n


async def fill(call_later: Callable[..., Any], pending: int,
               tt: bucketimer.TimerThread | None) -> list[Any]:
    """``pending`` timers due 10 s to 1 h from now (never during a run)."""
    rng = random.Random(pending)
    span = PENDING_MAX - PENDING_MIN
    keep = [call_later(PENDING_MIN + span * rng.random(), noop) for _ in range(pending)]
    await settle(tt)  # let a timer thread take them in
    return keep


async def settle(tt: bucketimer.TimerThread | None, limit: float = 10.0) -> None:
    """Waits (untimed) until a bucketimer TimerThread has caught up: the
    timers just scheduled are in its heap and the ones just cancelled are
    swept.  Otherwise that work runs beside the next measurement and slows
    it down (it is the point of the design that it runs in the background,
    but it is not what a schedule+cancel pair costs)."""
    await asyncio.sleep(0.01)
    if tt is None:
        return
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        st = tt.stats()
        if st["dead"] < SETTLED_DEAD and st["list_size"] < SETTLED_LIST:
            return
        await asyncio.sleep(0.02)


class PairsTarget:
    """A fresh loop of contender ``name`` with ``pending`` timers parked on
    the ``call_later`` that is measured; bucketimer's columns get a
    TimerThread of their own (``bucketimer``: its ``call_later`` on the stock
    loop; the drop-in loops: their own ``call_later``, served by it)."""

    def __init__(self, name: str, pending: int) -> None:
        self.tt: bucketimer.TimerThread | None = None
        self.pure: bucketimer.TimerThread | None = pure_timer_thread() if name == PURE else None
        if name in (BUCKETIMER, DROPIN, DROPIN_UV):
            self.tt = bucketimer.TimerThread()
        self.loop = new_loop(name, self.tt)
        self.call_later: Callable[..., Any] = (
            self.tt.call_later if name == BUCKETIMER and self.tt is not None
            else self.pure.call_later if self.pure is not None
            else self.loop.call_later)
        self.keep: list[Any] = []
        try:
            self.keep = self.loop.run_until_complete(fill(self.call_later, pending, self.tt))
        except BaseException:
            self.close()
            raise

    def round(self, n: int, batch: int) -> float:
        """ns per pair over ``n`` pairs (:func:`pairs_round`)."""
        return self.loop.run_until_complete(pairs_round(self.call_later, n, batch))

    def inside(self, fn: Callable[[], _T]) -> _T:
        """``fn()`` called from a coroutine of the target's loop (so that it
        runs in a running loop, as a library's code does)."""

        async def call() -> _T:
            return fn()

        return self.loop.run_until_complete(call())

    def close(self) -> None:
        """Cancels what was pending (untimed): nothing may linger in a timer
        thread after the loop closes."""
        for h in self.keep:
            h.cancel()
        self.keep = []
        if not self.loop.is_closed():
            self.loop.run_until_complete(settle(self.tt))
            self.loop.close()
        for tt in (self.tt, self.pure):
            if tt is not None:
                tt.close()


def steps(runner: Runner) -> int:
    return len(runner.suite.pending) * len(contenders(runner)) * runner.suite.rounds


def contenders(runner: Runner) -> list[str]:
    return list(with_pure(runner.loops, runner.want))


def run(runner: Runner) -> None:
    """Pairs of every contender at every pending level.  Each (contender,
    level) has its own loop -- and, for bucketimer's columns, its own
    TimerThread -- all set up at once (~1.6 GB with a million pending per
    column), and they take turns round by round: both the ratios between
    columns and the flatness from 0 to 1 000 000 pending are read off rounds
    taken at the same moments, whatever the speed of a shared machine does
    meanwhile."""
    s = runner.suite
    targets: dict[tuple[str, int], PairsTarget] = {}
    try:
        for name in contenders(runner):
            for pending in s.pending:
                targets[(name, pending)] = PairsTarget(name, pending)
        gc.collect()
        gc.freeze()  # the pending handles: out of the collector's way
        for target in targets.values():  # warm-up
            target.round(min(s.pairs, 2000), s.batch)
        samples: dict[tuple[str, int], list[float]] = {k: [] for k in targets}
        for key in taking_turns(list(targets), s.rounds):
            samples[key].append(targets[key].round(s.pairs, s.batch))
            runner.step(f"pairs {count_label(key[1])} {key[0]}")
    finally:
        gc.unfreeze()
        for target in targets.values():
            target.close()
    for pending in s.pending:
        for name in contenders(runner):
            runner.add(make_record("pairs", f"pairs@{pending}",
                                   f"pairs in a loop, {count_label(pending)} pending", name,
                                   "ns", "lower", samples[(name, pending)], per_round=s.pairs,
                                   pending=pending))
