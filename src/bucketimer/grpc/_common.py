"""What the sync and aio interceptors share: budgets and their propagation,
argument checks, per-method settings (``methodConfig``), the facts handed to
hooks (logged by ``_records``, delivered off the timer path by
``_delivery``), a server call's budget and what decides its end, handler
wrapping with its caches, and the settings of each interceptor
(docs/grpc.rst; the per-call cost: "Costs").
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
import json
import logging
import math
import re
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Self

import bucketimer

from . import _delivery
from ._records import check_level, log_deadline, log_hook_error, log_slow
from ._records import logger as logger

# the public names both backends export
__all__ = ["DeadlineEvent", "SlowCall", "current_deadline", "flush_reports", "remaining"]

_monotonic = time.monotonic
_new = object.__new__
_INF = math.inf

# Above this, a server's time_remaining() means "no deadline" (sync grpc
# reports ~9.2e18 s for a call without one).
_NO_DEADLINE = 1e9

DEFAULT_DETAILS = "Deadline Exceeded"

# The timeout given to a call whose propagated budget is already spent.
_SPENT = -1.0

#: A budget that is the client's deadline is looked at this long before it
#: runs out: a call grpc has ended by then was cancelled (or its server
#: stopped), not timed out.  grpc ends a call for the client's deadline up
#: to a couple of milliseconds before the server's clock says it is due
#: (``_GRACE``): a look later than that cannot tell, so the look is early
#: enough for a busy dispatcher thread or loop to run it late by 18 ms.
_EARLY = 0.02
_GRACE = 0.002
#: A downstream call's DEADLINE_EXCEEDED is the budget's doing when it came
#: no earlier than this before the deadline the budget gave that call
#: (grpc's clock and ours differ by microseconds)
_BOUND_SLACK = 0.001

# -- deadline propagation ------------------------------------------------------

#: The call being served in this context (set by ServerDeadlineInterceptor
#: around the handler), or None: an object whose ``_deadline`` is its
#: absolute ``time.monotonic()`` deadline and whose ``_bound`` is the
#: earliest deadline it gave a downstream call (propagation).
_deadline_var: contextvars.ContextVar[Any] = contextvars.ContextVar(
    "bucketimer.grpc.deadline", default=None
)


def current_deadline() -> float | None:
    """The absolute deadline (``time.monotonic()`` seconds) of the call being
    served in this context, or None outside a handler served through
    ``ServerDeadlineInterceptor`` or when the call has no budget."""
    b = _deadline_var.get()
    if b is None:
        return None
    deadline: float = b._deadline
    return deadline


def remaining() -> float | None:
    """Seconds left in the budget of the call being served in this context
    (never negative), or None when there is no budget (outside a handler, or a
    call with neither a client deadline nor ``max_time``).

    Read from the monotonic clock; inside a sync handler it is valid in the
    handler's thread, inside an aio handler in the handler's task (and in
    tasks it creates, which copy its context).
    """
    b = _deadline_var.get()
    if b is None:
        return None
    r: float = b._deadline - _monotonic()
    return r if r > 0.0 else 0.0


def _propagated_timeout(timeout: float | None, margin: float) -> float | None:
    """``timeout`` capped by the current budget minus ``margin`` (never < 0);
    a cap is noted on the call (``_bound``), so that the downstream's
    DEADLINE_EXCEEDED is known for the budget's own."""
    b = _deadline_var.get()
    if b is None:
        return timeout
    now = _monotonic()
    left: float = b._deadline - now - margin
    if left <= 0.0:
        if now < b._bound:
            b._bound = now
        # Spent: a deadline already well in the past, so grpc fails the call
        # with DEADLINE_EXCEEDED before sending it.  (A timeout of 0 is not
        # enough: the core compares it with a cached clock and often lets a
        # fast call through.)
        return _SPENT
    if timeout is None or left < timeout:
        if now + left < b._bound:
            b._bound = now + left
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


# -- per-method settings ------------------------------------------------------------------

#: the keys of a ``methodConfig`` entry in grpc's service config (grpc's
#: doc/service_config.md): accepted, and left to grpc but the one asked for
_GRPC_METHOD_KEYS = frozenset({"name", "waitForReady", "timeout", "maxRequestMessageBytes",
                               "maxResponseMessageBytes", "retryPolicy", "hedgingPolicy"})
_DURATION = re.compile(r"\A\d+(\.\d+)?s\Z")


