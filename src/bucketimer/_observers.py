"""Who hears of the gRPC interceptors' reports besides the log and the
hooks: ``bucketimer.otel``'s metrics and span events (docs/monitoring.rst).

Kept apart from both, with no import of grpc or OpenTelemetry, so that
either side may be imported first and neither needs the other installed.
The interceptors read ``grpc`` only when a call hits its deadline or turns
slow, never per call.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from .grpc._common import DeadlineEvent, SlowCall


class GrpcObserver(Protocol):
    def deadline(self, ev: DeadlineEvent, /) -> None:
        """A server call ran out of its budget."""

    def slow(self, info: SlowCall, /) -> None:
        """A call passed its slow-call threshold, or such a call ended."""

    # and optionally (the interceptors look it up):
    # deadline_ended(method, source, budget, deadline): a call its deadline
    # ended ends now, in its handler's thread or task (where its span is
    # current); ``deadline`` is the budget's end, time.monotonic() seconds


#: The observers of every interceptor; replaced whole (never mutated), so a
#: report reads one consistent tuple without a lock.
grpc: tuple[GrpcObserver, ...] = ()
_lock = threading.Lock()


def add_grpc(observer: GrpcObserver) -> None:
    global grpc
    with _lock:
        if observer not in grpc:
            grpc = (*grpc, observer)


def remove_grpc(observer: GrpcObserver) -> None:
    global grpc
    with _lock:
        grpc = tuple(o for o in grpc if o is not observer)
