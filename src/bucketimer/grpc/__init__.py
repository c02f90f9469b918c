"""gRPC-python interceptors built on bucketimer timers (sync ``grpc`` API).

Every interceptor here arms one bucketimer timer per call and cancels it when
the call ends in time, so a call that finishes before its deadline or
threshold costs one schedule + one cancel; the timer fires only for the calls
that actually run out of time.

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
* :func:`remaining` / :func:`current_deadline` -- the budget left to the
  handler running in this context.

The ``grpc.aio`` versions live in :mod:`bucketimer.grpc.aio`.  Everything is
logged on the ``bucketimer.grpc`` logger.
"""

from __future__ import annotations

try:
    import grpc  # absolute import: the real grpcio package, not this one
except ImportError as _exc:  # pragma: no cover - exercised without grpcio only
    raise ImportError(
        "bucketimer.grpc needs grpcio, which is not installed; "
        "install it with: pip install 'bucketimer[grpc]'"
    ) from _exc

import collections
import contextvars
import ctypes
import dataclasses
import logging
import math
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import bucketimer

try:  # the C-core status codes, for cancelling a server call with a status
    from grpc._cython import cygrpc as _cygrpc

    _CORE_DEADLINE_EXCEEDED: Any = _cygrpc.StatusCode.deadline_exceeded
except (ImportError, AttributeError):  # pragma: no cover - a very different grpcio
    _cygrpc = None
    _CORE_DEADLINE_EXCEEDED = None

__all__ = [
    "DeadlineEvent",
    "DeadlineInterrupt",
    "DeadlinePropagationInterceptor",
    "DefaultTimeoutInterceptor",
    "ServerDeadlineInterceptor",
    "SlowCall",
    "SlowCallInterceptor",
    "current_deadline",
    "remaining",
]

logger = logging.getLogger("bucketimer.grpc")

_monotonic = time.monotonic
_get_ident = threading.get_ident

# Above this, a server's time_remaining() means "no deadline" (sync grpc
# reports ~9.2e18 s for a call without one).
_NO_DEADLINE = 1e9

DEFAULT_DETAILS = "Deadline Exceeded"

# The timeout given to a call whose propagated budget is already spent.
_SPENT = -1.0

# -- deadline propagation ------------------------------------------------------

#: Absolute ``time.monotonic()`` deadline of the call being served in this
#: context (set by :class:`ServerDeadlineInterceptor` around the handler), or
#: None when there is none.
_deadline_var: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "bucketimer.grpc.deadline", default=None
)


def current_deadline() -> float | None:
    """The absolute deadline (``time.monotonic()`` seconds) of the call being
    served in this context, or None outside a handler served through
    :class:`ServerDeadlineInterceptor` or when the call has no budget."""
    return _deadline_var.get()


def remaining() -> float | None:
    """Seconds left in the budget of the call being served in this context
    (never negative), or None when there is no budget (outside a handler, or a
    call with neither a client deadline nor ``max_time``).

    Read from the monotonic clock; inside a sync handler it is valid in the
    handler's thread, inside an aio handler in the handler's task (and in
    tasks it creates, which copy its context).
    """
    d = _deadline_var.get()
    if d is None:
        return None
    r = d - _monotonic()
    return r if r > 0.0 else 0.0


def _propagated_timeout(timeout: float | None, margin: float) -> float | None:
    """``timeout`` capped by the current budget minus ``margin`` (never < 0)."""
    d = _deadline_var.get()
    if d is None:
        return timeout
    left = d - _monotonic() - margin
    if left <= 0.0:
        # Spent: a deadline already well in the past, so grpc fails the call
        # with DEADLINE_EXCEEDED before sending it.  (A timeout of 0 is not
        # enough: the core compares it with a cached clock and often lets a
        # fast call through.)
        return _SPENT
    if timeout is None or left < timeout:
        return left
    return timeout


# -- small shared helpers -----------------------------------------------------------


def _check_seconds(name: str, value: Any, *, allow_none: bool, allow_zero: bool = False) -> float | None:
    if value is None:
        if allow_none:
            return None
        raise TypeError(f"{name} must be a number of seconds, not None")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds, not {type(value).__name__}")
    value = float(value)
    if math.isnan(value):
        raise ValueError(f"{name} must not be NaN")
    if value < 0 or (value == 0 and not allow_zero):
        raise ValueError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {value!r}")
    return value


def _method_name(method: Any) -> str:
    if isinstance(method, bytes):
        return method.decode("utf-8", "replace")
    return str(method)


def _timer_thread(tt: bucketimer.TimerThread | None) -> bucketimer.TimerThread:
    return tt if tt is not None else bucketimer.default_timer_thread()


def _budget(context: Any, max_time: float | None) -> tuple[float, str, float] | None:
    """A call's budget: (deadline, "client" or "max_time", now), the
    smaller of the client's deadline and ``max_time`` from now; None when
    there is neither."""
    now = _monotonic()
    rem = context.time_remaining()
    if rem is None or rem >= _NO_DEADLINE:
        if max_time is None:
            return None
        return now + max_time, "max_time", now
    if max_time is not None and max_time < rem:
        return now + max_time, "max_time", now
    return now + (rem if rem > 0.0 else 0.0), "client", now


