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
"""

from __future__ import annotations

import os
import statistics
from typing import Any

import pytest

from bucketimer.bench.workloads import ServiceTurn, service_contenders, service_turn

QUICK = bool(os.environ.get("BUCKETIMER_BENCH_QUICK"))
CONNS = [100, 1000] + ([] if QUICK else [10_000])
ROUNDS = 2 if QUICK else 3
WARMUP, WINDOW = (0.2, 0.5) if QUICK else (1.0, 3.0)


@pytest.mark.parametrize("contender", service_contenders())
@pytest.mark.parametrize("conns", CONNS, ids=lambda n: f"{n}conns")
def test_service(benchmark: Any, conns: int, contender: str) -> None:
    benchmark.group = f"service[{conns} conns]"
    turns: list[ServiceTurn] = []
    benchmark.pedantic(lambda: turns.append(service_turn(contender, conns, WARMUP, WINDOW)),
                       rounds=ROUNDS, iterations=1)

    def med(field: str, scale: float = 1.0) -> float:
        return round(statistics.median(getattr(t, field) for t in turns) * scale, 2)

    info = {"rps": med("rps"), "p50_ms": med("p50_ns", 1e-6), "p99_ms": med("p99_ns", 1e-6),
            "stall_ms": med("stall_ns", 1e-6), "rss_mib": med("rss_mib"),
            "server_busy_pct": med("server_busy", 100), "client_busy_pct": med("client_busy", 100)}
    benchmark.extra_info.update(info)
    print(f"\n  service {contender} {conns} conns: {info}")
