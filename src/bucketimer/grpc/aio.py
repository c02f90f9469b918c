"""gRPC ``grpc.aio`` interceptors built on bucketimer timers.

The asyncio counterparts of :mod:`bucketimer.grpc`:

* :class:`DefaultTimeoutInterceptor` / :class:`DeadlinePropagationInterceptor`
  -- client: default timeout and deadline propagation.  Register client
  interceptors through :func:`client_interceptors`
  (``grpc.aio.insecure_channel(target, interceptors=client_interceptors(...))``):
  grpc.aio would use a multi-shape interceptor for unary-unary calls only.
* :class:`ServerDeadlineInterceptor` -- server: when a call's budget runs out
  the handler task is cancelled and the call is aborted with
  ``DEADLINE_EXCEEDED`` (never left to a raw ``CancelledError``, which leaves
  the client waiting; grpc/grpc#29248).
* :class:`SlowCallInterceptor` -- client and server: logs calls still running
  after a threshold (with the handler task's stack on the server) and their
  total time when they end.

Timers are scheduled from the event loop's thread, so they fire in that loop
(posted through bucketimer's eventfd port); a call that ends in time costs one
schedule + cancel.  :func:`remaining` works inside aio handlers (per task).
"""

from __future__ import annotations

try:
    import grpc  # absolute imports: the real grpcio package
    import grpc.aio
except ImportError as _exc:  # pragma: no cover - exercised without grpcio only
    raise ImportError(
        "bucketimer.grpc.aio needs grpcio, which is not installed; "
        "install it with: pip install 'bucketimer[grpc]'"
    ) from _exc

import asyncio
import inspect
import io
import linecache
from collections.abc import Callable
from typing import Any

import bucketimer

from . import (
    DEFAULT_DETAILS,
    DeadlineEvent,
    SlowCall,
    _budget,
    _budget_length,
    _check_seconds,
    _deadline_var,
    _log_deadline,
    _log_slow,
    _method_name,
    _monotonic,
    _safe_hook,
    _SlowCallSettings,
    _TimeoutRules,
    _timer_thread,
    _wrap_handler,
    _WrapCache,
    current_deadline,
    remaining,
)

__all__ = [
    "client_interceptors",
    "DeadlineEvent",
    "DeadlinePropagationInterceptor",
    "DefaultTimeoutInterceptor",
    "ServerDeadlineInterceptor",
    "SlowCall",
    "SlowCallInterceptor",
    "current_deadline",
    "remaining",
]

_AbortError: Any = grpc.aio.AbortError
_CancelledError = asyncio.CancelledError

# grpc cancels an aio handler task itself when the client's deadline passes
# (by its own clock, a few ms apart from ours): a cancellation that close to a
# client deadline is that deadline running out, not a client cancel.
_CLIENT_DEADLINE_SLACK = 0.05