def _budget_length(call: Any) -> float:
    """A call's budget in seconds, for its DeadlineEvent: the server's
    ``max_time`` exactly when that was the budget (``deadline - start`` of
    two monotonic floats can come out as 0.09999999999854481 for 0.1)."""
    if call._source == "max_time":
        return float(call._ic._max_time)
    return call._deadline - call._start


def _safe_hook(hook: Callable[[Any], object], arg: Any, what: str) -> None:
    try:
        hook(arg)
    except Exception:
        logger.exception("bucketimer.grpc: %s hook %r raised", what, hook)


class _CallDetails(
    collections.namedtuple(
        "_CallDetails",
        ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression"),
    ),
    grpc.ClientCallDetails,
):
    """A ClientCallDetails for details objects that are not namedtuples."""


def _with_timeout(details: Any, timeout: float | None) -> Any:
    replace = getattr(details, "_replace", None)
    if replace is not None:
        return replace(timeout=timeout)
    return _CallDetails(
        details.method,
        timeout,
        getattr(details, "metadata", None),
        getattr(details, "credentials", None),
        getattr(details, "wait_for_ready", None),
        getattr(details, "compression", None),
    )


# -- facts handed to hooks ----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DeadlineEvent:
    """What :class:`ServerDeadlineInterceptor` passes to ``on_deadline``.

    ``source`` is ``"client"`` when the client's deadline was the binding one,
    ``"max_time"`` when the server's ``max_time`` was.  ``budget`` is the
    call's budget in seconds, ``elapsed`` the time since the handler started.
    ``interrupted`` is True when the sync handler thread was sent a
    :class:`DeadlineInterrupt` (interrupt mode) and ``cancelled`` when the aio
    handler task was cancelled.
    """

    method: str
    source: str
    budget: float
    elapsed: float
    interrupted: bool = False
    cancelled: bool = False


@dataclasses.dataclass(frozen=True)
class SlowCall:
    """What :class:`SlowCallInterceptor` logs and passes to ``on_slow``.

    Reported twice for each slow call: once when it passes the threshold
    (``finished=False``; on a sync server ``stack`` holds the handler thread's
    current Python stack, on an aio server the handler task's stack), and once
    when it ends (``finished=True``, ``elapsed`` is its total time and
    ``code`` its status when known).
    """

    method: str
    side: str  # "client" or "server"
    elapsed: float
    finished: bool
    code: grpc.StatusCode | None = None
    stack: str | None = None


def _log_slow(level: int, info: SlowCall) -> None:
    if not logger.isEnabledFor(level):
        return
    extra = {
        "grpc_method": info.method,
        "grpc_side": info.side,
        "grpc_elapsed": info.elapsed,
        "grpc_finished": info.finished,
        "grpc_code": info.code,
    }
    if info.finished:
        code = info.code.name if info.code is not None else "unknown status"
        logger.log(level, "slow gRPC %s call %s finished after %.3f s (%s)",
                   info.side, info.method, info.elapsed, code, extra=extra)
    elif info.stack:
        logger.log(level, "slow gRPC %s call %s still running after %.3f s; handler stack:\n%s",
                   info.side, info.method, info.elapsed, info.stack.rstrip("\n"), extra=extra)
    else:
        logger.log(level, "slow gRPC %s call %s still running after %.3f s",
                   info.side, info.method, info.elapsed, extra=extra)


def _log_deadline(ev: DeadlineEvent) -> None:
    if not logger.isEnabledFor(logging.INFO):
        return
    how = " (handler interrupted)" if ev.interrupted else " (handler cancelled)" if ev.cancelled else ""
    logger.info("gRPC server call %s ran out of its %.3f s budget (%s) after %.3f s%s",
                ev.method, ev.budget, ev.source, ev.elapsed, how,
                extra={"grpc_method": ev.method, "grpc_elapsed": ev.elapsed,
                       "grpc_budget": ev.budget, "grpc_source": ev.source})


def _code_of(outcome: Any) -> grpc.StatusCode | None:
    code = getattr(outcome, "code", None)
    if code is None:
        return None
    try:
        c = code()
    except Exception:
        return None
    return c if isinstance(c, grpc.StatusCode) else None


# -- the handler-wrapping machinery (sync server) --------------------------------------

_BEHAVIORS = ("unary_unary", "unary_stream", "stream_unary", "stream_stream")


class _Handler(
    collections.namedtuple(
        "_Handler",
        ("request_streaming", "response_streaming", "request_deserializer",
         "response_serializer", "unary_unary", "unary_stream", "stream_unary",
         "stream_stream"),
    ),
    grpc.RpcMethodHandler,
):
    """An RpcMethodHandler for handlers that are not namedtuples."""


