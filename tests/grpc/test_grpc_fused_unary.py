"""The fused sync unary wrapper (SlowCallInterceptor around
ServerDeadlineInterceptor, or ServerDeadlineSlowCallInterceptor) called
directly with a stand-in context, and once on a real server: what it must
keep whichever backend serves it -- C on the native backend
(``_core.GrpcUnary``), Python on the pure one (docs/grpc.rst, "Both at
once").  Run on both: ``BUCKETIMER_NO_EXTENSIONS=1`` selects the pure one."""

from __future__ import annotations

import contextvars
import gc
import threading
import time
import weakref
from typing import Any

import pytest

grpc = pytest.importorskip("grpc")

from _grpc_harness import SERVICE, SyncBackend, busy_until, wait_for  # noqa: E402

import bucketimer  # noqa: E402
import bucketimer.grpc as btg  # noqa: E402
from bucketimer import _backend  # noqa: E402

METHOD = f"/{SERVICE}/Direct"


class Aborted(Exception):
    """What the stand-in's abort() raises (grpc's sync abort() raises too)."""


class StandIn:
    """The parts of a sync servicer context the interceptors use, and two
    the handler may ask for through the proxy."""

    def __init__(self, left: float | None) -> None:
        self.left = left
        self.cancelled = False
        self.aborted: list[Any] = []
        self.peer_name = "ipv4:127.0.0.1:1"
        self._code: Any = None

    def time_remaining(self) -> float | None:
        return self.left

    def code(self) -> Any:
        return self._code

    def is_active(self) -> bool:
        return not self.cancelled

    def cancel(self) -> None:
        self.cancelled = True

    def abort(self, code: Any, details: str) -> None:
        self.aborted.append((code, details))
        raise Aborted(code, details)

    def peer(self) -> str:
        return self.peer_name

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return (("k", "v"),)


def _wrapper(behavior: Any, tt: bucketimer.TimerThread, threshold: float, max_time: float | None,
             **kw: Any) -> Any:
    ic = btg.ServerDeadlineSlowCallInterceptor(threshold, max_time, timer_thread=tt, **kw)
    return ic._wrap(behavior, METHOD, False, False)


def test_the_native_backend_serves_it_in_c(tt: bucketimer.TimerThread) -> None:
    w = _wrapper(lambda req, ctx: req, tt, 1.0, 2.0)
    if _backend.NATIVE:
        from bucketimer import _core

        assert type(w) is _core.GrpcUnary and w.free_calls == 0
        with pytest.raises(TypeError):
            _core.GrpcCall()
        with pytest.raises(TypeError):  # a class with a layout of its own
            _core.GrpcUnary(type("C", (_core.GrpcCall,), {}), print, btg._common._deadline_var,
                            lambda: tt, 1.0, None)
    else:
        assert callable(w) and w.__name__ == "both_unary"
    # listed separately (slow-call outermost), the same wrapper kind
    slow, deadline = btg.SlowCallInterceptor(1.0, timer_thread=tt), btg.ServerDeadlineInterceptor(2.0, timer_thread=tt)
    fused = slow._wrap(deadline._wrap(print, METHOD, False, False), METHOD, False, False)
    assert type(fused) is type(w)


def test_a_call_in_time(tt: bucketimer.TimerThread) -> None:
    seen: list[Any] = []

    def behavior(req: bytes, ctx: Any) -> bytes:
        seen.append((ctx.time_remaining(), btg.remaining(), btg.current_deadline(), ctx.is_active(),
                     ctx.code(), ctx.peer(), ctx.invocation_metadata(),
                     isinstance(ctx, grpc.ServicerContext), threading.get_ident()))
        return req + b"!"

    w = _wrapper(behavior, tt, 5.0, 3.0)
    assert w(b"x", StandIn(10.0)) == b"x!"
    assert btg.current_deadline() is None  # reset after the call
    (ctx_left, left, deadline, active, code, peer, meta, is_ctx, ident), = seen
    assert 2.5 < ctx_left <= 3.0 and 2.5 < left <= 3.0  # max_time (3 s) < the client's 10 s
    assert abs(deadline - (time.monotonic() + 3.0)) < 0.5
    assert active and code is None and peer == "ipv4:127.0.0.1:1" and meta == (("k", "v"),)
    assert is_ctx and ident == threading.get_ident()
    assert wait_for(lambda: tt.stats()["cancelled"] == 1)
    assert tt.stats()["scheduled"] == 1 and tt.stats()["fired"] == 0


