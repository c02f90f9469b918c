"""bucketimer.otel's TimerThread metrics, read with the OpenTelemetry SDK's
in-memory reader and scraped as Prometheus text over HTTP, on either
backend: each is ``TimerThread.stats()`` read at collection time."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
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
    return {k: point(got[f"bucketimer.timers.{k}"][1], **{"bucketimer.timer_thread": name})
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
    assert kinds == {
        **{f"bucketimer.timers.{k}": ("{timer}", True) for k in COUNTERS},
        "bucketimer.timers.pending": ("{timer}", False),
        "bucketimer.timers.lateness": ("{timer}", True),
    }


def test_the_default_timer_thread_is_reported_by_default(metrics: Callable[..., Any]) -> None:
    m = metrics()
    before = bucketimer.default_timer_thread().stats()["scheduled"]
    bucketimer.call_later(60, print).cancel()
    got = m.collect()
    scheduled = point(got["bucketimer.timers.scheduled"][1], **{"bucketimer.timer_thread": "default"})
    assert scheduled >= before + 1


def _lateness(m: Any, name: str = "tt") -> list[tuple[float, int]]:
    points = m.collect()["bucketimer.timers.lateness"][1]
    out = []
    for attrs, value in points.items():
        a = dict(attrs)
        if a["bucketimer.timer_thread"] == name:
            out.append((float(a["le"]), value))
    return sorted(out)


def test_lateness_is_cumulative_by_le_in_seconds(metrics: Callable[..., Any],
                                                 tt: bucketimer.TimerThread) -> None:
    m = metrics({"tt": tt})
    # the no-loop callbacks share one dispatcher thread: a timer due while
    # the first one sleeps runs ~0.3 s late
    tt.call_later(0, time.sleep, 0.3)
    done = threading.Event()
    tt.call_later(0.01, done.set)
    assert done.wait(5)
    assert wait_until(lambda: tt.stats()["ran"] == 2)
    buckets = _lateness(m)
    les = [le for le, _ in buckets]
    assert les[0] == 0.0 and les[-1] == float("inf")
    assert les[1] == 2**10 / 1e9 and les[-2] == 2**36 / 1e9
    assert all(b == 2 * a for a, b in zip(les[1:-2], les[2:-1]))
    counts = [n for _, n in buckets]
    assert counts == sorted(counts) and counts[-1] == 2  # cumulative; +Inf: every timer that ran
    # the late one: more than 0.25 s late, less than 2**33 ns (8.6 s)
    assert dict(buckets)[2**27 / 1e9] <= 1  # 0.134 s
    assert dict(buckets)[2**33 / 1e9] == 2
    # the same counts as stats() gives, bucket by bucket
    hist = tt.stats()["lateness_hist"]
    for le, n in buckets[1:-1]:
        i = round(le * 1e9).bit_length() - 1
        assert n == sum(hist[:i + 1]), (le, n, hist)


def test_several_timer_threads_by_name(metrics: Callable[..., Any]) -> None:
    with bucketimer.TimerThread() as a, bucketimer.TimerThread() as b:
        m = metrics({"a": a, "b": b})
        for _ in range(3):
            a.call_later(60, print)
        b.call_later(60, print).cancel()
        got = m.collect()
        scheduled = got["bucketimer.timers.scheduled"][1]
        assert point(scheduled, **{"bucketimer.timer_thread": "a"}) == 3
        assert point(scheduled, **{"bucketimer.timer_thread": "b"}) == 1
        pending = got["bucketimer.timers.pending"][1]
        assert point(pending, **{"bucketimer.timer_thread": "a"}) == 3
        assert point(pending, **{"bucketimer.timer_thread": "b"}) == 0
        m.inst.remove_timer_thread("a")
        names = {dict(k)["bucketimer.timer_thread"]
                 for k in m.collect()["bucketimer.timers.scheduled"][1]}
        assert names == {"b"}


def test_close_reports_nothing_more(metrics: Callable[..., Any], tt: bucketimer.TimerThread) -> None:
    from bucketimer import _observers

    m = metrics({"tt": tt})
    assert m.inst in _observers.grpc
    tt.call_later(60, print)
    assert m.collect()["bucketimer.timers.scheduled"][1]
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
                 for k in m.collect()["bucketimer.timers.scheduled"][1]}
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

    assert value("bucketimer_timers_scheduled_total") == 3
    assert value("bucketimer_timers_fired_total") == 1
    assert value("bucketimer_timers_cancelled_total") == 1
    assert value("bucketimer_timers_dropped_total") == 0
    assert value("bucketimer_timers_pending") == 1
    # buckets as histogram_quantile() reads them: an `le` label, cumulative
    assert value("bucketimer_timers_lateness_total", le="+Inf") == 1
    assert value("bucketimer_timers_lateness_total", le="0") <= 1
    les = [lab["le"] for lab, _ in samples["bucketimer_timers_lateness_total"]]
    assert les[:3] == ["0", "1.024e-06", "2.048e-06"] and len(les) == 29


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
