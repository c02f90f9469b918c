"""Deadline resets: the kit's reset workloads (``python -m bucketimer.bench
--only reset``, docs/performance.rst, "Deadline resets") as
pytest-benchmark cases.

* ``reset[reschedule-<pending>]``: ``Timeout.reschedule(loop.time() + 30)``
  of a pending timeout: bucketimer's (``bucketimer``, on the stock loop) and
  asyncio's on each loop.
* ``reset[rearm-<pending>]``: ``h.cancel(); h = loop.call_later(30, cb)``.

Each round is ``N`` resets; ``extra_info`` has the time per reset and what
one leaves behind: Python-heap blocks still allocated and tombstones
(cancelled entries still held by the loop's heap or the core).

``BUCKETIMER_BENCH_QUICK=1`` drops the 1 000 000-pending cases.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
from _figures import per_op
from _kinds import LOOP_KINDS

from bucketimer.bench.workloads import ResetTarget, fill, rearm_round, reschedule_round, settle

QUICK = bool(os.environ.get("BUCKETIMER_BENCH_QUICK"))
N, BATCH = 2000, 1000
PENDING = [0, 10_000] + ([] if QUICK else [1_000_000])
# The helper on the stock loop, then asyncio's Timeout on each loop kind.
CONTENDERS = {"bucketimer": "bucketimer", **LOOP_KINDS}


@pytest.mark.parametrize("contender", sorted(CONTENDERS))
@pytest.mark.parametrize("pending", PENDING)
@pytest.mark.parametrize("kind", ["reschedule", "rearm"])
def test_reset(benchmark: Any, kind: str, pending: int, contender: str) -> None:
    benchmark.group = f"reset[{kind}-{pending} pending]"
    t = ResetTarget(CONTENDERS[contender])
    keep = t.run(fill(t.call_later, pending, t.tt))
    try:
        if kind == "reschedule":
            body = lambda: t.run(reschedule_round(t.timeout, N, BATCH))  # noqa: E731
            left = t.run(t.timeout_leftovers())
        else:
            body = lambda: t.run(rearm_round(t.call_later, N, BATCH))  # noqa: E731
            left = t.run(t.rearm_leftovers())
        benchmark.pedantic(body, rounds=20, warmup_rounds=2, iterations=1)
    finally:
        for h in keep:
            h.cancel()
        t.run(settle(t.tt))
        t.loop.close()
    benchmark.extra_info.update({
        "per_reset_ns": per_op(benchmark, N, 1e9),
        "heap_blocks_left": None if left.blocks is None else round(left.blocks, 3),
        "tombstones_left": None if left.tombstones is None else round(left.tombstones, 3)})
