"""What the sync and aio interceptors share: budgets and their propagation,
argument checks, the facts handed to hooks (logged by ``_records``), the
delegating context base, handler wrapping with its per-method cache, and
the settings of each interceptor (docs/grpc.rst; the per-call cost: "Costs").
"""

from __future__ import annotations

try:
    import grpc as grpc  # the real grpcio package (absolute import); re-exported
except ImportError as _exc:  # pragma: no cover - exercised without grpcio only
    raise ImportError(
        "bucketimer.grpc needs grpcio, which is not installed; "
        "install it with: pip install 'bucketimer[grpc]'"
    ) from _exc

import collections
import contextvars
import dataclasses
import logging
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Self

import bucketimer

from ._records import check_level, log_deadline, log_hook_error, log_slow
from ._records import logger as logger

# the public names both backends export
__all__ = ["DeadlineEvent", "SlowCall", "current_deadline", "remaining"]

_monotonic = time.monotonic
_new = object.__new__

# Above this, a server's time_remaining() means "no deadline" (sync grpc
# reports ~9.2e18 s for a call without one).
_NO_DEADLINE = 1e9

DEFAULT_DETAILS = "Deadline Exceeded"

# The timeout given to a call whose propagated budget is already spent.
_SPENT = -1.0

# -- deadline propagation ------------------------------------------------------

#: Absolute ``time.monotonic()`` deadline of the call being served in this
#: context (set by ServerDeadlineInterceptor around the handler), or None.
_deadline_var: contextvars.ContextVar[float | None] = contextvars.ContextVar(
    "bucketimer.grpc.deadline", default=None
)


def current_deadline() -> float | None:
    """The absolute deadline (``time.monotonic()`` seconds) of the call being
    served in this context, or None outside a handler served through
    ``ServerDeadlineInterceptor`` or when the call has no budget."""
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


# -- small helpers -----------------------------------------------------------------


def _check_seconds(name: str, value: Any, *, allow_none: bool, allow_zero: bool = False) -> float | None:
    if value is None:
        if allow_none:
            return None
        raise TypeError(f"{name} must be a number of seconds, not None")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds, not {type(value).__name__}")
    seconds = float(value)
    if math.isnan(seconds):
        raise ValueError(f"{name} must not be NaN")
    if seconds < 0 or (seconds == 0 and not allow_zero):
        raise ValueError(f"{name} must be {'>= 0' if allow_zero else '> 0'}, got {seconds!r}")
    return seconds


def _check_hook(name: str, hook: Any) -> Any:
    if hook is not None and not callable(hook):
        raise TypeError(f"{name} must be callable")
    return hook


def _method_name(method: Any) -> str:
    if isinstance(method, bytes):
        return method.decode("utf-8", "replace")
    return str(method)


def _safe_hook(hook: Callable[[Any], object], arg: Any, what: str) -> None:
    try:
        hook(arg)
    except Exception:
        log_hook_error(what, hook, arg)


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


def _observe(fact: DeadlineEvent | SlowCall) -> None:
    """Hand a report to the metrics observers (``bucketimer.otel``;
    docs/monitoring.rst).  Reached only when a call hits its deadline or
    turns slow, so the per-call path pays nothing for metrics."""
    from bucketimer import _observers

    for observer in _observers.grpc:
        try:
            if isinstance(fact, DeadlineEvent):
                observer.deadline(fact)
            else:
                observer.slow(fact)
        except Exception:
            logger.exception("bucketimer.grpc: metrics observer %r raised", observer)


def _observe_end(call: _DeadlineCall) -> None:
    """``call``, which its deadline ended, ends now, in its handler's
    thread or task: where the call's span is current (the span events of
    ``bucketimer.otel``, docs/monitoring.rst).  Reached by expired calls
    only."""
    from bucketimer import _observers

    for observer in _observers.grpc:
        ended = getattr(observer, "deadline_ended", None)
        if ended is not None:
            try:
                ended(call._method, call._source, call._budget_length(), call._deadline)
            except Exception:
                logger.exception("bucketimer.grpc: metrics observer %r raised", observer)


