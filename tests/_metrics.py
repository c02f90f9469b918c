"""Reading bucketimer's metrics in tests, through the real OpenTelemetry
SDK (its in-memory reader) and a real Prometheus scrape over HTTP."""

from __future__ import annotations

import contextlib
import urllib.request
from collections.abc import Iterator
from typing import Any

from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.parser import text_string_to_metric_families

import bucketimer.otel

Points = dict[frozenset[tuple[str, Any]], Any]


class Metrics:
    """A MeterProvider with an in-memory reader and a Prometheus reader on
    a registry of its own, and bucketimer instrumented on it."""

    def __init__(self, timer_threads: Any = None, **kw: Any) -> None:
        self.reader = InMemoryMetricReader()
        self.registry = CollectorRegistry()
        self.provider = MeterProvider(
            metric_readers=[self.reader, PrometheusMetricReader(registry=self.registry)])
        self.inst = bucketimer.otel.instrument(timer_threads, meter_provider=self.provider, **kw)

    def collect(self) -> dict[str, tuple[str, Points]]:
        """name -> (unit, {attributes: point}) of one collection; a point is
        the value of a sum, the data point itself of a histogram."""
        out: dict[str, tuple[str, Points]] = {}
        data = self.reader.get_metrics_data()
        for rm in data.resource_metrics if data is not None else ():
            for sm in rm.scope_metrics:
                if sm.scope.name != "bucketimer":
                    continue
                for m in sm.metrics:
                    points: Points = {}
                    for p in m.data.data_points:
                        points[frozenset(p.attributes.items())] = getattr(p, "value", p)
                    out[m.name] = (m.unit or "", points)
        return out

    def close(self) -> None:
        self.inst.close()
        self.provider.shutdown()


def point(points: Points, **attrs: Any) -> Any:
    """The one point whose attributes include ``attrs``."""
    want = set(attrs.items())
    found = [v for k, v in points.items() if want <= set(k)]
    assert len(found) == 1, (attrs, points)
    return found[0]


@contextlib.contextmanager
def prometheus_server(registry: CollectorRegistry) -> Iterator[str]:
    """prometheus_client's exposition server on 127.0.0.1 (a free port):
    its /metrics URL."""
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        yield f"http://127.0.0.1:{server.server_port}/metrics"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def scrape(url: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """sample name -> [(labels, value)] of one scrape, parsed by prometheus_client."""
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.headers.get_content_type() == "text/plain"
        text = response.read().decode()
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((dict(s.labels), s.value))
    return out
