"""bucketimer.otel's gRPC metrics: what the interceptors report (a call
that hit its deadline, a call that turned slow) counted by method and side,
against real servers on 127.0.0.1, sync and aio, read with the
OpenTelemetry SDK's in-memory reader and scraped as Prometheus text."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import Any

import pytest

grpc = pytest.importorskip("grpc")
pytest.importorskip("opentelemetry.sdk.metrics")
pytest.importorskip("prometheus_client")

from _grpc_harness import SERVICE, Backend, stubborn, stuck_in_here, wait_for  # noqa: E402
from _metrics import Metrics, point, prometheus_server, scrape  # noqa: E402

import bucketimer  # noqa: E402
from bucketimer import _observers  # noqa: E402


@pytest.fixture
def metrics() -> Iterator[Metrics]:
    m = Metrics({})
    try:
        yield m
    finally:
        m.close()


def _points(m: Metrics, name: str) -> dict[Any, Any]:
    return m.collect().get(name, ("", {}))[1]


def test_a_call_that_hits_its_deadline(backend: Backend, metrics: Metrics, tt: bucketimer.TimerThread,
                                       stop: threading.Event) -> None:
    log: list[Any] = []
    ic = backend.mod.ServerDeadlineInterceptor(max_time=0.1, timer_thread=tt)
    with backend.serve(backend.all_shapes("Stub", stubborn(log, stop)), (ic,)) as addr, \
            backend.channel(addr) as ch:
        for shape, suffix in backend.variants:
            r = backend.invoke(ch, shape, f"Stub_{suffix}", timeout=10.0)
            assert r.code == grpc.StatusCode.DEADLINE_EXCEEDED, (suffix, r)
        n = len(backend.variants)
        assert wait_for(lambda: sum(_points(metrics, "bucketimer.grpc.deadlines").values()) == n)
    got = metrics.collect()
    unit, deadlines = got["bucketimer.grpc.deadlines"]
    assert unit == "{call}"
    for _, suffix in backend.variants:
        attrs = {"rpc.system": "grpc", "rpc.service": SERVICE, "rpc.method": f"Stub_{suffix}",
                 "bucketimer.grpc.side": "server", "bucketimer.grpc.budget_source": "max_time"}
        assert deadlines[frozenset(attrs.items())] == 1
        # the call's time when the deadline acted, over its 0.1 s budget:
        # never early, so at least 1
        used = point(got["bucketimer.grpc.deadline.budget_used"][1], **{"rpc.method": attrs["rpc.method"]})
        assert used.count == 1 and 1.0 <= used.sum < 20.0
        assert list(used.explicit_bounds) == [1.0, 1.001, 1.01, 1.05, 1.1, 1.25, 1.5, 2.0, 5.0]
    assert got["bucketimer.grpc.deadline.budget_used"][0] == "1"
    assert not got.get("bucketimer.grpc.slow_calls", ("", {}))[1]


def test_a_call_that_turns_slow_on_each_side(backend: Backend, metrics: Metrics,
                                             tt: bucketimer.TimerThread) -> None:
    async def work(req: bytes, ctx: Any) -> bytes:
        await stuck_in_here(lambda: False, 0.2)
        return req

    server_ic = backend.mod.SlowCallInterceptor(0.05, stack=False, timer_thread=tt)
    client_ic = backend.mod.SlowCallInterceptor(0.05, timer_thread=tt)
    with backend.serve({"Slow": backend.handler("unary_unary", work)}, (server_ic,)) as addr, \
            backend.channel(addr, client_ic) as ch:
        r = backend.invoke(ch, "unary_unary", "Slow", timeout=10.0)
        assert r.code == grpc.StatusCode.OK
        assert wait_for(lambda: len(_points(metrics, "bucketimer.grpc.slow_call.duration")) == 2)
    got = metrics.collect()
    for side in ("client", "server"):
        attrs = {"rpc.system": "grpc", "rpc.service": SERVICE, "rpc.method": "Slow",
                 "bucketimer.grpc.side": side}
        assert got["bucketimer.grpc.slow_calls"][1][frozenset(attrs.items())] == 1, side
        duration = got["bucketimer.grpc.slow_call.duration"][1][
            frozenset({**attrs, "rpc.grpc.status_code": 0}.items())]
        assert duration.count == 1 and 0.2 <= duration.sum < 20.0, side
    assert got["bucketimer.grpc.slow_call.duration"][0] == "s"
    assert not got.get("bucketimer.grpc.deadlines", ("", {}))[1]


def test_nothing_is_recorded_once_closed(backend: Backend, metrics: Metrics, tt: bucketimer.TimerThread,
                                         stop: threading.Event) -> None:
    events: list[Any] = []
    metrics.inst.close()
    ic = backend.mod.ServerDeadlineInterceptor(max_time=0.05, timer_thread=tt, on_deadline=events.append)
    with backend.serve(backend.all_shapes("Stub", stubborn([], stop)), (ic,)) as addr, \
            backend.channel(addr) as ch:
        r = backend.invoke(ch, "unary_unary", "Stub_unary_unary", timeout=10.0)
        assert r.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert wait_for(lambda: len(events) == 1)
    assert not _points(metrics, "bucketimer.grpc.deadlines")


class _Broken:
    def deadline(self, ev: Any, /) -> None:
        raise RuntimeError("observer broke")

    slow = deadline


def test_a_failing_observer_is_logged_and_changes_nothing(
        backend: Backend, metrics: Metrics, tt: bucketimer.TimerThread, stop: threading.Event,
        caplog: pytest.LogCaptureFixture) -> None:
    broken = _Broken()
    _observers.add_grpc(broken)
    try:
        events: list[Any] = []
        ic = backend.mod.ServerDeadlineInterceptor(max_time=0.05, timer_thread=tt,
                                                   on_deadline=events.append)
        with caplog.at_level(logging.ERROR, logger="bucketimer.grpc"), \
                backend.serve(backend.all_shapes("Stub", stubborn([], stop)), (ic,)) as addr, \
                backend.channel(addr) as ch:
            r = backend.invoke(ch, "unary_unary", "Stub_unary_unary", timeout=10.0)
            assert r.code == grpc.StatusCode.DEADLINE_EXCEEDED
            # the hook and the other observers still hear of it
            assert wait_for(lambda: len(events) == 1)
            assert wait_for(lambda: bool(_points(metrics, "bucketimer.grpc.deadlines")))
            # (reported on the timer's thread, maybe still after the others)
            assert wait_for(lambda: any(
                "metrics observer" in rec.getMessage() and rec.exc_info is not None
                and "observer broke" in str(rec.exc_info[1]) for rec in list(caplog.records)))
    finally:
        _observers.remove_grpc(broken)


@pytest.mark.parametrize("backend", ["sync"], indirect=True)
def test_prometheus_scrape_of_grpc_metrics(backend: Backend, metrics: Metrics, tt: bucketimer.TimerThread,
                                           stop: threading.Event) -> None:
    ic = backend.mod.ServerDeadlineInterceptor(max_time=0.05, timer_thread=tt)
    with backend.serve(backend.all_shapes("Stub", stubborn([], stop)), (ic,)) as addr, \
            backend.channel(addr) as ch:
        r = backend.invoke(ch, "unary_unary", "Stub_unary_unary", timeout=10.0)
        assert r.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert wait_for(lambda: bool(_points(metrics, "bucketimer.grpc.deadlines")))
    with prometheus_server(metrics.registry) as url:
        samples = scrape(url)
    [(labels, value)] = samples["bucketimer_grpc_deadlines_total"]
    assert value == 1
    assert (labels["rpc_service"], labels["rpc_method"], labels["bucketimer_grpc_side"],
            labels["bucketimer_grpc_budget_source"]) == (SERVICE, "Stub_unary_unary", "server", "max_time")
    counts = {lab["le"]: v for lab, v in samples["bucketimer_grpc_deadline_budget_used_bucket"]}
    assert counts["+Inf"] == 1 and counts["1.0"] == 0
