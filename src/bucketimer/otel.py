"""OpenTelemetry metrics of bucketimer (the ``otel`` extra; docs/monitoring.rst).

:func:`instrument` puts bucketimer's instruments on a ``MeterProvider``
(the global one unless told): per TimerThread, the counters of
``TimerThread.stats()`` and its lateness histogram, read by callbacks when
the provider collects, so the timers' own path does nothing for them; and
for the gRPC interceptors, the calls that hit their deadline or turned
slow, recorded when the interceptor reports one, never per call.

Only ``opentelemetry-api`` is needed, as for any instrumentation library:
the application picks the SDK, the readers and the exporters (Prometheus
among them).
"""

from __future__ import annotations

try:
    from opentelemetry import metrics as _metrics
except ImportError as _exc:  # pragma: no cover - exercised without the extra only
    raise ImportError(
        "bucketimer.otel needs opentelemetry-api, which is not installed; "
        "install it with: pip install 'bucketimer[otel]'"
    ) from _exc

import threading
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING

from opentelemetry.metrics import CallbackOptions, MeterProvider, Observation

from . import _observers
from ._backend import TimerThread, default_timer_thread
from ._stats import Stats
from ._version import __version__

if TYPE_CHECKING:
    from .grpc._common import DeadlineEvent, SlowCall

__all__ = ["DEFAULT", "Instrumentation", "instrument"]

#: The name the default TimerThread is reported under (the
#: ``bucketimer.timer_thread`` attribute).
DEFAULT = "default"

_THREAD = "bucketimer.timer_thread"
_SIDE = "bucketimer.grpc.side"
_SOURCE = "bucketimer.grpc.budget_source"

# The lateness buckets reported: ``stats()["lateness_hist"][i]`` counts
# lateness in [2**(i-1), 2**i) ns (docs/design.rst, rule 10).  The finer
# ones below 2**10 ns (1.024 us) are merged into that one, the coarser ones
# above 2**36 ns (68.7 s) into +Inf: the counts stay exact at every
# boundary reported, as they are cumulative.
_FIRST_BOUND = 10
_LAST_BOUND = 36
_BOUNDS = [(0, "0")] + [(i, repr(2**i / 1e9)) for i in range(_FIRST_BOUND, _LAST_BOUND + 1)]

#: ``bucketimer.grpc.deadline.budget_used``'s buckets: the call's time when
#: its deadline acted, over its budget (1 is on the dot).
_BUDGET_USED_BOUNDS = [1.0, 1.001, 1.01, 1.05, 1.1, 1.25, 1.5, 2.0, 5.0]
#: ``bucketimer.grpc.slow_call.duration``'s buckets, in seconds.
_DURATION_BOUNDS = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0]


def _pending(s: Stats) -> int:
    """Timers scheduled and not yet run, cancelled or dropped (at rest,
    ``scheduled == ran + cancelled + dropped``); the counters are read one
    by one, so a moment's skew is clamped at 0."""
    n = s["scheduled"] - s["ran"] - s["cancelled"] - s["dropped"]
    return n if n > 0 else 0


def _cumulative(hist: list[int]) -> Iterator[tuple[str, int]]:
    """(``le`` label, timers at most that late) for each bucket reported."""
    running = 0
    done = 0
    for i, le in _BOUNDS:
        while done <= i:
            running += hist[done]
            done += 1
        yield le, running
    yield "+Inf", running + sum(hist[done:])


def _rpc_attributes(method: str, side: str) -> dict[str, str]:
    # OpenTelemetry's RPC conventions: rpc.method is "package.Service/Method"
    return {"rpc.system": "grpc", "rpc.method": method.lstrip("/"), _SIDE: side}


