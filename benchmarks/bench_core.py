"""schedule + cancel from Python inside a running loop: bucketimer vs asyncio.

Every RPC deadline and every ``asyncio.timeout`` is a timer that is almost
never fired, so the pair is the cost that matters.  Each benchmark runs
``INNER`` pairs per round (the kit's ``sync_pairs``) inside a running loop,
with 0, 10 000 or 1 000 000 other timers already pending (the kit's
``PairsTarget``), and pytest-benchmark groups the contenders by pending
count so they sit side by side::

    python -m pytest benchmarks/bench_core.py --benchmark-only \\
        --benchmark-disable-gc --benchmark-columns=median,iqr,ops

Figures are per round of INNER pairs: divide the median by INNER for one
pair.  ``python benchmarks/bench_core.py [ROUNDS]`` prints per-pair medians
and the ratios directly (``python -m bucketimer.bench --only pairs``).
``BUCKETIMER_BENCH_QUICK=1`` drops the 1 000 000-pending cases.
"""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest

from bucketimer import bench
from bucketimer.bench.workloads import PairsTarget, sync_pairs

INNER = 1000
PENDING = [0, 10_000] + ([] if os.environ.get("BUCKETIMER_BENCH_QUICK") else [1_000_000])


@pytest.mark.parametrize("pending", PENDING, ids=lambda n: f"pending={n}")
@pytest.mark.parametrize("contender", ["bucketimer", "asyncio"])
def test_schedule_cancel_pair(benchmark: Any, contender: str, pending: int) -> None:
    benchmark.group = f"schedule+cancel x{INNER}, {pending} pending"
    target = PairsTarget(contender, pending)
    try:
        call_later = target.call_later
        target.inside(lambda: sync_pairs(call_later, INNER))  # warm-up
        target.inside(lambda: benchmark.pedantic(
            sync_pairs, args=(call_later, INNER),
            rounds=200 if pending < 1_000_000 else 100, iterations=1))
    finally:
        target.close()


def main() -> int:
    """Per-pair medians and ratios, side by side, in one process."""
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else None
    data = bench.run("full", groups=["pairs"], contenders=["bucketimer", "asyncio"],
                     rounds=rounds, as_frame=False)
    print(bench.format_table(data, sys.stdout))
    return 0


if __name__ == "__main__":
    sys.exit(main())
