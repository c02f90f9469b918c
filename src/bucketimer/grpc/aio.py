"""The ``grpc.aio`` interceptors: enforcing a server call's budget by sending
the client ``DEADLINE_EXCEEDED`` and cancelling the handler task (never a
raw ``CancelledError`` alone, which leaves the client waiting:
grpc/grpc#29248), reporting slow calls with the handler's await stack,
default client timeouts with propagation, and :func:`client_interceptors`
to register other libraries' multi-kind client interceptors; timers are armed
from the loop's thread and fire in that loop (docs/grpc.rst, "grpc.aio").
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import io
import linecache
import logging
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
    _DEADLINE_EXCEEDED,
    DEFAULT_DETAILS,
    DeadlineEvent,
    _as_status,
    _BothSettings,
    _client_gone_code,
    _deadline_status,
    _deadline_var,
    _DeadlineCall,
    _DeadlineSettings,
    _fusable,
    _FusedCall,
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
_EOF: Any = grpc.aio.EOF
_CancelledError = asyncio.CancelledError
_current_task = asyncio.current_task

try:  # what grpc.aio raises to a handler using a call that has ended
    _ExecuteBatchError: Any = importlib.import_module("grpc._cython.cygrpc").ExecuteBatchError
except (ImportError, AttributeError):  # pragma: no cover - a very different grpcio
    _ExecuteBatchError = grpc.RpcError


def _is_async(behavior: Callable[..., Any]) -> bool:
    """Coroutine and async generator functions; plain functions on an aio
    server run in grpc's executor and are left alone."""
    return inspect.iscoroutinefunction(behavior) or inspect.isasyncgenfunction(behavior)