class Instrumentation:
    """bucketimer's instruments on one ``MeterProvider`` (made by
    :func:`instrument`, once per provider) and what they report: the
    TimerThreads added by name, and the gRPC interceptors' reports while
    :attr:`grpc` is true."""

    def __init__(self, meter_provider: MeterProvider) -> None:
        self._lock = threading.Lock()
        #: name -> TimerThread; None: the default one, whichever it is when read
        self._threads: dict[str, TimerThread | None] = {}
        self._grpc = False
        meter = meter_provider.get_meter("bucketimer", __version__)
        counters: list[tuple[str, Callable[[Stats], int], str]] = [
            ("scheduled", lambda s: s["scheduled"], "Timers scheduled"),
            ("fired", lambda s: s["fired"],
             "Timers whose deadline passed and that the timer thread handed on to run"),
            ("cancelled", lambda s: s["cancelled"],
             "Timers cancelled before they ran (or dropped unrun by close())"),
            ("dropped", lambda s: s["dropped"],
             "Timers released unrun because the loop they were for closed"),
        ]
        for name, read, description in counters:
            meter.create_observable_counter(
                f"bucketimer.timers.{name}", [self._reader(read)], unit="{timer}",
                description=description)
        meter.create_observable_up_down_counter(
            "bucketimer.timers.pending", [self._reader(_pending)], unit="{timer}",
            description="Timers scheduled and not yet run, cancelled or dropped")
        meter.create_observable_counter(
            "bucketimer.timers.lateness", [self._lateness], unit="{timer}",
            description="Timers that ran at most `le` seconds after their deadline "
                        "(cumulative, as a Prometheus histogram's buckets)")
        self._deadlines = meter.create_counter(
            "bucketimer.grpc.deadlines", unit="{call}",
            description="Server calls that ran out of their budget")
        self._budget_used = meter.create_histogram(
            "bucketimer.grpc.deadline.budget_used", unit="1",
            description="A call's time when its deadline acted, over its budget",
            explicit_bucket_boundaries_advisory=_BUDGET_USED_BOUNDS)
        self._slow_calls = meter.create_counter(
            "bucketimer.grpc.slow_calls", unit="{call}",
            description="Calls that passed their slow-call threshold")
        self._slow_duration = meter.create_histogram(
            "bucketimer.grpc.slow_call.duration", unit="s",
            description="How long the calls that turned slow took in all",
            explicit_bucket_boundaries_advisory=_DURATION_BOUNDS)

    # -- what is reported ---------------------------------------------------------

    def add_timer_thread(self, name: str, timer_thread: TimerThread | None = None) -> None:
        """Report ``timer_thread`` with ``bucketimer.timer_thread=name``;
        None: the default TimerThread (the one ``default_timer_thread()``
        returns when the metrics are read, made then if there is none)."""
        if not isinstance(name, str) or not name:
            raise TypeError("name must be a non-empty str")
        if timer_thread is not None and not isinstance(timer_thread, TimerThread):
            raise TypeError(
                f"timer_thread must be a bucketimer.TimerThread or None, "
                f"not {type(timer_thread).__name__}")
        with self._lock:
            if name in self._threads and self._threads[name] is not timer_thread:
                raise ValueError(f"a different TimerThread is reported as {name!r}")
            self._threads[name] = timer_thread

    def remove_timer_thread(self, name: str) -> None:
        """Stop reporting the TimerThread named ``name`` (if there is one)."""
        with self._lock:
            self._threads.pop(name, None)

    @property
    def timer_threads(self) -> dict[str, TimerThread | None]:
        """The TimerThreads reported, by name (a copy)."""
        with self._lock:
            return dict(self._threads)

    @property
    def grpc(self) -> bool:
        """Whether the gRPC interceptors' reports are recorded."""
        return self._grpc

    @grpc.setter
    def grpc(self, on: bool) -> None:
        with self._lock:
            self._grpc = bool(on)
            if self._grpc:
                _observers.add_grpc(self)
            else:
                _observers.remove_grpc(self)

    def close(self) -> None:
        """Report nothing more: no TimerThread, no gRPC call.  (OpenTelemetry
        has no way to remove an instrument: they stay, with no data.)"""
        self.grpc = False
        with self._lock:
            self._threads.clear()

    # -- the timer threads, read at collection time ---------------------------------------

    def _snapshots(self) -> list[tuple[dict[str, str], Stats]]:
        with self._lock:
            threads = list(self._threads.items())
        out = []
        for name, tt in threads:
            stats = (tt if tt is not None else default_timer_thread()).stats()
            out.append(({_THREAD: name}, stats))
        return out

    def _reader(self, read: Callable[[Stats], int]) -> Callable[[CallbackOptions], list[Observation]]:
        def callback(options: CallbackOptions) -> list[Observation]:
            return [Observation(read(stats), attrs) for attrs, stats in self._snapshots()]
        return callback

    def _lateness(self, options: CallbackOptions) -> list[Observation]:
        out = []
        for attrs, stats in self._snapshots():
            for le, count in _cumulative(stats["lateness_hist"]):
                out.append(Observation(count, {**attrs, "le": le}))
        return out

    # -- the gRPC interceptors' reports (bucketimer._observers.GrpcObserver) -----------------

    def deadline(self, ev: DeadlineEvent, /) -> None:
        attrs = _rpc_attributes(ev.method, "server")
        if ev.budget > 0.0:
            self._budget_used.record(ev.elapsed / ev.budget, attrs)
        # last: a reader that sees the count sees the rest of the report
        self._deadlines.add(1, {**attrs, _SOURCE: ev.source})

    def slow(self, info: SlowCall, /) -> None:
        attrs = _rpc_attributes(info.method, info.side)
        if not info.finished:
            self._slow_calls.add(1, attrs)
            return
        code = info.code
        self._slow_duration.record(
            info.elapsed, attrs if code is None else {**attrs, "rpc.grpc.status_code": code.value[0]})


#: each provider's Instrumentation (an instrument made twice on one meter
#: would keep only the first one's callbacks)
_by_provider: weakref.WeakKeyDictionary[MeterProvider, Instrumentation] = weakref.WeakKeyDictionary()
_registry_lock = threading.Lock()


def instrument(timer_threads: Mapping[str, TimerThread | None] | None = None, *,
               meter_provider: MeterProvider | None = None, grpc: bool = True) -> Instrumentation:
    """Report bucketimer's metrics through ``meter_provider`` (default: the
    global one, ``opentelemetry.metrics.get_meter_provider()``).

    ``timer_threads`` maps a name (the ``bucketimer.timer_thread``
    attribute) to each TimerThread to report, None standing for the default
    one; without it, the default TimerThread is reported as ``"default"``.
    ``grpc``: record the gRPC interceptors' reports too.

    The instruments are made once per provider: calling again with the same
    provider adds to what its :class:`Instrumentation` reports and returns it.
    """
    if meter_provider is None:
        meter_provider = _metrics.get_meter_provider()
    elif not isinstance(meter_provider, MeterProvider):
        raise TypeError(f"meter_provider must be an opentelemetry.metrics.MeterProvider or None, "
                        f"not {type(meter_provider).__name__}")
    if timer_threads is None:
        timer_threads = {DEFAULT: None}
    elif not isinstance(timer_threads, Mapping):
        raise TypeError(f"timer_threads must be a mapping of names to TimerThreads or None, "
                        f"not {type(timer_threads).__name__}")
    with _registry_lock:
        inst = _by_provider.get(meter_provider)
        if inst is None:
            inst = _by_provider[meter_provider] = Instrumentation(meter_provider)
    for name, tt in timer_threads.items():
        inst.add_timer_thread(name, tt)
    if grpc:
        inst.grpc = True
    return inst
