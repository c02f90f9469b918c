"""gRPC-python interceptors built on bucketimer timers: this package's
namespace is the sync ``grpc`` API (:mod:`bucketimer.grpc.sync`); the
``grpc.aio`` one is :mod:`bucketimer.grpc.aio`, and what both share lives in
``_common`` (docs/grpc.rst).

Every interceptor arms one bucketimer timer per call and cancels it when the
call ends in time, so a call that finishes before its deadline or threshold
costs one schedule + one cancel; the timer fires only for the calls that
actually run out of time.

* :class:`DefaultTimeoutInterceptor` -- client: a call without a timeout gets
  a default one; inside a handler, outgoing calls get at most the handler's
  remaining budget minus a margin (deadline propagation).
* :class:`DeadlinePropagationInterceptor` -- client: propagation only.
* :class:`ServerDeadlineInterceptor` -- server: enforces each call's budget
  (the smaller of the client's deadline and ``max_time``): the client gets
  ``DEADLINE_EXCEEDED`` when it runs out, ``context.is_active()`` turns false,
  an optional hook is called, and (opt-in) the handler thread is interrupted.
* :class:`SlowCallInterceptor` -- client and server: logs calls still
  running after a threshold (with the stuck handler thread's Python stack on
  the server) and their total time when they end.
* :class:`ServerDeadlineSlowCallInterceptor` -- server: the slow-call
  interceptor around the deadline one, in one wrapper and one timer per call
  (as the two listed in that order).
* :func:`remaining` / :func:`current_deadline` -- the budget left to the
  handler running in this context.

Everything is logged on the ``bucketimer.grpc`` logger (``_records``).
Importing this package wraps grpc's constructors that take interceptors,
so that grpc takes these however they are registered and refuses those of
the other API clearly: :func:`patch_grpc` (undone by :func:`unpatch_grpc`;
not done with ``BUCKETIMER_GRPC_PATCH=0``), in ``_registration``.
"""

from __future__ import annotations

# Each name re-exported as itself (``X as X``), so that a type checker in
# strict mode sees the sync API here: a star import would hide it.
from ._common import DEFAULT_DETAILS as DEFAULT_DETAILS
from ._common import DeadlineEvent as DeadlineEvent
from ._common import SlowCall as SlowCall
from ._common import current_deadline as current_deadline
from ._common import flush_reports as flush_reports
from ._common import grpc as grpc  # the real grpcio package
from ._common import logger as logger
from ._common import remaining as remaining
from ._registration import install as _install
from ._registration import patch_grpc as patch_grpc
from ._registration import unpatch_grpc as unpatch_grpc
from .sync import DeadlineInterrupt as DeadlineInterrupt
from .sync import DeadlinePropagationInterceptor as DeadlinePropagationInterceptor
from .sync import DefaultTimeoutInterceptor as DefaultTimeoutInterceptor
from .sync import ServerDeadlineInterceptor as ServerDeadlineInterceptor
from .sync import ServerDeadlineSlowCallInterceptor as ServerDeadlineSlowCallInterceptor
from .sync import SlowCallInterceptor as SlowCallInterceptor

#: this namespace is the sync API (:mod:`bucketimer.grpc.sync`'s ``__all__``);
#: ``patch_grpc`` and ``unpatch_grpc`` are this package's own
__all__ = [
    "DeadlineEvent",
    "DeadlineInterrupt",
    "DeadlinePropagationInterceptor",
    "DefaultTimeoutInterceptor",
    "ServerDeadlineInterceptor",
    "ServerDeadlineSlowCallInterceptor",
    "SlowCall",
    "SlowCallInterceptor",
    "current_deadline",
    "flush_reports",
    "remaining",
]

_install()  # patch_grpc(), unless BUCKETIMER_GRPC_PATCH=0
