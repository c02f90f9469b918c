"""The gRPC interceptors' cost, for whoever changes them: the kit's gRPC
workload (:mod:`bucketimer.bench.grpc_echo`; ``python -m bucketimer.bench
--only grpc`` is the table row) with a developer's options.

Plain mode prints the interleaved medians and ratios over several fresh
sets of servers (docs/grpc.rst, "Costs": deadline+slow within 1.02x of 2
no-op; the exit status says whether it was met)::

    python tools/bench_grpc.py [--calls 2000] [--rounds 4] [--pin 1] [--quick]
        [--parts] [--against ../other-checkout] [--api sync|aio]

``--pin CPU`` runs everything on one CPU (steadier figures); ``--parts``
adds servers with one of the two interceptors beside a no-op, and both on a
stand-in TimerThread that arms nothing; ``--against TREE`` adds a server
with the interceptors of another checkout (e.g. a git worktree of an older
commit), in the same interleaved run.

``--chain`` measures one call through each server's interceptor chain
without the network (grpc's own interceptor pipeline calling the wrapped
handler with a stand-in context, in a tight loop): nanoseconds per call, or,
run under ``valgrind --tool=callgrind`` with ``--chain-calls N --api API
--contender NAME``, the instructions of N calls, which do not drift with the
machine's load (two values of N: their difference is the calls' cost)::

    valgrind --tool=callgrind python tools/bench_grpc.py --chain \\
        --chain-calls 2000 --api sync --contender deadline+slow
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import importlib
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from types import ModuleType
from typing import Any

from bucketimer.bench import grpc_echo as ge

# -- another checkout's interceptors ---------------------------------------------------------


def load_against(tree: str) -> tuple[ModuleType, ModuleType]:
    """(sync, aio) interceptor modules of another checkout
    (``tree``/src/bucketimer/grpc), imported under another package name:
    they import the core as ``bucketimer``, and their own modules relatively."""
    where = tempfile.mkdtemp(prefix="bench_grpc_against_")
    shutil.copytree(os.path.join(tree, "src", "bucketimer", "grpc"),
                    os.path.join(where, "bucketimer_grpc_against"))
    sys.path.insert(0, where)
    return (importlib.import_module("bucketimer_grpc_against"),
            importlib.import_module("bucketimer_grpc_against.aio"))


# -- plain mode ----------------------------------------------------------------------------------


def _print_rows(rows: list[tuple[str, dict[str, float], list[float]]], against: bool) -> bool:
    """The table of medians and ratios; whether every API met the target."""
    others = ["combined", *(["against"] if against else [])]
    print(f"{'api':<5}{'plain':>9}{'2 no-op':>9}{'2 wrap':>9}{'dl+slow':>9}"
          + "".join(f"{o:>9}" for o in others) + f"{'added':>9}{'wrap':>7}{'dl+slow':>9}"
          + "".join(f"{o:>9}" for o in others)
          + f"  {'per-round':<20} target (dl+slow <= {ge.TARGET} x 2 no-op)")
    ok = True
    for api, s, ratios in rows:
        met = s["ratio_vs_noop"] <= ge.TARGET
        ok &= met
        print(f"{api:<5}{s['plain_median_us']:>9.1f}{s['noop_median_us']:>9.1f}"
              f"{s['wrappers_median_us']:>9.1f}{s['intercepted_median_us']:>9.1f}"
              + "".join(f"{s[f'{o}_median_us']:>9.1f}" for o in others)
              + f"{s['added_us']:>+9.1f}{s['wrappers_vs_noop']:>7.3f}{s['ratio_vs_noop']:>9.3f}"
              + "".join(f"{s[f'{o}_vs_noop']:>9.3f}" for o in others)
              + f"  {' '.join(f'{r:.3f}' for r in ratios):<20} {'met' if met else 'MISSED'}")
    print(f"\n(us per call; added = dl+slow - 2 no-op; then x 2 no-op: wrap, dl+slow, "
          f"{', '.join(others)}; per-round: dl+slow x 2 no-op)")
    return ok


def _print_parts(rows: list[tuple[str, dict[str, float], list[float]]]) -> None:
    print("\nthe parts: us per call, over and x 2 no-op")
    for api, s, _ in rows:
        for name in ge.PARTS:
            us = s[f"{name}_median_us"]
            print(f"{api:<5}{name:<18}{us:>9.1f}{us - s['noop_median_us']:>+9.1f}"
                  f"{s[f'{name}_vs_noop']:>8.3f}")


def plain_main(args: argparse.Namespace, apis: list[str],
               against: tuple[ModuleType, ModuleType] | None) -> int:
    n, rounds = (300, 1) if args.quick else (args.calls, args.rounds)
    rows = []
    for api in apis:
        other = None if against is None else against[0 if api == "sync" else 1]
        m = ge.measure(api, rounds, n, parts=args.parts, against=other)
        rows.append((api, ge.summarize(m.pooled),
                     [ge.summarize(one)["ratio_vs_noop"] for one in m.per_set]))
    where = f"pinned to CPU {args.pin}" if args.pin is not None else f"{os.cpu_count()} CPUs"
    print(f"gRPC unary echo over 127.0.0.1 ({where}): {rounds} round(s) x {n} interleaved calls "
          f"per server; median per call")
    print(f"servers: no interceptor | 2 pass-through interceptors | 2 wrapping pass-throughs | "
          f"SlowCallInterceptor({ge.SLOW_THRESHOLD:g}) + "
          f"ServerDeadlineInterceptor({ge.MAX_TIME:g}) | the two as "
          f"ServerDeadlineSlowCallInterceptor; client timeout {ge.CLIENT_TIMEOUT:g} s\n")
    ok = _print_rows(rows, against is not None)
    if args.parts:
        _print_parts(rows)
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
    method = ge.METHOD
    invocation_metadata = ()


def sync_chain(interceptors: list[Any]) -> Callable[[], Any]:
    """One call: grpc's own server interceptor pipeline finds the handler,
    then its (wrapped) behaviour runs with a stand-in context."""
    import grpc
    from grpc import _interceptor

    handler = grpc.unary_unary_rpc_method_handler(ge.sync_echo)
    pipeline = _interceptor.service_pipeline(interceptors)
    details = _Details()

    def query(_: Any) -> Any:
        return handler

    def one() -> Any:
        found = pipeline.execute(query, details) if pipeline is not None else handler
        return found.unary_unary(ge.PAYLOAD, _StandInContext(time.time() + ge.CLIENT_TIMEOUT))

    return one


def aio_chain(interceptors: list[Any]) -> Callable[[], Any]:
    """:func:`sync_chain` for grpc.aio: its interceptor chain (a coroutine
    per interceptor, each continuation a partial), then the coroutine
    handler, awaited in the loop."""
    import grpc

    handler = grpc.unary_unary_rpc_method_handler(ge.aio_echo)
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
        return await found.unary_unary(ge.PAYLOAD,
                                       _StandInContext(time.time() + ge.CLIENT_TIMEOUT))

    return one


async def _calls(one: Callable[[], Any], calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        await one()
    return time.perf_counter() - t0


def _sync_calls(one: Callable[[], Any], calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        one()
    return time.perf_counter() - t0


def chain_costs(api: str, sets: list[tuple[str, list[Any]]], calls: int,
                repeats: int = 7) -> dict[str, float]:
    """Median ns per call through each server's chain (taking turns)."""
    out: dict[str, list[float]] = {name: [] for name, _ in sets}
    if api == "sync":
        chains = {name: sync_chain(ics) for name, ics in sets}
        for _ in range(repeats):
            for name, one in chains.items():
                out[name].append(_sync_calls(one, calls) / calls * 1e9)
    else:
        loop = asyncio.new_event_loop()
        try:
            aio_chains = {name: aio_chain(ics) for name, ics in sets}
            for _ in range(repeats):
                for name, one in aio_chains.items():
                    out[name].append(loop.run_until_complete(_calls(one, calls)) / calls * 1e9)
        finally:
            loop.close()
    return {name: statistics.median(v) for name, v in out.items()}


