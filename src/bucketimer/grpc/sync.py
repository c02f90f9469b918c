"""The sync ``grpc`` interceptors: enforcing a server call's budget from
bucketimer's dispatcher thread (and, in interrupt mode, stopping the handler
thread with an asynchronous exception), reporting slow calls with the stuck
handler thread's stack, and default client timeouts with propagation
(docs/grpc.rst).
"""

from __future__ import annotations

import ctypes
import importlib
import sys
import threading
import time
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
    DEFAULT_DETAILS,
    DeadlineEvent,
    _BothSettings,
    _code_of,
    _deadline_var,
    _DeadlineCall,
    _DeadlineSettings,
    _fusable,
    _FusedCall,
    _mark_fusable,
    _method_name,
    _monotonic,
    _NativeCallMethods,
    _observe_end,
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
    import logging
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

# How often an interrupt is retried while the handler thread is in code where
# an asynchronous exception must not land (see _UNSAFE_CODE).
_INTERRUPT_RETRY = 0.001

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

    No lock: the handler's end sets ``_done`` and cancels the timer; a failed
    cancel means the timer fired.  A timer firing at the very moment the
    handler ends may still end the call with ``DEADLINE_EXCEEDED``, which is
    right either way.
    """

    __slots__ = ()

    def is_active(self) -> bool:
        return not self._expired and self._ctx.is_active()

    def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)``, a piece of the handler's code, with the budget in
        :func:`remaining`."""
        token = _deadline_var.set(self._deadline)
        try:
            return fn(*args)
        finally:
            _deadline_var.reset(token)

    def _finish(self) -> bool:
        """The handler is done: cancel the timer; True if the budget ran out."""
        self._done = True
        return not self._handle.cancel()  # a failed cancel: the timer fired

    def _ends_expired(self, exc: BaseException) -> bool:
        """The handler raised ``exc``: :meth:`_finish`; does ``exc`` end the
        call with DEADLINE_EXCEEDED (rather than propagate)?"""
        expired = self._finish()
        return isinstance(exc, DeadlineInterrupt) or (isinstance(exc, Exception) and expired)

    def _end_expired(self) -> None:
        _observe_end(self)
        # The client already has its status; this tells grpc the handler is
        # over without sending a response (grpc skips a cancelled call).
        self._ctx.abort(grpc.StatusCode.DEADLINE_EXCEEDED, self._ic._details)

    def _fire(self) -> None:
        """Timer callback (dispatcher thread): the budget ran out."""
        if self._done or self._expired:
            return
        self._expired = True
        _abort_server_call(self._ctx, self._ic._details, self._method)
        self._report()


