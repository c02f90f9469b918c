"""The ``grpc`` group: what the :mod:`bucketimer.grpc` interceptors add to a
unary echo call over 127.0.0.1, sync and aio (the workload:
:mod:`bucketimer.bench.grpc_echo`).  The servers are the rows, all in the
``bucketimer`` column: each row's rounds are the medians of its fresh sets
of servers, whose calls took turns with every other server's.  Under the
table: deadline+slow against the target, and what each part costs."""

from __future__ import annotations

import statistics
from typing import TYPE_CHECKING, Any

from ._contenders import BUCKETIMER
from ._records import make_record

if TYPE_CHECKING:
    from ._runner import Runner

_MISSING = "grpcio is not installed: no grpc rows (pip install grpcio)"
API = ("sync", "aio")
TARGET = 1.02  # deadline+slow / 2 no-op, at the median
#: The servers, by their interceptors: none; two pass-throughs (what grpc's
#: own interceptor machinery costs); two pass-throughs that wrap the handler
#: and set a ContextVar around it (the least any pair of interceptors that
#: act around the handler costs); ``SlowCallInterceptor`` +
#: ``ServerDeadlineInterceptor``; and the same two as one interceptor,
#: ``ServerDeadlineSlowCallInterceptor`` ("combined": one wrapper, and one
#: interceptor fewer in grpc's pipeline).
SERVERS = ("plain", "2 no-op", "2 wrappers", "deadline+slow", "combined")
#: deadline+slow's parts: each of the two beside a no-op, and both on a
#: stand-in TimerThread that arms nothing (what they cost without timers).
PARTS = ("slow + no-op", "no-op + deadline", "no timers")


def _available() -> bool:
    # grpc.aio, not grpc: a directory named grpc on sys.path (a checkout's
    # tests/grpc) imports as an empty namespace package.
    try:
        import grpc.aio  # noqa: F401
    except ImportError:
        return False
    return True


def steps(runner: Runner) -> int:
    return len(API) * runner.suite.grpc_sets if _available() else 0


def run(runner: Runner) -> None:
    if not _available():
        runner.notes.append(_MISSING)
        return
    from . import grpc_echo

    s = runner.suite
    for api in API:
        m = grpc_echo.measure(api, s.grpc_sets, s.grpc_calls, step=runner.step)
        for name in m.pooled:
            runner.add(make_record(
                "grpc", f"grpc_{api}@{name}", f"gRPC {api} unary echo, {name}", BUCKETIMER,
                "ns", "lower", [statistics.median(one[name]) * 1e9 for one in m.per_set],
                per_round=s.grpc_calls, api=api, server=name))
        runner.add(make_record(
            "grpc", f"grpc_{api}_vs_noop", f"gRPC {api}: deadline+slow / 2 no-op", BUCKETIMER,
            "x", "lower", [grpc_echo.summarize(one)["ratio_vs_noop"] for one in m.per_set],
            per_round=s.grpc_calls, api=api))


def verdict(recs: list[dict[str, Any]]) -> list[str]:
    """A line per API: deadline+slow against the target, and what it and
    each part add over 2 no-op (medians of the sets' medians)."""
    by = {r["workload"]: r for r in recs if r["group"] == "grpc"}
    lines = []
    for api in API:
        ratio, noop = by.get(f"grpc_{api}_vs_noop"), by.get(f"grpc_{api}@2 no-op")
        if ratio is None or noop is None:
            continue
        added = []
        for name in ("2 wrappers", "deadline+slow", "combined", *PARTS):
            r = by.get(f"grpc_{api}@{name}")
            if r is not None:
                added.append(f"{name} {(r['median'] - noop['median']) / 1e3:+.1f}")
        met = "met" if ratio["median"] <= TARGET else "missed"
        combined = by.get(f"grpc_{api}@combined")
        as_one = ("" if combined is None else
                  f", combined {combined['median'] / noop['median']:.3f}x")
        lines.append(f"gRPC {api}: deadline+slow {ratio['median']:.3f}x 2 no-op (target "
                     f"<= {TARGET}: {met}){as_one}; us a call over 2 no-op: "
                     + ", ".join(added) + ".")
    return lines
