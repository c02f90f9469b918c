"""Records and their statistics: one record is one table cell (a workload
measured on one contender over rounds), with every round's value, its
summary (median, quartiles, p10/p90, min, max, mean) and its ratio to the
``bucketimer`` column of the same row (docs/performance.rst, "What the rows
measure")."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

from .._backend import HIST_BUCKETS as HIST_BUCKETS  # of stats()["lateness_hist"]
from ._contenders import BUCKETIMER


def count_label(n: float) -> str:
    """1000000 -> '1M', 10000 -> '10k' (a whole float too: a DataFrame's
    column of counts with gaps holds floats)."""
    if isinstance(n, float) and n.is_integer():
        n = int(n)
    for div, suffix in ((1_000_000, "M"), (1000, "k")):
        if n >= div and n % div == 0:
            return f"{n // div}{suffix}"
    return str(n)


def quantile(sorted_values: Sequence[float], q: float) -> float:
    """Linear-interpolation quantile of already sorted values."""
    n = len(sorted_values)
    if n == 0:
        return math.nan
    pos = (n - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, n - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def summarize(samples: Iterable[float]) -> dict[str, float]:
    v = sorted(float(x) for x in samples)
    if not v:
        nan = math.nan
        return {k: nan for k in ("median", "p10", "p25", "p75", "p90", "min", "max", "mean")}
    return {
        "median": quantile(v, 0.5),
        "p10": quantile(v, 0.1),
        "p25": quantile(v, 0.25),
        "p75": quantile(v, 0.75),
        "p90": quantile(v, 0.9),
        "min": v[0],
        "max": v[-1],
        "mean": sum(v) / len(v),
    }


def log2_hist(values_ns: Iterable[int], hist: list[int] | None = None) -> list[int]:
    """The core's lateness histogram format: bucket i counts [2^(i-1), 2^i) ns,
    bucket 0 counts values <= 0."""
    h = hist if hist is not None else [0] * HIST_BUCKETS
    top = HIST_BUCKETS - 1
    for v in values_ns:
        i = 0 if v <= 0 else min(int(v).bit_length(), top)
        h[i] += 1
    return h


def make_record(group: str, workload: str, label: str, contender: str, unit: str,
                better: str, samples: Sequence[float], *, per_round: int = 0,
                pending: int | None = None, threads: int | None = None,
                note: str = "", **extra: Any) -> dict[str, Any]:
    """One table cell: a workload measured on one contender."""
    rec: dict[str, Any] = {
        "group": group, "workload": workload, "label": label, "contender": contender,
        "unit": unit, "better": better, "rounds": len(samples), "per_round": per_round,
        "pending": pending, "threads": threads,
    }
    rec.update(summarize(samples))
    rec["samples"] = [float(x) for x in samples]
    rec["ratio"] = math.nan  # contender / bucketimer, filled in by add_ratios
    rec["note"] = note
    rec.update(extra)
    return rec


# Units whose cells have no ratio to the bucketimer column.
NO_RATIO_UNITS = ("x", "count", "%", "blocks", "entries")


def add_ratios(records: list[dict[str, Any]]) -> None:
    """Sets each record's ratio: its median over bucketimer's on the same row."""
    base = {r["workload"]: r["median"] for r in records if r["contender"] == BUCKETIMER}
    for r in records:
        b = base.get(r["workload"])
        if r["unit"] in NO_RATIO_UNITS or b is None or not b or math.isnan(b):
            r["ratio"] = math.nan
        else:
            r["ratio"] = r["median"] / b