def _behavior_kind(handler: Any) -> str:
    if handler.response_streaming:
        return "stream_stream" if handler.request_streaming else "unary_stream"
    return "stream_unary" if handler.request_streaming else "unary_unary"


def _replace_behavior(handler: Any, kind: str, wrapped: Callable[..., Any]) -> Any:
    replace = getattr(handler, "_replace", None)
    if replace is not None:
        return replace(**{kind: wrapped})
    fields = {k: getattr(handler, k, None) for k in _Handler._fields}
    fields[kind] = wrapped
    return _Handler(**fields)


def _wrap_handler(handler: Any, make: Callable[[Callable[..., Any], bool, bool], Callable[..., Any]]) -> Any:
    """``handler`` with its behaviour replaced by
    ``make(behavior, request_streaming, response_streaming)``."""
    if handler is None:
        return None
    kind = _behavior_kind(handler)
    behavior = getattr(handler, kind, None)
    if behavior is None or getattr(behavior, "experimental_non_blocking", False):
        return handler  # non-blocking handlers answer from other threads: left alone
    wrapped = make(behavior, bool(handler.request_streaming), bool(handler.response_streaming))
    pool = getattr(behavior, "experimental_thread_pool", None)
    if pool is not None:
        wrapped.experimental_thread_pool = pool  # type: ignore[attr-defined]
    return _replace_behavior(handler, kind, wrapped)


class _WrapCache:
    """Wrapped handlers by method: generic handlers return the same handler
    object for every call of a method, so the wrapping (new closures, a new
    RpcMethodHandler) is done once, not per call.  An entry is used only for
    the very handler object it was made from; the cache is cleared when it
    reaches ``limit`` methods."""

    __slots__ = ("_entries", "_wrap", "_limit")

    def __init__(self, wrap: Callable[[Any, str], Any], limit: int = 1024) -> None:
        self._entries: dict[Any, tuple[Any, Any]] = {}
        self._wrap = wrap
        self._limit = limit

    def get(self, handler: Any, method: Any) -> Any:
        entry = self._entries.get(method)
        if entry is not None and entry[0] is handler:
            return entry[1]
        wrapped = self._wrap(handler, _method_name(method))
        if len(self._entries) >= self._limit:
            self._entries.clear()
        self._entries[method] = (handler, wrapped)
        return wrapped


# -- asynchronous exceptions (interrupt mode) -------------------------------------------

# Own prototypes, so the shared ctypes.pythonapi function object is not touched.
_SetAsyncExc = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_ulong, ctypes.py_object)(
    ("PyThreadState_SetAsyncExc", ctypes.pythonapi)
)
_ClearAsyncExc = ctypes.PYFUNCTYPE(ctypes.c_int, ctypes.c_ulong, ctypes.c_void_p)(
    ("PyThreadState_SetAsyncExc", ctypes.pythonapi)
)


class DeadlineInterrupt(BaseException):
    """Raised asynchronously inside a sync handler thread whose budget ran out
    (``ServerDeadlineInterceptor(interrupt=True)``).

    A ``BaseException``, so ``except Exception`` in the handler does not
    swallow it; ``finally`` blocks and context managers still run.  The
    interceptor catches it and ends the call with ``DEADLINE_EXCEEDED``.
    """


def _code_dirs() -> tuple[str, ...]:
    """Where an asynchronous exception must not land: code that keeps state
    across statements (grpc's call bookkeeping, locks and conditions, the
    executor, logging, this package)."""
    import concurrent.futures
    import os
    import queue

    mods = (grpc, threading, queue, concurrent.futures, logging, sys.modules[__name__])
    dirs = []
    for m in mods:
        f = getattr(m, "__file__", None)
        if f:
            dirs.append(os.path.dirname(f) + os.sep if os.path.basename(f) == "__init__.py" else f)
    return tuple(dirs)


_UNSAFE_CODE = _code_dirs()

# How often an interrupt is retried while the handler thread is in code where
# an asynchronous exception must not land (see _UNSAFE_CODE).
_INTERRUPT_RETRY = 0.001


def _abort_server_call(context: Any, details: str) -> None:
    """End a sync server call with DEADLINE_EXCEEDED from any thread.

    grpc's sync ``context.abort()`` only works in the handler's thread, so
    this cancels the core call with a status: the transport sends the client a
    ``DEADLINE_EXCEEDED`` trailer and the call is marked cancelled (which
    turns ``is_active()`` false).  Without access to the core call (a context
    wrapped by someone else) it falls back to ``context.cancel()``: the client
    then sees ``CANCELLED``.
    """
    call = getattr(getattr(context, "_rpc_event", None), "call", None)
    try:
        if call is not None and _CORE_DEADLINE_EXCEEDED is not None:
            call.cancel(_CORE_DEADLINE_EXCEEDED, details)
        else:
            context.cancel()
    except Exception:  # the call ended meanwhile
        logger.debug("bucketimer.grpc: cancelling an expired call failed", exc_info=True)