async def _write_all(behavior: Callable[..., Any], request: Any, handler_context: Any,
                     context: Any, call: Any) -> None:
    """Serve an async generator handler through ``context.write()``, so that
    every ``await`` of the call is inside the interceptor; a message it
    yields once ``call``'s budget ran out is dropped, and the generator
    closed, as grpc leaves it once the call has ended.  Closed itself (its
    task dropped while pending), it awaits nothing: the generator, still
    running inside it, is left to its finaliser, as grpc leaves one."""
    responses = behavior(request, handler_context)
    try:
        async for message in responses:
            if call is not None and call._expired:
                break
            await context.write(message)
    except GeneratorExit:
        raise
    except BaseException:
        await responses.aclose()
        raise
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
    without a timeout gets ``timeout`` (or its ``method_config`` entry's);
    an explicit one is kept; with ``propagate=True`` a call made inside a
    handler served through :class:`ServerDeadlineInterceptor` (in its task,
    or a task it created) gets at most the remaining budget minus ``margin``.
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


def _dead_call() -> BaseException:
    """What grpc.aio raises to a handler that writes to, or aborts, a call
    that has ended (as its deadline's passing ends it)."""
    err: BaseException = _ExecuteBatchError(
        'Failed "execute_batch": the call has ended (its budget ran out)')
    return err


async def _send_deadline(ctx: Any, details: str) -> Any:
    """Send the client DEADLINE_EXCEEDED: grpc's ``AbortError`` that sending
    it raised, or None if it could not be sent now (a write of the
    handler's in flight; or the handler aborted first, and its status is out)."""
    try:
        await ctx.abort(_DEADLINE_EXCEEDED, details)
    except _AbortError as sent:
        return sent
    except Exception:
        return None
    return None  # pragma: no cover - abort() always raises


class _AioDeadlineContext(_DeadlineCall):
    """An aio call under :class:`ServerDeadlineInterceptor` and its context
    (everything runs in the loop's thread).

    When its budget runs out while grpc has not ended the call, the timer
    sends the client DEADLINE_EXCEEDED (a task of its own, ``_abort``) and
    cancels the handler's task.  From then on grpc treats the call as one
    whose status is out, and the handler sees what grpc shows a handler
    whose call ended at its deadline: a write or an ``abort()`` raises
    grpc's ``ExecuteBatchError``, ``read()`` and the request stream end,
    and what it returns or raises is handled by grpc as it would be (an
    exception logged as grpc logs it).
    """

    __slots__ = ()
    _task: asyncio.Task[Any] | None
    #: the slow-call threshold passed (fused calls; never on a deadline's own)
    _slow = False

    # -- the handler's view --------------------------------------------------------------

    async def write(self, message: Any) -> None:
        if self._expired:
            raise _dead_call()
        await self._ctx.write(message)

    async def send_initial_metadata(self, metadata: Any) -> None:
        if self._expired:
            raise _dead_call()
        await self._ctx.send_initial_metadata(metadata)

    async def read(self) -> Any:
        if self._expired:
            return _EOF
        return await self._ctx.read()

    async def abort(self, code: Any, details: str = "", trailing_metadata: Any = ()) -> None:
        if self._expired:
            raise _dead_call()
        await self._ctx.abort(code, details, trailing_metadata)

    async def abort_with_status(self, status: Any) -> None:
        if self._expired:
            raise _dead_call()
        await self._ctx.abort_with_status(status)

    # -- the timer (in the loop) -----------------------------------------------------------

    def _ended_by_grpc(self) -> bool:
        # grpc cancels the handler's task when the client cancels, its
        # deadline passes or the server stops
        task = self._task
        return task is not None and task.cancelling() > 0

    def _end_flags(self) -> dict[str, bool]:
        task = self._task
        return {"cancelled": task is not None and not task.done()}

    def _end_now(self) -> None:
        self._abort = asyncio.ensure_future(_send_deadline(self._ctx, self._ic._details))
        task = self._task
        if task is not None:
            task.cancel()

    # -- the handler's end (in its task) ------------------------------------------------------

    async def _sent(self) -> Any:
        """The budget's status is out: grpc's ``AbortError`` of sending it;
        None when grpc ended the call itself (the client's deadline)."""
        aborting = self._abort
        if aborting is None:
            return None
        sent = await aborting
        if sent is None and not self._ctx.done():  # not sent at the deadline: now
            sent = await _send_deadline(self._ctx, self._ic._details)
        return sent

    async def _end(self, exc: BaseException | None) -> None:
        """End a call that its budget ended, whose handler returned (``exc``
        None) or raised ``exc``: once the status is out, what the handler
        did goes on to grpc, which handles it as on a call whose deadline
        passed (an exception of the handler's logged as grpc logs one)."""
        await self._sent()
        # what the client got (ours, or its deadline's if grpc's came first),
        # whatever the handler set since
        self._ctx.set_code(_DEADLINE_EXCEEDED)
        if exc is None or isinstance(exc, _ExecuteBatchError) or _deadline_status(exc) is exc:
            # returned, used the ended call, or let a downstream's
            # DEADLINE_EXCEEDED through (a status, not an error): grpc finds
            # the call ended as it would (its abort, or its deadline) and says nothing
            task = self._task
            if self._abort is not None and task is not None and task.cancelling():
                task.uncancel()  # ours, and the handler swallowed it
            return None
        raise exc

    async def _end_expired_slow(self, exc: BaseException | None) -> None:
        """:meth:`_end`, reporting a slow call's end with the status it gives."""
        try:
            await self._end(exc)
        except BaseException as e:
            if self._slow:
                self._end_slow(e)
            raise
        if self._slow:
            self._end_slow(None)

    async def _end_downstream(self, exc: BaseException, details: str) -> None:
        """End the call with DEADLINE_EXCEEDED and ``details``, the handler
        having raised ``exc`` from a downstream's (raises grpc's abort),
        reporting a slow call's end."""
        if _deadline_status(exc) is not exc:  # the handler's own exception: as grpc logs one
            _log_like_grpc(exc, self._method)
        try:
            await self._ctx.abort(_DEADLINE_EXCEEDED, details)
        except BaseException as e:
            if self._slow:
                self._end_slow(e)
            raise

    def _end_slow(self, exc: BaseException | None) -> None:
        raise NotImplementedError


def _tail(call: Any, exc: BaseException | None) -> Coroutine[Any, Any, None] | None:
    """The end of a call whose handler raised ``exc``, or returned (``exc``
    None) after a timer of the call fired: None when the wrapper returns the
    result or re-raises ``exc`` (a slow call's end reported); else the
    coroutine that ends the call, which the wrapper awaits in its place.
    Shared by the Python wrappers and the C one (``_core.GrpcAioUnary``
    calls it as its class's ``_tail``)."""
    if call._settle() and (exc is None or isinstance(exc, (Exception, _CancelledError))):
        return call._end_expired_slow(exc)  # type: ignore[no-any-return]
    # (a coroutine being closed, GeneratorExit, must not await: it ends here)
    if isinstance(exc, Exception) and not isinstance(exc, _AbortError):
        details = call._downstream(exc)
        if details is not None:
            return call._end_downstream(exc, details)  # type: ignore[no-any-return]
    if call._slow:
        call._end_slow(exc)
    return None


_AioDeadlineContext._tail = staticmethod(_tail)  # type: ignore[attr-defined]
grpc.aio.ServicerContext.register(_AioDeadlineContext)


class _BudgetRequests(_Requests):
    """A streamed request that ends once the call's budget ran out, as
    grpc's ends on a call whose deadline passed."""

    __slots__ = ()

    def __aiter__(self) -> _BudgetRequests:
        return self

    async def __anext__(self) -> Any:
        if self._call._expired:
            raise StopAsyncIteration
        return await self._it.__anext__()


async def _without_budget(behavior: Callable[..., Any], is_gen: bool, method: str,
                          request: Any, context: Any) -> Any:
    """A call without a budget: the handler as it is, but a downstream call's
    DEADLINE_EXCEEDED it lets through is passed on as that status."""
    try:
        if not is_gen:
            return await behavior(request, context)
        await _write_all(behavior, request, context, context, None)
        return None
    except Exception as exc:
        details = _pass_on(exc) if not isinstance(exc, _AbortError) else None
        if details is None:
            raise
        if _deadline_status(exc) is not exc:
            _log_like_grpc(exc, method)
        await context.abort(_DEADLINE_EXCEEDED, details)
        raise  # pragma: no cover - abort() raises


#: grpc.aio's server's logger, and what it writes of a handler's exception
_grpc_log = logging.getLogger("grpc._cython.cygrpc")


def _log_like_grpc(exc: BaseException, method: str) -> None:
    """Log ``exc``, raised by a handler whose call ends with a downstream's
    DEADLINE_EXCEEDED, as grpc.aio logs a handler's exception."""
    # grpc's own text, formatted before it is logged, as grpc does
    _grpc_log.error(f"Unexpected [{type(exc).__name__}] raised by servicer method [{method}]",
                    exc_info=exc)


class ServerDeadlineInterceptor(_DeadlineSettings, grpc.aio.ServerInterceptor):
    """aio server interceptor: enforce each call's budget.

    The budget is the smaller of the client's deadline and ``max_time``
    seconds from the handler's start (``method_config``: per method).  When
    it runs out while the handler is still running, the client is sent
    ``DEADLINE_EXCEEDED`` (and ``details``) at once and the handler task is
    cancelled (``CancelledError`` at its current ``await``); from then on
    the handler sees its call as ended, as grpc shows it one whose deadline
    passed.  ``on_deadline(DeadlineEvent)`` is called and a WARNING is
    logged on ``bucketimer.grpc`` (on bucketimer's reports thread).  A call
    the client cancelled, or that the server's stop ended, is no deadline;
    a downstream call's ``DEADLINE_EXCEEDED`` that the handler lets through
    ends the call with ``DEADLINE_EXCEEDED`` (docs/grpc.rst, "What the
    caller sees").

    Async generator handlers (streaming responses) are served through
    ``context.write()`` so that every ``await`` of the call is inside the
    interceptor.  Plain (non-async) handlers on an aio server are left alone.
    ``context.time_remaining()`` and :func:`remaining` count against the
    budget; a handler that finishes in time costs one timer schedule + cancel.
    """

    def __init__(self, max_time: float | None = None, *,
                 on_deadline: Callable[[DeadlineEvent], object] | None = None,
                 details: str = DEFAULT_DETAILS,
                 method_config: Any = None,
                 timer_thread: bucketimer.TimerThread | None = None) -> None:
        super().__init__(max_time, on_deadline=on_deadline, details=details,
                         method_config=method_config, timer_thread=timer_thread)

    intercept_service = _intercept_service

    def _wrap(self, behavior: Callable[..., Any], method: str,
              request_streaming: bool, response_streaming: bool) -> Callable[..., Any]:
        if not _is_async(behavior):
            return behavior
        is_gen = inspect.isasyncgenfunction(behavior)
        max_time = self.max_time_for(method)
        begin = _AioDeadlineContext._for(self, method, _max_time=max_time)._begin

        async def deadline_handler(request: Any, context: Any) -> Any:
            call = begin(context, _current_task())
            if call is None:  # no budget: nothing to enforce
                return await _without_budget(behavior, is_gen, method, request, context)
            if request_streaming:
                request = _BudgetRequests(request, call)
            token = _deadline_var.set(call)
            try:
                if is_gen:
                    await _write_all(behavior, request, call, context, call)
                    result = None
                else:
                    result = await behavior(request, call)
            except BaseException as exc:
                call._done = True
                call._handle.cancel()
                tail = _tail(call, exc)
                if tail is None:
                    raise
                return await tail
            else:
                call._done = True
                if call._handle.cancel():  # in time: no timer fired
                    return result
                tail = _tail(call, None)
                return result if tail is None else await tail
            finally:
                try:
                    _deadline_var.reset(token)
                except ValueError as e:
                    if not isinstance(e.__context__, GeneratorExit):
                        raise
                    # closed where its dropped task was collected, outside
                    # the call's context: nothing of the call's is set here

        if not is_gen and not request_streaming and not response_streaming:
            _mark_fusable(deadline_handler, self, behavior, max_time)
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


def _aio_code_after(context: Any, exc: BaseException | None, look: _Look | None = None,
                    task: Any = None) -> grpc.StatusCode | None:
    """The status the client of an aio server call whose handler ended
    (``exc``: how; ``task``: the handler's) got: the budget's, once it is
    out; what ended the call when grpc did (it cancels the task for the
    client's deadline, a cancel, the server's stop; ``look``: how a slow
    call's client's deadline stood); else the handler's."""
    own = getattr(context, "_client_code", None)  # a budget's own call, as the context
    code: grpc.StatusCode | None = own() if own is not None else None
    if code is not None:
        return code
    try:
        done = context.done()
        code = _as_status(context.code()) if done else None
    except Exception:
        done, code = False, None
    if code is _DEADLINE_EXCEEDED:
        return code
    if task is None:
        task = _current_task()
    if task is not None and task.cancelling():
        return look.code() if look is not None else _client_gone_code(context)
    if done and code is not None:
        return code
    # an aio handler's exception overrides an OK it set (grpc sends UNKNOWN)
    return _server_code(context, exc, set_code_wins=False, exc_codes=_EXC_CODES)


_STATUS = staticmethod(_aio_code_after)


class _AioSlowCall(_SlowCallBase):
    """Per-call state of :class:`SlowCallInterceptor` (aio), in the loop;
    ``where`` is the handler's coroutine or async generator."""

    __slots__ = ()

    def fire(self) -> None:
        if self.done:
            return
        ic = self.interceptor
        if self.look is None and self.context is not None:
            self.look = _look(self.context, self.task, ic._timers)
        if self.own_time_left() > 0.0:
            return
        self.slow = True
        stack = None
        if ic._stack and self.where is not None:
            stack = _await_stack(self.where, ic._stack_limit)
        self._report(False, None, stack)

    def finish(self, code: grpc.StatusCode | None) -> None:
        """The call ended with ``code`` (what its end reports, if it was slow)."""
        if self.done:
            return
        self.done = True
        self.handle.cancel()
        if self.slow:
            self._report(True, code, None)
        if self.look is not None:
            self.look.close()

    def finish_server(self, context: Any, exc: BaseException | None) -> None:
        if not self.done:
            self.finish(_aio_code_after(context, exc, self.look, self.task) if self.slow else None)


def _look(context: Any, task: Any, timers: Callable[[], bucketimer.TimerThread]) -> _Look:
    """How grpc ends the aio server call of ``context`` and ``task``."""
    return _Look(lambda: task is not None and task.cancelling() > 0, context, timers)


class _AioPeerRequests(_Requests):
    """A streamed request whose wait for the client's next message is not
    the handler's own time."""

    __slots__ = ()

    def __aiter__(self) -> _AioPeerRequests:
        return self

    async def __anext__(self) -> Any:
        return await _peer_wait(self._call, self._it.__anext__())


class _PeerContext(_common._ContextProxy):
    """A streaming call's context, whose ``write()`` and ``read()`` (waits
    for the client) are not the handler's own time."""

    __slots__ = ("_call",)

    def __init__(self, ctx: Any, call: _AioSlowCall) -> None:
        self._ctx = ctx
        self._call = call

    async def write(self, message: Any) -> None:
        await _peer_wait(self._call, self._ctx.write(message))

    async def read(self) -> Any:
        return await _peer_wait(self._call, self._ctx.read())


async def _peer_wait(call: _AioSlowCall, waiting: Any) -> Any:
    """``await waiting``, counted as time the call spent waiting for its client."""
    call.wait_begin()
    try:
        return await waiting
    finally:
        call.wait_end()


grpc.aio.ServicerContext.register(_PeerContext)


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
    reported at the threshold is the handler task's (where it is awaiting),
    and the threshold is compared with the handler's own time (waiting for
    the client to send or take a message is left out).
    """

    # -- server ------------------------------------------------------------------

    intercept_service = _intercept_service

    def _wrap(self, behavior: Callable[..., Any], method: str,
              request_streaming: bool, response_streaming: bool) -> Callable[..., Any]:
        # Long because it holds the per-call wrappers themselves, as closures:
        # what they read per call is then a closure cell, not an attribute
        # (docs/grpc.rst, "Costs").
        threshold = self.threshold_for(method)
        if threshold is None or not _is_async(behavior):
            return behavior
        if request_streaming or response_streaming:
            return self._wrap_stream(behavior, method, threshold, request_streaming,
                                     response_streaming)
        both = _fusable(behavior, self)
        if both is not None:  # a ServerDeadlineInterceptor's wrapper: serve both in one
            return _serve_both(both[0], self, both[1], method, both[2], threshold)
        ic = self
        #: the calls whose threshold was reported, by handler coroutine: what their look tells
        reported: dict[Any, _Look] = {}

        def fire(start: float, handler: Any, context: Any, task: Any) -> None:
            """Timer callback (in the loop): the call started at ``start``,
            whose handler is the coroutine ``handler``, passed the threshold
            (it still runs: its end cancels this)."""
            reported[handler] = _look(context, task, ic._timers)
            stack = _await_stack(handler, ic._stack_limit) if ic._stack else None
            ic._report_server(method, start, False, None, stack)

        def ended(start: float, coro: Any, context: Any, exc: BaseException | None) -> None:
            look = reported.pop(coro, None)
            if look is not None:
                ic._report_server(method, start, True, _aio_code_after(context, exc, look), None)
                look.close()

        async def slow_coro(request: Any, context: Any) -> Any:
            tt = ic._live_tt
            if tt is None or tt.closed:
                tt = ic._timers()
            coro = behavior(request, context)
            start = _monotonic()
            try:
                handle = tt.call_at(start + threshold, fire, start, coro, context, _current_task())
            except BaseException:
                coro.close()  # never awaited
                raise
            try:
                result = await coro
            except BaseException as exc:
                if not handle.cancel():  # the timer fired: maybe a slow call
                    ended(start, coro, context, exc)
                raise
            if not handle.cancel():
                ended(start, coro, context, None)
            return result

        return slow_coro

    def _wrap_stream(self, behavior: Callable[..., Any], method: str, threshold: float,
                     request_streaming: bool, response_streaming: bool) -> Callable[..., Any]:
        """A streaming call's wrapper: one :class:`_AioSlowCall` per call,
        which leaves the time spent waiting for the client out."""
        ic = self

        if inspect.isasyncgenfunction(behavior):
            async def slow_gen(request: Any, context: Any) -> AsyncIterator[Any]:
                call = _AioSlowCall(ic, method, "server", threshold=threshold, context=context,
                                    task=_current_task())
                if request_streaming:
                    request = _AioPeerRequests(request, call)
                call.where = responses = behavior(request, context)
                exc: BaseException | None = None
                try:
                    async for message in responses:
                        call.wait_begin()  # grpc writes it: the client's pace
                        try:
                            yield message
                        finally:
                            call.wait_end()
                except BaseException as e:
                    exc = None if isinstance(e, GeneratorExit) else e
                    raise
                finally:
                    call.finish_server(context, exc)

            return slow_gen

        async def slow_stream_coro(request: Any, context: Any) -> Any:
            call = _AioSlowCall(ic, method, "server", threshold=threshold, context=context,
                                task=_current_task())
            if request_streaming:
                request = _AioPeerRequests(request, call)
            call.where = coro = behavior(request, _PeerContext(context, call))
            try:
                result = await coro
            except BaseException as exc:
                call.finish_server(context, exc)
                raise
            call.finish_server(context, None)
            return result

        return slow_stream_coro

    # -- client ------------------------------------------------------------------

    async def _client(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        method = _method_name(client_call_details.method)
        threshold = self.threshold_for(method)
        if threshold is None:
            return await continuation(client_call_details, request)
        call = _AioSlowCall(self, method, "client", threshold=threshold)
        try:
            rpc = await continuation(client_call_details, request)
        except BaseException:
            call.finish(grpc.StatusCode.UNKNOWN)
            raise

        def done(_rpc: Any) -> None:
            if not call.slow:
                call.finish(None)
            else:
                asyncio.ensure_future(_finish_with_code(call, rpc))

        try:
            rpc.add_done_callback(done)
        except (AttributeError, NotImplementedError):  # an interceptor answered directly
            call.finish(grpc.StatusCode.OK)
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

    def _live_stack(self, limit: int | None) -> str | None:
        return _await_stack(getattr(self, "_where", None), limit)

    _end_slow = _FusedCall._end_slow


grpc.aio.ServicerContext.register(_AioBothContext)


def _serve_both(dic: ServerDeadlineInterceptor, sic: SlowCallInterceptor,
                behavior: Callable[..., Any], method: str, max_time: float | None,
                threshold: float) -> Callable[..., Any]:
    """One wrapper for a unary coroutine handler doing what ``sic`` around
    ``dic`` does: one coroutine, one context object that is also the
    timer's payload, one timer, one ``ContextVar`` set.  On the native
    backend and Python 3.12+ the wrapper is C
    (:class:`_NativeAioBothContext`): its coroutine has no frame."""
    if sys.version_info >= (3, 12) and _GrpcAioUnary is not None:
        ncls = _DeadlineCall._for.__func__(  # type: ignore[attr-defined]
            _NativeAioBothContext, dic, method, _sic=sic, _threshold=threshold,
            _max_time=max_time, _status=_STATUS)
        wrapper: Callable[..., Any] = _GrpcAioUnary(ncls, behavior, _deadline_var, dic._timers,
                                                    threshold, max_time, _current_task)
        # what grpc.aio asks (inspect.iscoroutinefunction) before awaiting a handler
        return inspect.markcoroutinefunction(wrapper)
    cls = _AioBothContext._for(dic, method, _sic=sic, _threshold=threshold, _max_time=max_time,
                               _status=_STATUS)
    begin = cls._begin_both

    async def both_coro(request: Any, context: Any) -> Any:
        call = begin(context, _current_task())
        has_budget = call._deadline is not None
        token = _deadline_var.set(call if has_budget else None)
        try:
            call._where = coro = behavior(request, call if has_budget else context)
            result = await coro
        except BaseException as exc:
            call._done = True
            call._handle.cancel()
            tail = _tail(call, exc)
            if tail is None:
                raise
            return await tail
        else:
            call._done = True
            if call._handle.cancel():  # in time: no timer fired
                return result
            tail = _tail(call, None)
            return result if tail is None else await tail
        finally:
            try:
                _deadline_var.reset(token)
            except ValueError as e:  # as in deadline_handler (and the C wrapper)
                if not isinstance(e.__context__, GeneratorExit):
                    raise

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
        the same fields, as the C type's, and the same methods.  The C
        wrapper calls :func:`_tail` when the handler raised or a timer of
        the call fired, and awaits the coroutine it returns.  Subclassed per
        method as :meth:`_DeadlineCall._for` does."""

        __slots__ = ()
        _ic: ServerDeadlineInterceptor
        _method: str
        _sic: SlowCallInterceptor
        _threshold: float

        write = _AioDeadlineContext.write
        send_initial_metadata = _AioDeadlineContext.send_initial_metadata
        read = _AioDeadlineContext.read
        abort = _AioDeadlineContext.abort
        abort_with_status = _AioDeadlineContext.abort_with_status
        _ended_by_grpc = _AioDeadlineContext._ended_by_grpc
        _end_flags = _AioDeadlineContext._end_flags
        _end_now = _AioDeadlineContext._end_now
        _sent = _AioDeadlineContext._sent
        _end = _AioDeadlineContext._end
        _end_expired_slow = _AioDeadlineContext._end_expired_slow
        _end_downstream = _AioDeadlineContext._end_downstream
        _live_stack = _AioBothContext._live_stack
        _tail = staticmethod(_tail)

    grpc.aio.ServicerContext.register(_NativeAioBothContext)


# -- both at once ----------------------------------------------------------------------------


class ServerDeadlineSlowCallInterceptor(_BothSettings, grpc.aio.ServerInterceptor):
    """aio server interceptor: :class:`SlowCallInterceptor` ``(threshold)``
    around :class:`ServerDeadlineInterceptor` ``(max_time)``, in one.

    Takes both interceptors' options and behaves exactly as the two listed
    in that order, at the cost of one: a unary coroutine handler is served
    by one wrapper with one timer, armed for the earliest of the threshold
    and the deadline and armed again for the next.  The two listed
    separately in that order get the same wrapper; this class also saves
    grpc one ``intercept_service`` call.  The parts are
    ``slow_call_interceptor`` and ``deadline_interceptor``.
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
