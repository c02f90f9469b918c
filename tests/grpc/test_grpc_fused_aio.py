"""The fused aio wrapper (SlowCallInterceptor around ServerDeadlineInterceptor,
or ServerDeadlineSlowCallInterceptor) of a coroutine handler, called
directly with a stand-in context in a running loop: what it must keep
whichever backend serves it -- C on the native backend and Python 3.12+
(``_core.GrpcAioUnary``, whose call returns a C coroutine), the Python
``both_coro`` elsewhere (docs/grpc.rst, "Both at once").  Also run with
``BUCKETIMER_NO_EXTENSIONS=1``, which selects the Python one."""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import sys
import warnings
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

grpc = pytest.importorskip("grpc")

from _grpc_harness import SERVICE  # noqa: E402

import bucketimer  # noqa: E402
import bucketimer.grpc.aio as bta  # noqa: E402
from bucketimer import _backend  # noqa: E402

METHOD = f"/{SERVICE}/DirectAio"
NATIVE = _backend.NATIVE and sys.version_info >= (3, 12)


class StandIn:
    """The parts of an aio servicer context the interceptors use."""

    def __init__(self, left: float | None) -> None:
        self.left = left
        self.aborted: list[Any] = []
        self._code: Any = None

    def time_remaining(self) -> float | None:
        return self.left

    def code(self) -> Any:
        return self._code

    def set_code(self, code: Any) -> None:
        self._code = code

    def done(self) -> bool:
        return bool(self.aborted)

    def peer(self) -> str:
        return "ipv4:127.0.0.1:1"

    async def abort(self, code: Any, details: str, trailing_metadata: Any = ()) -> None:
        self.aborted.append((code, details))
        self._code = code
        raise grpc.aio.AbortError()


def _wrapper(behavior: Any, tt: bucketimer.TimerThread, threshold: float, max_time: float | None,
             **kw: Any) -> Any:
    ic = bta.ServerDeadlineSlowCallInterceptor(threshold, max_time, timer_thread=tt, **kw)
    return ic._wrap(behavior, METHOD, False, False)


def _run(main: Callable[[], Awaitable[Any]]) -> Any:
    return asyncio.run(main())  # type: ignore[arg-type]


async def _echo(req: bytes, ctx: Any) -> bytes:
    return req


def test_which_wrapper_serves_it(tt: bucketimer.TimerThread) -> None:
    w = _wrapper(_echo, tt, 1.0, 2.0)
    assert inspect.iscoroutinefunction(w)  # what grpc.aio asks before awaiting it
    slow, deadline = bta.SlowCallInterceptor(1.0, timer_thread=tt), bta.ServerDeadlineInterceptor(2.0, timer_thread=tt)
    fused = slow._wrap(deadline._wrap(_echo, METHOD, False, False), METHOD, False, False)
    assert type(fused) is type(w)
    if NATIVE:
        from bucketimer import _core

        assert type(w) is _core.GrpcAioUnary and w.behavior is _echo and w.free_calls == 0
        c = w(b"", StandIn(None))
        assert type(c).__name__ == "GrpcAioCoro"
        c.close()
    else:
        # 3.11 (its iscoroutinefunction wants a function) and the pure backend
        assert inspect.iscoroutinefunction(w) and w.__name__ == "both_coro"


def test_a_call_in_time(tt: bucketimer.TimerThread) -> None:
    seen: list[Any] = []

    async def behavior(req: bytes, ctx: Any) -> bytes:
        await asyncio.sleep(0)
        seen.append((ctx.time_remaining(), bta.remaining(), bta.current_deadline(), ctx.code(),
                     ctx.peer(), isinstance(ctx, grpc.aio.ServicerContext), ctx._task))
        return req + b"!"

    w = _wrapper(behavior, tt, 5.0, 3.0)

    async def main() -> Any:
        got = await w(b"x", StandIn(10.0))
        return got, bta.current_deadline(), asyncio.current_task()

    got, after, task = _run(main)
    assert got == b"x!" and after is None  # the variable is reset at the end
    (ctx_left, left, deadline, code, peer, is_ctx, ctx_task), = seen
    assert 2.5 < ctx_left <= 3.0 and 2.5 < left <= 3.0  # max_time (3 s) < the client's 10 s
    assert deadline is not None and code is None and peer == "ipv4:127.0.0.1:1"
    assert is_ctx and ctx_task is task
    stats = tt.stats()
    assert stats["scheduled"] == 1 and stats["cancelled"] == 1 and stats["fired"] == 0
    if NATIVE:
        assert w.free_calls == 1  # the call went back to the wrapper's free list