class _InterruptibleContext(_DeadlineContext):
    """:class:`_DeadlineContext` for ``interrupt=True``.

    The handler's own code runs in windows (:meth:`_step`: the call, or one
    ``next()``) in thread ``_ident``.  Calls into grpc from a window (this
    context's methods, the request iterator) go through :meth:`_shield`:
    they leave the window for their duration, and an interrupt due meanwhile
    is raised synchronously when they return -- grpc's bookkeeping is never
    cut in half.  For other code (a downstream client call, a lock wait) the
    timer checks where the thread is and retries every millisecond while it
    is in such code.

    No lock is taken in the handler thread: an asynchronous exception can
    land between a lock's acquire and the ``try`` that would release it (on
    3.14, inside ``with lock:`` too), and the thread would then block on
    that lock forever (docs/grpc.rst, "Interrupt mode").  Instead each
    window is a token ``_window``, a list holding ``_OPEN``; ending the
    window means removing ``_OPEN`` from it (one C call under the GIL), and
    whoever does so decides how it ends:

    * the timer, only at a safe point: it sends the interrupt, then appends
      ``_SENT``.  The handler thread, finding ``_OPEN`` gone, waits for
      ``_SENT`` and clears what was not delivered (:meth:`_close`), so the
      exception lands at most once, and only before the window is closed;
    * the handler thread (it appends ``_ENDED``): the timer sends nothing.

    A window opens (:meth:`_open`) by publishing its token and then looking
    at ``_expired``; the timer sets ``_expired`` and then looks at the
    window, so an expiry is never missed by both.  Likewise the timer and
    the handler's end each take the one item of ``_fate``: the first decides
    whether the call expired.
    """

    __slots__ = ("_fate", "_window", "_ident", "_in_step", "_shielded")
    _fate: list[None]
    _window: list[object]
    _ident: int
    _in_step: bool
    _shielded: bool

    @staticmethod
    def _setup(call: _InterruptibleContext) -> None:
        call._fate = [None]
        call._window = _CLOSED
        call._ident = 0
        call._in_step = False  # in _step (its window open, or in grpc through _shield)
        call._shielded = False  # in grpc through _shield

    def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        token = _deadline_var.set(self._deadline)
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

    def _finish(self) -> bool:
        self._done = True
        try:
            self._fate.pop()
        except IndexError:
            return True  # the timer took it: expired
        self._handle.cancel()
        return False

    # -- the timer (bucketimer's dispatcher thread) ------------------------------------------

    def _interrupt(self) -> bool:
        """Send the interrupt if the handler thread is in its window at a
        safe point; False if it must be retried."""
        window = self._window
        if _OPEN not in window:
            return True  # in grpc through _shield (raised on return), or between windows
        ident = self._ident
        frame = sys._current_frames().get(ident)
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

    def _retry_interrupt(self) -> None:
        if not self._done and not self._interrupt():
            self._ic._timers().call_later(_INTERRUPT_RETRY, self._retry_interrupt)

    def _fire(self) -> None:
        try:
            self._fate.pop()
        except IndexError:
            return  # the handler ended first
        self._expired = True
        # interrupted now, on the return from grpc (shielded), or by a retry
        interrupted = self._in_step
        retry = interrupted and not self._interrupt()
        _abort_server_call(self._ctx, self._ic._details, self._method)
        if retry:
            self._ic._timers().call_later(_INTERRUPT_RETRY, self._retry_interrupt)
        self._report(interrupted=interrupted)


grpc.ServicerContext.register(_DeadlineContext)


class _BothContext(_FusedCall, _DeadlineContext):
    """A sync call under the slow-call and the deadline interceptors served
    by one wrapper (:func:`_serve_both`): :class:`_DeadlineContext` for the
    handler, one timer for both (:class:`_FusedCall`).  Per method:
    ``_code``, the wrapper's code, by which the stack at the threshold finds
    the call's frame."""

    __slots__ = ()
    _code: Any

    _expire = _DeadlineContext._fire

    def _live_stack(self, limit: int | None) -> str | None:
        """The stack of the thread running this call's handler: the one
        whose frames include the wrapper's frame of this call."""
        code = self._code
        for top in sys._current_frames().values():
            f: Any = top
            while f is not None:
                if f.f_code is code and f.f_locals.get("call") is self:
                    return handler_stack(top, limit, wrapper=partial(is_, f))
                f = f.f_back
        return None

    def _ends_expired_both(self, exc: BaseException, expired: bool) -> bool:
        return isinstance(exc, DeadlineInterrupt) or (expired and isinstance(exc, Exception))

    def _end_expired_slow(self) -> None:
        """End the call with DEADLINE_EXCEEDED (raises), reporting a slow
        call's end with the status that gives."""
        try:
            self._end_expired()
        except BaseException as exc:
            if self._slow:
                self._end_slow(exc)
            raise


