"""Overhead of the bucketimer.grpc interceptors on a unary echo call.

A unary-unary echo (bytes, no protobuf) over 127.0.0.1, with the server
running no interceptor ("plain"), two pass-through interceptors ("2 no-op":
what grpc's own interceptor machinery costs), two pass-through interceptors
that wrap the handler and set a ContextVar around it ("2 wrappers": the
least any pair of interceptors that act around the handler costs), or
``SlowCallInterceptor`` + ``ServerDeadlineInterceptor`` ("deadline+slow"),
for the sync and the aio APIs, side by side in one process.  Every call
carries a client timeout, so the deadline interceptor works out a budget
(the smaller of the client deadline and ``max_time``) and arms a timer; with
the slow-call interceptor that is two schedule+cancel pairs per call.
Target (docs/grpc.rst, "Costs"): deadline+slow within **1.02x** of 2 no-op
at the median.

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

``--chain`` measures one call through each server's interceptor chain
without the network (grpc's own interceptor pipeline calling the wrapped
handler with a stand-in context, in a tight loop): nanoseconds per call, or,
run under ``valgrind --tool=callgrind`` with ``--chain-calls N --api API
--contender NAME``, the instructions of N calls, which do not drift with the
machine's load (two values of N: their difference is the calls' cost)::

    valgrind --tool=callgrind python benchmarks/bench_grpc.py --chain \
        --chain-calls 2000 --api sync --contender deadline+slow
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import contextvars
import functools
import gc
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import pytest
from _figures import per_op

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


_wrapper_var: contextvars.ContextVar[float] = contextvars.ContextVar("bench_grpc.wrapper")


class _WrappingInterceptor(grpc.ServerInterceptor):
    """Passes every call through a wrapper of the unary handler (made once per
    method, found again with one dict lookup per call) that sets a
    ContextVar around it: the least an interceptor that acts around the
    handler costs."""

    def __init__(self) -> None:
        self._wrapped: dict[str, tuple[Any, Any]] = {}

    def intercept_service(self, continuation: Any, handler_call_details: Any) -> Any:
        handler = continuation(handler_call_details)
        entry = self._wrapped.get(handler_call_details.method)
        return entry[1] if entry is not None and entry[0] is handler else self._wrap(handler_call_details, handler)

    def _wrap(self, handler_call_details: Any, handler: Any) -> Any:
        behavior = handler.unary_unary

        def wrapper(request: Any, context: Any) -> Any:
            token = _wrapper_var.set(1.0)
            try:
                return behavior(request, context)
            finally:
                _wrapper_var.reset(token)

        wrapped = handler._replace(unary_unary=wrapper)
        self._wrapped[handler_call_details.method] = (handler, wrapped)
        return wrapped


class _AioWrappingInterceptor(grpc.aio.ServerInterceptor):
    """:class:`_WrappingInterceptor` for grpc.aio."""

    def __init__(self) -> None:
        self._wrapped: dict[str, tuple[Any, Any]] = {}

    async def intercept_service(self, continuation: Any, handler_call_details: Any) -> Any:
        handler = await continuation(handler_call_details)
        entry = self._wrapped.get(handler_call_details.method)
        return entry[1] if entry is not None and entry[0] is handler else self._wrap(handler_call_details, handler)

    def _wrap(self, handler_call_details: Any, handler: Any) -> Any:
        behavior = handler.unary_unary

        async def wrapper(request: Any, context: Any) -> Any:
            token = _wrapper_var.set(1.0)
            try:
                return await behavior(request, context)
            finally:
                _wrapper_var.reset(token)

        wrapped = handler._replace(unary_unary=wrapper)
        self._wrapped[handler_call_details.method] = (handler, wrapped)
        return wrapped


#: (sync module, aio module) of another tree's interceptors (``--against``)
AGAINST: tuple[Any, Any] | None = None
#: the servers that split deadline+slow into its parts (``--parts``)
PARTS = False


class _StandInHandle:
    __slots__ = ()

    def cancel(self) -> bool:
        return True


class _StandInTimerThread:
    """A ``timer_thread=`` whose timers are never armed: what the interceptors
    cost without their timers."""

    closed = False
    _handle = _StandInHandle()

    def call_at(self, when: float, callback: Any, *args: Any) -> _StandInHandle:
        return self._handle


_PART_NAMES = ["slow + no-op", "no-op + deadline", "no timers"]


def _parts(mod: Any, noop: Callable[[], Any]) -> list[tuple[str, list[Any]]]:
    if not PARTS:
        return []
    stand_in = _StandInTimerThread()
    return [("slow + no-op", [mod.SlowCallInterceptor(SLOW_THRESHOLD), noop()]),
            ("no-op + deadline", [noop(), mod.ServerDeadlineInterceptor(MAX_TIME)]),
            ("no timers", [mod.SlowCallInterceptor(SLOW_THRESHOLD, timer_thread=stand_in),
                           mod.ServerDeadlineInterceptor(MAX_TIME, timer_thread=stand_in)])]


def _sync_contenders() -> list[tuple[str, list[Any]]]:
    out: list[tuple[str, list[Any]]] = [
        ("plain", []),
        ("2 no-op", [_NoopInterceptor(), _NoopInterceptor()]),
        ("2 wrappers", [_WrappingInterceptor(), _WrappingInterceptor()]),
        ("deadline+slow", [btg.SlowCallInterceptor(SLOW_THRESHOLD),
                           btg.ServerDeadlineInterceptor(MAX_TIME)]),
    ]
    if AGAINST is not None:
        out.append(("against", [AGAINST[0].SlowCallInterceptor(SLOW_THRESHOLD),
                                AGAINST[0].ServerDeadlineInterceptor(MAX_TIME)]))
    return out + _parts(btg, _NoopInterceptor)


def _aio_contenders() -> list[tuple[str, list[Any]]]:
    out: list[tuple[str, list[Any]]] = [
        ("plain", []),
        ("2 no-op", [_AioNoopInterceptor(), _AioNoopInterceptor()]),
        ("2 wrappers", [_AioWrappingInterceptor(), _AioWrappingInterceptor()]),
        ("deadline+slow", [bta.SlowCallInterceptor(SLOW_THRESHOLD),
                           bta.ServerDeadlineInterceptor(MAX_TIME)]),
    ]
    if AGAINST is not None:
        out.append(("against", [AGAINST[1].SlowCallInterceptor(SLOW_THRESHOLD),
                                AGAINST[1].ServerDeadlineInterceptor(MAX_TIME)]))
    return out + _parts(bta, _AioNoopInterceptor)


CONTENDERS = ["plain", "2 no-op", "2 wrappers", "deadline+slow"]


def load_against(tree: str) -> None:
    """Another checkout's interceptors (``tree``/src/bucketimer/grpc), as one
    more server in every comparison: imported under another package name
    (they import the core as ``bucketimer``, and their own modules relatively)."""
    import importlib
    import shutil
    import tempfile

    global AGAINST
    where = tempfile.mkdtemp(prefix="bench_grpc_against_")
    shutil.copytree(os.path.join(tree, "src", "bucketimer", "grpc"),
                    os.path.join(where, "bucketimer_grpc_against"))
    sys.path.insert(0, where)
    AGAINST = (importlib.import_module("bucketimer_grpc_against"),
               importlib.import_module("bucketimer_grpc_against.aio"))
    CONTENDERS.append("against")
TARGET = 1.02  # deadline+slow / 2 no-op, at the median


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
    wrap = statistics.median(samples["2 wrappers"])
    inter = statistics.median(samples["deadline+slow"])
    other = {"against_median_us": statistics.median(samples["against"]) * 1e6,
             "against_vs_noop": statistics.median(samples["against"]) / noop} if "against" in samples else {}
    for name in _PART_NAMES:
        if name in samples:
            other[f"{name}_median_us"] = statistics.median(samples[name]) * 1e6
    return other | {
        "plain_median_us": plain * 1e6,
        "noop_median_us": noop * 1e6,
        "wrappers_median_us": wrap * 1e6,
        "intercepted_median_us": inter * 1e6,
        "added_us": (inter - noop) * 1e6,       # over 2 no-op
        "ratio": inter / plain,
        "noop_ratio": noop / plain,             # grpc's own interceptor machinery
        "wrappers_vs_noop": wrap / noop,        # what acting around the handler costs at least
        "ratio_vs_noop": inter / noop,          # the target: <= TARGET
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
    """Sync unary echo, CALLS per round (compare in grpc-interleaved)."""
    benchmark.group = "grpc-sync-unary-echo"
    call = sync_calls[server]

    def batch() -> None:
        for _ in range(CALLS):
            call(PAYLOAD, timeout=CLIENT_TIMEOUT)

    benchmark.extra_info["calls_per_round"] = CALLS
    benchmark.pedantic(batch, rounds=15, warmup_rounds=2, iterations=1)
    benchmark.extra_info["per_call_us"] = per_op(benchmark, CALLS, 1e6)


@pytest.mark.parametrize("server", SERVERS)
def test_aio_unary_echo(benchmark: Any, aio_servers: AioServers, server: str) -> None:
    """aio unary echo, CALLS per round in one task (compare in grpc-interleaved)."""
    benchmark.group = "grpc-aio-unary-echo"
    benchmark.extra_info["calls_per_round"] = CALLS
    benchmark.pedantic(lambda: aio_servers.run(aio_servers.batch(server, CALLS)),
                       rounds=15, warmup_rounds=2, iterations=1)
    benchmark.extra_info["per_call_us"] = per_op(benchmark, CALLS, 1e6)


@pytest.mark.parametrize("api", ["sync", "aio"])
def test_interleaved_overhead(benchmark: Any, api: str) -> None:
    """The servers called in turn, over 3 fresh sets of servers (one set's
    own placement offset can be several %): medians and ratios in extra_info."""
    benchmark.group = "grpc-interleaved"
    summary, ratios = benchmark.pedantic(measure, args=(api, 3, 1000), rounds=1, iterations=1)
    benchmark.extra_info.update(summary)
    benchmark.extra_info["per_round_ratios"] = ratios
    print(f"\n{api}: plain {summary['plain_median_us']:.1f} us, 2 no-op "
          f"{summary['noop_median_us']:.1f} us, 2 wrappers {summary['wrappers_median_us']:.1f} us, "
          f"deadline+slow {summary['intercepted_median_us']:.1f} us: "
          f"{summary['ratio_vs_noop']:.3f} x 2 no-op (target <= {TARGET}; per set "
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
        ratios.append(summarize(samples)["ratio_vs_noop"])
        for k, v in samples.items():
            pooled[k].extend(v)
    return summarize(pooled), ratios


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000, help="interleaved calls per server and round")
    parser.add_argument("--rounds", type=int, default=4, help="fresh sets of servers per API")
    parser.add_argument("--pin", type=int, metavar="CPU", default=None,
                        help="run the whole process on this one CPU (no cross-CPU wake-ups: "
                             "steadier figures, and a faster baseline)")
    parser.add_argument("--quick", action="store_true", help="1 round of 300 calls (a smoke run)")
    parser.add_argument("--chain", action="store_true",
                        help="one call through each interceptor chain, no network (see the docstring)")
    parser.add_argument("--chain-calls", type=int, default=None, metavar="N",
                        help="with --chain: run only N calls of each contender, print nothing "
                             "(for callgrind: the difference of two N is the cost of the calls)")
    parser.add_argument("--api", choices=["sync", "aio"], default=None, help="one API only")
    parser.add_argument("--against", metavar="TREE", default=None,
                        help="also a server with the interceptors of another checkout (e.g. a "
                             "git worktree of an older commit), in the same interleaved run")
    parser.add_argument("--parts", action="store_true",
                        help="also servers with one of the two interceptors beside a no-op, and "
                             "both on a stand-in TimerThread that arms nothing: where the cost is")
    parser.add_argument("--contender", choices=[*CONTENDERS, "against", *_PART_NAMES], default=None,
                        help="with --chain-calls: this server's chain only")
    args = parser.parse_args(argv)
    apis = [args.api] if args.api else ["sync", "aio"]
    if args.against is not None:
        load_against(args.against)
    if args.parts:
        global PARTS
        PARTS = True
        CONTENDERS.extend(_PART_NAMES)
    if args.pin is not None:
        os.sched_setaffinity(0, {args.pin})
    if args.chain:
        return chain_main(apis, args.chain_calls, args.contender)
    n, rounds = (300, 1) if args.quick else (args.calls, args.rounds)

    gc.disable()
    rows = [(api, *measure(api, rounds, n)) for api in apis]
    gc.enable()

    where = f"pinned to CPU {args.pin}" if args.pin is not None else f"{os.cpu_count()} CPUs"
    print(f"gRPC unary echo over 127.0.0.1 ({where}): {rounds} round(s) x {n} interleaved calls "
          f"per server; median per call")
    print(f"servers: no interceptor | 2 pass-through interceptors | 2 wrapping pass-throughs | "
          f"SlowCallInterceptor({SLOW_THRESHOLD:g}) + ServerDeadlineInterceptor({MAX_TIME:g}); "
          f"client timeout {CLIENT_TIMEOUT:g} s\n")
    against = AGAINST is not None
    print(f"{'api':<5}{'plain':>9}{'2 no-op':>9}{'2 wrap':>9}{'dl+slow':>9}"
          + (f"{'against':>9}" if against else "") + f"{'added':>9}{'wrap':>7}{'dl+slow':>9}"
          + (f"{'against':>9}" if against else "")
          + f"  {'per-round':<20} target (dl+slow <= {TARGET} x 2 no-op)")
    ok = True
    for api, s, ratios in rows:
        met = s["ratio_vs_noop"] <= TARGET
        ok &= met
        print(f"{api:<5}{s['plain_median_us']:>9.1f}{s['noop_median_us']:>9.1f}"
              f"{s['wrappers_median_us']:>9.1f}{s['intercepted_median_us']:>9.1f}"
              + (f"{s['against_median_us']:>9.1f}" if against else "")
              + f"{s['added_us']:>+9.1f}{s['wrappers_vs_noop']:>7.3f}{s['ratio_vs_noop']:>9.3f}"
              + (f"{s['against_vs_noop']:>9.3f}" if against else "")
              + f"  {' '.join(f'{r:.3f}' for r in ratios):<20} {'met' if met else 'MISSED'}")
    print("\n(us per call; added = dl+slow - 2 no-op; then x 2 no-op: wrap, dl+slow"
          + (", against" if against else "") + "; per-round: dl+slow x 2 no-op)")
    if PARTS:
        print("\nthe parts: us per call, over and x 2 no-op")
        for api, s, _ in rows:
            for name in _PART_NAMES:
                us = s[f"{name}_median_us"]
                print(f"{api:<5}{name:<18}{us:>9.1f}{us - s['noop_median_us']:>+9.1f}"
                      f"{us / s['noop_median_us']:>8.3f}")
    return 0 if ok else 1


# -- one call through the chain, no network --------------------------------------------------------


class _StandInContext:
    """What the interceptors ask of a server context on a call in time."""

    def __init__(self, deadline: float) -> None:
        self._deadline = deadline

    def time_remaining(self) -> float:
        return max(self._deadline - time.time(), 0.0)  # sync grpc's own formula

    def code(self) -> None:
        return None


class _Details:
    method = METHOD
    invocation_metadata = ()


def sync_chain(interceptors: list[Any]) -> Callable[[], Any]:
    """One call: grpc's own server interceptor pipeline finds the handler,
    then its (wrapped) behaviour runs with a stand-in context."""
    from grpc import _interceptor

    handler = grpc.unary_unary_rpc_method_handler(_sync_echo)
    pipeline = _interceptor.service_pipeline(interceptors)
    details = _Details()

    def query(_: Any) -> Any:
        return handler

    def one() -> Any:
        found = pipeline.execute(query, details) if pipeline is not None else handler
        return found.unary_unary(PAYLOAD, _StandInContext(time.time() + CLIENT_TIMEOUT))

    return one


def aio_chain(interceptors: list[Any]) -> Callable[[], Any]:
    """:func:`sync_chain` for grpc.aio: its interceptor chain (a coroutine
    per interceptor, each continuation a partial), then the coroutine
    handler, awaited in the loop."""
    handler = grpc.unary_unary_rpc_method_handler(_aio_echo)
    details = _Details()

    async def query(_: Any) -> Any:
        return handler

    async def run_interceptor(it: Any, d: Any) -> Any:
        ic = next(it, None)
        if ic is None:
            return await query(d)
        return await ic.intercept_service(functools.partial(run_interceptor, it), d)

    async def one() -> Any:
        found = await run_interceptor(iter(interceptors), details)
        return await found.unary_unary(PAYLOAD, _StandInContext(time.time() + CLIENT_TIMEOUT))

    return one


def chain_costs(api: str, calls: int, repeats: int = 7) -> dict[str, float]:
    """Median ns per call through each contender's chain (interleaved)."""
    contenders = _sync_contenders() if api == "sync" else _aio_contenders()
    perf = time.perf_counter
    out: dict[str, list[float]] = {name: [] for name, _ in contenders}
    if api == "sync":
        chains = {name: sync_chain(ics) for name, ics in contenders}
        for _ in range(repeats):
            for name, one in chains.items():
                t0 = perf()
                for _ in range(calls):
                    one()
                out[name].append((perf() - t0) / calls * 1e9)
    else:
        loop = asyncio.new_event_loop()
        try:
            aio_chains = {name: aio_chain(ics) for name, ics in contenders}

            async def batch(one: Any) -> float:
                t0 = perf()
                for _ in range(calls):
                    await one()
                return perf() - t0

            for _ in range(repeats):
                for name, one in aio_chains.items():
                    out[name].append(loop.run_until_complete(batch(one)) / calls * 1e9)
        finally:
            loop.close()
    return {name: statistics.median(v) for name, v in out.items()}


async def _calls(one: Callable[[], Any], calls: int) -> None:
    for _ in range(calls):
        await one()


def chain_main(apis: list[str], calls: int | None, only: str | None = None) -> int:
    if calls is not None:  # under callgrind: the calls, nothing else
        for api in apis:
            contenders = _sync_contenders() if api == "sync" else _aio_contenders()
            for name, ics in contenders:
                if only is not None and name != only:
                    continue
                if api == "sync":
                    one = sync_chain(ics)
                    for _ in range(calls):
                        one()
                else:
                    asyncio.run(_calls(aio_chain(ics), calls))
        return 0
    print("one call through the server interceptor chain, no network: median ns per call")
    print(f"{'api':<5}" + "".join(f"{name:>15}" for name in CONTENDERS) + f"{'dl+slow-noop':>14}")
    for api in apis:
        c = chain_costs(api, 20000)
        print(f"{api:<5}" + "".join(f"{c[name]:>15.0f}" for name in CONTENDERS)
              + f"{c['deadline+slow'] - c['2 no-op']:>+14.0f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