# -- status codes ---------------------------------------------------------------------

# grpc.aio contexts report the C core's codes; map them to grpc.StatusCode.
_CODE_MAP: dict[Any, grpc.StatusCode] = {}
try:
    from grpc import _common as _grpc_common

    _CODE_MAP = dict(_grpc_common.CYGRPC_STATUS_CODE_TO_STATUS_CODE)
except (ImportError, AttributeError):  # pragma: no cover
    pass


def _as_status(code: Any) -> grpc.StatusCode | None:
    if isinstance(code, grpc.StatusCode):
        return code
    return _CODE_MAP.get(code)


def _code_of(outcome: Any) -> grpc.StatusCode | None:
    """The status of a finished client call (sync grpc's call, future or error)."""
    code = getattr(outcome, "code", None)
    if code is None:
        return None
    try:
        c = code()
    except Exception:
        return None
    return c if isinstance(c, grpc.StatusCode) else None


def _server_code(context: Any, exc: BaseException | None, *, set_code_wins: bool,
                 exc_codes: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = ()) -> grpc.StatusCode | None:
    """The status a server call ended with: the one the handler set (which
    on the sync server survives an exception: ``set_code_wins``), OK when it
    returned, else the code ``exc_codes`` gives its exception, or UNKNOWN."""
    try:
        code = _as_status(context.code())
    except Exception:
        code = None
    if code is not None and (exc is None or set_code_wins or code is not grpc.StatusCode.OK):
        return code
    if exc is None:
        return grpc.StatusCode.OK
    for kind, kind_code in exc_codes:
        if isinstance(exc, kind):
            return kind_code
    return grpc.StatusCode.UNKNOWN


# -- facts handed to hooks ----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DeadlineEvent:
    """What ``ServerDeadlineInterceptor`` passes to ``on_deadline``.

    ``source`` is ``"client"`` when the client's deadline was the binding one,
    ``"max_time"`` when the server's ``max_time`` was.  ``budget`` is the
    call's budget in seconds, ``elapsed`` the time since the handler started.
    ``interrupted`` is True when the sync handler thread was sent a
    ``DeadlineInterrupt`` (interrupt mode) and ``cancelled`` when the aio
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
    """What ``SlowCallInterceptor`` logs and passes to ``on_slow``.

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


# -- the handler's context --------------------------------------------------------------


class _ContextProxy:
    """The real servicer context ``_ctx``, seen through: every attribute this
    class does not define is the real context's.

    Each backend registers its subclasses as virtual subclasses of its
    ``ServicerContext`` ABC (``isinstance`` holds), rather than deriving from
    it: deriving would shadow ``__getattr__`` with the ABC's methods, which
    are abstract or raise ``NotImplementedError``.
    """

    __slots__ = ("_ctx",)

    def __getattr__(self, name: str) -> Any:
        if name == "_ctx":  # not set yet: never recurse
            raise AttributeError(name)
        return getattr(self._ctx, name)