def test_no_budget_the_handler_gets_grpcs_context(tt: bucketimer.TimerThread) -> None:
    got: list[Any] = []

    async def behavior(req: bytes, ctx: Any) -> None:
        got.append((ctx, bta.remaining()))

    w = _wrapper(behavior, tt, 5.0, None)
    plain, huge, client = StandIn(None), StandIn(1e10), StandIn(0.5)

    async def main() -> None:
        for ctx in (plain, huge, client):
            assert await w(b"", ctx) is None

    _run(main)
    assert got[0] == (plain, None) and got[1] == (huge, None)
    ctx, left = got[2]
    assert ctx is not client and ctx._source == "client" and 0.3 < left <= 0.5


def test_the_variable_is_set_only_inside_the_handler(tt: bucketimer.TimerThread) -> None:
    seen: list[Any] = []

    async def main() -> None:
        started, release = asyncio.Event(), asyncio.Event()

        async def behavior(req: bytes, ctx: Any) -> None:
            started.set()
            await release.wait()
            seen.append(bta.remaining())

        async def other() -> None:
            await started.wait()
            seen.append(("other task", bta.remaining()))
            release.set()

        w = _wrapper(behavior, tt, 5.0, 3.0)
        await asyncio.gather(w(b"", StandIn(None)), other())
        seen.append(("after", bta.remaining()))

    _run(main)
    assert seen[0] == ("other task", None)
    assert 2.5 < seen[1] <= 3.0 and seen[2] == ("after", None)


def test_an_exception_propagates_unchanged(tt: bucketimer.TimerThread) -> None:
    reports: list[Any] = []
    boom = ValueError("boom")

    async def raiser(req: bytes, ctx: Any) -> bytes:
        await asyncio.sleep(0)
        raise boom

    w = _wrapper(raiser, tt, 5.0, 3.0, on_slow=reports.append)

    async def main() -> Any:
        with pytest.raises(ValueError) as info:
            await w(b"", StandIn(10.0))
        return info, bta.current_deadline()

    info, after = _run(main)
    assert info.value is boom and after is None
    assert any(entry.name == "raiser" for entry in info.traceback)
    assert tt.stats()["cancelled"] == 1 and reports == []


