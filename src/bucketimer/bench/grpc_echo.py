"""The gRPC workload: what the :mod:`bucketimer.grpc` interceptors add to a
unary echo call (docs/performance.rst, "gRPC interceptors"; docs/grpc.rst,
"Costs").

A unary-unary echo (bytes, no protobuf) over 127.0.0.1, each server with
one set of interceptors (:data:`SERVERS`), for the sync and the aio APIs.
Every call carries a client timeout, so the deadline interceptor works out a
budget and arms a timer; with the slow-call interceptor that is two
schedule+cancel pairs per call.  The servers take turns call by call
(:func:`interleaved`), over several fresh sets of servers (:func:`measure`):
one set's own placement offset (where its threads happen to run) can be
several %.  Target: ``deadline+slow`` within :data:`TARGET` times ``2 no-op``
at the median.

Needs grpcio (``pip install grpcio``; the ``bench`` extra has it): importing
this module without it raises ImportError.  The kit's ``grpc`` group
(``python -m bucketimer.bench --only grpc``) runs it;
``benchmarks/bench_grpc.py`` wraps it for pytest-benchmark and
``tools/bench_grpc.py`` adds what a developer of the interceptors wants
(another checkout's interceptors side by side, pinning, callgrind chains).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import gc
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import grpc

import bucketimer.grpc as btg
import bucketimer.grpc.aio as bta

from ._grpc import API, PARTS, SERVERS, TARGET
from ._suite import taking_turns

__all__ = [
    "API",
    "CLIENT_TIMEOUT",
    "MAX_TIME",
    "METHOD",
    "PARTS",
    "PAYLOAD",
    "SERVERS",
    "SLOW_THRESHOLD",
    "TARGET",
    "AioServers",
    "Measurement",
    "aio_echo",
    "interceptor_sets",
    "interleaved",
    "measure",
    "summarize",
    "sync_echo",
    "sync_servers",
]

SERVICE = "bt.Bench"
METHOD = f"/{SERVICE}/Echo"
PAYLOAD = b"x" * 32
CLIENT_TIMEOUT = 30.0  # every call has a deadline: the interceptor computes a budget
MAX_TIME = 60.0  # never reached
SLOW_THRESHOLD = 30.0  # never reached
WARMUP_CALLS = 50  # per server, after it connects

class _NoopInterceptor(grpc.ServerInterceptor):
    """Passes every call through: what grpc's interceptor machinery costs."""

    def intercept_service(self, continuation: Any, handler_call_details: Any) -> Any:
        return continuation(handler_call_details)


class _AioNoopInterceptor(grpc.aio.ServerInterceptor):
    async def intercept_service(self, continuation: Any, handler_call_details: Any) -> Any:
        return await continuation(handler_call_details)


_wrapper_var: contextvars.ContextVar[float] = contextvars.ContextVar("grpc_echo.wrapper")


class _Wrapping:
    """What :class:`_WrappingInterceptor` and :class:`_AioWrappingInterceptor`
    share: each method's wrapped handler, made once (:meth:`_wrap`, with the
    API's own wrapper from :meth:`_wrapper`) and found again by the API's
    ``intercept_service`` with one dict lookup per call."""

    def __init__(self) -> None:
        self._wrapped: dict[str, tuple[Any, Any]] = {}

    def _wrap(self, handler_call_details: Any, handler: Any) -> Any:
        wrapped = handler._replace(unary_unary=self._wrapper(handler.unary_unary))
        self._wrapped[handler_call_details.method] = (handler, wrapped)
        return wrapped

    @staticmethod
    def _wrapper(behavior: Callable[..., Any]) -> Callable[..., Any]:
        raise NotImplementedError