class _DeadlineCall(_ContextProxy):
    """One call under ``ServerDeadlineInterceptor``: its budget and timer, and
    the context its handler sees, with ``time_remaining()`` counted against
    the budget and ``code()`` ``DEADLINE_EXCEEDED`` once the budget ran out
    (if the handler set none).  ``_expired``: the timer fired; ``_done``: the
    handler ended; ``_task``: the aio handler's task.

    What is the same for every call of a method (the interceptor ``_ic``,
    the method's name) is on a class of that method's own (:meth:`_for`), so
    a call stores only what is its own.
    """

    __slots__ = ("_deadline", "_source", "_start", "_expired", "_done", "_handle", "_task")
    _ctx: Any
    _deadline: float
    _source: str
    _start: float
    _expired: bool
    _done: bool
    _handle: bucketimer.Handle
    _task: Any
    #: per method (:meth:`_for`)
    _ic: _DeadlineSettings
    _method: str

    @classmethod
    def _for(cls, ic: Any, method: str, **constants: Any) -> type[Self]:
        """The class of ``method``'s calls under ``ic``."""
        return type(cls.__name__, (cls,), {"__slots__": (), "_ic": ic, "_method": method, **constants})

    @classmethod
    def _begin(cls, ctx: Any, task: Any = None) -> Self | None:
        """The call's budget (the smaller of the client's deadline and
        ``max_time`` from now) and its timer armed; None when it has neither.
        The constructor: one call per RPC, so no ``__init__`` frame."""
        now = _monotonic()
        rem = ctx.time_remaining()
        ic = cls._ic
        max_time = ic._max_time
        if rem is None or rem >= _NO_DEADLINE:
            if max_time is None:
                return None
            deadline, source = now + max_time, "max_time"
        elif max_time is not None and max_time < rem:
            deadline, source = now + max_time, "max_time"
        else:
            deadline, source = now + (rem if rem > 0.0 else 0.0), "client"
        call = _new(cls)
        call._ctx = ctx
        call._deadline = deadline
        call._source = source
        call._start = now
        call._task = task
        call._expired = call._done = False
        if cls._setup is not None:
            cls._setup(call)
        tt = ic._live_tt
        if tt is None or tt.closed:
            tt = ic._timers()
        call._handle = tt.call_at(deadline, call._fire)
        return call

    #: ``_setup(call)``: what a subclass adds to a new call, before its timer is armed
    _setup: Callable[[Any], None] | None = None

    def _fire(self) -> None:
        raise NotImplementedError

    def time_remaining(self) -> float:
        r = self._deadline - _monotonic()
        return r if r > 0.0 else 0.0

    def code(self) -> Any:
        code = self._ctx.code()
        if self._expired and _as_status(code) in (None, grpc.StatusCode.OK):
            return grpc.StatusCode.DEADLINE_EXCEEDED
        return code

    def _budget_length(self) -> float:
        """The server's ``max_time`` exactly when that was the budget
        (``deadline - start`` of two monotonic floats can come out as
        0.09999999999854481 for 0.1)."""
        if self._source == "max_time":
            return float(self._ic._max_time)  # type: ignore[arg-type]
        return self._deadline - self._start

    def _report(self, *, interrupted: bool = False, cancelled: bool = False) -> None:
        ic = self._ic
        ev = DeadlineEvent(self._method, self._source, self._budget_length(),
                           _monotonic() - self._start, interrupted=interrupted, cancelled=cancelled)
        log_deadline(ev)
        if ic._on_deadline is not None:
            _safe_hook(ic._on_deadline, ev, "on_deadline")
        _observe(ev)