@pytest.mark.parametrize("how", ["return", "raise", "suppress"])
def test_an_expired_call_ends_with_deadline_exceeded(tt: bucketimer.TimerThread, how: str) -> None:
    events: list[bta.DeadlineEvent] = []
    reports: list[bta.SlowCall] = []
    inside: list[Any] = []

    async def behavior(req: bytes, ctx: Any) -> bytes:
        try:
            await asyncio.sleep(5)
        except asyncio.CancelledError:
            inside.append((ctx.time_remaining(), ctx.code(), bta.remaining()))
            if how == "raise":
                raise
        return req  # "return", "suppress": the cancellation swallowed

    w = _wrapper(behavior, tt, 5.0, 0.05, on_deadline=events.append, on_slow=reports.append)
    ctx = StandIn(10.0)

    async def main() -> Any:
        # the client's status is sent at the deadline; what the handler does
        # then goes on to grpc, as on a call whose client's deadline passed
        if how == "raise":
            with pytest.raises(asyncio.CancelledError):
                await w(b"x", ctx)
        else:
            assert await w(b"x", ctx) is None
        task = asyncio.current_task()
        assert task is not None
        return task.cancelling(), bta.current_deadline()

    cancelling, after = _run(main)
    # swallowed, the cancellation is taken back: the task goes on
    assert cancelling == (1 if how == "raise" else 0) and after is None
    assert ctx.aborted == [(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")]
    assert inside == [(0.0, grpc.StatusCode.DEADLINE_EXCEEDED, 0.0)]
    assert bta.flush_reports(5.0)
    assert [(e.source, e.budget, e.cancelled) for e in events] == [("max_time", 0.05, True)]
    assert reports == []  # never slow: the threshold's timer, re-armed, was cancelled


def test_a_slow_call_reports_its_live_await_stack(tt: bucketimer.TimerThread) -> None:
    reports: list[bta.SlowCall] = []

    async def stuck_here() -> None:
        while not reports:
            await asyncio.sleep(0.005)

    async def behavior(req: bytes, ctx: Any) -> bytes:
        await stuck_here()
        return req

    w = _wrapper(behavior, tt, 0.05, 5.0, on_slow=reports.append)

    async def main() -> Any:
        return await w(b"ok", StandIn(10.0))

    assert _run(main) == b"ok"
    assert bta.flush_reports(5.0)
    assert [r.finished for r in reports] == [False, True]
    stack = reports[0].stack or ""
    assert "in behavior" in stack and "in stuck_here" in stack and reports[0].method == METHOD
    assert reports[1].code == grpc.StatusCode.OK and reports[1].elapsed >= 0.05


@pytest.mark.parametrize("cancel_at,reported", [(0.04, False), (0.099, True)],
                         ids=["cancel", "client-deadline"])
def test_grpcs_cancel_is_a_deadline_only_after_the_early_look(tt: bucketimer.TimerThread,
                                                               cancel_at: float, reported: bool) -> None:
    # grpc cancels the task itself when the client cancels, and at the
    # client's deadline, a moment before ours: the budget's early look, 20 ms
    # before that deadline, tells them apart
    events: list[bta.DeadlineEvent] = []
    ctx = StandIn(0.1)

    async def behavior(req: bytes, ctx: Any) -> None:
        await asyncio.sleep(5)

    w = _wrapper(behavior, tt, 5.0, None, on_deadline=events.append)

    async def main() -> None:
        task = asyncio.ensure_future(w(b"", ctx))
        await asyncio.sleep(cancel_at)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    _run(main)
    assert bta.flush_reports(5.0)
    if not reported:
        assert events == [] and ctx.aborted == []
    else:  # grpc's cancel first (or, on a loaded machine, ours: it sent the status)
        assert [(e.source, e.cancelled) for e in events] == [("client", bool(ctx.aborted))]


def test_a_cancel_from_outside_propagates(tt: bucketimer.TimerThread) -> None:
    events: list[Any] = []
    ctx = StandIn(None)

    async def behavior(req: bytes, ctx: Any) -> None:
        await asyncio.sleep(5)

    w = _wrapper(behavior, tt, 5.0, 10.0, on_deadline=events.append)

    async def main() -> None:
        task = asyncio.ensure_future(w(b"", ctx))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    _run(main)
    assert events == [] and ctx.aborted == [] and tt.stats()["cancelled"] == 1


# -- the coroutine protocol of what the wrapper returns ---------------------------------------


def test_close_or_throw_before_the_first_send_runs_nothing(tt: bucketimer.TimerThread) -> None:
    ran: list[Any] = []

    async def behavior(req: bytes, ctx: Any) -> None:
        ran.append(req)

    w = _wrapper(behavior, tt, 5.0, 1.0)

    async def main() -> None:
        c = w(b"", StandIn(None))
        c.close()
        c.close()
        with pytest.raises(RuntimeError, match="cannot reuse already awaited coroutine"):
            await c
        c = w(b"", StandIn(None))
        with pytest.raises(KeyError):
            c.throw(KeyError("k"))
        with pytest.raises(RuntimeError, match="cannot reuse already awaited coroutine"):
            c.send(None)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _run(main)
    assert ran == [] and tt.stats()["scheduled"] == 0


def test_send_throw_and_close_reach_the_handler(tt: bucketimer.TimerThread) -> None:
    log: list[Any] = []

    async def behavior(req: bytes, ctx: Any) -> Any:
        while True:
            try:
                got = await Step()
            except KeyError as e:
                log.append(("caught", e.args[0], bta.remaining() is not None))
                continue
            except GeneratorExit:
                log.append(("closed", bta.remaining() is not None))
                raise
            if got == "done":
                return req
            log.append(("sent", got))

    w = _wrapper(behavior, tt, 5.0, 3.0)

    async def main() -> None:
        c = w(b"r", StandIn(None))
        assert c.send(None) == "step"  # the handler's first suspension, yielded through
        assert bta.remaining() is not None  # set in this (the driving) context
        assert c.send("a") == "step"
        assert c.throw(KeyError("k")) == "step"
        with pytest.raises(StopIteration) as stop:
            c.send("done")
        assert stop.value.value == b"r" and bta.remaining() is None
        with pytest.raises(RuntimeError, match="cannot reuse"):
            c.send(None)
        # close() while suspended: GeneratorExit at the handler's await
        c = w(b"r", StandIn(None))
        assert c.send(None) == "step"
        assert c.close() is None
        assert bta.remaining() is None
        # an exception thrown in that the handler does not catch ends it
        c = w(b"r", StandIn(None))
        c.send(None)
        with pytest.raises(ValueError, match="v"):
            c.throw(ValueError("v"))
        assert bta.remaining() is None

    _run(main)
    assert log == [("sent", "a"), ("caught", "k", True), ("closed", True)]
    stats = tt.stats()
    assert stats["scheduled"] == 3 and stats["cancelled"] == 3 and stats["fired"] == 0


def test_the_coroutine_states(tt: bucketimer.TimerThread) -> None:
    """inspect.getcoroutinestate() through a call's life: the C coroutine
    has no frame, but reports its states as ``both_coro`` does."""
    states: list[str] = []
    outer: list[Any] = []

    async def behavior(req: bytes, ctx: Any) -> bytes:
        states.append(inspect.getcoroutinestate(outer[0]))
        await asyncio.sleep(0)
        return req

    w = _wrapper(behavior, tt, 5.0, 3.0)

    async def main() -> None:
        c = w(b"r", StandIn(None))
        outer.append(c)
        states.append(inspect.getcoroutinestate(c))
        task = asyncio.ensure_future(c)
        await asyncio.sleep(0)
        states.append(inspect.getcoroutinestate(c))
        assert await task == b"r"
        states.append(inspect.getcoroutinestate(c))
        c = w(b"r", StandIn(None))
        c.close()
        states.append(inspect.getcoroutinestate(c))

    _run(main)
    assert states == [inspect.CORO_CREATED, inspect.CORO_RUNNING, inspect.CORO_SUSPENDED,
                      inspect.CORO_CLOSED, inspect.CORO_CLOSED]


@pytest.mark.parametrize("where", ["suspended", "before the start"])
def test_throw_of_a_class_inside_except(tt: bucketimer.TimerThread, where: str) -> None:
    """throw(ValueError) (the class) from inside an ``except`` block: the
    ValueError is made where the coroutine waits, without the caller's
    handled exception as its __context__."""

    async def behavior(req: bytes, ctx: Any) -> Any:
        return await Step()

    w = _wrapper(behavior, tt, 5.0, 3.0)

    async def main() -> BaseException:
        c = w(b"r", StandIn(None))
        if where == "suspended":
            assert c.send(None) == "step"
        try:
            raise KeyError("the caller's")
        except KeyError:
            with pytest.raises(ValueError) as ei:
                c.throw(ValueError)
        return ei.value

    exc = _run(main)
    assert type(exc) is ValueError and exc.args == ()
    assert exc.__context__ is None and exc.__cause__ is None


@pytest.mark.parametrize("how", ["raised", "returned"])
def test_the_variable_reset_failing_chains_as_a_finally_block(tt: bucketimer.TimerThread,
                                                              how: str) -> None:
    """Started in one context and ended in another, the call cannot reset
    the deadline variable: that ValueError is raised as from the wrapper's
    ``finally`` block, its __context__ the handler's exception if it raised
    (else what the caller was handling), never the caller's in its place."""

    async def behavior(req: bytes, ctx: Any) -> Any:
        await Step()
        if how == "raised":
            raise LookupError("the handler's")
        return req

    w = _wrapper(behavior, tt, 5.0, 3.0)

    async def main() -> BaseException:
        c = w(b"r", StandIn(None))
        assert contextvars.copy_context().run(c.send, None) == "step"
        try:
            raise KeyError("the caller's")
        except KeyError:
            with pytest.raises(ValueError, match="different Context") as ei:
                c.send(None)
        return ei.value

    exc = _run(main)
    context = exc.__context__
    if how == "raised":
        assert type(context) is LookupError and context.args == ("the handler's",)
        context = context.__context__
    assert type(context) is KeyError and context.args == ("the caller's",)


@pytest.mark.skipif(not NATIVE, reason="the C wrapper: native backend, Python 3.12+")
def test_a_handler_cannot_change_the_fields_c_reads(tt: bucketimer.TimerThread) -> None:
    refused: list[str] = []
    names = ("_handle", "_ctx", "_deadline", "_source", "_task", "_start", "_ident",
             "_first_slow", "_where")

    async def behavior(req: bytes, ctx: Any) -> bytes:
        await asyncio.sleep(0)
        for name in names:
            for change in (lambda n=name: delattr(ctx, n), lambda n=name: setattr(ctx, n, None)):
                with pytest.raises(AttributeError):
                    change()
            refused.append(name)
        return req + b"!"

    w = _wrapper(behavior, tt, 5.0, 1.0)

    async def main() -> Any:
        return await w(b"x", StandIn(None))

    assert _run(main) == b"x!"
    assert refused == list(names)
    stats = tt.stats()
    assert stats["scheduled"] == stats["cancelled"] == 1


# -- closed where its dropped task is collected -------------------------------------------------
#
# grpc.aio's server stop can drop a handler's task while it is pending; the
# coroutine is then closed wherever it is collected, outside the call's
# context.  As a handler without the interceptors, it ends quietly: no
# ValueError from the variable's reset, nothing awaited while closing.


@pytest.mark.parametrize("which", ["fused", "deadline"])
def test_closed_outside_its_context_ends_quietly(tt: bucketimer.TimerThread, which: str) -> None:
    log: list[Any] = []

    async def behavior(req: bytes, ctx: Any) -> bytes:
        try:
            return await Step()  # type: ignore[no-any-return]
        except GeneratorExit:
            log.append(("closed", bta.remaining() is not None))
            raise

    if which == "fused":
        w = _wrapper(behavior, tt, 5.0, 3.0)
    else:
        w = bta.ServerDeadlineInterceptor(3.0, timer_thread=tt)._wrap(behavior, METHOD, False, False)

    async def main() -> None:
        c = w(b"r", StandIn(None))
        assert c.send(None) == "step"
        assert contextvars.Context().run(c.close) is None
        assert bta.remaining() is not None  # this context's, left as a dropped task leaves it
        # not closing: a reset the context refuses is still raised
        c = w(b"r", StandIn(None))
        assert c.send(None) == "step"
        with pytest.raises(ValueError, match="different Context"):
            contextvars.Context().run(c.send, b"")

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _run(main)
    assert log == [("closed", False)]  # it ran in the context it was closed in
    stats = tt.stats()
    assert stats["scheduled"] == stats["cancelled"] == 2 and stats["fired"] == 0


def test_a_stream_closed_inside_its_generator_ends_quietly(tt: bucketimer.TimerThread) -> None:
    """Closed while its async generator is suspended inside a step (not at
    a ``yield``): nothing is awaited, the generator left as grpc leaves it
    (CPython before 3.13 leaves it running: its finaliser's aclose()
    fails, as it does without the interceptor)."""
    written: list[bytes] = []
    errors: list[str] = []

    class Writer(StandIn):
        async def write(self, message: bytes) -> None:
            written.append(message)

    async def behavior(req: bytes, ctx: Any) -> Any:
        yield b"first"
        await Step()
        yield b"second"

    w = bta.ServerDeadlineInterceptor(3.0, timer_thread=tt)._wrap(behavior, METHOD, False, True)

    async def main() -> None:
        asyncio.get_running_loop().set_exception_handler(
            lambda loop, context: errors.append(repr(context.get("exception"))))
        c = w(b"r", Writer(None))
        assert c.send(None) == "step"
        assert contextvars.Context().run(c.close) is None

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _run(main)
    assert written == [b"first"]
    assert all("already running" in e for e in errors), errors
    if sys.version_info >= (3, 13):
        assert errors == []
    stats = tt.stats()
    assert stats["scheduled"] == stats["cancelled"] == 1 and stats["fired"] == 0


class Step:
    """An awaitable yielding "step" once and returning what is sent back."""

    def __await__(self) -> Any:
        return (yield "step")


@pytest.mark.skipif(not NATIVE, reason="the C wrapper: native backend, Python 3.12+")
def test_a_behaviour_raising_when_called(tt: bucketimer.TimerThread) -> None:
    from bucketimer import _core

    def bad(req: bytes, ctx: Any) -> Any:
        raise LookupError("at call")

    call_type = _wrapper(_echo, tt, 5.0, 3.0).call_type
    w = _core.GrpcAioUnary(call_type, bad, bta._deadline_var, lambda: tt, 5.0, 3.0,
                           asyncio.current_task)

    async def main() -> None:
        with pytest.raises(LookupError, match="at call"):
            await w(b"", StandIn(None))
        assert bta.remaining() is None

    _run(main)
    assert tt.stats()["scheduled"] == 1 and tt.stats()["cancelled"] == 1
    with pytest.raises(TypeError):  # a class with a layout of its own
        _core.GrpcAioUnary(type("C", (_core.GrpcCall,), {}), bad, bta._deadline_var,
                           lambda: tt, 1.0, None, asyncio.current_task)