def _behavior_shape(behavior: Callable[..., Any]) -> str | None:
    """"gen" for an async generator function, "coro" for a coroutine
    function, None for a plain function (left alone on an aio server)."""
    if inspect.isasyncgenfunction(behavior):
        return "gen"
    if inspect.iscoroutinefunction(behavior):
        return "coro"
    return None


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

    async def intercept_unary_unary(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return await continuation(self._details(client_call_details), request)

    async def intercept_unary_stream(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return await continuation(self._details(client_call_details), request)

    async def intercept_stream_unary(self, continuation: Any, client_call_details: Any,
                                     request_iterator: Any) -> Any:
        return await continuation(self._details(client_call_details), request_iterator)

    async def intercept_stream_stream(self, continuation: Any, client_call_details: Any,
                                      request_iterator: Any) -> Any:
        return await continuation(self._details(client_call_details), request_iterator)


class DeadlinePropagationInterceptor(DefaultTimeoutInterceptor):
    """aio client interceptor: deadline propagation only
    (``DefaultTimeoutInterceptor(None, margin=margin)``)."""

    def __init__(self, margin: float = 0.0) -> None:
        super().__init__(None, propagate=True, margin=margin)


# -- registering multi-shape client interceptors --------------------------------------
#
# grpc.aio.Channel files each interceptor under the first of the four client
# interceptor interfaces it implements (an if/elif chain: grpc/grpc#31442,
# #40946), so an object implementing all four would only ever see unary-unary
# calls.  client_interceptors() hands grpc one single-shape adapter per shape.


class _UnaryUnaryAdapter(grpc.aio.UnaryUnaryClientInterceptor):
    __slots__ = ("inner",)

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def intercept_unary_unary(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return self.inner.intercept_unary_unary(continuation, client_call_details, request)

    def __repr__(self) -> str:
        return f"<unary-unary {self.inner!r}>"


class _UnaryStreamAdapter(grpc.aio.UnaryStreamClientInterceptor):
    __slots__ = ("inner",)

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def intercept_unary_stream(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return self.inner.intercept_unary_stream(continuation, client_call_details, request)

    def __repr__(self) -> str:
        return f"<unary-stream {self.inner!r}>"


class _StreamUnaryAdapter(grpc.aio.StreamUnaryClientInterceptor):
    __slots__ = ("inner",)

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def intercept_stream_unary(self, continuation: Any, client_call_details: Any, request_iterator: Any) -> Any:
        return self.inner.intercept_stream_unary(continuation, client_call_details, request_iterator)

    def __repr__(self) -> str:
        return f"<stream-unary {self.inner!r}>"


class _StreamStreamAdapter(grpc.aio.StreamStreamClientInterceptor):
    __slots__ = ("inner",)

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def intercept_stream_stream(self, continuation: Any, client_call_details: Any, request_iterator: Any) -> Any:
        return self.inner.intercept_stream_stream(continuation, client_call_details, request_iterator)

    def __repr__(self) -> str:
        return f"<stream-stream {self.inner!r}>"


_ADAPTERS = (
    (grpc.aio.UnaryUnaryClientInterceptor, _UnaryUnaryAdapter),
    (grpc.aio.UnaryStreamClientInterceptor, _UnaryStreamAdapter),
    (grpc.aio.StreamUnaryClientInterceptor, _StreamUnaryAdapter),
    (grpc.aio.StreamStreamClientInterceptor, _StreamStreamAdapter),
)


def client_interceptors(*interceptors: Any) -> list[Any]:
    """The list to pass as ``grpc.aio.insecure_channel(..., interceptors=)``.

    ``grpc.aio`` uses an interceptor that implements several of the four
    client interceptor interfaces for the first one only (unary-unary;
    grpc/grpc#31442), so the interceptors of this module -- which implement
    all four -- would silently miss streaming calls if passed directly.  This
    returns one single-shape adapter per interface each interceptor
    implements, in the given order (any aio client interceptor may be
    passed)::

        channel = grpc.aio.insecure_channel(target, interceptors=client_interceptors(
            DefaultTimeoutInterceptor(2.0), SlowCallInterceptor(0.5)))
    """
    out: list[Any] = []
    for ic in interceptors:
        kinds = [adapter for base, adapter in _ADAPTERS if isinstance(ic, base)]
        if not kinds:
            raise TypeError(f"{ic!r} is not a grpc.aio client interceptor")
        if len(kinds) == 1:
            out.append(ic)
        else:
            out.extend(adapter(ic) for adapter in kinds)
    return out


# -- server deadline ----------------------------------------------------------------------


class _AioDeadlineContext(grpc.aio.ServicerContext):
    """The context an aio handler sees under :class:`ServerDeadlineInterceptor`,
    which is also the call's deadline state (one object per call; everything
    runs in the loop's thread).  The real context, with ``time_remaining()``
    counted against the budget and ``code()`` ``DEADLINE_EXCEEDED`` once it
    ran out."""

    __slots__ = ("_ctx", "_ic", "_method", "_deadline", "_source", "_start", "_task",
                 "_handle", "_fired", "_reported")

    def __init__(self, ctx: Any, ic: ServerDeadlineInterceptor, method: str,
                 deadline: float, source: str, start: float, task: Any) -> None:
        self._ctx = ctx
        self._ic = ic
        self._method = method
        self._deadline = deadline
        self._source = source
        self._start = start
        self._task = task
        self._fired = False
        self._reported = False
        self._handle: Any = None

    def _fire(self) -> None:
        """Timer callback (in the loop): cancel the handler task."""
        self._fired = True
        cancelled = self._task is not None and self._task.cancel()
        self._report(cancelled)

    def _report(self, cancelled: bool) -> None:
        if self._reported:
            return
        self._reported = True
        ic = self._ic
        ev = DeadlineEvent(self._method, self._source, _budget_length(self),
                           _monotonic() - self._start, cancelled=cancelled)
        _log_deadline(ev)
        if ic._on_deadline is not None:
            _safe_hook(ic._on_deadline, ev, "on_deadline")

    def time_remaining(self) -> float:
        r = self._deadline - _monotonic()
        return r if r > 0.0 else 0.0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._ctx, name)

    def read(self) -> Any:
        return self._ctx.read()

    def write(self, message: Any) -> Any:
        return self._ctx.write(message)

    def send_initial_metadata(self, initial_metadata: Any) -> Any:
        return self._ctx.send_initial_metadata(initial_metadata)

    def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata: Any = ()) -> Any:
        return self._ctx.abort(code, details, trailing_metadata)

    def abort_with_status(self, status: Any) -> Any:
        return self._ctx.abort_with_status(status)

    def set_trailing_metadata(self, trailing_metadata: Any) -> None:
        return self._ctx.set_trailing_metadata(trailing_metadata)

    def invocation_metadata(self) -> Any:
        return self._ctx.invocation_metadata()

    def set_code(self, code: grpc.StatusCode) -> None:
        return self._ctx.set_code(code)

    def set_details(self, details: str) -> None:
        return self._ctx.set_details(details)

    def set_compression(self, compression: Any) -> None:
        return self._ctx.set_compression(compression)

    def disable_next_message_compression(self) -> None:
        return self._ctx.disable_next_message_compression()

    def peer(self) -> str:
        return self._ctx.peer()

    def peer_identities(self) -> Any:
        return self._ctx.peer_identities()

    def peer_identity_key(self) -> Any:
        return self._ctx.peer_identity_key()

    def auth_context(self) -> Any:
        return self._ctx.auth_context()

    def trailing_metadata(self) -> Any:
        return self._ctx.trailing_metadata()

    def code(self) -> Any:
        code = self._ctx.code()
        if self._fired and _as_status(code) in (None, grpc.StatusCode.OK):
            return grpc.StatusCode.DEADLINE_EXCEEDED
        return code

    def details(self) -> Any:
        return self._ctx.details()

    def add_done_callback(self, callback: Any) -> None:
        return self._ctx.add_done_callback(callback)

    def cancelled(self) -> bool:
        return self._ctx.cancelled()

    def done(self) -> bool:
        return self._ctx.done()


class ServerDeadlineInterceptor(grpc.aio.ServerInterceptor):
    """aio server interceptor: enforce each call's budget.

    The budget is the smaller of the client's deadline and ``max_time``
    seconds from the handler's start.  When it runs out while the handler is
    still running, the handler task is cancelled (``CancelledError`` at its
    current ``await``); once the handler has unwound, the interceptor
    uncancels the task and aborts the call with ``DEADLINE_EXCEEDED`` (and
    ``details``), so the client never hangs on a raw ``CancelledError``.
    ``on_deadline(DeadlineEvent)`` is called in the loop and an INFO record
    is logged on ``bucketimer.grpc``.  A handler that suppresses the
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
        self._max_time = _check_seconds("max_time", max_time, allow_none=True)
        if on_deadline is not None and not callable(on_deadline):
            raise TypeError("on_deadline must be callable")
        self._on_deadline = on_deadline
        self._details = str(details)
        self._tt = timer_thread
        self._cache = _WrapCache(self._wrap_handler)

    def _begin(self, method: str, context: Any) -> _AioDeadlineContext | None:
        budget = _budget(context, self._max_time)
        if budget is None:
            return None
        deadline, source, now = budget
        call = _AioDeadlineContext(context, self, method, deadline, source, now,
                                   asyncio.current_task())
        call._handle = _timer_thread(self._tt).call_at(deadline, call._fire)
        return call

    async def intercept_service(self, continuation: Any, handler_call_details: Any) -> Any:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        return self._cache.get(handler, handler_call_details.method)

    def _wrap_handler(self, handler: Any, method: str) -> Any:
        return _wrap_handler(handler, lambda b, req_streaming, streaming: self._wrap(b, method))

    def _wrap(self, behavior: Callable[..., Any], method: str) -> Callable[..., Any]:
        shape = _behavior_shape(behavior)
        if shape is None:
            return behavior
        is_gen = shape == "gen"

        async def deadline_handler(request: Any, context: Any) -> Any:
            call = self._begin(method, context)
            if call is None:  # no budget: nothing to enforce
                if not is_gen:
                    return await behavior(request, context)
                async for message in behavior(request, context):
                    await context.write(message)
                return None
            token = _deadline_var.set(call._deadline)
            try:
                result = None
                try:
                    try:
                        if is_gen:
                            responses = behavior(request, call)
                            try:
                                async for message in responses:
                                    await context.write(message)
                            finally:
                                await responses.aclose()
                        else:
                            result = await behavior(request, call)
                    finally:
                        if not call._fired:
                            call._handle.cancel()
                except _CancelledError:
                    if not call._fired:
                        if call._source == "client" and call._deadline - _monotonic() <= _CLIENT_DEADLINE_SLACK:
                            call._report(False)  # grpc enforced the client's deadline first
                        raise
                except _AbortError:
                    raise  # the handler ended the call itself
                except Exception:
                    if not call._fired:
                        raise
                if not call._fired:
                    return result
                task = call._task
                if task is not None and task.cancelling():
                    task.uncancel()
                await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, self._details)
            finally:
                _deadline_var.reset(token)

        return deadline_handler

    def __repr__(self) -> str:
        return f"{type(self).__name__}(max_time={self._max_time!r})"


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


class _AioSlowCall:
    """Per-call state of :class:`SlowCallInterceptor` (aio), in the loop."""

    __slots__ = ("interceptor", "method", "side", "start", "handler", "handle", "slow", "done")

    def __init__(self, interceptor: SlowCallInterceptor, method: str, side: str) -> None:
        self.interceptor = interceptor
        self.method = method
        self.side = side
        self.handler: Any = None  # the handler's coroutine / async generator
        self.slow = False
        self.done = False
        self.start = _monotonic()
        self.handle = _timer_thread(interceptor._tt).call_at(
            self.start + interceptor._threshold, self.fire)

    def fire(self) -> None:
        if self.done:
            return
        self.slow = True
        ic = self.interceptor
        stack = None
        if ic._stack and self.handler is not None:
            stack = _await_stack(self.handler, ic._stack_limit)
        info = SlowCall(self.method, self.side, _monotonic() - self.start, False, None, stack)
        _log_slow(ic._level, info)
        if ic._on_slow is not None:
            _safe_hook(ic._on_slow, info, "on_slow")

    def finish(self, code: grpc.StatusCode | None) -> None:
        if self.done:
            return
        self.done = True
        if not self.slow:
            self.handle.cancel()
            return
        ic = self.interceptor
        info = SlowCall(self.method, self.side, _monotonic() - self.start, True, code, None)
        _log_slow(ic._level, info)
        if ic._on_slow is not None:
            _safe_hook(ic._on_slow, info, "on_slow")


def _server_code(context: Any, exc: BaseException | None) -> grpc.StatusCode | None:
    try:
        code = _as_status(context.code())
    except Exception:
        code = None
    if code is not None and (exc is None or code is not grpc.StatusCode.OK):
        return code
    if exc is None:
        return grpc.StatusCode.OK
    if isinstance(exc, _CancelledError):
        return grpc.StatusCode.CANCELLED
    return grpc.StatusCode.UNKNOWN


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

    async def intercept_service(self, continuation: Any, handler_call_details: Any) -> Any:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        return self._cache.get(handler, handler_call_details.method)

    def _wrap_handler(self, handler: Any, method: str) -> Any:
        return _wrap_handler(handler, lambda b, req_streaming, streaming: self._wrap(b, method))

    def _wrap(self, behavior: Callable[..., Any], method: str) -> Callable[..., Any]:
        shape = _behavior_shape(behavior)
        if shape is None:
            return behavior
        if shape == "gen":
            async def slow_gen(request: Any, context: Any) -> Any:
                call = _AioSlowCall(self, method, "server")
                exc: BaseException | None = None
                try:
                    call.handler = responses = behavior(request, context)
                    async for message in responses:
                        yield message
                except BaseException as e:
                    exc = None if isinstance(e, GeneratorExit) else e
                    raise
                finally:
                    call.finish(_server_code(context, exc) if call.slow else None)

            return slow_gen

        async def slow_coro(request: Any, context: Any) -> Any:
            call = _AioSlowCall(self, method, "server")
            exc: BaseException | None = None
            try:
                call.handler = coro = behavior(request, context)
                return await coro
            except BaseException as e:
                exc = e
                raise
            finally:
                call.finish(_server_code(context, exc) if call.slow else None)

        return slow_coro

    # -- client ------------------------------------------------------------------

    async def _client(self, continuation: Any, details: Any, request: Any) -> Any:
        call = _AioSlowCall(self, _method_name(details.method), "client")
        try:
            rpc = await continuation(details, request)
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

    async def intercept_unary_unary(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return await self._client(continuation, client_call_details, request)

    async def intercept_unary_stream(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return await self._client(continuation, client_call_details, request)

    async def intercept_stream_unary(self, continuation: Any, client_call_details: Any,
                                     request_iterator: Any) -> Any:
        return await self._client(continuation, client_call_details, request_iterator)

    async def intercept_stream_stream(self, continuation: Any, client_call_details: Any,
                                      request_iterator: Any) -> Any:
        return await self._client(continuation, client_call_details, request_iterator)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(threshold={self._threshold!r})"


async def _finish_with_code(call: _AioSlowCall, rpc: Any) -> None:
    try:
        code = _as_status(await rpc.code())
    except Exception:
        code = None
    call.finish(code)