def test_the_client_deadline_and_no_deadline(tt: bucketimer.TimerThread) -> None:
    got: list[Any] = []
    w = _wrapper(lambda req, ctx: got.append((ctx, btg.remaining())), tt, 5.0, None)
    plain = StandIn(0.5)
    w(b"", plain)
    ctx, left = got.pop()
    assert ctx is not plain and 0.3 < left <= 0.5 and 0.3 < ctx.time_remaining() <= 0.5
    assert ctx._source == "client"
    none = StandIn(None)  # no deadline, no max_time: grpc's own context, no budget
    w(b"", none)
    assert got.pop() == (none, None)
    huge = StandIn(9.2e18)  # sync grpc's "no deadline"
    w(b"", huge)
    assert got.pop() == (huge, None)
    past = StandIn(-1.0)  # already spent: a budget of 0, the timer fires at once

    def late(req: bytes, ctx: Any) -> None:
        busy_until(lambda: not ctx.is_active(), 2.0)
        got.append((ctx.time_remaining(), btg.remaining(), ctx._source))

    with pytest.raises(Aborted):
        _wrapper(late, tt, 5.0, None)(b"", past)
    assert got.pop() == (0.0, 0.0, "client")


def test_an_exception_propagates_unchanged(tt: bucketimer.TimerThread) -> None:
    reports: list[Any] = []
    boom = ValueError("boom")

    def raiser(req: bytes, ctx: Any) -> bytes:
        raise boom

    w = _wrapper(raiser, tt, 5.0, 3.0, on_slow=reports.append)
    with pytest.raises(ValueError) as info:
        w(b"", StandIn(10.0))
    assert info.value is boom
    assert info.traceback[-1].name == "raiser"
    assert btg.current_deadline() is None
    assert wait_for(lambda: tt.stats()["cancelled"] == 1) and reports == []


