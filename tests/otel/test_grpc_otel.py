"""bucketimer's gRPC telemetry beside OpenTelemetry's own gRPC
instrumentation (opentelemetry-instrumentation-grpc), in one process,
against real servers on 127.0.0.1, sync and aio: the metrics' RPC
attributes join the instrumentation's spans on service and method, in the
default conventions and in the stable ones (``OTEL_SEMCONV_STABILITY_OPT_IN``),
and a call that runs out of budget or turns slow adds an event to the
call's span."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest
from _helpers import wait_until

grpc = pytest.importorskip("grpc")
otel_grpc = pytest.importorskip("opentelemetry.instrumentation.grpc")

from _serving import SERVICE, server, sync_call  # noqa: E402
from opentelemetry.sdk.metrics import MeterProvider  # noqa: E402
from opentelemetry.sdk.metrics.export import InMemoryMetricReader  # noqa: E402
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (  # noqa: E402
    InMemorySpanExporter,
)
from opentelemetry.trace import SpanKind  # noqa: E402

import bucketimer.grpc as btg  # noqa: E402
import bucketimer.grpc.aio as bta  # noqa: E402
import bucketimer.otel  # noqa: E402

API = {"sync": btg, "aio": bta}


class Telemetry:
    """An SDK TracerProvider and MeterProvider of the test's own, the
    instrumentation's server interceptor on the first, bucketimer
    instrumented on the second."""

    def __init__(self, api: str) -> None:
        self.spans = InMemorySpanExporter()
        self.tracer_provider = TracerProvider()
        self.tracer_provider.add_span_processor(SimpleSpanProcessor(self.spans))
        self.reader = InMemoryMetricReader()
        self.meter_provider = MeterProvider(metric_readers=[self.reader])
        self.inst = bucketimer.otel.instrument({}, meter_provider=self.meter_provider)
        make = otel_grpc.server_interceptor if api == "sync" else otel_grpc.aio_server_interceptor
        #: OpenTelemetry's interceptor, to be listed first: its span is the
        #: current one around bucketimer's
        self.interceptor = make(tracer_provider=self.tracer_provider)

    def server_span(self) -> ReadableSpan:
        [span] = [s for s in self.spans.get_finished_spans() if s.kind == SpanKind.SERVER]
        return span

    def points(self, name: str) -> list[dict[str, Any]]:
        data = self.reader.get_metrics_data()
        return [dict(p.attributes) for rm in (data.resource_metrics if data else ())
                for sm in rm.scope_metrics for m in sm.metrics if m.name == name
                for p in m.data.data_points]

    def close(self) -> None:
        self.inst.close()
        self.meter_provider.shutdown()
        self.tracer_provider.shutdown()


@pytest.fixture
def telemetry(request: pytest.FixtureRequest) -> Iterator[Telemetry]:
    t = Telemetry(request.node.callspec.params["api"])
    yield t
    t.close()


def stubborn(api: str, seconds: float = 3.0) -> Any:
    """A handler that keeps working past its budget (until the sync call is
    no longer active; the aio handler is cancelled)."""
    if api == "aio":
        async def work_aio(request: bytes, context: Any) -> bytes:
            await asyncio.sleep(seconds)
            return request
        return work_aio

    def work(request: bytes, context: Any) -> bytes:
        end = time.monotonic() + seconds
        while context.is_active() and time.monotonic() < end:
            time.sleep(0.005)
        return request

    return work


def slow(api: str, seconds: float = 0.3) -> Any:
    if api == "aio":
        async def slow_handler_aio(request: bytes, context: Any) -> bytes:
            await asyncio.sleep(seconds)
            return request
        return slow_handler_aio

    def slow_handler(request: bytes, context: Any) -> bytes:
        time.sleep(seconds)
        return request

    return slow_handler


def _joins(conventions: str, ours: dict[str, Any], theirs: dict[str, Any]) -> None:
    """bucketimer's attributes ``ours`` name the call the instrumentation's
    span attributes ``theirs`` name: the one same service and method."""
    # the installed instrumentation emits the conventions before the stable ones
    service, method = theirs["rpc.service"], theirs["rpc.method"]
    assert theirs["rpc.system"] == "grpc" and (service, method) == (SERVICE, "Dl")
    if conventions == "default":
        assert {k: ours.get(k) for k in ("rpc.system", "rpc.service", "rpc.method")} == \
            {k: theirs[k] for k in ("rpc.system", "rpc.service", "rpc.method")}
        assert "rpc.system.name" not in ours
        return
    # stable: rpc.system.name, the fully-qualified method, no rpc.service
    assert (ours.get("rpc.system.name"), ours["rpc.method"]) == ("grpc", f"{service}/{method}")
    if conventions == "rpc":
        assert "rpc.system" not in ours and "rpc.service" not in ours
    else:  # rpc/dup: the old ones too, but for the key both name
        assert (ours.get("rpc.system"), ours.get("rpc.service")) == (theirs["rpc.system"], service)


@pytest.mark.parametrize("conventions", ["default", "rpc", "rpc/dup"])
@pytest.mark.parametrize("api", ["sync", "aio"])
def test_a_deadline_joins_the_instrumentations_span(
        api: str, conventions: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if conventions != "default":
        monkeypatch.setenv("OTEL_SEMCONV_STABILITY_OPT_IN", f"http,{conventions}")
    t = Telemetry(api)
    try:
        interceptors = [t.interceptor, API[api].ServerDeadlineInterceptor(max_time=0.05)]
        with server(api, stubborn(api), interceptors, method="Dl") as address:
            assert sync_call(address, "Dl") == grpc.StatusCode.DEADLINE_EXCEEDED
            # the span ends with the handler, the count comes from the timer's thread
            assert wait_until(lambda: t.spans.get_finished_spans()
                              and t.points("bucketimer.grpc.deadlines"))
        span = t.server_span()
        [ours] = t.points("bucketimer.grpc.deadlines")
        assert ours["bucketimer.grpc.side"] == "server"
        assert ours["bucketimer.grpc.budget_source"] == "max_time"
        _joins(conventions, ours, dict(span.attributes or {}))
        assert t.inst.rpc_conventions == conventions
        # the deadline is an event of the call's own span, with the budget
        [event] = [e for e in span.events if e.name == bucketimer.otel.DEADLINE_EVENT]
        assert dict(event.attributes or {}) == {"bucketimer.grpc.budget": 0.05,
                                                "bucketimer.grpc.budget_source": "max_time"}
        assert span.start_time is not None and span.end_time is not None
        assert span.start_time + 40_000_000 <= event.timestamp <= span.end_time
    finally:
        t.close()


@pytest.mark.parametrize("conventions", ["default", "rpc"])
@pytest.mark.parametrize("api", ["sync", "aio"])
def test_a_slow_call_is_an_event_of_its_span(api: str, conventions: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    if conventions != "default":
        monkeypatch.setenv("OTEL_SEMCONV_STABILITY_OPT_IN", conventions)
    t = Telemetry(api)
    try:
        interceptors = [t.interceptor, API[api].SlowCallInterceptor(0.05)]
        with server(api, slow(api), interceptors, method="Slow") as address:
            assert sync_call(address, "Slow") == grpc.StatusCode.OK
            assert wait_until(lambda: t.spans.get_finished_spans()
                              and t.points("bucketimer.grpc.slow_call.duration"))
        span = t.server_span()
        [event] = [e for e in span.events if e.name == bucketimer.otel.SLOW_CALL_EVENT]
        attrs = dict(event.attributes or {})
        assert attrs["bucketimer.grpc.side"] == "server" and attrs["bucketimer.grpc.elapsed"] >= 0.05
        assert "slow_handler" in attrs["code.stacktrace"]  # the stuck handler's stack
        [duration] = t.points("bucketimer.grpc.slow_call.duration")
        if conventions == "default":  # as the instrumentation's span says it
            assert duration["rpc.grpc.status_code"] == 0 == span.attributes["rpc.grpc.status_code"]
        else:
            assert duration["rpc.status_code"] == "OK" and "rpc.grpc.status_code" not in duration
    finally:
        t.close()


@pytest.mark.parametrize("api", ["sync", "aio"])
def test_the_combined_interceptor_adds_both_events(api: str, telemetry: Telemetry) -> None:
    # one wrapper, one timer for both (C on the native backend's sync server and 3.12+ aio)
    interceptors = [telemetry.interceptor, API[api].ServerDeadlineSlowCallInterceptor(0.02, 0.05)]
    with server(api, stubborn(api), interceptors, method="Dl") as address:
        assert sync_call(address, "Dl") == grpc.StatusCode.DEADLINE_EXCEEDED
        assert wait_until(lambda: telemetry.spans.get_finished_spans())
    names = [e.name for e in telemetry.server_span().events]
    assert names.count(bucketimer.otel.SLOW_CALL_EVENT) == 1
    assert names.count(bucketimer.otel.DEADLINE_EVENT) == 1


@pytest.mark.parametrize("api", ["sync"])
def test_without_span_events_or_a_tracer_nothing_is_added(api: str) -> None:
    t = Telemetry(api)
    try:
        t.inst.span_events = False
        interceptors = [t.interceptor, btg.ServerDeadlineInterceptor(max_time=0.05)]
        with server(api, stubborn(api), interceptors, method="Dl") as address:
            assert sync_call(address, "Dl") == grpc.StatusCode.DEADLINE_EXCEEDED
            # the metrics still count it
            assert wait_until(lambda: t.spans.get_finished_spans()
                              and t.points("bucketimer.grpc.deadlines"))
        assert not [e for e in t.server_span().events if e.name.startswith("bucketimer.")]
        # no tracer provider at all: the API's span records nothing, and
        # the call ends as it does without bucketimer.otel
        t.inst.span_events = True
        with server(api, stubborn(api), [btg.ServerDeadlineInterceptor(max_time=0.05)],
                    method="Dl") as address:
            assert sync_call(address, "Dl") == grpc.StatusCode.DEADLINE_EXCEEDED
    finally:
        t.close()