class _MethodTable:
    """Per-method values of one setting (``key``: "timeout", "threshold" or
    "max_time"), given as grpc's service config gives per-method settings:
    a ``methodConfig`` list, the service config holding one, or its JSON.

    Each entry names methods (``{"service": "pkg.Svc", "method": "M"}``),
    whole services (``{"service": "pkg.Svc"}``) or every method (``{}``);
    as in grpc, a method takes the most specific entry that names it, and
    an entry without ``key`` (or no entry) leaves the method the
    interceptor's own value.  A value is seconds, a duration as the JSON
    form of the config writes it (``"1.5s"``), or None: none for this method.
    """

    _limit = 1024

    def __init__(self, key: str, config: Any, allow_zero: bool = False) -> None:
        self._key = key
        self._allow_zero = allow_zero
        #: (service, method) -> value; method "" for a whole service, ("", "") for all
        self._values: dict[tuple[str, str], float | None] = {}
        #: the names an entry claims, with or without ``key`` (the most specific entry wins)
        self._claimed: set[tuple[str, str]] = set()
        self._cache: dict[str, tuple[bool, float | None]] = {}
        for entry in self._entries(config):
            self._add(entry)

    @staticmethod
    def _entries(config: Any) -> list[Any]:
        if isinstance(config, str):
            try:
                config = json.loads(config)
            except ValueError as e:
                raise ValueError(f"method_config is not valid JSON: {e}") from None
        if isinstance(config, Mapping):
            if set(config) - {"methodConfig", "loadBalancingConfig", "loadBalancingPolicy",
                              "retryThrottling", "healthCheckConfig"}:
                raise ValueError("method_config: a service config holds its per-method "
                                 "settings under 'methodConfig'")
            config = config.get("methodConfig", [])
        if isinstance(config, (str, bytes)) or not isinstance(config, (list, tuple)):
            raise TypeError("method_config must be a list of methodConfig entries, a service "
                            f"config or its JSON, not {type(config).__name__}")
        return list(config)

    def _add(self, entry: Any) -> None:
        if not isinstance(entry, Mapping):
            raise TypeError(f"a methodConfig entry must be a dict, not {type(entry).__name__}")
        extra = set(entry) - _GRPC_METHOD_KEYS - {self._key}
        if extra:
            raise ValueError(f"unknown key(s) in a methodConfig entry: {sorted(extra)}")
        names = entry.get("name")
        if not isinstance(names, (list, tuple)) or not names:
            raise ValueError("a methodConfig entry needs 'name': a list of "
                             "{'service': ..., 'method': ...}")
        keys = [self._name(n) for n in names]
        has = self._key in entry
        value = self._value(entry[self._key]) if has else None
        for k in keys:
            if k in self._claimed:
                raise ValueError(f"method_config names {self._show(k)} twice")
            self._claimed.add(k)
            if has:
                self._values[k] = value

    @staticmethod
    def _name(name: Any) -> tuple[str, str]:
        if not isinstance(name, Mapping) or set(name) - {"service", "method"}:
            raise ValueError(f"a methodConfig name is {{'service': ..., 'method': ...}}, not {name!r}")
        service, method = name.get("service", ""), name.get("method", "")
        if not isinstance(service, str) or not isinstance(method, str):
            raise TypeError(f"a methodConfig name's service and method are strings: {name!r}")
        if method and not service:
            raise ValueError(f"a methodConfig name with a method names its service too: {name!r}")
        return service, method

    @staticmethod
    def _show(k: tuple[str, str]) -> str:
        return f"/{k[0]}/{k[1]}" if k[1] else f"service {k[0]!r}" if k[0] else "every method ({})"

    def _value(self, value: Any) -> float | None:
        if isinstance(value, str):
            if not _DURATION.match(value):
                raise ValueError(f"{self._key} {value!r}: a duration is seconds, or a string "
                                 "such as '1.5s'")
            value = float(value[:-1])
        return _check_seconds(self._key, value, allow_none=True, allow_zero=self._allow_zero)

    def __bool__(self) -> bool:
        return bool(self._claimed)

    def lookup(self, method: str) -> tuple[bool, float | None]:
        """(whether an entry sets ``method``'s value, the value) for a full
        method name, ``/pkg.Svc/Method``."""
        hit = self._cache.get(method)
        if hit is not None:
            return hit
        service, _, name = method.lstrip("/").rpartition("/")
        for k in ((service, name), (service, ""), ("", "")):
            if k in self._claimed:
                hit = (k in self._values, self._values.get(k))
                break
        else:
            hit = (False, None)
        if len(self._cache) >= self._limit:
            self._cache.clear()
        self._cache[method] = hit
        return hit

    def value(self, method: str, default: float | None) -> float | None:
        found, value = self.lookup(method)
        return value if found else default


# -- reports ------------------------------------------------------------------------------


def flush_reports(timeout: float | None = None) -> bool:
    """Wait until the interceptors' reports made so far have been delivered
    (their log records written, ``on_deadline``/``on_slow`` called, the
    metrics observers told); False if ``timeout`` seconds passed first.

    The reports are delivered on a thread of bucketimer's, in order, never
    on the timer's path (docs/grpc.rst, "Reports")."""
    return _delivery.flush(timeout)