class _DeadlineContext(grpc.ServicerContext):
    """The context a handler sees under :class:`ServerDeadlineInterceptor`,
    which is also the call's deadline state (one object per call).

    The real context, except that ``is_active()`` turns false as soon as the
    budget runs out, ``time_remaining()`` counts against the budget, and
    ``code()`` is ``DEADLINE_EXCEEDED`` once it ran out (if none was set).

    No lock: the handler's end sets ``_done`` and cancels the timer; a failed
    cancel means the timer fired.  A timer firing at the very moment the
    handler ends may still end the call with ``DEADLINE_EXCEEDED``, which is
    right either way.
    """

    __slots__ = ("_ctx", "_ic", "_method", "_deadline", "_source", "_start",
                 "_expired", "_done", "_handle")

    def __init__(self, ctx: Any, ic: ServerDeadlineInterceptor, method: str,
                 deadline: float, source: str, start: float) -> None:
        self._ctx = ctx
        self._ic = ic
        self._method = method
        self._deadline = deadline
        self._source = source
        self._start = start
        self._expired = False
        self._done = False
        self._handle: Any = None

    # -- the deadline ----------------------------------------------------------

    def _finish(self) -> bool:
        """The handler is done: cancel the timer; True if the budget ran out."""
        self._done = True
        return not self._handle.cancel()  # a failed cancel: the timer fired

    def _fire(self) -> None:
        """Timer callback (dispatcher thread): the budget ran out."""
        if self._done or self._expired:
            return
        self._expired = True
        _abort_server_call(self._ctx, self._ic._details)
        self._report(False)

    def _report(self, interrupted: bool) -> None:
        ic = self._ic
        ev = DeadlineEvent(self._method, self._source, _budget_length(self),
                           _monotonic() - self._start, interrupted=interrupted)
        _log_deadline(ev)
        if ic._on_deadline is not None:
            _safe_hook(ic._on_deadline, ev, "on_deadline")

    # -- the context -------------------------------------------------------------

    def is_active(self) -> bool:
        return not self._expired and self._ctx.is_active()

    def time_remaining(self) -> float:
        r = self._deadline - _monotonic()
        return r if r > 0.0 else 0.0

    def code(self) -> Any:
        code = self._ctx.code()
        if code is None and self._expired:
            return grpc.StatusCode.DEADLINE_EXCEEDED
        return code

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ctx, name)

    def cancel(self) -> None:
        return self._ctx.cancel()

    def add_callback(self, callback: Callable[[], None]) -> bool:
        return self._ctx.add_callback(callback)

    def invocation_metadata(self) -> Any:
        return self._ctx.invocation_metadata()

    def peer(self) -> str:
        return self._ctx.peer()

    def peer_identities(self) -> Any:
        return self._ctx.peer_identities()

    def peer_identity_key(self) -> Any:
        return self._ctx.peer_identity_key()

    def auth_context(self) -> Any:
        return self._ctx.auth_context()

    def set_compression(self, compression: Any) -> None:
        return self._ctx.set_compression(compression)

    def send_initial_metadata(self, initial_metadata: Any) -> None:
        return self._ctx.send_initial_metadata(initial_metadata)

    def set_trailing_metadata(self, trailing_metadata: Any) -> None:
        return self._ctx.set_trailing_metadata(trailing_metadata)

    def trailing_metadata(self) -> Any:
        return self._ctx.trailing_metadata()

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        return self._ctx.abort(code, details)

    def abort_with_status(self, status: Any) -> None:
        return self._ctx.abort_with_status(status)

    def set_code(self, code: grpc.StatusCode) -> None:
        return self._ctx.set_code(code)

    def set_details(self, details: str) -> None:
        return self._ctx.set_details(details)

    def details(self) -> Any:
        return self._ctx.details()

    def disable_next_message_compression(self) -> None:
        return self._ctx.disable_next_message_compression()


