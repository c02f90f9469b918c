"""The ``metrics`` fixture of tests/otel/ (the helpers: tests/_metrics.py).

The tests of the metrics need the OpenTelemetry SDK and prometheus_client
(the ``test`` extra); those of the logs, of grpc's patching and of the
pending timers run without them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

try:
    import opentelemetry.sdk.metrics  # noqa: F401
    import prometheus_client  # noqa: F401
except ImportError:  # the otel test packages are in the ``test`` extra only
    collect_ignore = ["test_timer_metrics.py", "test_lateness.py", "test_grpc_otel.py"]


@pytest.fixture
def metrics() -> Iterator[Callable[..., Any]]:
    """``metrics(timer_threads, **kw)``: bucketimer instrumented on a new
    MeterProvider (``_metrics.Metrics``), shut down after the test."""
    from _metrics import Metrics

    made: list[Metrics] = []

    def make(timer_threads: Any = None, **kw: Any) -> Metrics:
        made.append(Metrics(timer_threads, **kw))
        return made[-1]

    yield make
    for m in made:
        m.close()