def _safe_hook(hook: Callable[[Any], object], arg: Any, what: str) -> None:
    try:
        hook(arg)
    except Exception:
        log_hook_error(what, hook, arg)


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
    """``call``, which its budget ended, ends now, in its handler's thread
    or task: where the call's span is current (the span events of
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


def _deliver_deadline(on_deadline: Callable[[DeadlineEvent], object] | None, ev: DeadlineEvent) -> None:
    log_deadline(ev)
    if on_deadline is not None:
        _safe_hook(on_deadline, ev, "on_deadline")
    _observe(ev)


def _deliver_slow(sic: _SlowCallSettings, info: SlowCall) -> None:
    log_slow(sic._level, info, sic._threshold)
    if sic._on_slow is not None:
        _safe_hook(sic._on_slow, info, "on_slow")
    _observe(info)


# -- status codes ---------------------------------------------------------------------

# grpc.aio contexts report the C core's codes; map them to grpc.StatusCode.
_CODE_MAP: dict[Any, grpc.StatusCode] = {}
try:
    from grpc import _common as _grpc_common

    _CODE_MAP = dict(_grpc_common.CYGRPC_STATUS_CODE_TO_STATUS_CODE)
except (ImportError, AttributeError):  # pragma: no cover
    pass

_DEADLINE_EXCEEDED = grpc.StatusCode.DEADLINE_EXCEEDED


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


def _client_gone_code(context: Any) -> grpc.StatusCode:
    """What the client of a server call that grpc ended saw: its deadline
    (grpc's ``time_remaining()`` of the call is down to 0), or a cancel."""
    try:
        left = context.time_remaining()
    except Exception:
        left = None
    return _DEADLINE_EXCEEDED if left is not None and left <= _BOUND_SLACK else grpc.StatusCode.CANCELLED


def _deadline_status(exc: BaseException | None) -> Any:
    """The downstream call's DEADLINE_EXCEEDED error that ``exc`` is, or
    that ``exc`` was raised from (``raise ... from err``); else None.  (Not
    one it was merely raised while handling: an ``abort()`` the handler
    chose in its ``except`` block is its status.)"""
    seen = 0
    while exc is not None and seen < 16:
        if isinstance(exc, grpc.RpcError):
            code = getattr(exc, "code", None)
            try:
                if code is not None and code() == _DEADLINE_EXCEEDED:
                    return exc
            except Exception:
                pass
        exc = exc.__cause__
        seen += 1
    return None


def _pass_on(exc: BaseException) -> str | None:
    """A handler without a budget raised ``exc``: the details of the
    DEADLINE_EXCEEDED it passes on when ``exc`` is (or comes from) a
    downstream call's, else None."""
    err = _deadline_status(exc) if isinstance(exc, Exception) else None
    return None if err is None else _downstream_details(err)


def _downstream_details(err: Any) -> str:
    try:
        details = err.details()
    except Exception:
        details = None
    return details if isinstance(details, str) and details else DEFAULT_DETAILS


# -- facts handed to hooks ----------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DeadlineEvent:
    """What ``ServerDeadlineInterceptor`` passes to ``on_deadline``.

    ``source`` is ``"client"`` when the client's deadline was the binding one,
    ``"max_time"`` when the server's ``max_time`` was.  ``budget`` is the
    call's budget in seconds, ``elapsed`` the time since the handler started
    (less than ``budget`` when a downstream call given the budget less its
    margin ran out first).  ``interrupted`` is True when the sync handler
    thread was sent a ``DeadlineInterrupt`` (interrupt mode) and
    ``cancelled`` when the aio handler task was cancelled.
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
    when it ends (``finished=True``, ``code`` the status the client got).
    ``elapsed`` is the time since the call started; on the server the
    threshold is compared with the handler's own time, which leaves out
    ``peer_wait``, the seconds it spent waiting for the client (for the next
    message of a streamed request, or to send one of a streamed response).
    """

    method: str
    side: str  # "client" or "server"
    elapsed: float
    finished: bool
    code: grpc.StatusCode | None = None
    stack: str | None = None
    peer_wait: float = 0.0


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


# -- what decides a call's end ------------------------------------------------------------

# A call's timer callbacks and its handler's end decide each question once,
# whoever comes first, under this lock (taken only when a timer of the call
# fired: never by a call that ends in time).  ``_claimed`` holds the
# questions decided:
_DEADLINE = 1  # did the budget end the call (``_expired`` the answer)
_LOOKED = 2  # a client budget's early look found the call running (or came too late to tell)
_SLOW = 4  # did the call pass its slow-call threshold (``_slow`` the answer)
_lock = threading.Lock()


class _DeadlineCall(_ContextProxy):
    """One call under ``ServerDeadlineInterceptor``: its budget and timer, and
    the context its handler sees, with ``time_remaining()`` counted against
    the budget and ``code()`` ``DEADLINE_EXCEEDED`` once the budget ran out
    (if the handler set none).

    The budget ends the call (``_expired``) when its timer finds the call
    still running; a call grpc ended first (the client cancelled, the
    server stopped) is no deadline.  Only for a budget that is the client's
    deadline can grpc end the call for it first, a moment before the
    timer: the timer looks first ``_early`` before the deadline, and a call
    grpc ended between that look and the deadline ran out of its budget
    (docs/grpc.rst, "What the caller sees").

    ``_done``: the handler ended; ``_handle``: the first timer,
    ``_handle2``: the one armed again for the next event; ``_task``: the aio
    handler's task; ``_bound``: the earliest deadline the budget gave a
    downstream call; ``_abort``: how the handler's end met an abort (the
    backend's).  What is the same for every call of a method (the
    interceptor ``_ic``, the method's name) is on a class of that method's
    own (:meth:`_for`), so a call stores only what is its own.
    """

    __slots__ = ("_deadline", "_source", "_start", "_expired", "_done", "_handle", "_handle2",
                 "_task", "_bound", "_claimed", "_abort")
    _ctx: Any
    _deadline: float
    _source: str
    _start: float
    _expired: bool
    _done: bool
    _handle: bucketimer.Handle
    _handle2: bucketimer.Handle | None
    _task: Any
    _bound: float
    _claimed: int
    _abort: Any
    #: per method (:meth:`_for`)
    _ic: _DeadlineSettings
    _method: str
    #: how long before a client budget the timer looks first
    _early = _EARLY
    #: the slow-call threshold (fused calls), None: none
    _threshold: float | None = None

    @classmethod
    def _for(cls, ic: Any, method: str, **constants: Any) -> type[Self]:
        """The class of ``method``'s calls under ``ic`` (made once per
        method and class: ``ic``'s cache)."""
        key = (cls, method, tuple(sorted(constants.items())))
        made = ic._classes.get(key)
        if made is None:
            made = type(cls.__name__, (cls,), {"__slots__": (), "_ic": ic, "_method": method,
                                               **constants})
            if len(ic._classes) >= ic._limit:
                ic._classes.clear()
            ic._classes[key] = made
        return made  # type: ignore[no-any-return]

    @classmethod
    def _begin(cls, ctx: Any, task: Any = None) -> Self | None:
        """The call's budget (the smaller of the client's deadline and
        ``max_time`` from now) and its timer armed; None when it has neither.
        The constructor: one call per RPC, so no ``__init__`` frame."""
        now = _monotonic()
        rem = ctx.time_remaining()
        ic = cls._ic
        max_time = cls._max_time
        if rem is None or rem >= _NO_DEADLINE:
            if max_time is None:
                return None
            deadline, source, due = now + max_time, "max_time", now + max_time
        elif max_time is not None and max_time < rem:
            deadline, source, due = now + max_time, "max_time", now + max_time
        else:
            deadline = now + (rem if rem > 0.0 else 0.0)
            source, due = "client", deadline - _EARLY
        call = _new(cls)
        call._ctx = ctx
        call._deadline = deadline
        call._source = source
        call._start = now
        call._task = task
        call._expired = call._done = False
        call._handle2 = call._abort = None
        call._bound = _INF
        call._claimed = 0
        if cls._setup is not None:
            cls._setup(call)
        tt = ic._live_tt
        if tt is None or tt.closed:
            tt = ic._timers()
        call._handle = tt.call_at(due, call._fire)
        return call

    #: ``_setup(call)``: what a subclass adds to a new call, before its timer is armed
    _setup: Callable[[Any], None] | None = None
    #: per method: the budget's ``max_time`` (the interceptor's, or the method's own)
    _max_time: float | None = None

    # -- the handler's view ------------------------------------------------------------

    def time_remaining(self) -> float:
        r = self._deadline - _monotonic()
        return r if r > 0.0 else 0.0

    def code(self) -> Any:
        code = self._ctx.code()
        if self._expired and _as_status(code) in (None, grpc.StatusCode.OK):
            return grpc.StatusCode.DEADLINE_EXCEEDED
        return code

    # -- the timer ---------------------------------------------------------------------

    def _fire(self) -> None:
        """Timer callback: run every event now due, in order (the slow-call
        threshold, a client budget's early look, the deadline), then arm
        the timer again for the next one."""
        while True:
            when, event = self._next_event()
            if event is None:
                return
            if when > _monotonic():
                self._rearm(when)
                return
            event(self)

    def _next_event(self) -> tuple[float, Callable[[Any], None] | None]:
        c = self._claimed
        when, event = _INF, None
        if self._threshold is not None and not c & _SLOW and not self._done:
            when, event = self._start + self._threshold, type(self)._slow_point  # type: ignore[attr-defined]
        d = self._deadline
        if d is not None and not c & _DEADLINE:
            if self._source == "client" and not c & _LOOKED:
                look = d - self._early
                if look < when:
                    when, event = look, type(self)._look
            elif d < when:
                when, event = d, type(self)._deadline_due
        return when, event

    def _rearm(self, when: float) -> None:
        with _lock:
            if not self._done:
                self._handle2 = self._ic._timers().call_at(when, type(self)._fire, self)

    def _look(self) -> None:
        """``_early`` before a client budget runs out: a call grpc has ended
        already was cancelled (or its server stopped): no deadline."""
        late = _monotonic() >= self._deadline - _GRACE
        with _lock:
            self._claimed |= _LOOKED
            if not late and not self._claimed & _DEADLINE and self._ended_by_grpc():
                self._claimed |= _DEADLINE

    def _deadline_due(self) -> None:
        """The budget ran out.  A call still running is ended now (the
        backend's :meth:`_end_now`); one that grpc ended meanwhile is a
        deadline only if its budget was the client's deadline (grpc ended
        it for that); one whose handler has just ended is left to that end."""
        with _lock:
            if self._claimed & _DEADLINE or self._done:
                return
            self._claimed |= _DEADLINE
            by_grpc = self._ended_by_grpc()
            if by_grpc and self._source != "client":
                return
            self._expired = True
            flags = {} if by_grpc else self._end_flags()
            self._report(**flags)
        if not by_grpc:
            self._end_now()

    def _client_code(self) -> grpc.StatusCode | None:
        """What the client got, once the budget or grpc ended the call:
        DEADLINE_EXCEEDED when the budget did, or grpc did for the client's
        deadline (the early look found it running); CANCELLED when grpc did
        for a cancel or the server's stop.  None while the call runs."""
        if self._expired:
            return _DEADLINE_EXCEEDED
        if not self._ended_by_grpc():
            return None
        if self._deadline is not None and self._claimed & (_DEADLINE | _LOOKED) == _LOOKED:
            return _DEADLINE_EXCEEDED
        return grpc.StatusCode.CANCELLED

    # -- the backends' parts ---------------------------------------------------------------

    def _ended_by_grpc(self) -> bool:
        """Has grpc ended the call (a cancel, a deadline or the server's stop)?"""
        raise NotImplementedError

    def _end_flags(self) -> dict[str, bool]:
        """The report's ``interrupted``/``cancelled`` for :meth:`_end_now`."""
        return {}

    def _end_now(self) -> None:
        """End the running call with DEADLINE_EXCEEDED (the timer's thread)."""
        raise NotImplementedError

    # -- the handler's end -----------------------------------------------------------------

    def _settle(self) -> bool:
        """The handler ended (``_done`` set) after a timer of the call fired
        (the cancel of ``_handle`` failed): no timer of it fires any more;
        decide what is not decided yet; did the budget end the call?"""
        with _lock:
            h2 = self._handle2
            if h2 is not None:
                h2.cancel()
            c = self._claimed
            if not c & _DEADLINE and self._deadline is not None:
                self._claimed |= _DEADLINE
                if c & _LOOKED and self._ended_by_grpc():  # the client's deadline, by grpc
                    self._expired = True
                    self._report()
            if not c & _SLOW:
                self._claimed |= _SLOW
            expired = self._expired
        if expired:
            _observe_end(self)
        return expired

    def _downstream(self, exc: BaseException) -> str | None:
        """The handler raised ``exc`` while its budget had not ended the
        call: the details of the DEADLINE_EXCEEDED the call ends with when
        ``exc`` is (or comes from) a downstream call's DEADLINE_EXCEEDED,
        else None.  The budget's doing when the downstream call's deadline
        was the one the budget gave it: reported, with ``details``; else
        the downstream's details are passed on."""
        err = _deadline_status(exc)
        if err is None:
            return None
        if self._deadline is None or _monotonic() < self._bound - _BOUND_SLACK:
            return _downstream_details(err)
        self._claimed |= _DEADLINE  # no timer of the call is left to decide it
        self._expired = True
        self._report()
        _observe_end(self)
        return self._ic._details

    def _budget_length(self) -> float:
        """The server's ``max_time`` exactly when that was the budget
        (``deadline - start`` of two monotonic floats can come out as
        0.09999999999854481 for 0.1)."""
        if self._source == "max_time":
            return float(self._max_time)  # type: ignore[arg-type]
        return self._deadline - self._start

    def _report(self, *, interrupted: bool = False, cancelled: bool = False) -> None:
        ev = DeadlineEvent(self._method, self._source, self._budget_length(),
                           _monotonic() - self._start, interrupted=interrupted, cancelled=cancelled)
        _delivery.put(_deliver_deadline, self._ic._on_deadline, ev)


class _FusedCall(_DeadlineCall):
    """One call under ``SlowCallInterceptor`` and ``ServerDeadlineInterceptor``
    together, served by one wrapper (docs/grpc.rst, "Both at once"): the
    deadline's call and context, and the slow call's state, on one timer.

    The timer (``_handle``) is armed for the earliest of the slow-call
    threshold, the early look and the deadline (``_first_slow``: the
    threshold); :meth:`_fire` runs what is due and arms ``_handle2`` for the
    next.  ``_slow``: the threshold passed while the call ran.  A call
    without a budget (``_deadline`` None) has the threshold only.

    The stack at the threshold is found only then (:meth:`_live_stack`, by
    the backend), never per call.
    """

    __slots__ = ("_slow", "_first_slow")
    _slow: bool
    _first_slow: bool
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
        max_time = cls._max_time
        call = _new(cls)
        # locals, not attributes: a proxy's attribute reads take the slow path
        deadline: float | None
        due = _INF
        if rem is None or rem >= _NO_DEADLINE:
            if max_time is None:
                deadline = None
            else:
                deadline = due = now + max_time
                call._source = "max_time"
        elif max_time is not None and max_time < rem:
            deadline = due = now + max_time
            call._source = "max_time"
        else:
            deadline = now + (rem if rem > 0.0 else 0.0)
            call._source = "client"
            due = deadline - _EARLY
        call._deadline = deadline  # type: ignore[assignment]
        call._ctx = ctx
        call._start = now
        call._task = task
        call._expired = call._done = call._slow = False
        call._handle2 = call._abort = None
        call._bound = _INF
        call._claimed = 0
        first = now + cls._threshold
        if due < first:
            first = due
            call._first_slow = False
        else:
            call._first_slow = True
        tt = ic._live_tt
        if tt is None or tt.closed:
            tt = ic._timers()
        call._handle = tt.call_at(first, cls._fire, call)
        return call

    def _slow_point(self) -> None:
        """The call passed the threshold: report it, with its live stack
        (under the lock, so that its end's report comes after it)."""
        with _lock:
            if self._claimed & _SLOW or self._done:
                return
            self._claimed |= _SLOW
            self._slow = True
            sic = self._sic
            stack = self._live_stack(sic._stack_limit) if sic._stack else None
            sic._report_server(self._method, self._start, False, None, stack)

    def _live_stack(self, limit: int | None) -> str | None:
        raise NotImplementedError

    # -- the handler's end ---------------------------------------------------------------

    def _ends_expired_both(self, exc: BaseException | None) -> bool:
        """The handler ended (``exc``: how, if it raised) and the budget had
        ended the call: does the wrapper end it the backend's expired way?"""
        raise NotImplementedError

    def _end_slow(self, exc: BaseException | None) -> None:
        """A slow call ended (``exc``: how, if it raised): the second report,
        with the status the client got."""
        code = self._client_code() or self._status(self._ctx, exc)
        self._sic._report_server(self._method, self._start, True, code, None)


class _Requests:
    """A handler's streamed request, seen through (``_it``) for the call
    ``_call``: the backends' subclasses do what the call needs around
    taking the next message."""

    __slots__ = ("_it", "_call")

    def __init__(self, it: Any, call: Any) -> None:
        self._it = it
        self._call = call

    def __getattr__(self, name: str) -> Any:
        return getattr(self._it, name)


class _NativeCallMethods:
    """The methods of :class:`_FusedCall` that the backends' call classes
    for their C wrappers (subclasses of ``_core.GrpcCall``, whose fields
    are :class:`_FusedCall`'s) take as they are; each adds its backend's."""

    __slots__ = ()
    __getattr__ = _ContextProxy.__getattr__
    time_remaining = _DeadlineCall.time_remaining
    code = _DeadlineCall.code
    _fire = _DeadlineCall._fire
    _next_event = _DeadlineCall._next_event
    _look = _DeadlineCall._look
    _deadline_due = _DeadlineCall._deadline_due
    _settle = _DeadlineCall._settle
    _client_code = _DeadlineCall._client_code
    _downstream = _DeadlineCall._downstream
    _budget_length = _DeadlineCall._budget_length
    _report = _DeadlineCall._report
    _end_flags = _DeadlineCall._end_flags
    _slow_point = _FusedCall._slow_point
    _end_slow = _FusedCall._end_slow
    _early = _EARLY

    _rearm = _DeadlineCall._rearm


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


def _mark_fusable(wrapper: Callable[..., Any], ic: _DeadlineSettings, behavior: Callable[..., Any],
                  max_time: float | None) -> None:
    """``wrapper`` (``ic``'s of ``behavior``, a unary call's, with the
    method's ``max_time``) may be served by one wrapper with an outer
    ``SlowCallInterceptor`` (:func:`_fusable`)."""
    wrapper._bucketimer_deadline = (ic, behavior, max_time)  # type: ignore[attr-defined]


def _fusable(behavior: Callable[..., Any], sic: _ServerWrapper) -> tuple[Any, Callable[..., Any], float | None] | None:
    """(the deadline interceptor, the handler it wraps, the method's
    ``max_time``) when ``behavior`` is a ``ServerDeadlineInterceptor``'s
    wrapper that ``sic``, the slow-call interceptor around it, may serve in
    one wrapper with it (their timers on the same TimerThread); else None."""
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
    once per method, not per call.  An interceptor listed after this one
    may return a new handler object per call: the wrapped handler made for
    an equal one (the same behaviour) is found in ``_by_behavior``; a new
    behaviour per call gets a new wrapper, but never a new class
    (``_classes``).  The wrapper holds its behaviour, so those entries are
    kept strongly, ``_KEPT`` per method; the caches are cleared when they
    hold ``_limit`` entries.
    """

    _limit = 1024
    _KEPT = 16

    def __init__(self, timer_thread: bucketimer.TimerThread | None) -> None:
        self._wrapped: dict[Any, tuple[Any, Any]] = {}
        #: method -> {behaviour: (grpc's handler, the wrapped one)}
        self._by_behavior: dict[str, dict[Any, tuple[Any, Any]]] = {}
        #: (base class, method, constants) -> the method's call class
        self._classes: dict[Any, type] = {}
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
        kept = self._by_behavior.get(method)
        try:
            entry = kept.get(behavior) if kept is not None else None
        except TypeError:  # an unhashable behaviour: not kept
            kept, entry = None, None
        if entry is not None and entry[0] == handler:  # the same fields: the same wrapping
            return entry[1]
        wrapped = self._wrap(behavior, method, bool(handler.request_streaming),
                             bool(handler.response_streaming))
        if wrapped is behavior:
            replaced = handler
        else:
            pool = getattr(behavior, "experimental_thread_pool", None)
            if pool is not None:
                wrapped.experimental_thread_pool = pool  # type: ignore[attr-defined]
            replaced = _replace_behavior(handler, kind, wrapped)
        self._keep(method, behavior, handler, replaced)
        return replaced

    def _keep(self, method: str, behavior: Any, handler: Any, replaced: Any) -> None:
        kept = self._by_behavior.get(method)
        if kept is None:
            if len(self._by_behavior) >= self._limit:
                self._by_behavior.clear()
            kept = self._by_behavior[method] = {}
        elif len(kept) >= self._KEPT:  # a new behaviour per call: keep a few
            kept.clear()
        try:
            kept[behavior] = (handler, replaced)
        except TypeError:
            pass

    def _wrap(self, behavior: Callable[..., Any], method: str,
              request_streaming: bool, response_streaming: bool) -> Callable[..., Any]:
        raise NotImplementedError


# -- settings ---------------------------------------------------------------------------------


class _TimeoutRules:
    """DefaultTimeoutInterceptor, sync and aio: the settings, the timeout a
    call gets, and the four client methods (which return what the
    continuation returns: grpc.aio awaits it)."""

    def __init__(self, timeout: float | None, *, propagate: bool = True, margin: float = 0.0,
                 method_config: Any = None) -> None:
        self._timeout = _check_seconds("timeout", timeout, allow_none=True)
        self._margin: float = _check_seconds("margin", margin, allow_none=False, allow_zero=True) or 0.0
        self._propagate = bool(propagate)
        table = _MethodTable("timeout", method_config) if method_config is not None else None
        self._methods = table if table else None

    @property
    def timeout(self) -> float | None:
        return self._timeout

    def timeout_for(self, method: str | bytes) -> float | None:
        """The timeout a call of ``method`` (``/pkg.Svc/Method``) without
        one of its own gets: its ``method_config`` entry's, else ``timeout``."""
        if self._methods is None:
            return self._timeout
        return self._methods.value(_method_name(method), self._timeout)

    def _details(self, details: Any) -> Any:
        explicit = details.timeout
        if explicit is not None:
            t = explicit
        elif self._methods is None:
            t = self._timeout
        else:
            t = self._methods.value(_method_name(details.method), self._timeout)
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
                 method_config: Any = None,
                 timer_thread: bucketimer.TimerThread | None = None) -> None:
        super().__init__(timer_thread)
        self._max_time = _check_seconds("max_time", max_time, allow_none=True)
        self._on_deadline = _check_hook("on_deadline", on_deadline)
        self._details = str(details)
        table = _MethodTable("max_time", method_config) if method_config is not None else None
        self._methods = table if table else None

    def max_time_for(self, method: str | bytes) -> float | None:
        """``max_time`` for ``method`` (``/pkg.Svc/Method``): its
        ``method_config`` entry's, else the interceptor's."""
        if self._methods is None:
            return self._max_time
        return self._methods.value(_method_name(method), self._max_time)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(max_time={self._max_time!r})"