class _FusedCall(_DeadlineCall):
    """One call under ``SlowCallInterceptor`` and ``ServerDeadlineInterceptor``
    together, served by one wrapper (docs/grpc.rst, "Both at once"): the
    deadline's call and context, and the slow call's state, on one timer.

    The timer (``_handle``) is armed at the earlier of the slow-call
    threshold and the deadline (``_first_slow``: the threshold); when it
    fires for one, it arms ``_handle2`` for the other, if the call still
    runs.  ``_slow``: the threshold passed while the call ran.  A call
    without a budget (``_deadline`` None) has the threshold only.

    The handler's end (any thread) sets ``_done`` and cancels ``_handle``:
    a failed cancel means it fired, and :meth:`_settle` then looks at
    ``_handle2``.  The callback arms ``_handle2`` before it looks at
    ``_done`` and the end sets ``_done`` before it looks at ``_handle2``, so
    either the end finds ``_handle2`` or the callback cancels it itself.

    The stack at the threshold is found only then (:meth:`_live_stack`, by
    the backend), never per call.
    """

    __slots__ = ("_slow", "_first_slow", "_handle2")
    _slow: bool
    _first_slow: bool
    _handle2: bucketimer.Handle | None
    #: per method (:meth:`_for`): the slow-call interceptor and its threshold,
    #: and the backend's status of a server call whose handler ended
    #: (``exc``: how, None if it returned)
    _sic: _SlowCallSettings
    _threshold: float
    _status: Callable[[Any, BaseException | None], grpc.StatusCode | None]

    @classmethod
    def _begin_both(cls, ctx: Any, task: Any = None) -> Self:
        """A new call, its budget worked out as :meth:`_DeadlineCall._begin`
        does (``_deadline`` None: none) and its one timer armed."""
        now = _monotonic()
        rem = ctx.time_remaining()
        ic = cls._ic
        max_time = ic._max_time
        call = _new(cls)
        # locals, not attributes: a proxy's attribute reads take the slow path
        deadline: float | None
        if rem is None or rem >= _NO_DEADLINE:
            if max_time is None:
                deadline = None
            else:
                deadline, call._source = now + max_time, "max_time"
        elif max_time is not None and max_time < rem:
            deadline, call._source = now + max_time, "max_time"
        else:
            deadline, call._source = now + (rem if rem > 0.0 else 0.0), "client"
        call._deadline = deadline  # type: ignore[assignment]
        call._ctx = ctx
        call._start = now
        call._task = task
        call._expired = call._done = call._slow = False
        call._handle2 = None
        first = now + cls._threshold
        if deadline is not None and deadline < first:
            first = deadline
            call._first_slow = False
        else:
            call._first_slow = True
        tt = ic._live_tt
        if tt is None or tt.closed:
            tt = ic._timers()
        call._handle = tt.call_at(first, cls._fire, call)
        return call

    # -- the timer ---------------------------------------------------------------------

    def _fire(self) -> None:
        """The first timer: the threshold or the deadline, whichever is
        earlier; then the timer for the other."""
        if self._first_slow:
            self._slow_point()
            if self._deadline is not None:
                self._rearm(self._deadline, self._expire)
        else:
            self._expire()
            self._rearm(self._start + self._threshold, self._slow_point)

    def _rearm(self, when: float, callback: Callable[[], None]) -> None:
        if self._done:
            return
        h = self._ic._timers().call_at(when, callback)
        self._handle2 = h
        if self._done:  # ended meanwhile, maybe without seeing _handle2
            h.cancel()

    def _slow_point(self) -> None:
        """The call passed the threshold: report it, with its live stack."""
        if self._done:
            return
        self._slow = True
        sic = self._sic
        stack = self._live_stack(sic._stack_limit) if sic._stack else None
        sic._report_server(self._method, self._start, False, None, stack)

    def _expire(self) -> None:
        """The budget ran out (the backend's deadline callback)."""
        raise NotImplementedError

    def _live_stack(self, limit: int | None) -> str | None:
        raise NotImplementedError

    # -- the handler's end ---------------------------------------------------------------

    def _settle(self) -> tuple[bool, bool]:
        """After ``_done`` and a failed cancel of ``_handle`` (it fired):
        (did the budget run out, did the call pass the threshold), each told
        by whether its timer fired, as for either interceptor alone."""
        h2 = self._handle2
        second = h2 is not None and not h2.cancel()
        return (second, True) if self._first_slow else (True, second)

    def _finish_both(self) -> tuple[bool, bool]:
        """The handler ended: (expired, slow) as :meth:`_settle` says."""
        self._done = True
        if self._handle.cancel():
            return False, False
        return self._settle()

    def _ends_expired_both(self, exc: BaseException, expired: bool) -> bool:
        """The handler raised ``exc`` (``expired``: as :meth:`_finish_both`
        says): does it end the call with DEADLINE_EXCEEDED (the backend's
        rule) rather than propagate?"""
        raise NotImplementedError

    # The backends' wrappers (``_serve_both``) keep the per-call path inline
    # -- the handler, ``_done``, the cancel of ``_handle`` -- and call these
    # only once the handler raised or a timer fired (docs/grpc.rst, "Costs").

    def _raised(self, exc: BaseException) -> bool:
        """The handler raised ``exc``: no timer of the call fires any more;
        does the call end with DEADLINE_EXCEEDED (the backend's
        ``_end_expired_slow`` then)?  If ``exc`` propagates instead, a slow
        call's end is reported here."""
        expired, slow = self._finish_both()
        return self._ended(self._ends_expired_both(exc, expired), slow, exc)

    def _returned(self) -> bool:
        """The handler returned after ``_handle`` fired (``_done`` set, its
        cancel failed): does the call end with DEADLINE_EXCEEDED?  If not, a
        slow call's end is reported here."""
        expired, slow = self._settle()
        return self._ended(expired, slow, None)

    def _ended(self, expired: bool, slow: bool, exc: BaseException | None) -> bool:
        if expired:
            # for _end_expired_slow: the threshold passed (its timer fired),
            # as _settle or _finish_both found it
            self._slow = slow
            return True
        if slow:
            self._end_slow(exc)
        return False

    def _end_slow(self, exc: BaseException | None) -> None:
        """A slow call ended (``exc``: how, if it raised): the second report."""
        self._sic._report_server(self._method, self._start, True, self._status(self._ctx, exc), None)