def chain_main(apis: list[str], calls: int | None, only: str | None, parts: bool,
               against: tuple[ModuleType, ModuleType] | None) -> int:
    def sets(api: str) -> list[tuple[str, list[Any]]]:
        other = None if against is None else against[0 if api == "sync" else 1]
        return ge.interceptor_sets(api, parts=parts, against=other)

    if calls is not None:  # under callgrind: the calls, nothing else
        for api in apis:
            for name, ics in sets(api):
                if only is not None and name != only:
                    continue
                if api == "sync":
                    _sync_calls(sync_chain(ics), calls)
                else:
                    asyncio.run(_calls(aio_chain(ics), calls))
        return 0
    names = [name for name, _ in sets(apis[0])]
    print("one call through the server interceptor chain, no network: median ns per call")
    print(f"{'api':<5}" + "".join(f"{name:>18}" for name in names) + f"{'dl+slow-noop':>14}")
    for api in apis:
        c = chain_costs(api, sets(api), 20000)
        print(f"{api:<5}" + "".join(f"{c[name]:>18.0f}" for name in names)
              + f"{c['deadline+slow'] - c['2 no-op']:>+14.0f}")
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=2000,
                        help="interleaved calls per server and round")
    parser.add_argument("--rounds", type=int, default=4, help="fresh sets of servers per API")
    parser.add_argument("--pin", type=int, metavar="CPU", default=None,
                        help="run the whole process on this one CPU (no cross-CPU wake-ups: "
                             "steadier figures, and a faster baseline)")
    parser.add_argument("--quick", action="store_true", help="1 round of 300 calls (a smoke run)")
    parser.add_argument("--chain", action="store_true",
                        help="one call through each interceptor chain, no network")
    parser.add_argument("--chain-calls", type=int, default=None, metavar="N",
                        help="with --chain: run only N calls of each server, print nothing "
                             "(for callgrind: the difference of two N is the cost of the calls)")
    parser.add_argument("--api", choices=ge.API, default=None, help="one API only")
    parser.add_argument("--against", metavar="TREE", default=None,
                        help="also a server with the interceptors of another checkout")
    parser.add_argument("--parts", action="store_true",
                        help="also servers with one of the two interceptors beside a no-op, and "
                             "both on a stand-in TimerThread that arms nothing: where the cost is")
    parser.add_argument("--contender", choices=[*ge.SERVERS, "against", *ge.PARTS],
                        default=None, help="with --chain-calls: this server's chain only")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    apis = [args.api] if args.api else list(ge.API)
    against = load_against(args.against) if args.against is not None else None
    if args.pin is not None:
        os.sched_setaffinity(0, {args.pin})
    if args.chain:
        parts = args.parts or args.contender in ge.PARTS
        return chain_main(apis, args.chain_calls, args.contender, parts, against)
    return plain_main(args, apis, against)


if __name__ == "__main__":
    sys.exit(main())