class _InterruptibleContext(_DeadlineContext):
    """:class:`_DeadlineContext` for ``interrupt=True``.

    ``_inside`` is True while the handler's own code runs in thread
    ``_ident`` (the interrupt window).  ``_lock`` orders the timer's "expire,
    maybe interrupt" against the handler's "leave the window, clear any
    interrupt not delivered yet", so an asynchronous exception never escapes
    the window.

    Inside the window, calls into grpc (this context's methods, the request
    iterator) go through :meth:`_shield`: they leave the window for their
    duration, and an interrupt due meanwhile is raised synchronously when
    they return -- grpc's bookkeeping is never cut in half.  For other code
    (a downstream client call, a lock wait) the timer checks where the thread
    is and retries every millisecond while it is in such code.
    """

    __slots__ = ("_lock", "_ident", "_inside", "_shielded", "_interrupted")

    def __init__(self, ctx: Any, ic: ServerDeadlineInterceptor, method: str,
                 deadline: float, source: str, start: float) -> None:
        super().__init__(ctx, ic, method, deadline, source, start)
        self._lock = threading.Lock()
        self._ident = 0
        self._inside = False
        self._shielded = False
        self._interrupted = False

    def _step(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run one piece of handler code (the call, or one ``next()``) in the window."""
        with self._lock:
            self._ident = _get_ident()
            self._inside = True
        try:
            return fn(*args)
        finally:
            with self._lock:
                self._inside = False
                if self._interrupted:
                    # Set but maybe not delivered yet: it must not land outside.
                    _ClearAsyncExc(self._ident, None)

    def _shield(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Call grpc code from the handler: out of the window while it runs."""
        if _get_ident() != self._ident:
            return fn(*args)
        with self._lock:
            if not self._inside:  # nested, or the handler is over
                inside = False
            else:
                inside = True
                if self._interrupted:
                    # Sent, maybe still pending: raise it here, not inside grpc.
                    _ClearAsyncExc(self._ident, None)
                    raise DeadlineInterrupt
                self._inside = False
                self._shielded = True
        if not inside:
            return fn(*args)
        try:
            return fn(*args)
        finally:
            with self._lock:
                self._inside = True
                self._shielded = False
                due = self._expired and not self._interrupted and not self._done
                if due:
                    self._interrupted = True
            if due:  # expired while in grpc: interrupt now, synchronously
                raise DeadlineInterrupt

    def _finish(self) -> bool:
        with self._lock:
            self._done = True
            expired = self._expired
        if not expired:
            self._handle.cancel()
        return expired

    def _interrupt_locked(self) -> bool:
        """With ``_lock`` held: send the interrupt if the thread is at a safe
        point; False if it must be retried."""
        if not self._inside or self._interrupted:
            return True  # in grpc through _shield() (raised on return), or between messages
        frame = sys._current_frames().get(self._ident)
        if frame is not None and frame.f_code.co_filename.startswith(_UNSAFE_CODE):
            return False
        self._interrupted = _SetAsyncExc(self._ident, DeadlineInterrupt) == 1
        return True

    def _retry_interrupt(self) -> None:
        with self._lock:
            if self._done or self._interrupt_locked():
                return
        _timer_thread(self._ic._tt).call_later(_INTERRUPT_RETRY, self._retry_interrupt)

    def _fire(self) -> None:
        retry = False
        with self._lock:
            if self._done or self._expired:
                return
            self._expired = True
            # interrupted now, on the return from grpc (shielded), or by a retry
            interrupted = self._inside or self._shielded
            if self._inside:
                retry = not self._interrupt_locked()
        _abort_server_call(self._ctx, self._ic._details)
        if retry:
            _timer_thread(self._ic._tt).call_later(_INTERRUPT_RETRY, self._retry_interrupt)
        self._report(interrupted)

    def is_active(self) -> bool:
        return not self._expired and self._shield(self._ctx.is_active)

    def code(self) -> Any:
        code = self._shield(self._ctx.code)
        if code is None and self._expired:
            return grpc.StatusCode.DEADLINE_EXCEEDED
        return code


def _shielded(name: str) -> Callable[..., Any]:
    def method(self: _InterruptibleContext, *args: Any) -> Any:
        return self._shield(getattr(self._ctx, name), *args)

    method.__name__ = method.__qualname__ = name
    return method


for _name in ("cancel", "add_callback", "invocation_metadata", "peer", "peer_identities",
              "peer_identity_key", "auth_context", "set_compression", "send_initial_metadata",
              "set_trailing_metadata", "trailing_metadata", "abort", "abort_with_status",
              "set_code", "set_details", "details", "disable_next_message_compression"):
    setattr(_InterruptibleContext, _name, _shielded(_name))
del _name


def _direct(fn: Callable[..., Any], *args: Any) -> Any:
    return fn(*args)


class _ShieldedRequests:
    """A request iterator whose ``next()`` is shielded from interrupts."""

    __slots__ = ("_it", "_call")

    def __init__(self, it: Any, call: _InterruptibleContext) -> None:
        self._it = it
        self._call = call

    def __iter__(self) -> _ShieldedRequests:
        return self

    def __next__(self) -> Any:
        return self._call._shield(next, self._it)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._it, name)


# -- client interceptors ----------------------------------------------------------------


class _TimeoutRules:
    """What the sync and aio DefaultTimeoutInterceptor share: the settings
    and the timeout a call gets."""

    def __init__(self, timeout: float | None, *, propagate: bool = True, margin: float = 0.0) -> None:
        self._timeout = _check_seconds("timeout", timeout, allow_none=True)
        self._margin = _check_seconds("margin", margin, allow_none=False, allow_zero=True)
        self._propagate = bool(propagate)

    @property
    def timeout(self) -> float | None:
        return self._timeout

    def _details(self, details: Any) -> Any:
        explicit = details.timeout
        t = self._timeout if explicit is None else explicit
        if self._propagate:
            t = _propagated_timeout(t, self._margin)
        return details if t is explicit else _with_timeout(details, t)

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(timeout={self._timeout!r}, "
                f"propagate={self._propagate!r}, margin={self._margin!r})")


