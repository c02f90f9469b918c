"""The sync ``grpc`` interceptors: enforcing a server call's budget from
bucketimer's dispatcher thread (and, in interrupt mode, stopping the handler
thread with an asynchronous exception), reporting slow calls with the stuck
handler thread's stack, and default client timeouts with propagation
(docs/grpc.rst).
"""

from __future__ import annotations

import ctypes
import gc
import importlib
import logging
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from functools import partial
from operator import is_
from typing import Any

import grpc

import bucketimer
from bucketimer import _backend

from . import _common
from ._common import *  # noqa: F403 - the names both backends export
from ._common import (
    _DEADLINE_EXCEEDED,
    DEFAULT_DETAILS,
    DeadlineEvent,
    _as_status,
    _BothSettings,
    _client_gone_code,
    _code_of,
    _deadline_status,
    _deadline_var,
    _DeadlineCall,
    _DeadlineSettings,
    _fusable,
    _FusedCall,
    _lock,
    _Look,
    _mark_fusable,
    _method_name,
    _monotonic,
    _NativeCallMethods,
    _pass_on,
    _Requests,
    _server_code,
    _ServerWrapper,
    _SlowCallBase,
    _SlowCallSettings,
    _TimeoutRules,
)
from ._records import handler_stack, log_abort_error

try:  # the C-core status codes, for cancelling a server call with a status
    _CORE_DEADLINE_EXCEEDED: Any = importlib.import_module(
        "grpc._cython.cygrpc").StatusCode.deadline_exceeded
except (ImportError, AttributeError):  # pragma: no cover - a very different grpcio
    _CORE_DEADLINE_EXCEEDED = None

__all__ = [
    "DeadlineInterrupt",
    "DeadlinePropagationInterceptor",
    "DefaultTimeoutInterceptor",
    "ServerDeadlineInterceptor",
    "ServerDeadlineSlowCallInterceptor",
    "SlowCallInterceptor",
]
__all__ += _common.__all__

_get_ident = threading.get_ident
_sleep = time.sleep

# next()'s default at the end of a response stream
_END: Any = object()

#: grpc's sync server's logger, and how it names where a handler's exception came from
_grpc_log = logging.getLogger("grpc._server")
_CALLING = "calling application"
_ITERATING = "iterating responses"


def _log_like_grpc(exc: BaseException, what: str) -> None:
    """Log ``exc``, raised by a handler whose call its budget had ended, as
    grpc's sync server logs a handler's exception (the record it would have
    written had the interceptor not ended the call first)."""
    try:
        details = f"Exception {what}: {exc}"
    except Exception:
        details = "Calling application raised unprintable Exception!"
        _grpc_log.exception(traceback.format_exception(type(exc), exc, exc.__traceback__))
        traceback.print_exc()
    _grpc_log.error(details, exc_info=exc)


