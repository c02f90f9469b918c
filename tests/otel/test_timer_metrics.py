"""bucketimer.otel's TimerThread metrics, read with the OpenTelemetry SDK's
in-memory reader and scraped as Prometheus text over HTTP, on either
backend: each is ``TimerThread.stats()`` read at collection time, named
and measured as OpenTelemetry's naming guide asks."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

import pytest
from _helpers import wait_until
from _metrics import point, prometheus_server, scrape

import bucketimer
import bucketimer.otel

COUNTERS = ("scheduled", "fired", "cancelled", "dropped")


def _timer_values(m: Any, name: str = "tt") -> dict[str, int]:
    got = m.collect()
    return {k: point(got[f"bucketimer.timer.{k}"][1], **{"bucketimer.timer_thread": name})
            for k in (*COUNTERS, "pending")}


def test_the_counters_are_stats_at_collection_time(metrics: Callable[..., Any],
                                                   tt: bucketimer.TimerThread) -> None:
    m = metrics({"tt": tt})
    ran = threading.Event()
    tt.call_later(0.01, ran.set)
    tt.call_later(60, print).cancel()
    tt.call_later(60, print)
    assert ran.wait(5)
    assert wait_until(lambda: tt.stats()["ran"] == 1)
    assert _timer_values(m) == {"scheduled": 3, "fired": 1, "cancelled": 1, "dropped": 0,
                                "pending": 1}
    s = tt.stats()
    assert {k: s[k] for k in COUNTERS} == {"scheduled": 3, "fired": 1, "cancelled": 1, "dropped": 0}
    # close() takes the pending one: read anew at the next collection (the
    # native core counts it cancelled, the pure backend dropped)
    tt.close()
    after = _timer_values(m)
    s = tt.stats()
    assert after == {**{k: s[k] for k in COUNTERS}, "pending": 0}
    assert after["cancelled"] + after["dropped"] == 2


def test_units_and_kinds(metrics: Callable[..., Any], tt: bucketimer.TimerThread) -> None:
    from opentelemetry.sdk.metrics.export import Sum

    m = metrics({"tt": tt})
    data = m.reader.get_metrics_data()
    kinds = {}
    for rm in data.resource_metrics:
        for sm in rm.scope_metrics:
            assert (sm.scope.name, sm.scope.version) == ("bucketimer", bucketimer.__version__)
            for metric in sm.metrics:
                assert isinstance(metric.data, Sum)
                kinds[metric.name] = (metric.unit, metric.data.is_monotonic)
    # the naming guide's: a namespace in the singular, an up-down counter's
    # name not pluralised, counts of things in UCUM's {annotation} units
    assert kinds == {
        **{f"bucketimer.timer.{k}": ("{timer}", True) for k in COUNTERS},
        "bucketimer.timer.pending": ("{timer}", False),
    }


def test_the_default_timer_thread_is_reported_by_default(metrics: Callable[..., Any]) -> None:
    m = metrics()
    before = bucketimer.default_timer_thread().stats()["scheduled"]
    bucketimer.call_later(60, print).cancel()
    got = m.collect()
    scheduled = point(got["bucketimer.timer.scheduled"][1], **{"bucketimer.timer_thread": "default"})
    assert scheduled >= before + 1


def test_several_timer_threads_by_name(metrics: Callable[..., Any]) -> None:
    with bucketimer.TimerThread() as a, bucketimer.TimerThread() as b:
        m = metrics({"a": a, "b": b})
        for _ in range(3):
            a.call_later(60, print)
        b.call_later(60, print).cancel()
        got = m.collect()
        scheduled = got["bucketimer.timer.scheduled"][1]
        assert point(scheduled, **{"bucketimer.timer_thread": "a"}) == 3
        assert point(scheduled, **{"bucketimer.timer_thread": "b"}) == 1
        pending = got["bucketimer.timer.pending"][1]
        assert point(pending, **{"bucketimer.timer_thread": "a"}) == 3
        assert point(pending, **{"bucketimer.timer_thread": "b"}) == 0
        m.inst.remove_timer_thread("a")
        names = {dict(k)["bucketimer.timer_thread"]
                 for k in m.collect()["bucketimer.timer.scheduled"][1]}
        assert names == {"b"}


def test_close_reports_nothing_more(metrics: Callable[..., Any], tt: bucketimer.TimerThread) -> None:
    from bucketimer import _observers

    m = metrics({"tt": tt})
    assert m.inst in _observers.grpc
    tt.call_later(60, print)
    assert m.collect()["bucketimer.timer.scheduled"][1]
    m.inst.close()
    assert m.inst not in _observers.grpc
    assert all(not points for _, points in m.collect().values())


def test_one_instrumentation_per_provider(metrics: Callable[..., Any]) -> None:
    with bucketimer.TimerThread() as a, bucketimer.TimerThread() as b:
        m = metrics({"a": a}, grpc=False)
        again = bucketimer.otel.instrument({"b": b}, meter_provider=m.provider, grpc=False)
        assert again is m.inst
        assert set(m.inst.timer_threads) == {"a", "b"}
        # the instruments were made once: both threads' points arrive
        names = {dict(k)["bucketimer.timer_thread"]
                 for k in m.collect()["bucketimer.timer.scheduled"][1]}
        assert names == {"a", "b"}
        with pytest.raises(ValueError, match="a different TimerThread is reported as 'a'"):
            m.inst.add_timer_thread("a", b)
        m.inst.add_timer_thread("a", a)  # the same one again: nothing to do


@pytest.mark.parametrize(("args", "error", "message"), [
    (("", None), TypeError, "name must be a non-empty str"),
    ((3, None), TypeError, "name must be a non-empty str"),
    (("x", object()), TypeError, "timer_thread must be a bucketimer.TimerThread or None, not object"),
])
def test_bad_arguments_name_the_argument(metrics: Callable[..., Any], args: tuple[Any, ...],
                                         error: type[Exception], message: str) -> None:
    m = metrics({})
    with pytest.raises(error, match=message):
        m.inst.add_timer_thread(*args)


def test_prometheus_scrape_over_http(metrics: Callable[..., Any], tt: bucketimer.TimerThread) -> None:
    m = metrics({"tt": tt})
    done = threading.Event()
    tt.call_later(0.01, done.set)
    tt.call_later(60, print).cancel()
    tt.call_later(60, print)
    assert done.wait(5)
    assert wait_until(lambda: tt.stats()["ran"] == 1)
    with prometheus_server(m.registry) as url:
        samples = scrape(url)

    def value(sample: str, **labels: str) -> float:
        found = [v for lab, v in samples[sample]
                 if lab.get("bucketimer_timer_thread") == "tt" and labels.items() <= lab.items()]
        assert len(found) == 1, (sample, labels, samples.get(sample))
        return found[0]

    assert value("bucketimer_timer_scheduled_total") == 3
    assert value("bucketimer_timer_fired_total") == 1
    assert value("bucketimer_timer_cancelled_total") == 1
    assert value("bucketimer_timer_dropped_total") == 0
    assert value("bucketimer_timer_pending") == 1


def test_bad_instrument_arguments_name_the_argument(tt: bucketimer.TimerThread) -> None:
    with pytest.raises(TypeError, match="timer_threads must be a mapping of names to "
                                        "TimerThreads or None, not TimerThread"):
        bucketimer.otel.instrument(tt)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="meter_provider must be an "
                                        "opentelemetry.metrics.MeterProvider or None, not str"):
        bucketimer.otel.instrument({}, meter_provider="sdk")  # type: ignore[arg-type]


def test_without_the_extra_nothing_imports_opentelemetry_and_the_error_says_what_to_install() -> None:
    code = ("import sys, bucketimer, bucketimer.grpc\n"
            "assert not any(m.startswith('opentelemetry') for m in sys.modules)\n"
            "sys.modules['opentelemetry'] = None  # as if opentelemetry-api were not installed\n"
            "try:\n"
            "    import bucketimer.otel\n"
            "except ImportError as e:\n"
            "    print(e)\n"
            "else:\n"
            "    raise SystemExit('imported without opentelemetry-api')\n")
    out = subprocess.run([sys.executable, "-c", code], check=True, timeout=60,
                         capture_output=True, text=True).stdout
    assert "opentelemetry-api" in out and "bucketimer[otel]" in out