class DefaultTimeoutInterceptor(
    _TimeoutRules,
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Client interceptor: a default timeout, and deadline propagation.

    ``timeout`` (seconds, or None for propagation only) is given to every call
    made without one; a call's explicit timeout is kept.  With
    ``propagate=True`` (the default), a call made inside a handler served
    through :class:`ServerDeadlineInterceptor` gets at most the handler's
    remaining budget minus ``margin`` seconds -- even an explicit timeout is
    capped, and when the budget is already spent the call fails at once
    with ``DEADLINE_EXCEEDED`` without being sent (it gets a negative
    timeout).  No timer is involved: grpc enforces the timeout.

    Use with ``grpc.intercept_channel(channel, DefaultTimeoutInterceptor(5.0))``.
    """

    def intercept_unary_unary(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(self, continuation: Any, client_call_details: Any, request_iterator: Any) -> Any:
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation: Any, client_call_details: Any, request_iterator: Any) -> Any:
        return continuation(self._details(client_call_details), request_iterator)


class DeadlinePropagationInterceptor(DefaultTimeoutInterceptor):
    """Client interceptor: deadline propagation only.

    Same as ``DefaultTimeoutInterceptor(None, margin=margin)``: calls made
    inside a handler get at most its remaining budget minus ``margin``; calls
    made elsewhere are unchanged.
    """

    def __init__(self, margin: float = 0.0) -> None:
        super().__init__(None, propagate=True, margin=margin)


# -- server deadline enforcement ---------------------------------------------------------


class ServerDeadlineInterceptor(grpc.ServerInterceptor):
    """Server interceptor: enforce each call's budget.

    The budget is the smaller of the client's deadline and ``max_time``
    seconds from the handler's start (no timer when there is neither).  When
    it runs out while the handler still runs:

    * the client receives ``DEADLINE_EXCEEDED`` (with ``details``) at once;
    * ``context.is_active()`` turns false and ``context.time_remaining()`` is 0
      for the handler;
    * ``on_deadline(DeadlineEvent)`` is called (on bucketimer's dispatcher
      thread) and an INFO record is logged on ``bucketimer.grpc``;
    * with ``interrupt=True``, :class:`DeadlineInterrupt` is raised
      asynchronously in the handler thread (``PyThreadState_SetAsyncExc``)
      so the pool thread is freed.  Limits: the exception is raised at the
      next Python bytecode boundary, so it cannot interrupt a blocking C call
      (``time.sleep(10)``, a socket read, a lock wait, a C extension's loop)
      until that call returns; ``except BaseException`` in the handler can
      swallow it; it may land inside any Python code the handler calls
      (``finally`` blocks and ``with`` exits still run).  It never lands
      outside the handler's own code.

    Whatever the handler does after that, the call ends with
    ``DEADLINE_EXCEEDED``.  Inside the handler, :func:`remaining` gives the
    budget left and :class:`DefaultTimeoutInterceptor` clients propagate it.
    A handler that finishes in time costs one timer schedule + cancel on
    ``timer_thread`` (default: :func:`bucketimer.default_timer_thread`).
    """

    def __init__(self, max_time: float | None = None, *,
                 on_deadline: Callable[[DeadlineEvent], object] | None = None,
                 interrupt: bool = False, details: str = DEFAULT_DETAILS,
                 timer_thread: bucketimer.TimerThread | None = None) -> None:
        self._max_time = _check_seconds("max_time", max_time, allow_none=True)
        if on_deadline is not None and not callable(on_deadline):
            raise TypeError("on_deadline must be callable")
        self._on_deadline = on_deadline
        self._interrupt = bool(interrupt)
        self._details = str(details)
        self._tt = timer_thread
        self._context_class = _InterruptibleContext if self._interrupt else _DeadlineContext
        self._cache = _WrapCache(self._wrap)

    def _begin(self, method: str, context: Any) -> _DeadlineContext | None:
        """The call's budget, and its timer armed; None without a budget."""
        budget = _budget(context, self._max_time)
        if budget is None:
            return None
        deadline, source, now = budget
        call = self._context_class(context, self, method, deadline, source, now)
        call._handle = _timer_thread(self._tt).call_at(deadline, call._fire)
        return call

    def _end_expired(self, call: _DeadlineContext) -> None:
        # The client already has its status; this tells grpc the handler is
        # over without sending a response (grpc skips a cancelled call).
        call._ctx.abort(grpc.StatusCode.DEADLINE_EXCEEDED, self._details)

    def intercept_service(self, continuation: Any, handler_call_details: Any) -> Any:
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        return self._cache.get(handler, handler_call_details.method)

    def _wrap(self, handler: Any, method: str) -> Any:
        return _wrap_handler(handler, lambda b, req_streaming, streaming: (
            self._wrap_stream(b, method, req_streaming) if streaming
            else self._wrap_unary(b, method, req_streaming)))

    def _wrap_unary(self, behavior: Callable[..., Any], method: str, req_streaming: bool) -> Callable[..., Any]:
        interrupt = self._interrupt
        shield_requests = req_streaming and interrupt
        begin = self._begin

        def deadline_unary(request: Any, context: Any) -> Any:
            call = begin(method, context)
            if call is None:  # no budget: nothing to enforce
                token = _deadline_var.set(None)
                try:
                    return behavior(request, context)
                finally:
                    _deadline_var.reset(token)
            token = _deadline_var.set(call._deadline)
            try:
                try:
                    try:
                        if interrupt:
                            if shield_requests:
                                request = _ShieldedRequests(request, call)
                            result = call._step(behavior, request, call)
                        else:
                            result = behavior(request, call)
                    finally:
                        expired = call._finish()
                except DeadlineInterrupt:
                    expired = True
                except Exception:
                    if not call._expired:
                        raise
                    expired = True
                if expired:
                    self._end_expired(call)
                return result
            finally:
                _deadline_var.reset(token)

        return deadline_unary

    def _wrap_stream(self, behavior: Callable[..., Any], method: str, req_streaming: bool) -> Callable[..., Any]:
        interrupt = self._interrupt
        shield_requests = req_streaming and interrupt

        def deadline_stream(request: Any, context: Any) -> Iterator[Any]:
            call = self._begin(method, context)
            if call is None:  # no budget: nothing to enforce
                yield from behavior(request, context)
                return
            if shield_requests:
                request = _ShieldedRequests(request, call)
            step = call._step if interrupt else _direct
            deadline = call._deadline
            it: Any = None
            expired = False
            try:
                try:
                    token = _deadline_var.set(deadline)
                    try:
                        it = iter(step(behavior, request, call))
                    finally:
                        _deadline_var.reset(token)
                    while not call._expired:
                        token = _deadline_var.set(deadline)
                        try:
                            item = step(next, it)
                        except StopIteration:
                            break
                        finally:
                            _deadline_var.reset(token)
                        if call._expired:  # produced after the budget ran out: dropped
                            break
                        yield item
                finally:
                    expired = call._finish()
            except DeadlineInterrupt:
                expired = True
            except Exception:
                if not call._expired:
                    raise
                expired = True
            if expired:
                close = getattr(it, "close", None)
                if close is not None:
                    try:
                        close()
                    except Exception:
                        pass
                self._end_expired(call)

        return deadline_stream

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(max_time={self._max_time!r}, "
                f"interrupt={self._interrupt!r})")


# -- slow calls ----------------------------------------------------------------------------


def _thread_stack(ident: int, limit: int | None) -> str | None:
    frame = sys._current_frames().get(ident)
    if frame is None:
        return None
    return "".join(traceback.format_stack(frame, limit=limit))


class _SlowCall:
    """Per-call state of :class:`SlowCallInterceptor` (sync).

    No lock: the end of the call cancels the timer, and only when that
    cancel fails (the timer fired: the call passed its threshold) is the end
    reported.  ``fire`` does nothing once ``done`` is set.
    """

    __slots__ = ("interceptor", "method", "side", "start", "handle", "slow",
                 "ident", "inside", "done")

    def __init__(self, interceptor: SlowCallInterceptor, method: str, side: str) -> None:
        self.interceptor = interceptor
        self.method = method
        self.side = side
        self.slow = False
        self.done = False
        self.ident = 0
        self.inside = False
        self.start = start = _monotonic()
        tt = interceptor._tt
        if tt is None:
            tt = bucketimer.default_timer_thread()
        self.handle = tt.call_at(start + interceptor._threshold, self.fire)

    def fire(self) -> None:
        """Timer callback (dispatcher thread): the call passed the threshold."""
        if self.done:
            return
        self.slow = True
        ic = self.interceptor
        ident = self.ident if self.inside else 0
        stack = _thread_stack(ident, ic._stack_limit) if ident and ic._stack else None
        info = SlowCall(self.method, self.side, _monotonic() - self.start, False, None, stack)
        _log_slow(ic._level, info)
        if ic._on_slow is not None:
            _safe_hook(ic._on_slow, info, "on_slow")

    def finish_server(self, context: Any, exc: BaseException | None) -> None:
        """The handler ended (``exc``: how, if it raised)."""
        if self.done:
            return
        self.done = True
        if not self.handle.cancel():  # the timer fired: a slow call
            self._report_end(_server_code(context, exc))

    def finish_client(self, outcome: Any) -> None:
        """The client call ended (``outcome``: grpc's call / future / error)."""
        if self.done:
            return
        self.done = True
        if not self.handle.cancel():
            self._report_end(_code_of(outcome) if outcome is not None else grpc.StatusCode.UNKNOWN)

    def _report_end(self, code: grpc.StatusCode | None) -> None:
        ic = self.interceptor
        info = SlowCall(self.method, self.side, _monotonic() - self.start, True, code, None)
        _log_slow(ic._level, info)
        if ic._on_slow is not None:
            _safe_hook(ic._on_slow, info, "on_slow")


def _server_code(context: Any, exc: BaseException | None) -> grpc.StatusCode | None:
    try:
        code = context.code()
    except Exception:
        code = None
    if isinstance(code, grpc.StatusCode):
        return code
    if exc is None:
        return grpc.StatusCode.OK
    if isinstance(exc, DeadlineInterrupt):
        return grpc.StatusCode.DEADLINE_EXCEEDED
    return grpc.StatusCode.UNKNOWN


class _SlowCallSettings:
    """What the sync and aio SlowCallInterceptor share: their settings.
    ``_wrap_handler(handler, method)`` wraps a server handler."""

    def __init__(self, threshold: float, *,
                 on_slow: Callable[[SlowCall], object] | None = None,
                 level: int = logging.WARNING, stack: bool = True,
                 stack_limit: int | None = 30,
                 timer_thread: bucketimer.TimerThread | None = None) -> None:
        self._threshold = _check_seconds("threshold", threshold, allow_none=False, allow_zero=True)
        if on_slow is not None and not callable(on_slow):
            raise TypeError("on_slow must be callable")
        self._on_slow = on_slow
        self._level = int(level)
        self._stack = bool(stack)
        self._stack_limit = stack_limit
        self._tt = timer_thread
        self._cache = _WrapCache(self._wrap_handler)

    @property
    def threshold(self) -> float:
        assert self._threshold is not None
        return self._threshold


class SlowCallInterceptor(
    _SlowCallSettings,
    grpc.ServerInterceptor,
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Client and server interceptor: report calls slower than ``threshold``.

    When a call is still running ``threshold`` seconds after it started, a
    record is logged on ``bucketimer.grpc`` (at ``level``, WARNING by default)
    with the method and the elapsed time -- on a sync server also the handler
    thread's current Python stack (``sys._current_frames``), while it is
    still stuck.  When a slow call ends, a second record gives its total time
    and status.  ``on_slow(SlowCall)`` receives the same facts (called on
    bucketimer's dispatcher thread at the threshold, in the call's thread or
    grpc's at the end).  A call that ends in time costs one timer schedule +
    cancel and logs nothing.

    Server: ``grpc.server(..., interceptors=[SlowCallInterceptor(1.0)])``;
    client: ``grpc.intercept_channel(channel, SlowCallInterceptor(1.0))``.
    With ``ServerDeadlineInterceptor(interrupt=True)``, list this one first
    (outermost), so that its own bookkeeping is outside the interrupt window.
    On the server, the time is the handler's (for a streaming response, until
    its iterator is exhausted); on the client, until the call completes.
    """

    # -- server ------------------------------------------------------------------

    def intercept_service(self, continuation: Any, handler_call_details: Any) -> Any:
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        return self._cache.get(handler, handler_call_details.method)

    def _wrap_handler(self, handler: Any, method: str) -> Any:
        return _wrap_handler(handler, lambda b, req_streaming, streaming: (
            self._wrap_stream(b, method, req_streaming) if streaming
            else self._wrap_unary(b, method, req_streaming)))

    def _wrap_unary(self, behavior: Callable[..., Any], method: str, req_streaming: bool) -> Callable[..., Any]:
        def slow_unary(request: Any, context: Any) -> Any:
            call = _SlowCall(self, method, "server")
            call.ident = _get_ident()
            call.inside = True
            try:
                result = behavior(request, context)
            except BaseException as e:
                call.inside = False
                call.finish_server(context, e)
                raise
            call.inside = False
            call.finish_server(context, None)
            return result

        return slow_unary

    def _wrap_stream(self, behavior: Callable[..., Any], method: str, req_streaming: bool) -> Callable[..., Any]:
        def slow_stream(request: Any, context: Any) -> Iterator[Any]:
            call = _SlowCall(self, method, "server")
            exc: BaseException | None = None
            try:
                call.ident = _get_ident()
                call.inside = True
                try:
                    it = iter(behavior(request, context))
                finally:
                    call.inside = False
                while True:
                    call.ident = _get_ident()
                    call.inside = True
                    try:
                        item = next(it)
                    except StopIteration:
                        return
                    finally:
                        call.inside = False
                    yield item
            except GeneratorExit:  # grpc stopped iterating (the call ended)
                raise
            except BaseException as e:
                exc = e
                raise
            finally:
                call.finish_server(context, exc)

        return slow_stream

    # -- client ------------------------------------------------------------------

    def _client(self, continuation: Any, details: Any, request: Any) -> Any:
        call = _SlowCall(self, _method_name(details.method), "client")
        try:
            outcome = continuation(details, request)
        except BaseException:
            call.finish_client(None)
            raise
        add_done = getattr(outcome, "add_done_callback", None)
        if add_done is None:
            call.finish_client(outcome)
        else:
            add_done(call.finish_client)
        return outcome

    def intercept_unary_unary(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return self._client(continuation, client_call_details, request)

    def intercept_unary_stream(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return self._client(continuation, client_call_details, request)

    def intercept_stream_unary(self, continuation: Any, client_call_details: Any, request_iterator: Any) -> Any:
        return self._client(continuation, client_call_details, request_iterator)

    def intercept_stream_stream(self, continuation: Any, client_call_details: Any, request_iterator: Any) -> Any:
        return self._client(continuation, client_call_details, request_iterator)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(threshold={self._threshold!r})"
