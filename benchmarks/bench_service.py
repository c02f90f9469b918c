"""A real service under load: the kit's service benchmark (``python -m
bucketimer.bench --only service``, docs/performance.rst, "The service
benchmark") as pytest-benchmark cases.

Each case is ``ROUNDS`` turns of one contender at one size: a fresh streams
server on 127.0.0.1 in its own process under N connections of a load
generator in another.  pytest-benchmark's time is the length of a turn
(warm-up + window, so nearly constant); the figures are in ``extra_info``
(medians over the turns: requests/s, latency p50/p99 in ms, worst loop
stall in ms, server RSS in MiB, server and client busy %) and printed.
Cases run one after the other, not in turns: for ratios that a drifting
machine cannot skew, use the kit's table.

``BUCKETIMER_BENCH_QUICK=1`` runs 100 and 1 000 connections, shorter.

A turn whose figures cannot be read even with a longer window (a loaded
machine gave the server's loop no CPU for the whole window:
``ServiceUnmeasured``) still has to have served every connection right; it
adds no figure, and its reason is in ``extra_info["unmeasured"]``.
"""

from __future__ import annotations

import os
import statistics
from typing import Any

import pytest

from bucketimer.bench.workloads import (
    ServiceTurn,
    ServiceUnmeasured,
    service_contenders,
    service_turn,
)

QUICK = bool(os.environ.get("BUCKETIMER_BENCH_QUICK"))
CONNS = [100, 1000] + ([] if QUICK else [10_000])
ROUNDS = 2 if QUICK else 3
WARMUP, WINDOW = (0.2, 0.5) if QUICK else (1.0, 3.0)


@pytest.mark.parametrize("contender", service_contenders())
@pytest.mark.parametrize("conns", CONNS, ids=lambda n: f"{n}conns")
def test_service(benchmark: Any, conns: int, contender: str) -> None:
    benchmark.group = f"service[{conns} conns]"
    turns: list[ServiceTurn] = []
    unmeasured: list[str] = []

    def turn() -> None:
        try:
            turns.append(service_turn(contender, conns, WARMUP, WINDOW))
        except ServiceUnmeasured as e:
            assert e.requests > 0 and not e.errors, e  # it served, and served right
            unmeasured.append(e.reason)

    benchmark.pedantic(turn, rounds=ROUNDS, iterations=1)
    for t in turns:
        assert t.requests > 0 and not t.errors, t
    if unmeasured:
        benchmark.extra_info["unmeasured"] = unmeasured
        print(f"\n  service {contender} {conns} conns: {len(unmeasured)} of {ROUNDS} turns "
              f"not measured: {unmeasured[-1]}")
    if not turns:
        return

    def med(field: str, scale: float = 1.0) -> float:
        return round(statistics.median(getattr(t, field) for t in turns) * scale, 2)

    info = {"rps": med("rps"), "p50_ms": med("p50_ns", 1e-6), "p99_ms": med("p99_ns", 1e-6),
            "stall_ms": med("stall_ns", 1e-6), "rss_mib": med("rss_mib"),
            "server_busy_pct": med("server_busy", 100), "client_busy_pct": med("client_busy", 100)}
    benchmark.extra_info.update(info)
    print(f"\n  service {contender} {conns} conns: {info}")