def _current_frames() -> dict[int, Any]:
    """``sys._current_frames()`` with the cyclic GC held off: CPython 3.11
    (python/cpython#106883) makes the frames' objects while it holds the
    lock of its list of threads, and a collection there can run a finalizer
    that lets go of the GIL -- then a thread ending, which takes that lock
    holding the GIL, deadlocks the process (seen in this suite).  A flag
    that another thread may flip meanwhile is what ``gc`` offers: it is put
    back only if it was on."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return sys._current_frames()
    finally:
        if enabled:
            gc.enable()


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

    mods = (grpc, threading, queue, concurrent.futures, logging, sys.modules[__package__])
    dirs = []
    for m in mods:
        f = getattr(m, "__file__", None)
        if f:
            dirs.append(os.path.dirname(f) + os.sep if os.path.basename(f) == "__init__.py" else f)
    return tuple(dirs)


_UNSAFE_CODE = _code_dirs()

# A window token (_InterruptibleContext) holds _OPEN while open, then _ENDED
# when the handler thread ended it, or _SENT once the timer has sent its
# interrupt (empty only in between).  _CLOSED: before the first window;
# _RAISED: a window ended by raising the interrupt synchronously.
_OPEN = object()
_ENDED = object()
_SENT = object()
_CLOSED: list[object] = [_ENDED]
_RAISED: list[object] = [_SENT]

# The handler thread's pause (seconds) while the timer finishes sending.
_SEND_WAIT = 0.0001


class _Retries:
    """The interrupts waiting for their handler thread to leave code where
    one must not land (``_UNSAFE_CODE``: a lock or queue wait, grpc's
    machinery, logging).  One timer serves them all: each round reads every
    thread's frame once (``sys._current_frames()``) and tries each call; the
    rounds back off from 1 ms to :attr:`LONGEST` while nobody new waits, so
    handlers stuck there for good cost almost nothing."""

    SHORTEST = 0.001
    LONGEST = 0.1

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: list[_InterruptibleContext] = []
        self._armed = False
        self._delay = self.SHORTEST

    def add(self, call: _InterruptibleContext) -> None:
        with self._lock:
            self._calls.append(call)
            self._delay = self.SHORTEST
            if self._armed:
                return
            self._armed = True
        call._ic._timers().call_later(self.SHORTEST, self._round, call._ic)

    def _round(self, ic: Any) -> None:
        with self._lock:
            calls, self._calls = self._calls, []
        frames = _current_frames()
        waiting = [c for c in calls if not c._done and not c._interrupt(frames)]
        with self._lock:
            self._calls[:0] = waiting
            if not self._calls:
                self._armed = False
                return
            delay = self._delay
            self._delay = min(delay * 2, self.LONGEST)
        ic._timers().call_later(delay, self._round, ic)


_retries = _Retries()


def _abort_server_call(context: Any, details: str, method: str) -> None:
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
        log_abort_error(method)


# -- the handler's context ------------------------------------------------------------------


class _DeadlineContext(_DeadlineCall):
    """A sync call under :class:`ServerDeadlineInterceptor` and its context:
    ``is_active()`` turns false as soon as the budget runs out.

    Its budget ends the call by cancelling grpc's core call with
    DEADLINE_EXCEEDED (:func:`_abort_server_call`), from the timer's thread:
    from then on grpc treats the call as it treats one whose client's
    deadline passed.  The handler's end (:meth:`_end_raised`,
    :meth:`_end_expired`) then tells grpc the handler is over without a
    response, logging as grpc would an exception the handler raised.
    """

    __slots__ = ()

    def is_active(self) -> bool:
        return not self._expired and self._ctx.is_active()

    def abort(self, code: Any, details: str) -> None:
        """grpc's ``abort()``; once the budget ran out, with its status
        (the client's), as grpc's own does on a call whose deadline passed."""
        if self._expired:
            code, details = _DEADLINE_EXCEEDED, self._ic._details
        try:
            self._ctx.abort(code, details)
        except BaseException as e:
            self._abort = e  # an abort, not an error: never logged
            raise

    def abort_with_status(self, status: Any) -> None:
        if self._expired:
            self.abort(_DEADLINE_EXCEEDED, self._ic._details)
        try:
            self._ctx.abort_with_status(status)
        except BaseException as e:
            self._abort = e
            raise

    def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, a piece of the handler's code, with the budget in
        :func:`remaining`."""
        token = _deadline_var.set(self)
        try:
            return fn(*args)
        finally:
            _deadline_var.reset(token)

    # -- the timer (bucketimer's dispatcher thread) ------------------------------------

    def _ended_by_grpc(self) -> bool:
        return not self._ctx.is_active()

    def _end_now(self) -> None:
        _abort_server_call(self._ctx, self._ic._details, self._method)

    # -- the handler's end -------------------------------------------------------------

    def _finish(self) -> bool:
        """The handler is done: no timer of the call fires any more; did
        the budget end the call?"""
        self._done = True
        if self._handle.cancel():
            return False
        return self._settle()

    def _end_expired(self) -> None:
        # The client already has its status; this tells grpc the handler is
        # over without sending a response (grpc skips a cancelled call).
        self._ctx.abort(_DEADLINE_EXCEEDED, self._ic._details)

    def _end_raised(self, exc: BaseException, what: str) -> None:
        """The handler raised ``exc`` (``what``: from calling it, or from
        iterating its responses).  Returns when ``exc`` is to propagate as
        it is; raises grpc's abort when the call ends with DEADLINE_EXCEEDED."""
        expired = self._finish()
        details = self._end_after(exc, expired, what)
        if details is not None:
            self._ctx.abort(_DEADLINE_EXCEEDED, details)

    def _end_after(self, exc: BaseException, expired: bool, what: str) -> str | None:
        """How a call whose handler raised ``exc`` ends (``expired``: its
        budget ended it): None when ``exc`` propagates (grpc then does what
        it does with it), else the details of the DEADLINE_EXCEEDED it ends
        with (an expired call's status is out already; a downstream call's
        DEADLINE_EXCEEDED is passed on: :meth:`_downstream`)."""
        if isinstance(exc, DeadlineInterrupt):
            return self._ic._details
        if not isinstance(exc, Exception) or exc is self._abort:
            return None  # not the handler's error: GeneratorExit, SystemExit, an abort
        details = self._ic._details if expired else self._downstream(exc)
        if details is not None and _deadline_status(exc) is not exc:
            # the handler's own exception (raised from a downstream's, maybe):
            # logged as grpc would have; a downstream's status let through is not
            _log_like_grpc(exc, what)
        return details


class _InterruptibleContext(_DeadlineContext):
    """:class:`_DeadlineContext` for ``interrupt=True``.

    The handler's own code runs in windows (:meth:`_step`: the call, or one
    ``next()``) in thread ``_ident``.  Calls into grpc from a window (this
    context's methods, the request iterator) go through :meth:`_shield`:
    they leave the window for their duration, and an interrupt due meanwhile
    is raised synchronously when they return -- grpc's bookkeeping is never
    cut in half.  For other code (a downstream client call, a lock wait) the
    timer checks where the thread is, and tries again (:class:`_Retries`)
    while it is in such code.

    No lock is taken in the handler thread inside a window: an asynchronous
    exception can land between a lock's acquire and the ``try`` that would
    release it (on 3.14, inside ``with lock:`` too), and the thread would
    then block on that lock forever (docs/grpc.rst, "Interrupt mode").
    Instead each window is a token ``_window``, a list holding ``_OPEN``;
    ending the window means removing ``_OPEN`` from it (one C call under the
    GIL), and whoever does so decides how it ends:

    * the timer, only at a safe point: it sends the interrupt, then appends
      ``_SENT``.  The handler thread, finding ``_OPEN`` gone, waits for
      ``_SENT`` and clears what was not delivered (:meth:`_close`), so the
      exception lands at most once, and only before the window is closed;
    * the handler thread (it appends ``_ENDED``): the timer sends nothing.

    A window opens (:meth:`_open`) by publishing its token and then looking
    at ``_expired``; the timer sets ``_expired`` and then looks at the
    window, so an expiry is never missed by both.
    """

    __slots__ = ("_window", "_ident", "_in_step", "_shielded")
    _window: list[object]
    _ident: int
    _in_step: bool
    _shielded: bool

    @staticmethod
    def _setup(call: _InterruptibleContext) -> None:
        call._window = _CLOSED
        call._ident = 0
        call._in_step = False  # in _step (its window open, or in grpc through _shield)
        call._shielded = False  # in grpc through _shield

    def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        token = _deadline_var.set(self)
        try:
            return self._step(fn, *args)
        finally:
            _deadline_var.reset(token)

    # -- the handler thread ------------------------------------------------------------

    def _step(self, fn: Callable[..., Any], *args: Any) -> Any:
        """One piece of handler code (the call, or one ``next()``) in a window."""
        self._ident = _get_ident()
        self._in_step = True
        try:
            try:
                self._open()
                return fn(*args)
            finally:
                # The interrupt may land in here too (once): then nothing is pending.
                self._close(self._window)
        finally:
            self._in_step = False

    def _open(self) -> None:
        """Open a window; raise :class:`DeadlineInterrupt` instead if the
        budget ran out already."""
        window = [_OPEN]
        self._window = window
        if self._expired:
            self._close(window)
            self._window = _RAISED
            raise DeadlineInterrupt

    def _close(self, window: list[object]) -> bool:
        """End ``window``; True if the timer ended it first (it interrupts).
        Either way no interrupt is pending when this returns."""
        try:
            window.remove(_OPEN)
        except ValueError:
            pass
        else:
            window.append(_ENDED)
            return False
        while not window:  # the timer is sending: wait until it is done
            _sleep(_SEND_WAIT)
        if window[-1] is _ENDED:  # ended here before
            return False
        _ClearAsyncExc(self._ident, None)  # not delivered yet: it must not land outside
        return True

    def _shield(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Call grpc code from the handler: out of the window while it runs."""
        if not self._in_step or self._shielded or _get_ident() != self._ident:
            return fn(*args, **kwargs)  # another thread, nested, or between windows
        if self._close(self._window):
            # Interrupted (maybe not delivered): raise it here, not inside grpc.
            self._window = _RAISED
            raise DeadlineInterrupt
        self._shielded = True
        try:
            return fn(*args, **kwargs)
        finally:
            self._shielded = False
            self._open()  # expired while in grpc: raises, synchronously

    def __getattr__(self, name: str) -> Any:
        attr = super().__getattr__(name)
        if not callable(attr):
            return attr
        shield = self._shield
        return lambda *args, **kwargs: shield(attr, *args, **kwargs)

    def is_active(self) -> bool:
        return not self._expired and bool(self._shield(self._ctx.is_active))

    def code(self) -> Any:
        return self._shield(super().code)

    def abort(self, code: Any, details: str) -> None:
        self._shield(super().abort, code, details)

    def abort_with_status(self, status: Any) -> None:
        self._shield(super().abort_with_status, status)

    # -- the timer (bucketimer's dispatcher thread) ------------------------------------------

    def _interrupt(self, frames: dict[int, Any] | None = None) -> bool:
        """Send the interrupt if the handler thread is in its window at a
        safe point; False if it must be tried again (``frames``: every
        thread's, if read already)."""
        window = self._window
        if _OPEN not in window:
            return True  # in grpc through _shield (raised on return), or between windows
        ident = self._ident
        frame = (_current_frames() if frames is None else frames).get(ident)
        if frame is not None and frame.f_code.co_filename.startswith(_UNSAFE_CODE):
            return False
        try:
            window.remove(_OPEN)
        except ValueError:
            return True  # the handler closed it meanwhile
        try:
            _SetAsyncExc(ident, DeadlineInterrupt)
        finally:
            window.append(_SENT)
        return True

    def _end_flags(self) -> dict[str, bool]:
        # interrupted now, on the return from grpc (shielded), or by a retry
        return {"interrupted": self._in_step}

    def _end_now(self) -> None:
        retry = self._in_step and not self._interrupt()
        _abort_server_call(self._ctx, self._ic._details, self._method)
        if retry:
            _retries.add(self)


grpc.ServicerContext.register(_DeadlineContext)


def _tail(call: Any, exc: BaseException | None) -> Any:
    """The end of a fused call whose handler raised ``exc``, or returned
    (``exc`` None) after a timer of the call fired: None when the wrapper
    returns the result or re-raises ``exc`` (a slow call's end reported);
    else what it ends the call with, given to ``_end_expired_slow``: the
    details of its DEADLINE_EXCEEDED.  Shared by the Python and the C
    wrapper (``_core.GrpcUnary`` calls it as its class's ``_tail``)."""
    expired = call._settle()
    details = None
    if exc is None:
        if expired:
            details = call._ic._details
    else:
        details = _DeadlineContext._end_after(call, exc, expired, _CALLING)
    if details is None and call._slow:
        call._end_slow(exc)
    return details


def _end_expired_slow(call: Any, details: str) -> None:
    """End the call with DEADLINE_EXCEEDED and ``details`` (raises grpc's
    abort), reporting a slow call's end with the status that gives."""
    try:
        call._ctx.abort(_DEADLINE_EXCEEDED, details)
    except BaseException as exc:
        if call._slow:
            call._end_slow(exc)
        raise


class _BothContext(_FusedCall, _DeadlineContext):
    """A sync call under the slow-call and the deadline interceptors served
    by one wrapper (:func:`_serve_both`): :class:`_DeadlineContext` for the
    handler, one timer for both (:class:`_FusedCall`).  Per method:
    ``_code``, the wrapper's code, by which the stack at the threshold finds
    the call's frame."""

    __slots__ = ()
    _code: Any

    _tail = staticmethod(_tail)
    _end_expired_slow = _end_expired_slow

    def _live_stack(self, limit: int | None) -> str | None:
        """The stack of the thread running this call's handler: the one
        whose frames include the wrapper's frame of this call."""
        code = self._code
        for top in _current_frames().values():
            f: Any = top
            while f is not None:
                if f.f_code is code and f.f_locals.get("call") is self:
                    return handler_stack(top, limit, wrapper=partial(is_, f))
                f = f.f_back
        return None


def _serve_both(dic: ServerDeadlineInterceptor, sic: SlowCallInterceptor,
                behavior: Callable[..., Any], method: str, max_time: float | None,
                threshold: float) -> Callable[..., Any]:
    """One wrapper for a unary call doing what ``sic`` around ``dic``
    does (no interrupt mode): one frame, one context object that is also
    the timer's payload, one timer, one ``ContextVar`` set.  On the native
    backend the wrapper is C (:class:`_NativeBothContext`), without a frame."""
    if _GrpcUnary is not None:
        ncls = _DeadlineCall._for.__func__(  # type: ignore[attr-defined]
            _NativeBothContext, dic, method, _sic=sic, _threshold=threshold, _max_time=max_time,
            _status=_STATUS, _handler_code=_code_of_callable(behavior))
        wrapper: Callable[..., Any] = _GrpcUnary(ncls, behavior, _deadline_var, dic._timers,
                                                 threshold, max_time)
        return wrapper
    cls = _BothContext._for(dic, method, _sic=sic, _threshold=threshold, _max_time=max_time,
                            _status=_STATUS)
    begin = cls._begin_both

    def both_unary(request: Any, context: Any) -> Any:
        call = begin(context)
        has_budget = call._deadline is not None
        token = _deadline_var.set(call if has_budget else None)
        try:
            result = behavior(request, call if has_budget else context)
        except BaseException as exc:
            call._done = True
            call._handle.cancel()
            details = _tail(call, exc)
            if details is None:
                raise
            _end_expired_slow(call, details)
        else:
            call._done = True
            if call._handle.cancel():  # in time: no timer fired
                return result
            details = _tail(call, None)
            if details is None:
                return result
            _end_expired_slow(call, details)
        finally:
            _deadline_var.reset(token)

    cls._code = both_unary.__code__
    return both_unary


#: the C wrapper's type on the native backend (else None: the Python one serves)
_GrpcUnary: Any = None

if _backend.NATIVE:
    from bucketimer._core import GrpcCall as _GrpcCall
    from bucketimer._core import GrpcUnary

    _GrpcUnary = GrpcUnary

    class _NativeBothContext(_NativeCallMethods, _GrpcCall):
        """:class:`_BothContext` for the C wrapper (``_core.GrpcUnary``):
        the same fields, as the C type's, and the same methods, but for how
        the live stack is found (the wrapper has no frame: the call keeps
        its handler's thread, ``_ident``).  The C wrapper calls
        :func:`_tail` when a timer of the call fired or its handler raised,
        and ``_end_expired_slow`` with what that returned.  Subclassed per
        method as :meth:`_DeadlineCall._for` does."""

        __slots__ = ()
        _ic: ServerDeadlineInterceptor
        _method: str
        _sic: SlowCallInterceptor
        _threshold: float
        _handler_code: Any  # the handler's code object, or None

        is_active = _DeadlineContext.is_active
        abort = _DeadlineContext.abort
        abort_with_status = _DeadlineContext.abort_with_status
        _ended_by_grpc = _DeadlineContext._ended_by_grpc
        _end_now = _DeadlineContext._end_now
        _tail = staticmethod(_tail)
        _end_expired_slow = _end_expired_slow

        def _live_stack(self, limit: int | None) -> str | None:
            """The stack of the thread running this call's handler (the
            caller checked that the call has not ended), from the handler's
            first frame on."""
            code = self._handler_code
            return _thread_stack(self._ident, limit, handler=lambda f: f.f_code is code)

    grpc.ServicerContext.register(_NativeBothContext)


class _ShieldedRequests(_Requests):
    """A request iterator whose ``next()`` is shielded from interrupts."""

    __slots__ = ()

    def __iter__(self) -> _ShieldedRequests:
        return self

    def __next__(self) -> Any:
        return self._call._shield(next, self._it)


def _close(it: Any) -> None:
    close = getattr(it, "close", None)
    if close is not None:
        try:
            close()
        except Exception:
            pass


# -- client interceptors ----------------------------------------------------------------


class DefaultTimeoutInterceptor(
    _TimeoutRules,
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Client interceptor: a default timeout, and deadline propagation.

    ``timeout`` (seconds, or None for propagation only) is given to every call
    made without one; a call's explicit timeout is kept.  ``method_config``
    gives methods timeouts of their own, or none (``"timeout": None``), in
    the form of grpc's service config: a ``methodConfig`` list, the service
    config holding one, or its JSON (docs/grpc.rst, "Per-method settings").
    grpc gives an interceptor ``timeout=None`` alike for a call that passed
    ``timeout=None`` and for one that passed none, so both get the default:
    a method without a timeout is opted out through ``method_config``.

    With ``propagate=True`` (the default), a call made inside a handler
    served through :class:`ServerDeadlineInterceptor` gets at most the
    handler's remaining budget minus ``margin`` seconds -- even an explicit
    timeout is capped, and when the budget is already spent the call fails
    at once with ``DEADLINE_EXCEEDED`` without being sent (it gets a
    negative timeout).  No timer is involved: grpc enforces the timeout.

    Use with ``grpc.intercept_channel(channel, DefaultTimeoutInterceptor(5.0))``.
    """


class DeadlinePropagationInterceptor(DefaultTimeoutInterceptor):
    """Client interceptor: deadline propagation only.

    Same as ``DefaultTimeoutInterceptor(None, margin=margin)``: calls made
    inside a handler get at most its remaining budget minus ``margin``; calls
    made elsewhere are unchanged.
    """

    def __init__(self, margin: float = 0.0) -> None:
        super().__init__(None, propagate=True, margin=margin)


def _intercept_service(self: _ServerWrapper, continuation: Any, handler_call_details: Any) -> Any:
    """``intercept_service`` of both server interceptors: the handler grpc
    found, with its behaviour wrapped (per call: one dict lookup)."""
    handler = continuation(handler_call_details)
    entry = self._wrapped.get(handler_call_details.method)
    if entry is not None and entry[0] is handler:
        return entry[1]
    return self._wrapped_handler(handler, handler_call_details.method)


# -- server deadline enforcement ---------------------------------------------------------


def _without_budget(behavior: Callable[..., Any], request: Any, context: Any) -> Any:
    """A unary call without a budget: the handler as it is, but a downstream
    call's DEADLINE_EXCEEDED it lets through is passed on as that status."""
    token = _deadline_var.set(None)
    try:
        return behavior(request, context)
    except Exception as exc:
        _abort_passing_on(exc, context, _CALLING)
        raise
    finally:
        _deadline_var.reset(token)


def _stream_without_budget(behavior: Callable[..., Any], request: Any, context: Any) -> Iterator[Any]:
    """:func:`_without_budget` of a streaming response."""
    try:
        yield from behavior(request, context)
    except Exception as exc:
        _abort_passing_on(exc, context, _ITERATING)
        raise


def _abort_passing_on(exc: Exception, context: Any, what: str) -> None:
    """End the call with the DEADLINE_EXCEEDED ``exc`` is (or comes from),
    if it does: grpc's abort raises (an exception of the handler's own
    logged as grpc would have); else return."""
    details = _pass_on(exc)
    if details is not None:
        if _deadline_status(exc) is not exc:
            _log_like_grpc(exc, what)
        context.abort(_DEADLINE_EXCEEDED, details)


class ServerDeadlineInterceptor(_DeadlineSettings, grpc.ServerInterceptor):
    """Server interceptor: enforce each call's budget.

    The budget is the smaller of the client's deadline and ``max_time``
    seconds from the handler's start (no timer when there is neither;
    ``method_config`` gives methods a ``max_time`` of their own, or none).
    When it runs out while the handler still runs:

    * the client receives ``DEADLINE_EXCEEDED`` (with ``details``) at once;
    * ``context.is_active()`` turns false and ``context.time_remaining()`` is 0
      for the handler;
    * ``on_deadline(DeadlineEvent)`` is called and a WARNING is logged on
      ``bucketimer.grpc`` (on bucketimer's reports thread: ``flush_reports()``);
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
    ``DEADLINE_EXCEEDED``; an exception it raises is logged as grpc logs a
    handler's exception.  A call the client cancelled, or that the server's
    stop ended, is no deadline.  A downstream call's ``DEADLINE_EXCEEDED``
    that the handler lets through ends the call with ``DEADLINE_EXCEEDED``
    too (docs/grpc.rst, "What the caller sees").  Inside the handler,
    :func:`remaining` gives the budget left and
    :class:`DefaultTimeoutInterceptor` clients propagate it.  A handler
    that finishes in time costs one timer schedule + cancel on
    ``timer_thread`` (default: :func:`bucketimer.default_timer_thread`).
    """

    def __init__(self, max_time: float | None = None, *,
                 on_deadline: Callable[[DeadlineEvent], object] | None = None,
                 interrupt: bool = False, details: str = DEFAULT_DETAILS,
                 method_config: Any = None,
                 timer_thread: bucketimer.TimerThread | None = None) -> None:
        super().__init__(max_time, on_deadline=on_deadline, details=details,
                         method_config=method_config, timer_thread=timer_thread)
        self._interrupt = bool(interrupt)
        self._context_class = _InterruptibleContext if self._interrupt else _DeadlineContext

    intercept_service = _intercept_service

    def _wrap(self, behavior: Callable[..., Any], method: str,
              request_streaming: bool, response_streaming: bool) -> Callable[..., Any]:
        # Long because it holds the per-call wrappers themselves, as closures:
        # what they read per call is then a closure cell, not an attribute
        # (docs/grpc.rst, "Costs").
        max_time = self.max_time_for(method)
        begin = self._context_class._for(self, method, _max_time=max_time)._begin
        interrupt = self._interrupt
        shield_requests = request_streaming and interrupt

        def deadline_unary(request: Any, context: Any) -> Any:
            call = begin(context)
            if call is None:  # no budget: nothing to enforce
                return _without_budget(behavior, request, context)
            if shield_requests:
                request = _ShieldedRequests(request, call)
            token = _deadline_var.set(call)
            try:
                result = call._step(behavior, request, call) if interrupt else behavior(request, call)
            except BaseException as exc:
                call._end_raised(exc, _CALLING)
                raise
            else:
                if interrupt:
                    expired = call._finish()
                else:  # _finish(), inline: once per RPC
                    call._done = True
                    expired = not call._handle.cancel() and call._settle()
                if not expired:
                    return result
                call._end_expired()
            finally:
                _deadline_var.reset(token)

        def deadline_stream(request: Any, context: Any) -> Iterator[Any]:
            call = begin(context)
            if call is None:  # no budget: nothing to enforce
                yield from _stream_without_budget(behavior, request, context)
                return
            if shield_requests:
                request = _ShieldedRequests(request, call)
            it: Any = None
            what = _CALLING
            try:
                it = iter(call._run(behavior, request, call))
                what = _ITERATING
                while not call._expired:
                    item = call._run(next, it, _END)
                    if item is _END or call._expired:  # produced after the budget ran out: dropped
                        break
                    yield item
            except BaseException as exc:
                call._end_raised(exc, what)
                raise
            else:
                if not call._finish():
                    return
            _close(it)
            call._end_expired()

        if response_streaming:
            return deadline_stream
        if not interrupt and not request_streaming:
            _mark_fusable(deadline_unary, self, behavior, max_time)
        return deadline_unary

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(max_time={self._max_time!r}, "
                f"interrupt={self._interrupt!r})")


# -- slow calls ----------------------------------------------------------------------------


def _thread_stack(ident: int, limit: int | None, **where: Any) -> str | None:
    """Thread ``ident``'s stack from its handler's first frame on
    (``where``: as :func:`handler_stack` takes it)."""
    frame = _current_frames().get(ident)
    if frame is None:
        return None
    return handler_stack(frame, limit, **where)


def _code_of_callable(fn: Any) -> Any:
    """The code object a Python function or bound method runs, or None."""
    return getattr(getattr(fn, "__func__", fn), "__code__", None)


_EXC_CODES = ((DeadlineInterrupt, grpc.StatusCode.DEADLINE_EXCEEDED),)


def _code_after(context: Any, exc: BaseException | None, look: _Look | None = None) -> grpc.StatusCode | None:
    """The status the client of a sync server call whose handler ended
    (``exc``: how) got: when the call is over already (grpc, or a budget,
    ended it), what ended it (``look``: how a slow call's client's deadline
    stood); else the handler's."""
    if isinstance(exc, DeadlineInterrupt):
        return _DEADLINE_EXCEEDED
    own = getattr(context, "_client_code", None)  # a budget's own call, as the context
    code: grpc.StatusCode | None = own() if own is not None else None
    if code is not None:
        return code
    try:
        if not context.is_active():
            if _as_status(context.code()) is _DEADLINE_EXCEEDED:  # a budget's abort
                return _DEADLINE_EXCEEDED
            return look.code() if look is not None else _client_gone_code(context)
    except Exception:
        pass
    # a sync handler's set_code() survives its exception (grpc sends it)
    return _server_code(context, exc, set_code_wins=True, exc_codes=_EXC_CODES)


def _look(context: Any, timers: Callable[[], bucketimer.TimerThread]) -> _Look:
    """How grpc ends the sync server call whose context is ``context``."""
    return _Look(lambda: not context.is_active(), context, timers)


_STATUS = staticmethod(_code_after)


class _SlowCall(_SlowCallBase):
    """Per-call state of :class:`SlowCallInterceptor` (sync); ``where`` is
    the handler's thread while the handler's own code runs in it.

    The end of the call cancels the timer; only when that cancel fails (the
    timer fired) are both under ``_lock``, so that the report at the
    threshold is made before the end's, or neither is.
    """

    __slots__ = ()

    def step(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, one piece of the handler's code, in this thread."""
        self.where = _get_ident()
        try:
            return fn(*args)
        finally:
            self.where = None

    def _is_step(self, frame: Any) -> bool:
        """Is ``frame`` this call's :meth:`step` (the handler's frames are above it)?"""
        return frame.f_code is _SlowCall.step.__code__ and frame.f_locals.get("self") is self

    def fire(self) -> None:
        """Timer callback (dispatcher thread): the call passed the threshold
        (of its own time, on the server)."""
        with _lock:
            if self.done:
                return
            ic = self.interceptor
            if self.look is None and self.context is not None:
                self.look = _look(self.context, ic._timers)
            if self.own_time_left() > 0.0:
                return
            self.slow = True
            ident = self.where
            stack = None
            if ident and ic._stack:
                stack = _thread_stack(ident, ic._stack_limit, wrapper=self._is_step)
            self._report(False, None, stack)

    def finish_server(self, context: Any, exc: BaseException | None) -> None:
        """The handler ended (``exc``: how, if it raised)."""
        self.where = None
        if self.done:
            return
        self.done = True
        if not self.handle.cancel():
            with _lock:
                if self.slow:
                    self._report(True, _code_after(context, exc, self.look), None)
        if self.look is not None:
            self.look.close()

    def finish_client(self, outcome: Any) -> None:
        """The client call ended (``outcome``: grpc's call / future / error)."""
        if self.done:
            return
        self.done = True
        if not self.handle.cancel():
            with _lock:
                if self.slow:
                    code = _code_of(outcome) if outcome is not None else grpc.StatusCode.UNKNOWN
                    self._report(True, code, None)


class _PeerRequests(_Requests):
    """A streamed request whose ``next()``, waiting for the client, is not
    the handler's own time."""

    __slots__ = ()

    def __iter__(self) -> _PeerRequests:
        return self

    def __next__(self) -> Any:
        call = self._call
        call.wait_begin()
        try:
            return next(self._it)
        finally:
            call.wait_end()


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
    record is logged on ``bucketimer.grpc`` (at ``level``: an int or a level
    name as ``logging`` takes them, WARNING by default) with the method and
    the elapsed time -- on a sync server also the handler thread's current
    Python stack (``sys._current_frames``), while it is still stuck.  When a
    slow call ends, a second record, at INFO (or ``level`` if lower), gives
    its total time and the status the client got.  ``on_slow(SlowCall)``
    receives the same facts.  Records and hooks are delivered on
    bucketimer's reports thread (``flush_reports()``).  A call that ends in
    time costs one timer schedule + cancel and logs nothing.

    On the server the threshold is compared with the handler's own time:
    the time it spends waiting for the client (for the next message of a
    streamed request, or to send one of a streamed response) is left out,
    so a long-lived stream is slow only when its handler is.  On the client,
    the time is the whole call's.  ``method_config`` gives methods a
    threshold of their own, or none (``"threshold": None``: not timed), in
    the form of grpc's service config (docs/grpc.rst, "Per-method settings").

    Server: ``grpc.server(..., interceptors=[SlowCallInterceptor(1.0)])``;
    client: ``grpc.intercept_channel(channel, SlowCallInterceptor(1.0))``.
    With ``ServerDeadlineInterceptor(interrupt=True)``, list this one first
    (outermost), so that its own bookkeeping is outside the interrupt window.
    """

    # -- server ------------------------------------------------------------------

    intercept_service = _intercept_service

    def _wrap(self, behavior: Callable[..., Any], method: str,
              request_streaming: bool, response_streaming: bool) -> Callable[..., Any]:
        threshold = self.threshold_for(method)
        if threshold is None:
            return behavior  # this method is not timed
        both = None if response_streaming or request_streaming else _fusable(behavior, self)
        if both is not None:  # a ServerDeadlineInterceptor's wrapper: serve both in one
            return _serve_both(both[0], self, both[1], method, both[2], threshold)
        if request_streaming or response_streaming:
            return self._wrap_stream(behavior, method, threshold, request_streaming,
                                     response_streaming)
        ic = self
        #: the calls whose threshold was reported, by (thread, start): their
        #: end is reported too, with what their look tells
        reported: dict[tuple[int, float], _Look] = {}

        def slow_unary(request: Any, context: Any) -> Any:
            # No per-call object: the timer's arguments are all that a slow
            # call needs; fire() finds this frame by its ``start``.
            tt = ic._live_tt
            if tt is None or tt.closed:
                tt = ic._timers()
            start = _monotonic()
            handle = tt.call_at(start + threshold, fire, start, _get_ident(), context)
            try:
                result = behavior(request, context)
            except BaseException as exc:
                if not handle.cancel():  # the timer fired: maybe a slow call
                    ended(start, context, exc)
                raise
            if not handle.cancel():
                ended(start, context, None)
            return result

        def fire(start: float, ident: int, context: Any) -> None:
            """Timer callback (dispatcher thread): the call started at
            ``start`` in thread ``ident`` passed the threshold, if it is
            still in ``slow_unary``."""
            with _lock:
                frame = _current_frames().get(ident)
                f = frame
                while f is not None and not (f.f_code is slow_unary.__code__
                                             and f.f_locals.get("start") is start):
                    f = f.f_back
                if f is None:  # it ended meanwhile: neither report
                    return
                reported[ident, start] = _look(context, ic._timers)
                stack = handler_stack(frame or f, ic._stack_limit, wrapper=partial(is_, f)) if ic._stack else None
                ic._report_server(method, start, False, None, stack)

        def ended(start: float, context: Any, exc: BaseException | None) -> None:
            with _lock:
                look = reported.pop((_get_ident(), start), None)
                if look is not None:
                    ic._report_server(method, start, True, _code_after(context, exc, look), None)
                    look.close()

        return slow_unary

    def _wrap_stream(self, behavior: Callable[..., Any], method: str, threshold: float,
                     request_streaming: bool, response_streaming: bool) -> Callable[..., Any]:
        """The wrapper of a streaming call: one :class:`_SlowCall` per call,
        which leaves the time spent waiting for the client out."""
        ic = self

        def slow_stream(request: Any, context: Any) -> Iterator[Any]:
            call = _SlowCall(ic, method, "server", threshold=threshold, context=context)
            if request_streaming:
                request = _PeerRequests(request, call)
            exc: BaseException | None = None
            try:
                it = call.step(_iter_of, behavior, request, context)
                while (item := call.step(next, it, _END)) is not _END:
                    call.wait_begin()  # grpc sends it: the client's pace
                    try:
                        yield item
                    finally:
                        call.wait_end()
            except GeneratorExit:  # grpc stopped iterating (the call ended)
                raise
            except BaseException as e:
                exc = e
                raise
            finally:
                call.finish_server(context, exc)

        def slow_stream_unary(request: Any, context: Any) -> Any:
            call = _SlowCall(ic, method, "server", threshold=threshold, context=context)
            exc: BaseException | None = None
            try:
                return call.step(behavior, _PeerRequests(request, call), context)
            except BaseException as e:
                exc = e
                raise
            finally:
                call.finish_server(context, exc)

        return slow_stream if response_streaming else slow_stream_unary

    # -- client ------------------------------------------------------------------

    def _client(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        method = _method_name(client_call_details.method)
        threshold = self.threshold_for(method)
        if threshold is None:
            return continuation(client_call_details, request)
        call = _SlowCall(self, method, "client", threshold=threshold)
        try:
            outcome = continuation(client_call_details, request)
        except BaseException:
            call.finish_client(None)
            raise
        add_done = getattr(outcome, "add_done_callback", None)
        if add_done is None:
            call.finish_client(outcome)
        else:
            add_done(call.finish_client)
        return outcome

    intercept_unary_unary = intercept_unary_stream = _client

    def intercept_stream_unary(self, continuation: Any, client_call_details: Any,
                               request_iterator: Any) -> Any:
        return self._client(continuation, client_call_details, request_iterator)

    intercept_stream_stream = intercept_stream_unary


def _iter_of(behavior: Callable[..., Any], request: Any, context: Any) -> Iterator[Any]:
    return iter(behavior(request, context))


# -- both at once ----------------------------------------------------------------------------


class ServerDeadlineSlowCallInterceptor(_BothSettings, grpc.ServerInterceptor):
    """Server interceptor: :class:`SlowCallInterceptor` ``(threshold)``
    around :class:`ServerDeadlineInterceptor` ``(max_time)``, in one.

    Takes both interceptors' options (``interrupt`` among them) and behaves
    exactly as the two listed in that order, at the cost of one: a unary
    call (without ``interrupt``) is served by one wrapper with one timer,
    armed for the earliest of the threshold and the deadline and armed again
    for the next.  The two listed separately in that order get the same
    wrapper; this class also saves grpc one ``intercept_service`` call.
    The parts are ``slow_call_interceptor`` and ``deadline_interceptor``;
    ``method_config`` entries set either's per-method value
    (``"threshold"``, ``"max_time"``).
    """

    _deadline_type = ServerDeadlineInterceptor
    _slow_type = SlowCallInterceptor

    intercept_service = _intercept_service