class _NativeCallMethods:
    """The methods of :class:`_FusedCall` that the backends' call classes
    for their C wrappers (subclasses of ``_core.GrpcCall``, whose fields
    are :class:`_FusedCall`'s) take as they are; each adds its backend's."""

    __slots__ = ()
    __getattr__ = _ContextProxy.__getattr__
    time_remaining = _DeadlineCall.time_remaining
    code = _DeadlineCall.code
    _budget_length = _DeadlineCall._budget_length
    _report = _DeadlineCall._report
    _fire = _FusedCall._fire
    _rearm = _FusedCall._rearm
    _slow_point = _FusedCall._slow_point
    _end_slow = _FusedCall._end_slow


# -- wrapping a server's handlers ----------------------------------------------------------------


if TYPE_CHECKING:  # generic in grpc's stubs only
    _RpcMethodHandler = grpc.RpcMethodHandler[Any, Any]
else:
    _RpcMethodHandler = grpc.RpcMethodHandler


class _Handler(
    collections.namedtuple(
        "_Handler",
        ("request_streaming", "response_streaming", "request_deserializer",
         "response_serializer", "unary_unary", "unary_stream", "stream_unary",
         "stream_stream"),
    ),
    _RpcMethodHandler,
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


def _mark_fusable(wrapper: Callable[..., Any], ic: _DeadlineSettings, behavior: Callable[..., Any]) -> None:
    """``wrapper`` (``ic``'s of ``behavior``) may be served by one wrapper
    with an outer ``SlowCallInterceptor`` (:func:`_fusable`)."""
    wrapper._bucketimer_deadline = (ic, behavior)  # type: ignore[attr-defined]


def _fusable(behavior: Callable[..., Any], sic: _ServerWrapper) -> tuple[Any, Callable[..., Any]] | None:
    """(the deadline interceptor, the handler it wraps) when ``behavior`` is
    a ``ServerDeadlineInterceptor``'s wrapper that ``sic``, the slow-call
    interceptor around it, may serve in one wrapper with it (their timers on
    the same TimerThread); else None."""
    both = getattr(behavior, "_bucketimer_deadline", None)
    if both is None or both[0]._tt is not sic._tt:
        return None
    return both  # type: ignore[no-any-return]


class _ServerWrapper:
    """A server interceptor that wraps each method's behaviour: ``_wrap``
    makes the wrapper for one method; ``intercept_service`` finds it again
    in ``_wrapped`` (method -> (grpc's handler, the wrapped one)), and
    ``_wrapped_handler`` makes the entry on a miss.

    Generic handlers return the same handler object for every call of a
    method, so the wrapping (new closures, a new RpcMethodHandler) is done
    once per method, not per call.  An entry is used only for the very handler
    object it was made from; the cache is cleared when it holds ``_limit``
    methods.
    """

    _limit = 1024

    def __init__(self, timer_thread: bucketimer.TimerThread | None) -> None:
        self._wrapped: dict[Any, tuple[Any, Any]] = {}
        self._tt = timer_thread
        #: the TimerThread timers go to: ``_tt``, or the default one, found
        #: again by ``_timers()`` when it is closed (after fork() too)
        self._live_tt: bucketimer.TimerThread | None = None

    def _timers(self) -> bucketimer.TimerThread:
        tt = self._tt if self._tt is not None else bucketimer.default_timer_thread()
        self._live_tt = tt
        return tt

    def _wrapped_handler(self, handler: Any, method: Any) -> Any:
        """``handler`` (of ``method``) with its behaviour wrapped; None stays None."""
        if handler is None:
            return None
        entry = self._wrapped.get(method)
        if entry is not None and entry[0] is handler:
            return entry[1]
        wrapped = self._wrap_handler(handler, _method_name(method))
        if len(self._wrapped) >= self._limit:
            self._wrapped.clear()
        self._wrapped[method] = (handler, wrapped)
        return wrapped

    def _wrap_handler(self, handler: Any, method: str) -> Any:
        kind = _behavior_kind(handler)
        behavior = getattr(handler, kind, None)
        if behavior is None or getattr(behavior, "experimental_non_blocking", False):
            return handler  # non-blocking handlers answer from other threads: left alone
        wrapped = self._wrap(behavior, method, bool(handler.request_streaming),
                             bool(handler.response_streaming))
        if wrapped is behavior:
            return handler
        pool = getattr(behavior, "experimental_thread_pool", None)
        if pool is not None:
            wrapped.experimental_thread_pool = pool  # type: ignore[attr-defined]
        return _replace_behavior(handler, kind, wrapped)

    def _wrap(self, behavior: Callable[..., Any], method: str,
              request_streaming: bool, response_streaming: bool) -> Callable[..., Any]:
        raise NotImplementedError


# -- settings ---------------------------------------------------------------------------------


class _TimeoutRules:
    """DefaultTimeoutInterceptor, sync and aio: the settings, the timeout a
    call gets, and the four client methods (which return what the
    continuation returns: grpc.aio awaits it)."""

    def __init__(self, timeout: float | None, *, propagate: bool = True, margin: float = 0.0) -> None:
        self._timeout = _check_seconds("timeout", timeout, allow_none=True)
        self._margin: float = _check_seconds("margin", margin, allow_none=False, allow_zero=True) or 0.0
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

    def _intercept(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return continuation(self._details(client_call_details), request)

    intercept_unary_unary = intercept_unary_stream = _intercept
    intercept_stream_unary = intercept_stream_stream = _intercept

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(timeout={self._timeout!r}, "
                f"propagate={self._propagate!r}, margin={self._margin!r})")


class _DeadlineSettings(_ServerWrapper):
    """ServerDeadlineInterceptor, sync and aio: the settings."""

    def __init__(self, max_time: float | None = None, *,
                 on_deadline: Callable[[DeadlineEvent], object] | None = None,
                 details: str = DEFAULT_DETAILS,
                 timer_thread: bucketimer.TimerThread | None = None) -> None:
        super().__init__(timer_thread)
        self._max_time = _check_seconds("max_time", max_time, allow_none=True)
        self._on_deadline = _check_hook("on_deadline", on_deadline)
        self._details = str(details)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(max_time={self._max_time!r})"


class _SlowCallSettings(_ServerWrapper):
    """SlowCallInterceptor, sync and aio: the settings, and reporting."""

    def __init__(self, threshold: float, *,
                 on_slow: Callable[[SlowCall], object] | None = None,
                 level: int | str = logging.WARNING, stack: bool = True,
                 stack_limit: int | None = 30,
                 timer_thread: bucketimer.TimerThread | None = None) -> None:
        super().__init__(timer_thread)
        seconds = _check_seconds("threshold", threshold, allow_none=False, allow_zero=True)
        assert seconds is not None
        self._threshold = seconds
        self._on_slow = _check_hook("on_slow", on_slow)
        self._level = check_level(level)
        self._stack = bool(stack)
        self._stack_limit = stack_limit

    @property
    def threshold(self) -> float:
        return self._threshold

    def _report(self, info: SlowCall) -> None:
        log_slow(self._level, info, self._threshold)
        if self._on_slow is not None:
            _safe_hook(self._on_slow, info, "on_slow")
        _observe(info)

    def _report_server(self, method: str, start: float, finished: bool,
                       code: grpc.StatusCode | None, stack: str | None) -> None:
        self._report(SlowCall(method, "server", _monotonic() - start, finished, code, stack))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(threshold={self._threshold!r})"


class _BothSettings(_ServerWrapper):
    """ServerDeadlineSlowCallInterceptor, sync and aio: the two interceptors
    it stands for (the backend's ``_deadline_type`` and ``_slow_type``),
    the slow-call one around the deadline one, as their wrappers then serve
    the call in one (docs/grpc.rst, "Both at once")."""

    _deadline_type: type[_DeadlineSettings]
    _slow_type: type[_SlowCallSettings]

    def __init__(self, threshold: float, max_time: float | None = None, *,
                 on_deadline: Callable[[DeadlineEvent], object] | None = None,
                 details: str = DEFAULT_DETAILS,
                 on_slow: Callable[[SlowCall], object] | None = None,
                 level: int | str = logging.WARNING, stack: bool = True,
                 stack_limit: int | None = 30,
                 timer_thread: bucketimer.TimerThread | None = None,
                 **deadline_options: Any) -> None:
        super().__init__(timer_thread)
        self.deadline_interceptor = self._deadline_type(
            max_time, on_deadline=on_deadline, details=details, timer_thread=timer_thread,
            **deadline_options)
        self.slow_call_interceptor = self._slow_type(
            threshold, on_slow=on_slow, level=level, stack=stack, stack_limit=stack_limit,
            timer_thread=timer_thread)

    def _wrap(self, behavior: Callable[..., Any], method: str,
              request_streaming: bool, response_streaming: bool) -> Callable[..., Any]:
        inner = self.deadline_interceptor._wrap(behavior, method, request_streaming, response_streaming)
        return self.slow_call_interceptor._wrap(inner, method, request_streaming, response_streaming)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.slow_call_interceptor!r}, {self.deadline_interceptor!r})"


class _SlowCallBase:
    """Per-call state of ``SlowCallInterceptor``: its start and timer, and
    ``where`` the backend looks for the stack at the threshold (None: no
    stack).  ``slow``: the timer fired; ``done``: the call ended."""

    __slots__ = ("interceptor", "method", "side", "where", "start", "handle", "slow", "done")

    def __init__(self, interceptor: _SlowCallSettings, method: str, side: str, where: Any = None) -> None:
        self.interceptor = interceptor
        self.method = method
        self.side = side
        self.where = where
        self.slow = False
        self.done = False
        self.start = start = _monotonic()
        tt = interceptor._live_tt
        if tt is None or tt.closed:
            tt = interceptor._timers()
        self.handle = tt.call_at(start + interceptor._threshold, self.fire)

    def fire(self) -> None:
        raise NotImplementedError

    def _report(self, finished: bool, code: grpc.StatusCode | None, stack: str | None) -> None:
        self.interceptor._report(SlowCall(self.method, self.side, _monotonic() - self.start,
                                          finished, code, stack))