def _serve_both(dic: ServerDeadlineInterceptor, sic: SlowCallInterceptor,
                behavior: Callable[..., Any], method: str) -> Callable[..., Any]:
    """One wrapper for a unary response doing what ``sic`` around ``dic``
    does (no interrupt mode): one frame, one context object that is also
    the timer's payload, one timer, one ``ContextVar`` set.  On the native
    backend the wrapper is C (:class:`_NativeBothContext`), without a frame."""
    status = staticmethod(_code_after)
    if _GrpcUnary is not None:
        ncls = _DeadlineCall._for.__func__(  # type: ignore[attr-defined]
            _NativeBothContext, dic, method, _sic=sic, _threshold=sic._threshold, _status=status,
            _handler_code=_code_of_callable(behavior))
        wrapper: Callable[..., Any] = _GrpcUnary(ncls, behavior, _deadline_var, dic._timers,
                                                 sic._threshold, dic._max_time)
        return wrapper
    cls = _BothContext._for(dic, method, _sic=sic, _threshold=sic._threshold, _status=status)
    begin = cls._begin_both

    def both_unary(request: Any, context: Any) -> Any:
        call = begin(context)
        deadline = call._deadline
        token = _deadline_var.set(deadline)
        try:
            result = behavior(request, context if deadline is None else call)
        except BaseException as exc:
            if not call._raised(exc):
                raise
        else:
            call._done = True
            if call._handle.cancel():  # in time: neither fired
                return result
            if not call._returned():
                return result
        finally:
            _deadline_var.reset(token)
        call._end_expired_slow()

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
        its handler's thread, ``_ident``) and :meth:`_tail`, the part of the
        wrapper left in Python: the end of a call whose timer fired.
        Subclassed per method as :meth:`_DeadlineCall._for` does."""

        __slots__ = ()
        _ic: ServerDeadlineInterceptor
        _method: str
        _sic: SlowCallInterceptor
        _threshold: float
        _handler_code: Any  # the handler's code object, or None

        is_active = _DeadlineContext.is_active
        _end_expired = _DeadlineContext._end_expired
        _expire = _DeadlineContext._fire
        _settle = _FusedCall._settle

        def _end_expired_slow(self, slow: bool) -> None:
            """:meth:`_BothContext._end_expired_slow`, told by the C wrapper
            whether the call passed the threshold (what ``_tail`` found)."""
            self._slow = slow
            _BothContext._end_expired_slow(self)  # type: ignore[arg-type]

        def _live_stack(self, limit: int | None) -> str | None:
            """The stack of the thread running this call's handler (the
            caller checked that the call has not ended), from the handler's
            first frame on."""
            code = self._handler_code
            return _thread_stack(self._ident, limit, handler=lambda f: f.f_code is code)

        @staticmethod
        def _tail(call: Any, exc: BaseException | None) -> bool | None:
            """The handler ended (``exc``: how, if it raised) and the first
            timer had fired.  None: the wrapper returns the result or
            re-raises ``exc`` (a slow call's end reported); else the call
            expired and the wrapper ends it with ``_end_expired_slow`` of
            what this returns (was it slow too)."""
            expired: bool
            slow: bool
            expired, slow = call._settle()
            if exc is None:
                if not expired:
                    call._end_slow(None)
                    return None
                return slow
            if isinstance(exc, DeadlineInterrupt) or (expired and isinstance(exc, Exception)):
                return slow
            if slow:
                call._end_slow(exc)
            return None

    grpc.ServicerContext.register(_NativeBothContext)


class _ShieldedRequests:
    """A request iterator whose ``next()`` is shielded from interrupts."""

    __slots__ = ("_it", "_call")

    def __init__(self, it: Any, call: _DeadlineContext) -> None:
        assert isinstance(call, _InterruptibleContext)
        self._it = it
        self._call = call

    def __iter__(self) -> _ShieldedRequests:
        return self

    def __next__(self) -> Any:
        return self._call._shield(next, self._it)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._it, name)


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
    made without one; a call's explicit timeout is kept.  With
    ``propagate=True`` (the default), a call made inside a handler served
    through :class:`ServerDeadlineInterceptor` gets at most the handler's
    remaining budget minus ``margin`` seconds -- even an explicit timeout is
    capped, and when the budget is already spent the call fails at once
    with ``DEADLINE_EXCEEDED`` without being sent (it gets a negative
    timeout).  No timer is involved: grpc enforces the timeout.

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


class ServerDeadlineInterceptor(_DeadlineSettings, grpc.ServerInterceptor):
    """Server interceptor: enforce each call's budget.

    The budget is the smaller of the client's deadline and ``max_time``
    seconds from the handler's start (no timer when there is neither).  When
    it runs out while the handler still runs:

    * the client receives ``DEADLINE_EXCEEDED`` (with ``details``) at once;
    * ``context.is_active()`` turns false and ``context.time_remaining()`` is 0
      for the handler;
    * ``on_deadline(DeadlineEvent)`` is called (on bucketimer's dispatcher
      thread) and a WARNING is logged on ``bucketimer.grpc``;
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
        super().__init__(max_time, on_deadline=on_deadline, details=details, timer_thread=timer_thread)
        self._interrupt = bool(interrupt)
        self._context_class = _InterruptibleContext if self._interrupt else _DeadlineContext

    intercept_service = _intercept_service

    def _wrap(self, behavior: Callable[..., Any], method: str,
              request_streaming: bool, response_streaming: bool) -> Callable[..., Any]:
        # Long because it holds the per-call wrappers themselves, as closures:
        # what they read per call is then a closure cell, not an attribute
        # (docs/grpc.rst, "Costs").
        begin = self._context_class._for(self, method)._begin
        interrupt = self._interrupt
        shield_requests = request_streaming and interrupt

        def deadline_unary(request: Any, context: Any) -> Any:
            call = begin(context)
            if call is None:  # no budget: nothing to enforce
                token = _deadline_var.set(None)
                try:
                    return behavior(request, context)
                finally:
                    _deadline_var.reset(token)
            if shield_requests:
                request = _ShieldedRequests(request, call)
            token = _deadline_var.set(call._deadline)
            try:
                result = call._step(behavior, request, call) if interrupt else behavior(request, call)
            except BaseException as exc:
                if not call._ends_expired(exc):
                    raise
            else:
                if interrupt:
                    expired = call._finish()
                else:  # _DeadlineContext._finish(), inline: once per RPC
                    call._done = True
                    expired = not call._handle.cancel()
                if not expired:
                    return result
            finally:
                _deadline_var.reset(token)
            call._end_expired()

        def deadline_stream(request: Any, context: Any) -> Iterator[Any]:
            call = begin(context)
            if call is None:  # no budget: nothing to enforce
                yield from behavior(request, context)
                return
            if shield_requests:
                request = _ShieldedRequests(request, call)
            it: Any = None
            try:
                it = iter(call._run(behavior, request, call))
                while not call._expired:
                    item = call._run(next, it, _END)
                    if item is _END or call._expired:  # produced after the budget ran out: dropped
                        break
                    yield item
            except BaseException as exc:
                if not call._ends_expired(exc):
                    raise
            else:
                if not call._finish():
                    return
            _close(it)
            call._end_expired()

        if response_streaming:
            return deadline_stream
        if not interrupt:
            _mark_fusable(deadline_unary, self, behavior)
        return deadline_unary

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(max_time={self._max_time!r}, "
                f"interrupt={self._interrupt!r})")


# -- slow calls ----------------------------------------------------------------------------


def _thread_stack(ident: int, limit: int | None, **where: Any) -> str | None:
    """Thread ``ident``'s stack from its handler's first frame on
    (``where``: as :func:`handler_stack` takes it)."""
    frame = sys._current_frames().get(ident)
    if frame is None:
        return None
    return handler_stack(frame, limit, **where)


def _code_of_callable(fn: Any) -> Any:
    """The code object a Python function or bound method runs, or None."""
    return getattr(getattr(fn, "__func__", fn), "__code__", None)


_EXC_CODES = ((DeadlineInterrupt, grpc.StatusCode.DEADLINE_EXCEEDED),)


def _code_after(context: Any, exc: BaseException | None) -> grpc.StatusCode | None:
    """The status of a sync server call whose handler ended (``exc``: how)."""
    # a sync handler's set_code() survives its exception (grpc sends it)
    return _server_code(context, exc, set_code_wins=True, exc_codes=_EXC_CODES)


class _SlowCall(_SlowCallBase):
    """Per-call state of :class:`SlowCallInterceptor` (sync); ``where`` is
    the handler's thread while the handler's own code runs in it.

    No lock: the end of the call cancels the timer, and only when that
    cancel fails (the timer fired: the call passed its threshold) is the end
    reported.  ``fire`` does nothing once ``done`` is set.
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
        """Timer callback (dispatcher thread): the call passed the threshold."""
        if self.done:
            return
        self.slow = True
        ic = self.interceptor
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
        if not self.handle.cancel():  # the timer fired: a slow call
            self._report(True, _code_after(context, exc), None)

    def finish_client(self, outcome: Any) -> None:
        """The client call ended (``outcome``: grpc's call / future / error)."""
        if self.done:
            return
        self.done = True
        if not self.handle.cancel():
            self._report(True, _code_of(outcome) if outcome is not None else grpc.StatusCode.UNKNOWN, None)


def _iter_of(behavior: Callable[..., Any], request: Any, context: Any) -> Iterator[Any]:
    return iter(behavior(request, context))


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
    its total time and status.  ``on_slow(SlowCall)`` receives the same facts (called on
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

    intercept_service = _intercept_service

    def _wrap(self, behavior: Callable[..., Any], method: str,
              request_streaming: bool, response_streaming: bool) -> Callable[..., Any]:
        both = None if response_streaming else _fusable(behavior, self)
        if both is not None:  # a ServerDeadlineInterceptor's wrapper: serve both in one
            return _serve_both(both[0], self, both[1], method)
        ic = self
        threshold = self._threshold

        def slow_unary(request: Any, context: Any) -> Any:
            # No per-call object: the timer's arguments are all that a slow
            # call needs; fire() finds this frame by its ``start``.
            tt = ic._live_tt
            if tt is None or tt.closed:
                tt = ic._timers()
            start = _monotonic()
            handle = tt.call_at(start + threshold, fire, start, _get_ident())
            try:
                result = behavior(request, context)
            except BaseException as exc:
                if not handle.cancel():  # the timer fired: a slow call
                    ic._report_server(method, start, True, _code_after(context, exc), None)
                raise
            if not handle.cancel():
                ic._report_server(method, start, True, _code_after(context, None), None)
            return result

        def fire(start: float, ident: int) -> None:
            """Timer callback (dispatcher thread): the call started at
            ``start`` in thread ``ident`` passed the threshold, if it is
            still in ``slow_unary``."""
            frame = sys._current_frames().get(ident)
            f = frame
            while f is not None and not (f.f_code is slow_unary.__code__ and f.f_locals.get("start") is start):
                f = f.f_back
            if f is None:  # it ended meanwhile: its end reports it
                return
            stack = handler_stack(frame or f, ic._stack_limit, wrapper=partial(is_, f)) if ic._stack else None
            ic._report_server(method, start, False, None, stack)

        def slow_stream(request: Any, context: Any) -> Iterator[Any]:
            call = _SlowCall(self, method, "server")
            exc: BaseException | None = None
            try:
                it = call.step(_iter_of, behavior, request, context)
                while (item := call.step(next, it, _END)) is not _END:
                    yield item
            except GeneratorExit:  # grpc stopped iterating (the call ended)
                raise
            except BaseException as e:
                exc = e
                raise
            finally:
                call.finish_server(context, exc)

        return slow_stream if response_streaming else slow_unary

    # -- client ------------------------------------------------------------------

    def _client(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        call = _SlowCall(self, _method_name(client_call_details.method), "client")
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



# -- both at once ----------------------------------------------------------------------------


class ServerDeadlineSlowCallInterceptor(_BothSettings, grpc.ServerInterceptor):
    """Server interceptor: :class:`SlowCallInterceptor` ``(threshold)``
    around :class:`ServerDeadlineInterceptor` ``(max_time)``, in one.

    Takes both interceptors' options (``interrupt`` among them) and behaves
    exactly as the two listed in that order, at the cost of one: a unary
    response (without ``interrupt``) is served by one wrapper with one
    timer, armed at the earlier of the threshold and the deadline and
    re-armed for the other.  The two listed separately in that order get the
    same wrapper; this class also saves grpc one ``intercept_service`` call.
    The parts are ``slow_call_interceptor`` and ``deadline_interceptor``.
    """

    _deadline_type = ServerDeadlineInterceptor
    _slow_type = SlowCallInterceptor

    intercept_service = _intercept_service
