"""The timers' lateness as a Prometheus histogram (the ``prometheus`` extra;
docs/monitoring.rst, "Lateness").

:class:`LatenessCollector` is a ``prometheus_client`` collector: each scrape
reads ``TimerThread.stats()`` -- the core's lateness buckets and the sum of
the lateness they count, kept as the timers run -- and serves them as
``bucketimer_timer_lateness_seconds``, a histogram with ``_bucket``,
``_sum`` and ``_count``.  Nothing is done per timer for it.  Its label,
``bucketimer_timer_thread``, is the one the OpenTelemetry exporter gives
``bucketimer.otel``'s counters, so the series join.

(A collector rather than an OpenTelemetry instrument: OpenTelemetry's API
has no histogram a callback can report, and its Python SDK no interface to
hand it data points made elsewhere; fed one timer at a time, a histogram
would cost each timer what this costs a scrape.)
"""

from __future__ import annotations

try:
    from prometheus_client.core import REGISTRY, HistogramMetricFamily
    from prometheus_client.registry import Collector, CollectorRegistry
except ImportError as _exc:  # pragma: no cover - exercised without the extra only
    raise ImportError(
        "bucketimer.prometheus needs prometheus-client, which is not installed; "
        "install it with: pip install 'bucketimer[prometheus]'"
    ) from _exc

from collections.abc import Iterator, Mapping

from ._backend import TimerThread, default_timer_thread

__all__ = ["LatenessCollector", "register"]

NAME = "bucketimer_timer_lateness"
LABEL = "bucketimer_timer_thread"
_HELP = "How late timers ran: the time from their deadline to their callback's start"

# The buckets served: ``stats()["lateness_hist"][i]`` counts lateness in
# [2**(i-1), 2**i) ns (docs/design.rst, rule 10).  The finer ones below
# 2**10 ns (1.024 us) are merged into that one, the coarser ones above
# 2**36 ns (68.7 s) into +Inf: the counts stay exact at every bound served,
# as they are cumulative.
_FIRST_BOUND = 10
_LAST_BOUND = 36
_BOUNDS = [(0, "0.0")] + [(i, repr(2**i / 1e9)) for i in range(_FIRST_BOUND, _LAST_BOUND + 1)]


def buckets(hist: list[int]) -> list[tuple[str, float]]:
    """(``le`` bound in seconds, timers at most that late) for each bound
    served, ``+Inf`` last: cumulative, as Prometheus's buckets are."""
    out: list[tuple[str, float]] = []
    running = done = 0
    for i, le in _BOUNDS:
        while done <= i:
            running += hist[done]
            done += 1
        out.append((le, running))
    out.append(("+Inf", running + sum(hist[done:])))
    return out


class LatenessCollector(Collector):
    """Serves each TimerThread of ``timer_threads`` (a name, the
    ``bucketimer_timer_thread`` label, for each; None stands for the
    default TimerThread, whichever it is at the scrape) as a series of
    ``bucketimer_timer_lateness_seconds``; without it, the default
    TimerThread as ``"default"``."""

    def __init__(self, timer_threads: Mapping[str, TimerThread | None] | None = None) -> None:
        if timer_threads is None:
            timer_threads = {"default": None}
        elif not isinstance(timer_threads, Mapping):
            raise TypeError(f"timer_threads must be a mapping of names to TimerThreads or None, "
                            f"not {type(timer_threads).__name__}")
        for name, tt in timer_threads.items():
            if not isinstance(name, str) or not name:
                raise TypeError("each name must be a non-empty str")
            if tt is not None and not isinstance(tt, TimerThread):
                raise TypeError(f"timer_threads[{name!r}] must be a bucketimer.TimerThread or "
                                f"None, not {type(tt).__name__}")
        self.timer_threads = dict(timer_threads)

    def describe(self) -> Iterator[HistogramMetricFamily]:
        """The metric, without samples: what a registry checks names with."""
        yield HistogramMetricFamily(NAME, _HELP, labels=[LABEL], unit="seconds")

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(NAME, _HELP, labels=[LABEL], unit="seconds")
        for name, tt in self.timer_threads.items():
            stats = (tt if tt is not None else default_timer_thread()).stats()
            family.add_metric([name], buckets(stats["lateness_hist"]),
                              stats["lateness_sum"] / 1e9)
        yield family


def register(timer_threads: Mapping[str, TimerThread | None] | None = None, *,
             registry: CollectorRegistry = REGISTRY) -> LatenessCollector:
    """A :class:`LatenessCollector` of ``timer_threads``, registered with
    ``registry`` (default: ``prometheus_client``'s, which
    ``start_http_server`` and OpenTelemetry's Prometheus exporter use)."""
    collector = LatenessCollector(timer_threads)
    registry.register(collector)
    return collector
