"""The ``grpc.aio`` interceptors: enforcing a server call's budget by
cancelling the handler task and aborting the call with ``DEADLINE_EXCEEDED``
(never a raw ``CancelledError``, which leaves the client waiting:
grpc/grpc#29248), reporting slow calls with the handler's await stack,
default client timeouts with propagation, and :func:`client_interceptors`
to register other libraries' multi-kind client interceptors; timers are armed
from the loop's thread and fire in that loop (docs/grpc.rst, "grpc.aio").
"""

from __future__ import annotations

import asyncio
import inspect
import io
import linecache
import sys
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import grpc  # the real grpcio (bucketimer.grpc, imported first, says if it is missing)
import grpc.aio

import bucketimer
from bucketimer import _backend

from . import _common, _registration
from ._common import *  # noqa: F403 - the names both backends export
from ._common import (
    DEFAULT_DETAILS,
    DeadlineEvent,
    _as_status,
    _BothSettings,
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

__all__ = [
    "DeadlinePropagationInterceptor",
    "DefaultTimeoutInterceptor",
    "ServerDeadlineInterceptor",
    "ServerDeadlineSlowCallInterceptor",
    "SlowCallInterceptor",
    "client_interceptors",
]
__all__ += _common.__all__

_AbortError: Any = grpc.aio.AbortError
_CancelledError = asyncio.CancelledError
_current_task = asyncio.current_task

# grpc cancels an aio handler task itself when the client's deadline passes
# (by its own clock, a few ms apart from ours): a cancellation that close to a
# client deadline is that deadline running out, not a client cancel.
_CLIENT_DEADLINE_SLACK = 0.05


def _is_async(behavior: Callable[..., Any]) -> bool:
    """Coroutine and async generator functions; plain functions on an aio
    server run in grpc's executor and are left alone."""
    return inspect.iscoroutinefunction(behavior) or inspect.isasyncgenfunction(behavior)


async def _write_all(behavior: Callable[..., Any], request: Any, handler_context: Any,
                     context: Any) -> None:
    """Serve an async generator handler through ``context.write()``, so that
    every ``await`` of the call is inside the interceptor."""
    responses = behavior(request, handler_context)
    try:
        async for message in responses:
            await context.write(message)
    finally:
        await responses.aclose()


async def _intercept_service(self: _ServerWrapper, continuation: Any, handler_call_details: Any) -> Any:
    """``intercept_service`` of both server interceptors: the handler grpc
    found, with its behaviour wrapped (per call: one dict lookup)."""
    handler = await continuation(handler_call_details)
    entry = self._wrapped.get(handler_call_details.method)
    if entry is not None and entry[0] is handler:
        return entry[1]
    return self._wrapped_handler(handler, handler_call_details.method)


# -- client --------------------------------------------------------------------------


class DefaultTimeoutInterceptor(
    _TimeoutRules,
    grpc.aio.UnaryUnaryClientInterceptor,
    grpc.aio.UnaryStreamClientInterceptor,
    grpc.aio.StreamUnaryClientInterceptor,
    grpc.aio.StreamStreamClientInterceptor,
):
    """aio client interceptor: default timeout and deadline propagation.

    Same rules as :class:`bucketimer.grpc.DefaultTimeoutInterceptor`: a call
    without a timeout gets ``timeout``; an explicit one is kept; with
    ``propagate=True`` a call made inside a handler served through
    :class:`ServerDeadlineInterceptor` (in its task, or a task it created)
    gets at most the remaining budget minus ``margin``.
    """


class DeadlinePropagationInterceptor(DefaultTimeoutInterceptor):
    """aio client interceptor: deadline propagation only
    (``DefaultTimeoutInterceptor(None, margin=margin)``)."""

    def __init__(self, margin: float = 0.0) -> None:
        super().__init__(None, propagate=True, margin=margin)


# -- registering client interceptors ---------------------------------------------------


def client_interceptors(*interceptors: Any) -> list[Any]:
    """The list to pass as ``grpc.aio.insecure_channel(..., interceptors=)``
    for any multi-kind aio client interceptors: one single-kind adapter per
    interface each implements, in the given order.

    ``grpc.aio`` uses an interceptor that implements several of the four
    client interceptor interfaces for the first one only (unary-unary).
    This module's interceptors may be passed to the channel directly (see
    :mod:`bucketimer.grpc._registration`); this function does the same for
    other libraries' multi-kind interceptors, and is kept for code that
    registers bucketimer's through it::

        channel = grpc.aio.insecure_channel(target, interceptors=client_interceptors(
            DefaultTimeoutInterceptor(2.0), SlowCallInterceptor(0.5)))
    """
    out: list[Any] = []
    for ic in interceptors:
        kinds = _registration.split(ic)
        if not kinds:
            raise TypeError(f"{ic!r} is not a grpc.aio client interceptor")
        out.extend(kinds)
    return out


# -- server deadline ----------------------------------------------------------------------


class _AioDeadlineContext(_DeadlineCall):
    """An aio call under :class:`ServerDeadlineInterceptor` and its context
    (everything runs in the loop's thread)."""

    __slots__ = ()
    _task: asyncio.Task[Any] | None

    def _fire(self) -> None:
        """Timer callback (in the loop): cancel the handler task."""
        self._expired = True
        cancelled = self._task is not None and self._task.cancel()
        self._report(cancelled=cancelled)

    def _ends_expired(self, exc: BaseException) -> bool:
        """The handler raised ``exc``: cancel the timer; does ``exc`` end the
        call with DEADLINE_EXCEEDED (rather than propagate)?  In the loop's
        thread, a timer that has not run yet never will once cancelled."""
        if not self._expired:
            self._handle.cancel()
            if (isinstance(exc, _CancelledError) and self._source == "client"
                    and self._deadline - _monotonic() <= _CLIENT_DEADLINE_SLACK):
                self._report()  # grpc enforced the client's deadline first
                _observe_end(self)
            return False
        return isinstance(exc, (Exception, _CancelledError)) and not isinstance(exc, _AbortError)

    async def _end_expired(self) -> None:
        _observe_end(self)
        task = self._task
        if task is not None and task.cancelling():
            task.uncancel()
        await self._ctx.abort(grpc.StatusCode.DEADLINE_EXCEEDED, self._ic._details)


grpc.aio.ServicerContext.register(_AioDeadlineContext)


class ServerDeadlineInterceptor(_DeadlineSettings, grpc.aio.ServerInterceptor):
    """aio server interceptor: enforce each call's budget.

    The budget is the smaller of the client's deadline and ``max_time``
    seconds from the handler's start.  When it runs out while the handler is
    still running, the handler task is cancelled (``CancelledError`` at its
    current ``await``); once the handler has unwound, the interceptor
    uncancels the task and aborts the call with ``DEADLINE_EXCEEDED`` (and
    ``details``), so the client never hangs on a raw ``CancelledError``.
    ``on_deadline(DeadlineEvent)`` is called in the loop and a WARNING is
    logged on ``bucketimer.grpc``.  A handler that suppresses the
    cancellation still ends with ``DEADLINE_EXCEEDED`` when it returns -- the
    client waits until then.

    Async generator handlers (streaming responses) are served through
    ``context.write()`` so that every ``await`` of the call is inside the
    interceptor.  Plain (non-async) handlers on an aio server are left alone.
    ``context.time_remaining()`` and :func:`remaining` count against the
    budget; a handler that finishes in time costs one timer schedule + cancel.
    """

    def __init__(self, max_time: float | None = None, *,
                 on_deadline: Callable[[DeadlineEvent], object] | None = None,
                 details: str = DEFAULT_DETAILS,
                 timer_thread: bucketimer.TimerThread | None = None) -> None:
        super().__init__(max_time, on_deadline=on_deadline, details=details, timer_thread=timer_thread)

    intercept_service = _intercept_service

    def _wrap(self, behavior: Callable[..., Any], method: str,
              request_streaming: bool, response_streaming: bool) -> Callable[..., Any]:
        if not _is_async(behavior):
            return behavior
        is_gen = inspect.isasyncgenfunction(behavior)
        begin = _AioDeadlineContext._for(self, method)._begin

        async def deadline_handler(request: Any, context: Any) -> Any:
            call = begin(context, _current_task())
            if call is None:  # no budget: nothing to enforce
                if not is_gen:
                    return await behavior(request, context)
                await _write_all(behavior, request, context, context)
                return None
            token = _deadline_var.set(call._deadline)
            try:
                if is_gen:
                    await _write_all(behavior, request, call, context)
                    result = None
                else:
                    result = await behavior(request, call)
            except BaseException as exc:
                if not call._ends_expired(exc):
                    raise
            else:
                if not call._expired:
                    call._handle.cancel()
                    return result
            finally:
                _deadline_var.reset(token)
            await call._end_expired()

        if not is_gen:
            _mark_fusable(deadline_handler, self, behavior)
        return deadline_handler


# -- slow calls ---------------------------------------------------------------------------


def _await_stack(obj: Any, limit: int | None) -> str | None:
    """Where a suspended handler is waiting: its coroutine (or async
    generator) and, through ``cr_await``, every coroutine it is awaiting,
    outermost first (``Task.get_stack()`` shows only the task's outermost
    coroutine, grpc's).  The last ``limit`` frames are kept."""
    frames = []
    for _ in range(1000):  # awaiting chains are short; never loop forever
        if obj is None:
            break
        frame = (getattr(obj, "cr_frame", None) or getattr(obj, "ag_frame", None)
                 or getattr(obj, "gi_frame", None))
        if frame is not None:
            frames.append(frame)
        obj = (getattr(obj, "cr_await", None) or getattr(obj, "ag_await", None)
               or getattr(obj, "gi_yieldfrom", None))
        if obj is not None and frame is not None and inspect.isawaitable(obj) and not (
                hasattr(obj, "cr_frame") or hasattr(obj, "ag_frame") or hasattr(obj, "gi_frame")):
            # ``async for`` awaits an anonymous ``__anext__()`` object: look for
            # the running async generator among the awaiting frame's locals.
            obj = next((v for v in frame.f_locals.values()
                        if inspect.isasyncgen(v) and v.ag_running), obj)
    if limit is not None:
        frames = frames[-limit:]
    buf = io.StringIO()
    for frame in frames:
        code = frame.f_code
        lineno = frame.f_lineno or code.co_firstlineno
        buf.write(f'  File "{code.co_filename}", line {lineno}, in {code.co_name}\n')
        line = linecache.getline(code.co_filename, lineno, frame.f_globals).strip()
        if line:
            buf.write(f"    {line}\n")
    return buf.getvalue() or None


_EXC_CODES = ((_CancelledError, grpc.StatusCode.CANCELLED),)


class _AioSlowCall(_SlowCallBase):
    """Per-call state of :class:`SlowCallInterceptor` (aio), in the loop;
    ``where`` is the handler's coroutine or async generator."""

    __slots__ = ()

    def fire(self) -> None:
        if self.done:
            return
        self.slow = True
        ic = self.interceptor
        stack = None
        if ic._stack and self.where is not None:
            stack = _await_stack(self.where, ic._stack_limit)
        self._report(False, None, stack)

    def finish(self, code: grpc.StatusCode | None) -> None:
        if self.done:
            return
        self.done = True
        if not self.slow:
            self.handle.cancel()
            return
        self._report(True, code, None)


def _aio_server_code(context: Any, exc: BaseException | None) -> grpc.StatusCode | None:
    # an aio handler's exception overrides an OK it set (grpc sends UNKNOWN)
    return _server_code(context, exc, set_code_wins=False, exc_codes=_EXC_CODES)


class SlowCallInterceptor(
    _SlowCallSettings,
    grpc.aio.ServerInterceptor,
    grpc.aio.UnaryUnaryClientInterceptor,
    grpc.aio.UnaryStreamClientInterceptor,
    grpc.aio.StreamUnaryClientInterceptor,
    grpc.aio.StreamStreamClientInterceptor,
):
    """aio client and server interceptor: report calls slower than ``threshold``.

    As :class:`bucketimer.grpc.SlowCallInterceptor`; on the server the stack
    reported at the threshold is the handler task's (where it is awaiting).
    ``on_slow(SlowCall)`` is called in the loop.
    """

    # -- server ------------------------------------------------------------------

    intercept_service = _intercept_service

    def _wrap(self, behavior: Callable[..., Any], method: str,
              request_streaming: bool, response_streaming: bool) -> Callable[..., Any]:
        # Long because it holds the per-call wrappers themselves, as closures:
        # what they read per call is then a closure cell, not an attribute
        # (docs/grpc.rst, "Costs").
        if not _is_async(behavior):
            return behavior
        both = _fusable(behavior, self)
        if both is not None:  # a ServerDeadlineInterceptor's wrapper: serve both in one
            return _serve_both(both[0], self, both[1], method)
        ic = self
        threshold = self._threshold

        def fire(start: float, handler: Any) -> None:
            """Timer callback (in the loop): the call started at ``start``,
            whose handler is the coroutine or async generator ``handler``,
            passed the threshold (it still runs: its end cancels this)."""
            stack = _await_stack(handler, ic._stack_limit) if ic._stack else None
            ic._report_server(method, start, False, None, stack)

        def arm(handler: Any) -> tuple[Any, float]:
            tt = ic._live_tt
            if tt is None or tt.closed:
                tt = ic._timers()
            start = _monotonic()
            return tt.call_at(start + threshold, fire, start, handler), start

        def ended(handle: Any, start: float, context: Any, exc: BaseException | None) -> None:
            # a failed cancel: the timer fired (or its TimerThread was closed)
            if not handle.cancel() and not ic._live_tt.closed:  # type: ignore[union-attr]
                ic._report_server(method, start, True, _aio_server_code(context, exc), None)


        if inspect.isasyncgenfunction(behavior):
            async def slow_gen(request: Any, context: Any) -> AsyncIterator[Any]:
                responses = behavior(request, context)
                handle, start = arm(responses)
                exc: BaseException | None = None
                try:
                    async for message in responses:
                        yield message
                except BaseException as e:
                    exc = None if isinstance(e, GeneratorExit) else e
                    raise
                finally:
                    ended(handle, start, context, exc)

            return slow_gen

        async def slow_coro(request: Any, context: Any) -> Any:
            # arm() and ended(), inline: once per RPC
            tt = ic._live_tt
            if tt is None or tt.closed:
                tt = ic._timers()
            coro = behavior(request, context)
            start = _monotonic()
            try:
                handle = tt.call_at(start + threshold, fire, start, coro)
            except BaseException:
                coro.close()  # never awaited
                raise
            try:
                result = await coro
            except BaseException as exc:
                ended(handle, start, context, exc)
                raise
            if not handle.cancel():
                ended(handle, start, context, None)
            return result

        return slow_coro

    # -- client ------------------------------------------------------------------

    async def _client(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        call = _AioSlowCall(self, _method_name(client_call_details.method), "client")
        try:
            rpc = await continuation(client_call_details, request)
        except BaseException:
            call.finish(grpc.StatusCode.UNKNOWN if call.slow else None)
            raise

        def done(_rpc: Any) -> None:
            if not call.slow:
                call.finish(None)
            else:
                asyncio.ensure_future(_finish_with_code(call, rpc))

        try:
            rpc.add_done_callback(done)
        except (AttributeError, NotImplementedError):  # an interceptor answered directly
            call.finish(grpc.StatusCode.OK if call.slow else None)
        return rpc

    intercept_unary_unary = intercept_unary_stream = _client

    def intercept_stream_unary(self, continuation: Any, client_call_details: Any,
                               request_iterator: Any) -> Coroutine[Any, Any, Any]:
        return self._client(continuation, client_call_details, request_iterator)

    intercept_stream_stream = intercept_stream_unary


class _AioBothContext(_FusedCall, _AioDeadlineContext):
    """An aio call under the slow-call and the deadline interceptors served
    by one wrapper (:func:`_serve_both`): :class:`_AioDeadlineContext` for
    the handler, one timer for both (:class:`_FusedCall`), all in the loop.
    ``_where``: the handler's coroutine (grpc's own coroutines above it do
    not show what they await), where the stack at the threshold is read."""

    __slots__ = ("_where",)
    _where: Any

    _expire = _AioDeadlineContext._fire

    def _live_stack(self, limit: int | None) -> str | None:
        return _await_stack(getattr(self, "_where", None), limit)

    def _finish_both(self) -> tuple[bool, bool]:
        """The handler ended: no timer of this call fires any more;
        (expired, slow) as the flags tell, all being in the loop (neither,
        after a failed cancel: its TimerThread was closed meanwhile)."""
        self._done = True
        self._handle.cancel()
        if self._handle2 is not None:
            self._handle2.cancel()
        return self._expired, self._slow

    _settle = _finish_both

    def _ends_expired_both(self, exc: BaseException, expired: bool) -> bool:
        return self._deadline is not None and self._ends_expired(exc)

    async def _end_expired_slow(self) -> None:
        """End the call with DEADLINE_EXCEEDED (raises), reporting a slow
        call's end with the status that gives."""
        try:
            await self._end_expired()
        except BaseException as exc:
            if self._slow:
                self._end_slow(exc)
            raise


grpc.aio.ServicerContext.register(_AioBothContext)


def _serve_both(dic: ServerDeadlineInterceptor, sic: SlowCallInterceptor,
                behavior: Callable[..., Any], method: str) -> Callable[..., Any]:
    """One wrapper for a coroutine handler doing what ``sic`` around ``dic``
    does: one coroutine, one context object that is also the timer's
    payload, one timer, one ``ContextVar`` set.  On the native backend and
    Python 3.12+ the wrapper is C (:class:`_NativeAioBothContext`): its
    coroutine has no frame."""
    status = staticmethod(_aio_server_code)
    if sys.version_info >= (3, 12) and _GrpcAioUnary is not None:
        ncls = _DeadlineCall._for.__func__(  # type: ignore[attr-defined]
            _NativeAioBothContext, dic, method, _sic=sic, _threshold=sic._threshold, _status=status)
        wrapper: Callable[..., Any] = _GrpcAioUnary(ncls, behavior, _deadline_var, dic._timers,
                                                    sic._threshold, dic._max_time, _current_task)
        # what grpc.aio asks (inspect.iscoroutinefunction) before awaiting a handler
        return inspect.markcoroutinefunction(wrapper)
    cls = _AioBothContext._for(dic, method, _sic=sic, _threshold=sic._threshold, _status=status)
    begin = cls._begin_both

    async def both_coro(request: Any, context: Any) -> Any:
        call = begin(context, _current_task())
        deadline = call._deadline
        token = _deadline_var.set(deadline)
        try:
            call._where = coro = behavior(request, context if deadline is None else call)
            result = await coro
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
        await call._end_expired_slow()

    return both_coro


#: the C wrapper's type on the native backend, 3.12+ (else None: the Python
#: ``both_coro`` serves; 3.11's ``inspect.iscoroutinefunction`` recognises
#: only function-like objects with a coroutine ``__code__``)
_GrpcAioUnary: Any = None

if _backend.NATIVE and sys.version_info >= (3, 12):
    from bucketimer._core import GrpcAioUnary
    from bucketimer._core import GrpcCall as _GrpcCall

    _GrpcAioUnary = GrpcAioUnary

    class _NativeAioBothContext(_NativeCallMethods, _GrpcCall):
        """:class:`_AioBothContext` for the C wrapper (``_core.GrpcAioUnary``):
        the same fields, as the C type's, and the same methods, but for
        :meth:`_tail`, the part of ``both_coro`` left in Python: the end of a
        call whose handler raised or whose timer fired.  Subclassed per
        method as :meth:`_DeadlineCall._for` does."""

        __slots__ = ()
        _ic: ServerDeadlineInterceptor
        _method: str
        _sic: SlowCallInterceptor
        _threshold: float

        _raised = _FusedCall._raised
        _returned = _FusedCall._returned
        _ended = _FusedCall._ended
        _expire = _AioDeadlineContext._fire
        _ends_expired = _AioDeadlineContext._ends_expired
        _end_expired = _AioDeadlineContext._end_expired
        _live_stack = _AioBothContext._live_stack
        _finish_both = _settle = _AioBothContext._finish_both
        _ends_expired_both = _AioBothContext._ends_expired_both
        _end_expired_slow = _AioBothContext._end_expired_slow

        @staticmethod
        def _tail(call: Any, exc: BaseException | None) -> Coroutine[Any, Any, None] | None:
            """The handler ended (``exc``: how, if it raised; if it returned,
            the first timer had fired), as ``both_coro``'s ``except`` and
            ``else`` blocks see it.  None: the wrapper returns the result or
            re-raises ``exc`` (a slow call's end reported); else the
            coroutine that ends the expired call, which the wrapper awaits."""
            expired = call._returned() if exc is None else call._raised(exc)
            return call._end_expired_slow() if expired else None

    grpc.aio.ServicerContext.register(_NativeAioBothContext)


# -- both at once ----------------------------------------------------------------------------


class ServerDeadlineSlowCallInterceptor(_BothSettings, grpc.aio.ServerInterceptor):
    """aio server interceptor: :class:`SlowCallInterceptor` ``(threshold)``
    around :class:`ServerDeadlineInterceptor` ``(max_time)``, in one.

    Takes both interceptors' options and behaves exactly as the two listed
    in that order, at the cost of one: a coroutine handler is served by one
    wrapper with one timer, armed at the earlier of the threshold and the
    deadline and re-armed for the other.  The two listed separately in that
    order get the same wrapper; this class also saves grpc one
    ``intercept_service`` call.  The parts are ``slow_call_interceptor``
    and ``deadline_interceptor``.
    """

    _deadline_type = ServerDeadlineInterceptor
    _slow_type = SlowCallInterceptor

    intercept_service = _intercept_service


async def _finish_with_code(call: _AioSlowCall, rpc: Any) -> None:
    try:
        code = _as_status(await rpc.code())
    except Exception:
        code = None
    call.finish(code)