class _SlowCallSettings(_ServerWrapper):
    """SlowCallInterceptor, sync and aio: the settings, and reporting."""

    def __init__(self, threshold: float, *,
                 on_slow: Callable[[SlowCall], object] | None = None,
                 level: int | str = logging.WARNING, stack: bool = True,
                 stack_limit: int | None = 30,
                 method_config: Any = None,
                 timer_thread: bucketimer.TimerThread | None = None) -> None:
        super().__init__(timer_thread)
        seconds = _check_seconds("threshold", threshold, allow_none=False, allow_zero=True)
        assert seconds is not None
        self._threshold = seconds
        self._on_slow = _check_hook("on_slow", on_slow)
        self._level = check_level(level)
        self._stack = bool(stack)
        self._stack_limit = stack_limit
        table = (_MethodTable("threshold", method_config, allow_zero=True)
                 if method_config is not None else None)
        self._methods = table if table else None

    @property
    def threshold(self) -> float:
        return self._threshold

    def threshold_for(self, method: str | bytes) -> float | None:
        """The threshold of ``method`` (``/pkg.Svc/Method``): its
        ``method_config`` entry's (None: the method is not timed), else
        ``threshold``."""
        if self._methods is None:
            return self._threshold
        return self._methods.value(_method_name(method), self._threshold)

    def _report(self, info: SlowCall) -> None:
        _delivery.put(_deliver_slow, self, info)

    def _report_server(self, method: str, start: float, finished: bool,
                       code: grpc.StatusCode | None, stack: str | None, peer_wait: float = 0.0) -> None:
        self._report(SlowCall(method, "server", _monotonic() - start, finished, code, stack, peer_wait))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(threshold={self._threshold!r})"


