"""The per-operation figure the pytest-benchmark wrappers put in
``extra_info``: a round's median over the operations it did."""

from __future__ import annotations

from typing import Any


def per_op(benchmark: Any, n: int, unit: float) -> float | None:
    """The median round's time per operation, in ``unit`` (1e6: µs, 1e9: ns);
    None under ``--benchmark-disable``, where each body runs once, as a
    check, and nothing is timed."""
    stats = benchmark.stats
    return None if stats is None else stats.stats.median / n * unit
