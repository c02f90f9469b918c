"""Overhead of the bucketimer.grpc interceptors on a unary echo call.

A unary-unary echo (bytes, no protobuf) over 127.0.0.1, with the server
running no interceptor ("plain"), two pass-through interceptors ("2 no-op":
what grpc's own interceptor machinery costs) or ``SlowCallInterceptor`` +
``ServerDeadlineInterceptor`` ("deadline+slow"), for the sync and the aio
APIs, side by side in one process.  Every call carries a client timeout, so
the deadline interceptor works out a budget (the smaller of the client
deadline and ``max_time``) and arms a timer; with the slow-call interceptor
that is two schedule+cancel pairs per call.  Target: **<= 5 %** added latency
(deadline+slow vs plain) at the median.

pytest-benchmark (the bench nox session)::

    pytest benchmarks/bench_grpc.py --benchmark-only --benchmark-disable-gc

Groups ``grpc-sync-unary-echo`` and ``grpc-aio-unary-echo`` hold the three
servers each (per round: ``CALLS`` sequential calls; ``per_call_us`` in
``extra_info``); one set of servers, so their ratios carry that set's
placement offset.  ``grpc-interleaved`` calls the servers in turn over three
fresh sets, which cancels most of the machine's drift, and records the
medians and ratios in ``extra_info``: compare with that one.

Plain mode prints the interleaved medians and ratios over several fresh sets
of servers (``--pin CPU`` runs everything on one CPU: steadier figures)::

    python benchmarks/bench_grpc.py [--calls 2000] [--rounds 4] [--pin 1] [--quick]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import pytest

grpc = pytest.importorskip("grpc")

import bucketimer.grpc as btg  # noqa: E402
import bucketimer.grpc.aio as bta  # noqa: E402

SERVICE = "bt.Bench"
METHOD = f"/{SERVICE}/Echo"
PAYLOAD = b"x" * 32
CLIENT_TIMEOUT = 30.0   # every call has a deadline: the interceptor computes a budget
MAX_TIME = 60.0         # never reached
SLOW_THRESHOLD = 30.0   # never reached
CALLS = 200             # sequential calls per pytest-benchmark round


class _NoopInterceptor(grpc.ServerInterceptor):
    """Passes every call through: what grpc's interceptor machinery costs."""

    def intercept_service(self, continuation: Any, handler_call_details: Any) -> Any:
        return continuation(handler_call_details)


class _AioNoopInterceptor(grpc.aio.ServerInterceptor):
    async def intercept_service(self, continuation: Any, handler_call_details: Any) -> Any:
        return await continuation(handler_call_details)


def _sync_contenders() -> list[tuple[str, list[Any]]]:
    return [("plain", []),
            ("2 no-op", [_NoopInterceptor(), _NoopInterceptor()]),
            ("deadline+slow", [btg.SlowCallInterceptor(SLOW_THRESHOLD),
                               btg.ServerDeadlineInterceptor(MAX_TIME)])]


def _aio_contenders() -> list[tuple[str, list[Any]]]:
    return [("plain", []),
            ("2 no-op", [_AioNoopInterceptor(), _AioNoopInterceptor()]),
            ("deadline+slow", [bta.SlowCallInterceptor(SLOW_THRESHOLD),
                               bta.ServerDeadlineInterceptor(MAX_TIME)])]


CONTENDERS = ["plain", "2 no-op", "deadline+slow"]


# -- sync ---------------------------------------------------------------------------------


def _sync_echo(request: bytes, context: Any) -> bytes:
    return request


@contextlib.contextmanager
def sync_servers() -> Iterator[dict[str, Callable[..., Any]]]:
    """A sync server per contender, and a blocking echo callable for each."""
    servers, channels, calls = [], [], {}
    try:
        for name, interceptors in _sync_contenders():
            server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), interceptors=interceptors)
            server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
                SERVICE, {"Echo": grpc.unary_unary_rpc_method_handler(_sync_echo)})])
            port = server.add_insecure_port("127.0.0.1:0")
            server.start()
            servers.append(server)
            channel = grpc.insecure_channel(f"127.0.0.1:{port}")
            channels.append(channel)
            calls[name] = channel.unary_unary(METHOD)
        for call in calls.values():  # connect and warm up
            for _ in range(50):
                call(PAYLOAD, timeout=CLIENT_TIMEOUT)
        yield calls
    finally:
        for channel in channels:
            channel.close()
        for server in servers:
            server.stop(None)


