"""schedule + cancel from Python inside a running loop: bucketimer vs asyncio.

Every RPC deadline and every ``asyncio.timeout`` is a timer that is almost
never fired, so the pair is the cost that matters.  Each benchmark runs
``INNER`` pairs per round inside a running loop, with 0, 10 000 or
1 000 000 other timers already pending, and pytest-benchmark groups the
contenders by pending count so they sit side by side::

    python -m pytest benchmarks/bench_core.py --benchmark-only \\
        --benchmark-disable-gc --benchmark-columns=median,iqr,ops

Figures are per round of INNER pairs: divide the median by INNER for one
pair.  ``python benchmarks/bench_core.py`` prints per-pair medians and the
ratios directly.
"""

from __future__ import annotations

import asyncio
import gc
import statistics
import sys
import time

import pytest

import bucketimer

INNER = 1000
PENDING = [0, 10_000, 1_000_000]


def _noop() -> None:
    pass


def _pairs_bucketimer(tt: bucketimer.TimerThread) -> None:
    call_later = tt.call_later
    for _ in range(INNER):
        call_later(30, _noop).cancel()


def _pairs_asyncio(loop: asyncio.AbstractEventLoop) -> None:
    call_later = loop.call_later
    for _ in range(INNER):
        call_later(30, _noop).cancel()


class _Setup:
    """A running loop (entered, not spinning) with `pending` timers parked in
    the contender's structure for the length of the benchmark."""

    def __init__(self, contender: str, pending: int) -> None:
        self.loop = asyncio.new_event_loop()
        self.tt = bucketimer.TimerThread()
        self.handles = []
        asyncio.events._set_running_loop(self.loop)
        if contender == "bucketimer":
            schedule = self.tt.call_later
        else:
            schedule = self.loop.call_later
        for _ in range(pending):
            self.handles.append(schedule(3600, _noop))
        if pending:
            # Steady state: let the timer thread finish moving the pending
            # timers from its bucket lists into its heap before measuring.
            time.sleep(0.5)
        self.run = (
            (lambda: _pairs_bucketimer(self.tt))
            if contender == "bucketimer"
            else (lambda: _pairs_asyncio(self.loop))
        )
        self.run()  # warm up: first port, free lists, caches

    def close(self) -> None:
        for h in self.handles:
            h.cancel()
        self.handles.clear()
        asyncio.events._set_running_loop(None)
        self.tt.close()
        self.loop.close()


@pytest.mark.parametrize("pending", PENDING, ids=lambda n: f"pending={n}")
@pytest.mark.parametrize("contender", ["bucketimer", "asyncio"])
def test_schedule_cancel_pair(benchmark, contender: str, pending: int) -> None:
    benchmark.group = f"schedule+cancel x{INNER}, {pending} pending"
    setup = _Setup(contender, pending)
    try:
        benchmark.pedantic(setup.run, rounds=200 if pending < 1_000_000 else 100, iterations=1)
    finally:
        setup.close()


def main() -> None:
    """Per-pair medians and ratios, side by side, in one process."""
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    print(f"{'pending':>9} {'bucketimer ns':>14} {'asyncio ns':>11} {'ratio':>7}")
    for pending in PENDING:
        med = {}
        for contender in ("bucketimer", "asyncio"):
            setup = _Setup(contender, pending)
            samples = []
            gc.disable()
            try:
                for _ in range(rounds):
                    t0 = time.perf_counter_ns()
                    setup.run()
                    samples.append((time.perf_counter_ns() - t0) / INNER)
            finally:
                gc.enable()
                setup.close()
            med[contender] = statistics.median(samples)
        print(
            f"{pending:>9} {med['bucketimer']:>14.0f} {med['asyncio']:>11.0f} "
            f"{med['asyncio'] / med['bucketimer']:>6.1f}x"
        )


if __name__ == "__main__":
    main()
