"""The suites' sizes (``smoke``, ``quick``, ``full``) and the order in which
contenders take their turns: every key once per round, each round starting
one further along, so that a machine whose speed drifts moves every column
of a round alike (docs/performance.rst, "What the rows measure")."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, TypeVar

_K = TypeVar("_K")


@dataclass(frozen=True)
class Suite:
    """Sizes of one suite.  ``SUITES`` holds the standard ones."""

    name: str
    rounds: int
    pairs: int  # schedule+cancel pairs per round, from Python
    batch: int  # pairs between two yields to the loop
    pending: tuple[int, ...]  # pending timers under the pairs rows
    timeouts: int  # timeout() enter+exit per round
    late_timers: int  # timers per lateness round
    late_window: float  # s over which their deadlines are spread
    noloop_pairs: int
    noloop_pending: int
    thread_timer_pairs: int  # threading.Timer starts a thread per timer
    thread_timer_late: int
    core_pairs: int  # pairs per thread per round, in C
    core_threads: tuple[int, ...]
    core_pending: int
    service_conns: tuple[int, ...]  # concurrent connections of the service rows
    service_rounds: int  # turns of each contender at each size
    service_warmup: float  # s of load before the measured window
    service_window: float  # s of the measured window
    grpc_sets: int  # fresh sets of gRPC servers per API
    grpc_calls: int  # interleaved calls to each server of a set


SUITES: dict[str, Suite] = {
    # For tests: every code path, tiny sizes (a few seconds).
    "smoke": Suite("smoke", rounds=3, pairs=1000, batch=250, pending=(0, 1000),
                   timeouts=300, late_timers=40, late_window=0.02, noloop_pairs=1000,
                   noloop_pending=1000, thread_timer_pairs=10, thread_timer_late=10,
                   core_pairs=20_000, core_threads=(1, 2), core_pending=10_000,
                   service_conns=(20,), service_rounds=1, service_warmup=0.1,
                   service_window=0.3, grpc_sets=2, grpc_calls=30),
    # The default (`--quick` names it too): every group, the whole table in
    # about a minute (half of it the service rows).
    "quick": Suite("quick", rounds=5, pairs=20_000, batch=1000, pending=(0, 10_000, 100_000),
                   timeouts=5000, late_timers=300, late_window=0.1, noloop_pairs=10_000,
                   noloop_pending=10_000, thread_timer_pairs=100, thread_timer_late=50,
                   core_pairs=300_000, core_threads=(1, 2, 4), core_pending=100_000,
                   service_conns=(100, 1000), service_rounds=3, service_warmup=0.2,
                   service_window=0.5, grpc_sets=2, grpc_calls=300),
    # `--full`: about ten minutes (the 10 000-connection service rows: four).
    "full": Suite("full", rounds=9, pairs=100_000, batch=1000,
                  pending=(0, 10_000, 1_000_000), timeouts=20_000, late_timers=2000,
                  late_window=0.3, noloop_pairs=50_000, noloop_pending=10_000,
                  thread_timer_pairs=300, thread_timer_late=200, core_pairs=2_000_000,
                  core_threads=(1, 2, 4), core_pending=1_000_000,
                  service_conns=(100, 1000, 10_000), service_rounds=5, service_warmup=1.0,
                  service_window=3.0, grpc_sets=4, grpc_calls=2000),
}


def suite_by_name(name: str, **overrides: Any) -> Suite:
    try:
        s = SUITES[name]
    except KeyError:
        raise ValueError(f"unknown suite {name!r}; known: {sorted(SUITES)}") from None
    return replace(s, **overrides) if overrides else s


def suite_dict(s: Suite) -> dict[str, Any]:
    return asdict(s)


def taking_turns(keys: Sequence[_K], rounds: int) -> Iterator[_K]:
    """Every key once per round, ``rounds`` times, each round starting one
    further along, so that no column always runs first (or last)."""
    keys = list(keys)
    for i in range(rounds):
        j = i % len(keys)
        yield from keys[j:] + keys[:j]