def _rotations(items: list[Any], n: int) -> Iterator[list[Any]]:
    """``n`` rounds over ``items``, the order rotated each round, so that
    every contender follows every other equally often."""
    k = len(items)
    for i in range(n):
        j = i % k
        yield items[j:] + items[:j]


def sync_interleaved(calls: dict[str, Callable[..., Any]], n: int) -> dict[str, list[float]]:
    """Per-call latencies (s): one call to each server in turn, ``n`` rounds."""
    perf = time.perf_counter
    out: dict[str, list[float]] = {name: [] for name in calls}
    for order in _rotations(list(calls.items()), n):
        for name, call in order:
            t0 = perf()
            call(PAYLOAD, timeout=CLIENT_TIMEOUT)
            out[name].append(perf() - t0)
    return out


# -- aio ------------------------------------------------------------------------------------


async def _aio_echo(request: bytes, context: Any) -> bytes:
    return request


class AioServers:
    """An aio server per contender, on a loop of their own (driven by run())."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.servers: list[Any] = []
        self.channels: list[Any] = []
        self.calls: dict[str, Any] = {}
        self.run(self._start())

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    async def _start(self) -> None:
        for name, interceptors in _aio_contenders():
            server = grpc.aio.server(interceptors=interceptors)
            server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
                SERVICE, {"Echo": grpc.unary_unary_rpc_method_handler(_aio_echo)})])
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            self.servers.append(server)
            channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
            self.channels.append(channel)
            self.calls[name] = channel.unary_unary(METHOD)
        for call in self.calls.values():
            for _ in range(50):
                await call(PAYLOAD, timeout=CLIENT_TIMEOUT)

    async def batch(self, name: str, n: int) -> None:
        call = self.calls[name]
        for _ in range(n):
            await call(PAYLOAD, timeout=CLIENT_TIMEOUT)

    async def interleaved(self, n: int) -> dict[str, list[float]]:
        perf = time.perf_counter
        out: dict[str, list[float]] = {name: [] for name in self.calls}
        for order in _rotations(list(self.calls.items()), n):
            for name, call in order:
                t0 = perf()
                await call(PAYLOAD, timeout=CLIENT_TIMEOUT)
                out[name].append(perf() - t0)
        return out

    def close(self) -> None:
        async def stop() -> None:
            for channel in self.channels:
                await channel.close()
            for server in self.servers:
                await server.stop(None)
        self.run(stop())
        self.loop.close()


def summarize(samples: dict[str, list[float]]) -> dict[str, float]:
    plain = statistics.median(samples["plain"])
    noop = statistics.median(samples["2 no-op"])
    inter = statistics.median(samples["deadline+slow"])
    return {
        "plain_median_us": plain * 1e6,
        "noop_median_us": noop * 1e6,
        "intercepted_median_us": inter * 1e6,
        "added_us": (inter - plain) * 1e6,
        "ratio": inter / plain,                 # the target: <= 1.05
        "noop_ratio": noop / plain,             # grpc's own interceptor machinery
        "ratio_vs_noop": inter / noop,          # bucketimer's share
    }


# -- pytest-benchmark ---------------------------------------------------------------------------

SERVERS = CONTENDERS


@pytest.fixture(scope="module")
def sync_calls() -> Iterator[dict[str, Callable[..., Any]]]:
    with sync_servers() as calls:
        yield calls


@pytest.fixture(scope="module")
def aio_servers() -> Iterator[AioServers]:
    servers = AioServers()
    try:
        yield servers
    finally:
        servers.close()


@pytest.mark.parametrize("server", SERVERS)
def test_sync_unary_echo(benchmark: Any, sync_calls: dict[str, Callable[..., Any]], server: str) -> None:
    """Sync unary echo, CALLS per round (target: deadline+slow <= 1.05 x plain)."""
    benchmark.group = "grpc-sync-unary-echo"
    call = sync_calls[server]

    def batch() -> None:
        for _ in range(CALLS):
            call(PAYLOAD, timeout=CLIENT_TIMEOUT)

    benchmark.extra_info["calls_per_round"] = CALLS
    benchmark.pedantic(batch, rounds=15, warmup_rounds=2, iterations=1)
    benchmark.extra_info["per_call_us"] = benchmark.stats.stats.median / CALLS * 1e6


@pytest.mark.parametrize("server", SERVERS)
def test_aio_unary_echo(benchmark: Any, aio_servers: AioServers, server: str) -> None:
    """aio unary echo, CALLS per round in one task (target: deadline+slow <= 1.05 x plain)."""
    benchmark.group = "grpc-aio-unary-echo"
    benchmark.extra_info["calls_per_round"] = CALLS
    benchmark.pedantic(lambda: aio_servers.run(aio_servers.batch(server, CALLS)),
                       rounds=15, warmup_rounds=2, iterations=1)
    benchmark.extra_info["per_call_us"] = benchmark.stats.stats.median / CALLS * 1e6


@pytest.mark.parametrize("api", ["sync", "aio"])
def test_interleaved_overhead(benchmark: Any, api: str) -> None:
    """The servers called in turn, over 3 fresh sets of servers (one set's
    own placement offset can be several %): medians and ratios in extra_info."""
    benchmark.group = "grpc-interleaved"
    summary, ratios = benchmark.pedantic(measure, args=(api, 3, 1000), rounds=1, iterations=1)
    benchmark.extra_info.update(summary)
    benchmark.extra_info["per_round_ratios"] = ratios
    print(f"\n{api}: plain {summary['plain_median_us']:.1f} us, 2 no-op "
          f"{summary['noop_median_us']:.1f} us, deadline+slow "
          f"{summary['intercepted_median_us']:.1f} us, added {summary['added_us']:+.2f} us, "
          f"ratio {summary['ratio']:.3f} (target <= 1.05; per set "
          f"{' '.join(f'{r:.3f}' for r in ratios)})")


# -- plain mode -----------------------------------------------------------------------------------


def measure(api: str, rounds: int, n: int) -> tuple[dict[str, float], list[float]]:
    """``rounds`` fresh sets of servers, ``n`` interleaved calls each: pooled
    medians, and each round's ratio.  Fresh servers average out where their
    threads happen to run (one set's own offset can be several %)."""
    pooled: dict[str, list[float]] = {name: [] for name in CONTENDERS}
    ratios = []
    for _ in range(rounds):
        if api == "sync":
            with sync_servers() as calls:
                samples = sync_interleaved(calls, n)
        else:
            servers = AioServers()
            try:
                samples = servers.run(servers.interleaved(n))
            finally:
                servers.close()
        ratios.append(summarize(samples)["ratio"])
        for k, v in samples.items():
            pooled[k].extend(v)
    return summarize(pooled), ratios


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000, help="interleaved calls per server and round")
    parser.add_argument("--rounds", type=int, default=4, help="fresh sets of servers per API")
    parser.add_argument("--pin", type=int, metavar="CPU", default=None,
                        help="run the whole process on this one CPU (no cross-CPU wake-ups: "
                             "steadier figures, and a faster baseline)")
    parser.add_argument("--quick", action="store_true", help="1 round of 300 calls (a smoke run)")
    args = parser.parse_args(argv)
    n, rounds = (300, 1) if args.quick else (args.calls, args.rounds)
    if args.pin is not None:
        os.sched_setaffinity(0, {args.pin})

    gc.disable()
    rows = [(api, *measure(api, rounds, n)) for api in ("sync", "aio")]
    gc.enable()

    where = f"pinned to CPU {args.pin}" if args.pin is not None else f"{os.cpu_count()} CPUs"
    print(f"gRPC unary echo over 127.0.0.1 ({where}): {rounds} round(s) x {n} interleaved calls "
          f"per server; median per call")
    print(f"servers: no interceptor | 2 pass-through interceptors | "
          f"SlowCallInterceptor({SLOW_THRESHOLD:g}) + ServerDeadlineInterceptor({MAX_TIME:g}); "
          f"client timeout {CLIENT_TIMEOUT:g} s\n")
    print(f"{'api':<5}{'plain':>9}{'2 no-op':>9}{'dl+slow':>9}{'added':>9}{'ratio':>7}"
          f"{'no-op':>7}{'vs no-op':>9}  {'per-round ratios':<25} target (ratio <= 1.05)")
    ok = True
    for api, s, ratios in rows:
        met = s["ratio"] <= 1.05
        ok &= met
        print(f"{api:<5}{s['plain_median_us']:>9.1f}{s['noop_median_us']:>9.1f}"
              f"{s['intercepted_median_us']:>9.1f}{s['added_us']:>+9.1f}{s['ratio']:>7.3f}"
              f"{s['noop_ratio']:>7.3f}{s['ratio_vs_noop']:>9.3f}  "
              f"{' '.join(f'{r:.3f}' for r in ratios):<25} {'met' if met else 'MISSED'}")
    print("\n(us per call; added = dl+slow - plain; no-op = what grpc's interceptor "
          "machinery alone costs; vs no-op = bucketimer's share)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
