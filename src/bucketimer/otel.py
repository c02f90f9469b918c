"""OpenTelemetry metrics and span events of bucketimer (the ``otel``
extra; docs/monitoring.rst).

:func:`instrument` puts bucketimer's instruments on a ``MeterProvider``
(the global one unless told): per TimerThread, the counters of
``TimerThread.stats()``, read by callbacks when the provider collects, so
the timers' own path does nothing for them; and for the gRPC interceptors,
the calls that hit their deadline or turned slow, recorded when the
interceptor reports one, never per call.  Such a report also adds an event
to the span that was current where the call's timer was armed (the call's
own span, when an RPC instrumentation such as
opentelemetry-instrumentation-grpc opened one), if that span records.

The RPC attributes follow ``OTEL_SEMCONV_STABILITY_OPT_IN`` as
OpenTelemetry's instrumentations do (:func:`rpc_conventions`).  The
lateness histogram is :mod:`bucketimer.prometheus`'s (docs/monitoring.rst
says why).

Only ``opentelemetry-api`` is needed, as for any instrumentation library:
the application picks the SDK, the readers and the exporters (Prometheus
among them).
"""

from __future__ import annotations

try:
    from opentelemetry import metrics as _metrics
    from opentelemetry import trace as _trace
except ImportError as _exc:  # pragma: no cover - exercised without the extra only
    raise ImportError(
        "bucketimer.otel needs opentelemetry-api, which is not installed; "
        "install it with: pip install 'bucketimer[otel]'"
    ) from _exc

import os
import threading
import time
import weakref
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from opentelemetry.metrics import CallbackOptions, MeterProvider, Observation

from . import _observers
from ._backend import TimerThread, default_timer_thread
from ._stats import Stats
from ._version import __version__

if TYPE_CHECKING:
    from .grpc._common import DeadlineEvent, SlowCall

__all__ = ["DEADLINE_EVENT", "DEFAULT", "SLOW_CALL_EVENT", "Instrumentation", "instrument",
           "rpc_conventions"]

#: The name the default TimerThread is reported under (the
#: ``bucketimer.timer_thread`` attribute).
DEFAULT = "default"

#: The span events a gRPC report adds (docs/monitoring.rst, "Span events").
DEADLINE_EVENT = "bucketimer.grpc.deadline"
SLOW_CALL_EVENT = "bucketimer.grpc.slow_call"

_THREAD = "bucketimer.timer_thread"
_SIDE = "bucketimer.grpc.side"
_SOURCE = "bucketimer.grpc.budget_source"

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


# -- OpenTelemetry's RPC conventions ---------------------------------------------------------

#: how OpenTelemetry's instrumentations are told to move to a domain's
#: stable conventions (``rpc``, ``rpc/dup``), a comma-separated list
OPT_IN = "OTEL_SEMCONV_STABILITY_OPT_IN"


def rpc_conventions(environ: Mapping[str, str] = os.environ) -> str:
    """Which RPC attributes the gRPC metrics carry, as
    ``OTEL_SEMCONV_STABILITY_OPT_IN`` asks: ``"default"``, those
    opentelemetry-instrumentation-grpc emits (``rpc.system``,
    ``rpc.service``, the method's own name as ``rpc.method``, the int
    ``rpc.grpc.status_code``); ``"rpc"``, the stable ones (``rpc.system.name``,
    the fully-qualified ``rpc.method``, the string ``rpc.status_code``);
    ``"rpc/dup"``, both, the key both name (``rpc.method``) taking the
    stable value.  ``rpc/dup`` wins over ``rpc``."""
    values = {v.strip() for v in environ.get(OPT_IN, "").split(",")}
    return "rpc/dup" if "rpc/dup" in values else "rpc" if "rpc" in values else "default"


def _rpc_attributes(conventions: str, method: str, side: str) -> dict[str, Any]:
    """The attributes of a report on ``method`` (``/package.Service/Method``)."""
    full = method.lstrip("/")
    attrs: dict[str, Any] = {}
    if conventions != "rpc":
        service, _, name = full.rpartition("/")
        attrs.update({"rpc.system": "grpc", "rpc.service": service, "rpc.method": name})
    if conventions != "default":
        attrs.update({"rpc.system.name": "grpc", "rpc.method": full})
    attrs[_SIDE] = side
    return attrs


def _status_attributes(conventions: str, code: Any) -> dict[str, Any]:
    """A ``grpc.StatusCode``'s attribute: its number before the stable
    conventions, its name in them."""
    attrs: dict[str, Any] = {}
    if conventions != "rpc":
        attrs["rpc.grpc.status_code"] = code.value[0]
    if conventions != "default":
        attrs["rpc.status_code"] = code.name
    return attrs