class _BothSettings(_ServerWrapper):
    """ServerDeadlineSlowCallInterceptor, sync and aio: the two interceptors
    it stands for (the backend's ``_deadline_type`` and ``_slow_type``),
    the slow-call one around the deadline one, as their wrappers then serve
    the call in one (docs/grpc.rst, "Both at once").  Its ``method_config``
    entries may set both parts' values: ``threshold`` and ``max_time``."""

    _deadline_type: type[_DeadlineSettings]
    _slow_type: type[_SlowCallSettings]

    def __init__(self, threshold: float, max_time: float | None = None, *,
                 on_deadline: Callable[[DeadlineEvent], object] | None = None,
                 details: str = DEFAULT_DETAILS,
                 on_slow: Callable[[SlowCall], object] | None = None,
                 level: int | str = logging.WARNING, stack: bool = True,
                 stack_limit: int | None = 30,
                 method_config: Any = None,
                 timer_thread: bucketimer.TimerThread | None = None,
                 **deadline_options: Any) -> None:
        super().__init__(timer_thread)
        entries = _MethodTable._entries(method_config) if method_config is not None else None
        self.deadline_interceptor = self._deadline_type(
            max_time, on_deadline=on_deadline, details=details, timer_thread=timer_thread,
            method_config=_without(entries, "threshold"), **deadline_options)
        self.slow_call_interceptor = self._slow_type(
            threshold, on_slow=on_slow, level=level, stack=stack, stack_limit=stack_limit,
            method_config=_without(entries, "max_time"), timer_thread=timer_thread)

    def _wrap(self, behavior: Callable[..., Any], method: str,
              request_streaming: bool, response_streaming: bool) -> Callable[..., Any]:
        inner = self.deadline_interceptor._wrap(behavior, method, request_streaming, response_streaming)
        return self.slow_call_interceptor._wrap(inner, method, request_streaming, response_streaming)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.slow_call_interceptor!r}, {self.deadline_interceptor!r})"


