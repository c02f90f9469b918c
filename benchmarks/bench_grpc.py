"""Overhead of the bucketimer.grpc interceptors on a unary echo call: the
kit's gRPC workload (``python -m bucketimer.bench --only grpc``,
:mod:`bucketimer.bench.grpc_echo`) as pytest-benchmark cases.

A unary-unary echo over 127.0.0.1 to servers with no interceptor
("plain"), two pass-throughs ("2 no-op"), two that wrap the handler ("2
wrappers") and ``SlowCallInterceptor`` + ``ServerDeadlineInterceptor``
("deadline+slow"), sync and aio.  Target (docs/grpc.rst, "Costs"):
deadline+slow within 1.02x of 2 no-op at the median.

* ``grpc-sync-unary-echo``, ``grpc-aio-unary-echo``: each server, ``CALLS``
  sequential calls per round (``per_call_us`` in ``extra_info``); one set of
  servers, so their ratios carry that set's placement offset.
* ``grpc-interleaved``: the servers called in turn over three fresh sets,
  which cancels most of the machine's drift; medians and ratios in
  ``extra_info``: compare with that one.

``tools/bench_grpc.py`` prints the interleaved figures directly, with
options for a developer of the interceptors (another checkout's side by
side, the parts, pinning, the chain alone under callgrind).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from _figures import per_op

ge = pytest.importorskip("bucketimer.bench.grpc_echo", exc_type=ImportError)

CALLS = 200  # sequential calls per pytest-benchmark round
SETS, INTERLEAVED = 3, 1000


@pytest.fixture(scope="module")
def sync_calls() -> Iterator[dict[str, Callable[..., Any]]]:
    with ge.sync_servers(ge.interceptor_sets("sync", parts=False)) as calls:
        yield calls


@pytest.fixture(scope="module")
def aio_servers() -> Iterator[Any]:
    servers = ge.AioServers(ge.interceptor_sets("aio", parts=False))
    try:
        yield servers
    finally:
        servers.close()


@pytest.mark.parametrize("server", ge.SERVERS)
def test_sync_unary_echo(benchmark: Any, sync_calls: dict[str, Callable[..., Any]],
                         server: str) -> None:
    """Sync unary echo, CALLS per round (compare in grpc-interleaved)."""
    benchmark.group = "grpc-sync-unary-echo"
    call = sync_calls[server]

    def batch() -> None:
        for _ in range(CALLS):
            call(ge.PAYLOAD, timeout=ge.CLIENT_TIMEOUT)

    benchmark.extra_info["calls_per_round"] = CALLS
    benchmark.pedantic(batch, rounds=15, warmup_rounds=2, iterations=1)
    benchmark.extra_info["per_call_us"] = per_op(benchmark, CALLS, 1e6)


@pytest.mark.parametrize("server", ge.SERVERS)
def test_aio_unary_echo(benchmark: Any, aio_servers: Any, server: str) -> None:
    """aio unary echo, CALLS per round in one task (compare in grpc-interleaved)."""
    benchmark.group = "grpc-aio-unary-echo"
    benchmark.extra_info["calls_per_round"] = CALLS
    benchmark.pedantic(lambda: aio_servers.run(aio_servers.batch(server, CALLS)),
                       rounds=15, warmup_rounds=2, iterations=1)
    benchmark.extra_info["per_call_us"] = per_op(benchmark, CALLS, 1e6)


@pytest.mark.parametrize("api", ge.API)
def test_interleaved_overhead(benchmark: Any, api: str) -> None:
    """The servers called in turn, over SETS fresh sets of servers (one set's
    own placement offset can be several %): medians and ratios in extra_info."""
    benchmark.group = "grpc-interleaved"
    m = benchmark.pedantic(ge.measure, args=(api, SETS, INTERLEAVED), kwargs={"parts": False},
                           rounds=1, iterations=1)
    summary = ge.summarize(m.pooled)
    ratios = [ge.summarize(one)["ratio_vs_noop"] for one in m.per_set]
    benchmark.extra_info.update(summary)
    benchmark.extra_info["per_round_ratios"] = ratios
    print(f"\n{api}: plain {summary['plain_median_us']:.1f} us, 2 no-op "
          f"{summary['noop_median_us']:.1f} us, 2 wrappers {summary['wrappers_median_us']:.1f} us, "
          f"deadline+slow {summary['intercepted_median_us']:.1f} us: "
          f"{summary['ratio_vs_noop']:.3f} x 2 no-op (target <= {ge.TARGET}; per set "
          f"{' '.join(f'{r:.3f}' for r in ratios)})")