class Instrumentation:
    """bucketimer's instruments on one ``MeterProvider`` (made by
    :func:`instrument`, once per provider) and what they report: the
    TimerThreads added by name, and the gRPC interceptors' reports while
    :attr:`grpc` is true (and their span events while :attr:`span_events`
    is true too)."""

    def __init__(self, meter_provider: MeterProvider) -> None:
        self._lock = threading.Lock()
        #: name -> TimerThread; None: the default one, whichever it is when read
        self._threads: dict[str, TimerThread | None] = {}
        self._grpc = False
        self._span_events = False
        #: the RPC attributes of the gRPC reports, read from the
        #: environment when the instruments are made (:func:`rpc_conventions`)
        self.rpc_conventions = rpc_conventions()
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
                f"bucketimer.timer.{name}", [self._reader(read)], unit="{timer}",
                description=description)
        meter.create_observable_up_down_counter(
            "bucketimer.timer.pending", [self._reader(_pending)], unit="{timer}",
            description="Timers scheduled and not yet run, cancelled or dropped")
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
            _span_events.want(self, self._grpc and self._span_events)

    @property
    def span_events(self) -> bool:
        """Whether a gRPC report also adds an event to the call's span
        (while :attr:`grpc` is true)."""
        return self._span_events

    @span_events.setter
    def span_events(self, on: bool) -> None:
        with self._lock:
            self._span_events = bool(on)
            _span_events.want(self, self._grpc and self._span_events)

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

    # -- the gRPC interceptors' reports (bucketimer._observers.GrpcObserver) -----------------

    def deadline(self, ev: DeadlineEvent, /) -> None:
        attrs = _rpc_attributes(self.rpc_conventions, ev.method, "server")
        if ev.budget > 0.0:
            self._budget_used.record(ev.elapsed / ev.budget, attrs)
        # last: a reader that sees the count sees the rest of the report
        self._deadlines.add(1, {**attrs, _SOURCE: ev.source})

    def slow(self, info: SlowCall, /) -> None:
        attrs = _rpc_attributes(self.rpc_conventions, info.method, info.side)
        if not info.finished:
            self._slow_calls.add(1, attrs)
            return
        if info.code is not None:
            attrs.update(_status_attributes(self.rpc_conventions, info.code))
        self._slow_duration.record(info.elapsed, attrs)


class _SpanEvents:
    """The gRPC reports as span events: one observer for the process,
    however many :class:`Instrumentation` ask for them.

    An interceptor reports a call where the call's timer runs, in a copy of
    the context the timer was armed in (every bucketimer timer's callback
    runs in one): on the server, the handler's, whose span an RPC
    instrumentation's interceptor listed before bucketimer's opened.  So
    the span is found when a call is reported, never per call."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users: set[Instrumentation] = set()

    def want(self, user: Instrumentation, on: bool) -> None:
        with self._lock:
            if on:
                self._users.add(user)
            else:
                self._users.discard(user)
            if self._users:
                _observers.add_grpc(self)
            else:
                _observers.remove_grpc(self)

    def deadline(self, ev: DeadlineEvent, /) -> None:
        """(The event is added when the call ends: :meth:`deadline_ended`.)"""

    def deadline_ended(self, method: str, source: str, budget: float, deadline: float) -> None:
        """A call its deadline ended ends now, in its handler's thread or
        task, where its span is current: the event, at the deadline.  (On
        the sync server the deadline is reported from the timer's thread
        while the handler may be ending the call: only here is the span
        sure to be open.)"""
        span = _trace.get_current_span()
        if span.is_recording():
            at = time.time_ns() - round((time.monotonic() - deadline) * 1e9)
            span.add_event(DEADLINE_EVENT, {"bucketimer.grpc.budget": budget, _SOURCE: source},
                           timestamp=at)

    def slow(self, info: SlowCall, /) -> None:
        if info.finished:  # the span's own end says how long the call took
            return
        span = _trace.get_current_span()
        if span.is_recording():
            attrs: dict[str, Any] = {"bucketimer.grpc.elapsed": info.elapsed, _SIDE: info.side}
            if info.stack:
                attrs["code.stacktrace"] = info.stack
            span.add_event(SLOW_CALL_EVENT, attrs)


_span_events = _SpanEvents()

#: each provider's Instrumentation (an instrument made twice on one meter
#: would keep only the first one's callbacks)
_by_provider: weakref.WeakKeyDictionary[MeterProvider, Instrumentation] = weakref.WeakKeyDictionary()
_registry_lock = threading.Lock()


def instrument(timer_threads: Mapping[str, TimerThread | None] | None = None, *,
               meter_provider: MeterProvider | None = None, grpc: bool = True,
               span_events: bool = True) -> Instrumentation:
    """Report bucketimer's metrics through ``meter_provider`` (default: the
    global one, ``opentelemetry.metrics.get_meter_provider()``).

    ``timer_threads`` maps a name (the ``bucketimer.timer_thread``
    attribute) to each TimerThread to report, None standing for the default
    one; without it, the default TimerThread is reported as ``"default"``.
    ``grpc``: record the gRPC interceptors' reports too; ``span_events``:
    and add each to the call's span, when one records.

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
        inst.span_events = span_events
        inst.grpc = True
    return inst