def _without(entries: list[Any] | None, key: str) -> list[Any] | None:
    """``entries`` with ``key`` taken out of each (the other part's)."""
    if entries is None:
        return None
    return [{k: v for k, v in e.items() if k != key} if isinstance(e, Mapping) else e
            for e in entries]


class _Look:
    """What the client of a slow server call that grpc ended saw: its
    deadline, or its cancel (or the server's stop) -- grpc tells neither.
    Made when the call's slow-call timer first fires (never per call): like
    a budget's early look (:class:`_DeadlineCall`), a timer ``_EARLY``
    before the client's deadline finds whether grpc (``ended()``) had ended
    the call by then.  (A threshold that comes later than that cannot
    tell: a call grpc ended then counts as the deadline's.)"""

    __slots__ = ("_ended", "_deadline", "_gone", "_handle")

    def __init__(self, ended: Callable[[], bool], context: Any,
                 timers: Callable[[], bucketimer.TimerThread]) -> None:
        self._ended = ended
        self._gone: bool | None = None
        self._handle: bucketimer.Handle | None = None
        try:
            rem = context.time_remaining()
        except Exception:
            rem = None
        if rem is None or rem >= _NO_DEADLINE:
            self._deadline = None
            return
        now = _monotonic()
        self._deadline = d = now + rem
        if d - _EARLY <= now:
            self._look()
        else:
            self._handle = timers().call_at(d - _EARLY, self._look)

    def _look(self) -> None:
        if self._gone is None:
            late = _monotonic() >= self._deadline - _GRACE  # type: ignore[operator]
            self._gone = not late and self._ended()

    def code(self) -> grpc.StatusCode:
        """The client's status of a call grpc ended, at its handler's end
        (before the look: a cancel too)."""
        if self._deadline is None or self._gone is not False:
            return grpc.StatusCode.CANCELLED
        return _DEADLINE_EXCEEDED

    def close(self) -> None:
        """The call ended: its look is not needed any more."""
        if self._handle is not None:
            self._handle.cancel()