class _WrappingInterceptor(_Wrapping, grpc.ServerInterceptor):
    """Passes every call through a wrapper of the unary handler (made once per
    method, found again with one dict lookup per call) that sets a
    ContextVar around it: the least an interceptor that acts around the
    handler costs."""

    @staticmethod
    def _wrapper(behavior: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(request: Any, context: Any) -> Any:
            token = _wrapper_var.set(1.0)
            try:
                return behavior(request, context)
            finally:
                _wrapper_var.reset(token)

        return wrapper

    def intercept_service(self, continuation: Any, handler_call_details: Any) -> Any:
        handler = continuation(handler_call_details)
        entry = self._wrapped.get(handler_call_details.method)
        if entry is not None and entry[0] is handler:
            return entry[1]
        return self._wrap(handler_call_details, handler)


class _AioWrappingInterceptor(_Wrapping, grpc.aio.ServerInterceptor):
    """:class:`_WrappingInterceptor` for grpc.aio."""

    @staticmethod
    def _wrapper(behavior: Callable[..., Any]) -> Callable[..., Any]:
        async def wrapper(request: Any, context: Any) -> Any:
            token = _wrapper_var.set(1.0)
            try:
                return await behavior(request, context)
            finally:
                _wrapper_var.reset(token)

        return wrapper

    async def intercept_service(self, continuation: Any, handler_call_details: Any) -> Any:
        handler = await continuation(handler_call_details)
        entry = self._wrapped.get(handler_call_details.method)
        if entry is not None and entry[0] is handler:
            return entry[1]
        return self._wrap(handler_call_details, handler)


class _StandInHandle:
    __slots__ = ()

    def cancel(self) -> bool:
        return True


class _StandInTimerThread:
    """A ``timer_thread=`` whose timers are never armed."""

    closed = False
    _handle = _StandInHandle()

    def call_at(self, when: float, callback: Any, *args: Any) -> _StandInHandle:
        return self._handle


def interceptor_sets(api: str, *, parts: bool = True,
                     against: ModuleType | None = None) -> list[tuple[str, list[Any]]]:
    """(server name, its interceptors) of :data:`SERVERS`, then (``parts``)
    of :data:`PARTS`, for ``api`` ("sync" or "aio"); ``against``: a module
    with the interceptors of the same API from elsewhere (e.g. another
    checkout), as one more server, ``"against"``."""
    if api not in API:
        raise ValueError(f"api must be one of {API}, not {api!r}")
    mod: Any = btg if api == "sync" else bta
    noop = _NoopInterceptor if api == "sync" else _AioNoopInterceptor
    wrap = _WrappingInterceptor if api == "sync" else _AioWrappingInterceptor
    out: list[tuple[str, list[Any]]] = [
        ("plain", []),
        ("2 no-op", [noop(), noop()]),
        ("2 wrappers", [wrap(), wrap()]),
        ("deadline+slow", [mod.SlowCallInterceptor(SLOW_THRESHOLD),
                           mod.ServerDeadlineInterceptor(MAX_TIME)]),
        ("combined", [mod.ServerDeadlineSlowCallInterceptor(SLOW_THRESHOLD, MAX_TIME)]),
    ]
    if against is not None:
        other: Any = against
        out.append(("against", [other.SlowCallInterceptor(SLOW_THRESHOLD),
                                other.ServerDeadlineInterceptor(MAX_TIME)]))
    if parts:
        stand_in = _StandInTimerThread()
        out += [("slow + no-op", [mod.SlowCallInterceptor(SLOW_THRESHOLD), noop()]),
                ("no-op + deadline", [noop(), mod.ServerDeadlineInterceptor(MAX_TIME)]),
                ("no timers", [mod.SlowCallInterceptor(SLOW_THRESHOLD, timer_thread=stand_in),
                               mod.ServerDeadlineInterceptor(MAX_TIME, timer_thread=stand_in)])]
    return out


def _echo_handlers(behaviour: Callable[..., Any]) -> Any:
    return grpc.method_handlers_generic_handler(
        SERVICE, {"Echo": grpc.unary_unary_rpc_method_handler(behaviour)})


# -- sync ---------------------------------------------------------------------------------


def sync_echo(request: bytes, context: Any) -> bytes:
    """The sync servers' handler."""
    return request


@contextlib.contextmanager
def sync_servers(sets: Sequence[tuple[str, list[Any]]]
                 ) -> Iterator[dict[str, Callable[..., Any]]]:
    """A sync server per (name, interceptors) of ``sets``, connected and
    warmed up; yields a blocking echo callable for each, by name."""
    servers: list[Any] = []
    channels: list[Any] = []
    calls: dict[str, Callable[..., Any]] = {}
    try:
        for name, interceptors in sets:
            server = grpc.server(futures.ThreadPoolExecutor(max_workers=4),
                                 interceptors=interceptors)
            server.add_generic_rpc_handlers([_echo_handlers(sync_echo)])
            port = server.add_insecure_port("127.0.0.1:0")
            server.start()
            servers.append(server)
            channel = grpc.insecure_channel(f"127.0.0.1:{port}")
            channels.append(channel)
            calls[name] = channel.unary_unary(METHOD)
        for call in calls.values():
            for _ in range(WARMUP_CALLS):
                call(PAYLOAD, timeout=CLIENT_TIMEOUT)
        yield calls
    finally:
        for channel in channels:
            channel.close()
        for server in servers:
            server.stop(None)


def _sync_interleaved(calls: dict[str, Callable[..., Any]], n: int) -> dict[str, list[float]]:
    perf = time.perf_counter
    out: dict[str, list[float]] = {name: [] for name in calls}
    for name in taking_turns(list(calls), n):
        call = calls[name]
        t0 = perf()
        call(PAYLOAD, timeout=CLIENT_TIMEOUT)
        out[name].append(perf() - t0)
    return out


# -- aio ----------------------------------------------------------------------------------


async def aio_echo(request: bytes, context: Any) -> bytes:
    """The aio servers' handler."""
    return request


class AioServers:
    """An aio server per (name, interceptors) of ``sets``, on an event loop
    of their own, which :meth:`run` drives; :meth:`close` stops them."""

    def __init__(self, sets: Sequence[tuple[str, list[Any]]]) -> None:
        self.loop = asyncio.new_event_loop()
        self.servers: list[Any] = []
        self.channels: list[Any] = []
        self.calls: dict[str, Any] = {}
        try:
            self.run(self._start(sets))
        except BaseException:
            self.close()
            raise

    def run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(coro)

    async def _start(self, sets: Sequence[tuple[str, list[Any]]]) -> None:
        for name, interceptors in sets:
            server = grpc.aio.server(interceptors=interceptors)
            server.add_generic_rpc_handlers([_echo_handlers(aio_echo)])
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            self.servers.append(server)
            channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
            self.channels.append(channel)
            self.calls[name] = channel.unary_unary(METHOD)
        for call in self.calls.values():
            for _ in range(WARMUP_CALLS):
                await call(PAYLOAD, timeout=CLIENT_TIMEOUT)

    async def batch(self, name: str, n: int) -> None:
        """``n`` sequential calls to the server ``name``."""
        call = self.calls[name]
        for _ in range(n):
            await call(PAYLOAD, timeout=CLIENT_TIMEOUT)

    async def interleaved(self, n: int) -> dict[str, list[float]]:
        """Per-call latencies (s): one call to each server in turn, ``n`` rounds."""
        perf = time.perf_counter
        out: dict[str, list[float]] = {name: [] for name in self.calls}
        for name in taking_turns(list(self.calls), n):
            call = self.calls[name]
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

        if not self.loop.is_closed():
            self.run(stop())
            self.loop.close()


# -- both -----------------------------------------------------------------------------------


def interleaved(api: str, sets: Sequence[tuple[str, list[Any]]], n: int
                ) -> dict[str, list[float]]:
    """A fresh server per (name, interceptors) of ``sets``, then per-call
    latencies (s) of each: one call to each server in turn, ``n`` rounds,
    each round starting one further along; the cyclic GC off meanwhile."""
    gc.collect()
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        if api == "sync":
            with sync_servers(sets) as calls:
                return _sync_interleaved(calls, n)
        servers = AioServers(sets)
        try:
            out: dict[str, list[float]] = servers.run(servers.interleaved(n))
            return out
        finally:
            servers.close()
    finally:
        if gc_was_enabled:
            gc.enable()


@dataclass
class Measurement:
    """What :func:`measure` found: every call's latency (s) by server, pooled
    over the sets, and each set's own."""

    pooled: dict[str, list[float]] = field(default_factory=dict)
    per_set: list[dict[str, list[float]]] = field(default_factory=list)


def measure(api: str, sets: int, calls: int, *, parts: bool = True,
            against: ModuleType | None = None,
            step: Callable[[str], None] | None = None) -> Measurement:
    """``sets`` fresh sets of the servers of :func:`interceptor_sets`,
    ``calls`` interleaved calls to each per set; ``step(what)`` after each
    set."""
    m = Measurement()
    for i in range(sets):
        samples = interleaved(api, interceptor_sets(api, parts=parts, against=against), calls)
        m.per_set.append(samples)
        for name, values in samples.items():
            m.pooled.setdefault(name, []).extend(values)
        if step is not None:
            step(f"grpc {api} set {i + 1}")
    return m


def summarize(samples: dict[str, list[float]]) -> dict[str, float]:
    """Medians (µs) of each server and the ratios that matter:
    ``ratio_vs_noop`` (deadline+slow / 2 no-op: the target's),
    ``wrappers_vs_noop``, ``noop_ratio`` (2 no-op / plain), ``ratio``
    (deadline+slow / plain), ``added_us`` (deadline+slow - 2 no-op); for
    each other server present, ``<name>_median_us`` and ``<name>_vs_noop``."""
    med = {name: statistics.median(v) for name, v in samples.items()}
    plain, noop = med["plain"], med["2 no-op"]
    wrap, inter = med["2 wrappers"], med["deadline+slow"]
    other: dict[str, float] = {}
    for name in ("against", "combined", *PARTS):
        if name in med:
            other[f"{name}_median_us"] = med[name] * 1e6
            other[f"{name}_vs_noop"] = med[name] / noop
    return other | {
        "plain_median_us": plain * 1e6,
        "noop_median_us": noop * 1e6,
        "wrappers_median_us": wrap * 1e6,
        "intercepted_median_us": inter * 1e6,
        "added_us": (inter - noop) * 1e6,
        "ratio": inter / plain,
        "noop_ratio": noop / plain,
        "wrappers_vs_noop": wrap / noop,
        "ratio_vs_noop": inter / noop,
    }