def test_an_expired_call_ends_with_deadline_exceeded(tt: bucketimer.TimerThread) -> None:
    events: list[btg.DeadlineEvent] = []
    reports: list[btg.SlowCall] = []
    inside: list[Any] = []

    def behavior(req: bytes, ctx: Any) -> bytes:
        busy_until(lambda: not ctx.is_active(), 2.0)
        inside.append((ctx.time_remaining(), ctx.code(), btg.remaining()))
        if req == b"raise":
            raise RuntimeError("after the deadline")
        return req

    w = _wrapper(behavior, tt, 5.0, 0.05, on_deadline=events.append, on_slow=reports.append)
    for req in (b"return", b"raise"):
        ctx = StandIn(10.0)
        with pytest.raises(Aborted):  # the result, or an Exception, gives way to the abort
            w(req, ctx)
        assert ctx.cancelled and ctx.aborted == [(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")]
        assert inside.pop() == (0.0, grpc.StatusCode.DEADLINE_EXCEEDED, 0.0)
        assert btg.current_deadline() is None
    # reported on the timer thread after the call was ended: the handler may end first
    assert wait_for(lambda: len(events) == 2)
    assert [(e.source, e.budget) for e in events] == [("max_time", 0.05)] * 2
    assert reports == []  # never slow: the threshold's timer, re-armed, was cancelled


class Stop(BaseException):
    pass


def test_a_base_exception_after_expiry_propagates(tt: bucketimer.TimerThread) -> None:
    def behavior(req: bytes, ctx: Any) -> bytes:
        busy_until(lambda: not ctx.is_active(), 2.0)
        raise Stop

    w = _wrapper(behavior, tt, 5.0, 0.05)
    ctx = StandIn(10.0)
    with pytest.raises(Stop):
        w(b"", ctx)
    assert ctx.cancelled and ctx.aborted == []


def _stuck_here(pred: Any) -> None:
    busy_until(pred, 2.0)


def test_a_slow_call_reports_its_live_stack(tt: bucketimer.TimerThread) -> None:
    reports: list[btg.SlowCall] = []

    def behavior(req: bytes, ctx: Any) -> bytes:
        _stuck_here(lambda: bool(reports))
        return req

    w = _wrapper(behavior, tt, 0.05, 5.0, on_slow=reports.append)
    assert w(b"ok", StandIn(10.0)) == b"ok"
    assert btg.flush_reports(5.0)  # reports are delivered on a thread of their own
    assert [r.finished for r in reports] == [False, True]
    assert "_stuck_here" in (reports[0].stack or "") and reports[0].method == METHOD
    assert reports[1].code == grpc.StatusCode.OK and reports[1].elapsed >= 0.05
    # slow, then re-armed for the deadline, which the end cancelled
    assert wait_for(lambda: tt.stats()["fired"] == 1 and tt.stats()["cancelled"] == 1)


def test_a_slow_call_that_raises_reports_its_status(tt: bucketimer.TimerThread) -> None:
    reports: list[btg.SlowCall] = []

    def behavior(req: bytes, ctx: Any) -> bytes:
        _stuck_here(lambda: bool(reports))
        ctx._code = grpc.StatusCode.NOT_FOUND  # no budget: grpc's own context
        raise KeyError("x")

    w = _wrapper(behavior, tt, 0.05, None, on_slow=reports.append, stack=False)
    with pytest.raises(KeyError):
        w(b"", StandIn(None))
    assert btg.flush_reports(5.0)
    assert [(r.finished, r.code, r.stack) for r in reports] == [
        (False, None, None), (True, grpc.StatusCode.NOT_FOUND, None)]


def test_reentrant_calls_keep_their_own_budget(tt: bucketimer.TimerThread) -> None:
    seen: list[Any] = []
    w: Any = None

    def behavior(req: int, ctx: Any) -> int:
        mine = btg.current_deadline()
        seen.append((req, id(ctx), mine, ctx.time_remaining()))
        if req:
            assert w(req - 1, StandIn(float(req))) == req - 1
            assert btg.current_deadline() == mine  # the inner call reset to ours
        return req

    w = _wrapper(behavior, tt, 5.0, None)
    assert w(3, StandIn(30.0)) == 3
    assert btg.current_deadline() is None
    assert [s[0] for s in seen] == [3, 2, 1, 0]
    assert len({s[1] for s in seen}) == 4  # one proxy per call in flight
    deadlines = [s[2] for s in seen]
    assert deadlines == sorted(deadlines, reverse=True)  # 30 s, 2 s, 1 s, 0 s budgets
    assert wait_for(lambda: tt.stats()["cancelled"] == 4)


def test_calls_from_threads_at_once(tt: bucketimer.TimerThread) -> None:
    barrier = threading.Barrier(4)
    out: list[Any] = []

    def behavior(req: float, ctx: Any) -> float:
        barrier.wait(5.0)
        out.append((req, round(ctx.time_remaining()), round(btg.remaining() or -1)))
        return req

    w = _wrapper(behavior, tt, 5.0, None)
    threads = [threading.Thread(target=w, args=(float(n), StandIn(float(n)))) for n in (10, 20, 30, 40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10.0)
    assert sorted(out) == [(n, n, n) for n in (10.0, 20.0, 30.0, 40.0)]


def test_a_reused_call_starts_afresh(tt: bucketimer.TimerThread) -> None:
    """A call object used again (the native free list) keeps nothing of the
    call before: not its expiry, slowness, timers, context or budget."""
    reports: list[btg.SlowCall] = []
    seen: list[Any] = []

    def behavior(req: bytes, ctx: Any) -> bytes:
        if req == b"expire":
            busy_until(lambda: not ctx.is_active() and bool(reports), 2.0)
        seen.append((id(ctx), ctx._expired, ctx._slow, ctx._handle2, ctx._ctx.left, ctx.code(),
                     ctx.is_active(), round(ctx.time_remaining())))
        return req

    w = _wrapper(behavior, tt, 0.02, 0.06, on_slow=reports.append, stack=False)
    first_ctx = StandIn(10.0)
    ref = weakref.ref(first_ctx)
    with pytest.raises(Aborted):
        w(b"expire", first_ctx)
    assert btg.flush_reports(5.0)
    assert [r.finished for r in reports] == [False, True]
    del first_ctx
    gc.collect()
    assert ref() is None  # the ended call let go of grpc's context
    first = seen.pop()
    assert first[1:3] == (True, True) and first[6] is False
    if _backend.NATIVE:
        assert w.free_calls == 1
    second_ctx = StandIn(20.0)
    assert w(b"again", second_ctx) == b"again"
    again = seen.pop()
    if _backend.NATIVE:
        assert again[0] == first[0]  # the same object, from the free list
        assert w.free_calls == 1
    assert again[1:] == (False, False, None, 20.0, None, True, 0)
    assert len(reports) == 2


def test_the_proxy_forwards_and_is_not_writable(tt: bucketimer.TimerThread) -> None:
    got: list[Any] = []

    def behavior(req: bytes, ctx: Any) -> bytes:
        got.append(ctx.peer_name)
        with pytest.raises(AttributeError):
            ctx.no_such_attribute  # noqa: B018
        with pytest.raises(AttributeError):
            ctx.anything = 1
        return req

    w = _wrapper(behavior, tt, 5.0, 1.0)
    w(b"", StandIn(None))
    assert got == ["ipv4:127.0.0.1:1"]


def test_on_a_real_server(tt: bucketimer.TimerThread) -> None:
    seen: list[Any] = []
    backend = SyncBackend()

    def echo(req: bytes, ctx: Any) -> bytes:
        seen.append((isinstance(ctx, grpc.ServicerContext), ctx.is_active(), ctx.peer().startswith("ipv4:"),
                     dict(ctx.invocation_metadata()).get("who"), round(ctx.time_remaining()),
                     round(btg.remaining() or -1)))
        ctx.set_trailing_metadata((("done", "yes"),))
        return req

    handlers = {"Echo": grpc.unary_unary_rpc_method_handler(echo)}
    ic = btg.ServerDeadlineSlowCallInterceptor(5.0, 4.0, timer_thread=tt)
    with backend.serve(handlers, (ic,)) as addr, backend.channel(addr) as ch:
        for _ in range(3):
            r, call = ch.unary_unary(f"/{SERVICE}/Echo").with_call(
                b"hi", timeout=10.0, metadata=(("who", "test"),))
            assert r == b"hi" and dict(call.trailing_metadata())["done"] == "yes"
    assert seen == [(True, True, True, "test", 4, 4)] * 3
    assert wait_for(lambda: tt.stats()["cancelled"] == 3)


#: the call's fields the C wrappers read: Python may read them, not change them
C_READS = ("_handle", "_ctx", "_deadline", "_source", "_task", "_start", "_ident", "_first_slow",
           "_where")


@pytest.mark.native
def test_a_handler_cannot_change_the_fields_c_reads(tt: bucketimer.TimerThread) -> None:
    refused: list[str] = []

    def behavior(req: bytes, ctx: Any) -> bytes:
        for name in C_READS:
            for change in (lambda n=name: delattr(ctx, n), lambda n=name: setattr(ctx, n, None)):
                with pytest.raises(AttributeError):
                    change()
            refused.append(name)
        return req + b"!"

    w = _wrapper(behavior, tt, 5.0, 1.0)
    assert w(b"x", StandIn(None)) == b"x!"
    assert refused == list(C_READS)
    stats = tt.stats()
    assert stats["scheduled"] == stats["cancelled"] == 1


@pytest.mark.native
def test_a_stand_in_timer_thread_replaced_while_asked_if_closed(tt: bucketimer.TimerThread) -> None:
    """The C wrapper asks a stand-in TimerThread (not the core's) whether it
    is closed: Python code, which here calls the wrapper again, and that
    nested call finds it closed and takes a new one from ``timers()``,
    dropping the wrapper's reference to the first.  The outer call still
    arms on the first, which it holds."""
    from bucketimer import _core

    made: list[weakref.ref[Any]] = []
    armed: list[tuple[int, bytes]] = []

    class StandInTimers:
        def __init__(self, n: int) -> None:
            self.n = n
            self.asked = 0

        @property
        def closed(self) -> bool:
            self.asked += 1
            if self.n == 0 and self.asked == 1:  # the outer call's question
                return w(b"inner", tagged(b"inner")) != b"inner"
            return self.n == 0  # the nested call's: closed, take another

        def call_at(self, when: float, fn: Any, *args: Any) -> Any:
            armed.append((self.n, args[0]._ctx.tag))
            return tt.call_at(when, fn, *args)

    def timers() -> StandInTimers:
        s = StandInTimers(len(made))
        made.append(weakref.ref(s))  # the wrapper holds the only reference
        return s

    def tagged(tag: bytes) -> StandIn:
        ctx = StandIn(1.0)
        ctx.tag = tag  # type: ignore[attr-defined]
        return ctx

    def behavior(req: bytes, ctx: Any) -> bytes:
        return req

    call_type = _wrapper(behavior, tt, 5.0, 3.0).call_type
    w = _core.GrpcUnary(call_type, behavior, contextvars.ContextVar("d"), timers, 5.0, 3.0)
    assert w(b"first", tagged(b"first")) == b"first"  # timers() -> stand-in 0
    assert w(b"outer", tagged(b"outer")) == b"outer"
    # stand-in 0 armed the first call and, though replaced meanwhile, the
    # outer one; stand-in 1 the nested call
    assert armed == [(0, b"first"), (1, b"inner"), (0, b"outer")]
    gc.collect()
    assert [r() is None for r in made] == [True, False]
    stats = tt.stats()
    assert stats["scheduled"] == stats["cancelled"] == 3