class _SlowCallBase:
    """Per-call state of ``SlowCallInterceptor``: its start and timer, and
    ``where`` the backend looks for the stack at the threshold (None: no
    stack).  ``slow``: the threshold was reported; ``done``: the call ended;
    on the server, ``context`` and (aio) ``task`` are the call's, and
    ``look`` what tells how grpc ended it (made when it turns slow).

    On the server, the threshold is compared with the handler's own time:
    the time the call has spent waiting for its peer (``waited``, and since
    ``waiting`` if it waits now: :meth:`wait_begin`/:meth:`wait_end`, called
    around a streamed request's next message and a streamed response's
    sending) is left out, and the timer is armed again for what is left.
    """

    __slots__ = ("interceptor", "method", "side", "where", "start", "handle", "slow", "done",
                 "threshold", "waited", "waiting", "look", "context", "task")

    def __init__(self, interceptor: _SlowCallSettings, method: str, side: str, where: Any = None,
                 threshold: float | None = None, context: Any = None, task: Any = None) -> None:
        self.interceptor = interceptor
        self.method = method
        self.side = side
        self.where = where
        self.context = context
        self.task = task
        self.look: _Look | None = None
        self.slow = False
        self.done = False
        self.waited = 0.0
        self.waiting: float | None = None
        self.threshold = th = interceptor._threshold if threshold is None else threshold
        self.start = start = _monotonic()
        tt = interceptor._live_tt
        if tt is None or tt.closed:
            tt = interceptor._timers()
        self.handle = tt.call_at(start + th, self.fire)

    def wait_begin(self) -> None:
        self.waiting = _monotonic()

    def wait_end(self) -> None:
        since = self.waiting
        if since is not None:
            self.waiting = None
            self.waited += _monotonic() - since

    def peer_wait(self, now: float) -> float:
        since = self.waiting
        return self.waited + (now - since if since is not None else 0.0)

    def own_time_left(self) -> float:
        """How much of the threshold the handler's own time has still to
        reach (> 0: not slow yet, the timer is armed again for it)."""
        now = _monotonic()
        left = self.threshold - (now - self.start - self.peer_wait(now))
        if left > 0.0:
            # while it waits for the peer its own time stands still: look again later
            delay = left if self.waiting is None else max(left, self.threshold / 2)
            self.handle = self.interceptor._timers().call_later(delay, self.fire)
        return left

    def fire(self) -> None:
        raise NotImplementedError

    def _report(self, finished: bool, code: grpc.StatusCode | None, stack: str | None) -> None:
        now = _monotonic()
        self.interceptor._report(SlowCall(self.method, self.side, now - self.start,
                                          finished, code, stack, self.peer_wait(now)))
