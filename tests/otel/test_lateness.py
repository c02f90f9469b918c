"""The timers' lateness as Prometheus scrapes it: a real histogram
(``bucketimer.prometheus``) with ``_bucket``, ``_sum`` and ``_count``, served
over HTTP beside OpenTelemetry's exporter, on either backend; and the
``lateness_sum`` of ``stats()`` it is made from."""

from __future__ import annotations

import threading
import time
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest
from _helpers import wait_until
from _metrics import prometheus_server
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

import bucketimer
import bucketimer.prometheus

NAME = "bucketimer_timer_lateness_seconds"


def _run_one_late(tt: bucketimer.TimerThread) -> None:
    """Two timers run: the no-loop callbacks share one dispatcher thread, so
    the one due while the first sleeps runs ~0.3 s late."""
    tt.call_later(0, time.sleep, 0.3)
    done = threading.Event()
    tt.call_later(0.01, done.set)
    assert done.wait(5)
    assert wait_until(lambda: tt.stats()["ran"] == 2)


def test_a_scrape_shows_a_histogram(metrics: Callable[..., Any], tt: bucketimer.TimerThread) -> None:
    # beside OpenTelemetry's exporter, on its registry: the label joins its series
    m = metrics({"tt": tt})
    bucketimer.prometheus.register({"tt": tt}, registry=m.registry)
    _run_one_late(tt)
    with prometheus_server(m.registry) as url, urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    assert f"# TYPE {NAME} histogram\n" in text
    [family] = [f for f in text_string_to_metric_families(text) if f.name == NAME]
    assert family.type == "histogram"
    got: dict[str, list[tuple[dict[str, str], float]]] = {}
    for s in family.samples:
        got.setdefault(s.name, []).append((s.labels, s.value))
    assert set(got) == {f"{NAME}_bucket", f"{NAME}_sum", f"{NAME}_count"}
    [(labels, count)] = got[f"{NAME}_count"]
    [(_, total)] = got[f"{NAME}_sum"]
    assert labels == {"bucketimer_timer_thread": "tt"} and count == 2
    assert 0.25 <= total < 10.0  # the late one, in seconds
    buckets = [(float(lab["le"]), v) for lab, v in got[f"{NAME}_bucket"]]
    les = [le for le, _ in buckets]
    assert les[0] == 0.0 and les[1] == 2**10 / 1e9 and les[-2] == 2**36 / 1e9
    assert les[-1] == float("inf") and len(les) == 29
    counts = [v for _, v in buckets]
    assert counts == sorted(counts) and counts[-1] == count  # cumulative
    assert dict(buckets)[2**27 / 1e9] <= 1 and dict(buckets)[2**33 / 1e9] == 2  # 0.13 s, 8.6 s
    # the same counts as stats() gives, bucket by bucket
    hist = tt.stats()["lateness_hist"]
    for le, n in buckets[1:-1]:
        i = round(le * 1e9).bit_length() - 1
        assert n == sum(hist[:i + 1]), (le, n, hist)
    # OpenTelemetry's counters of the same TimerThread, under the same label
    assert 'bucketimer_timer_scheduled_total{bucketimer_timer_thread="tt"' in text


def test_the_sum_is_the_lateness_the_buckets_count(tt: bucketimer.TimerThread) -> None:
    before = tt.stats()
    assert before["lateness_sum"] == 0
    _run_one_late(tt)
    s = tt.stats()
    # each timer's lateness lies in its bucket: [2**(i-1), 2**i) ns
    low = sum(n * (2 ** (i - 1) if i else 0) for i, n in enumerate(s["lateness_hist"]))
    high = sum(n * 2**i for i, n in enumerate(s["lateness_hist"]))
    assert low <= s["lateness_sum"] < high, s
    assert s["lateness_sum"] >= 0.25e9


def test_a_timer_due_as_soon_as_possible_adds_at_most_the_last_buckets_start(
        tt: bucketimer.TimerThread) -> None:
    done = threading.Event()
    tt.call_at(float("-inf"), done.set)
    assert done.wait(5)
    assert wait_until(lambda: tt.stats()["ran"] == 1)
    s = tt.stats()
    # (the native core keeps -inf as "before any clock reading": its lateness
    # saturates, into the last bucket; the pure backend's clock starts at 0)
    i = s["lateness_hist"].index(1)
    assert s["lateness_sum"] == 2**46 if i == len(s["lateness_hist"]) - 1 else \
        2 ** (i - 1) <= s["lateness_sum"] < 2**i


def test_the_default_timer_thread_by_default() -> None:
    registry = CollectorRegistry()
    collector = bucketimer.prometheus.register(registry=registry)
    assert collector.timer_threads == {"default": None}
    bucketimer.call_later(60, print).cancel()
    count = registry.get_sample_value(f"{NAME}_count", {"bucketimer_timer_thread": "default"})
    assert count == bucketimer.default_timer_thread().stats()["ran"]


@pytest.mark.parametrize(("arg", "message"), [
    ([], "timer_threads must be a mapping of names to TimerThreads or None, not list"),
    ({"": None}, "each name must be a non-empty str"),
    ({"x": "tt"}, r"timer_threads\['x'\] must be a bucketimer.TimerThread or None, not str"),
])
def test_bad_arguments_name_the_argument(arg: Any, message: str) -> None:
    with pytest.raises(TypeError, match=message):
        bucketimer.prometheus.LatenessCollector(arg)
