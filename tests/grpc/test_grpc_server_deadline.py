"""ServerDeadlineInterceptor: on the wire, the status the client gets and
when; what the handler sees (``is_active()`` turning false on the sync
server, a cancellation on the aio one; ``time_remaining()``,
``remaining()``); the hook and the log record; what a call in time costs."""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
import types
from typing import Any

import pytest

grpc = pytest.importorskip("grpc")

from _grpc_harness import (  # noqa: E402
    ENDED,
    LOGGER,
    SERVICE,
    SHAPES,
    Backend,
    is_active,
    stubborn,
    variant_params,
    wait_for,
)

import bucketimer  # noqa: E402
import bucketimer.grpc as btg  # noqa: E402


def assert_stopped(backend: Backend, entry: tuple[Any, ...], low: float) -> None:
    """How the handler learnt that its budget ran out: ``low`` s or more
    after it started (the clock it reads is started before the budget left
    is read, so a ``low`` of that budget proves nothing stopped it early)."""
    if backend.name == "sync":
        _, active, _, since_start = entry
        assert active is False and low <= since_start < ENDED, entry
    else:
        assert entry[0] == "cancelled" and low <= entry[1] < ENDED, entry


@pytest.mark.parametrize("backend,shape,method", variant_params(), indirect=["backend"])
def test_max_time_gives_client_deadline_exceeded_promptly(backend: Backend, shape: str, method: str,
                                                          stop: threading.Event) -> None:
    log: list[Any] = []
    events: list[btg.DeadlineEvent] = []
    ic = backend.mod.ServerDeadlineInterceptor(0.1, on_deadline=events.append, details="budget gone")
    with backend.serve(backend.all_shapes("Stub", stubborn(log, stop)), (ic,)) as addr, \
            backend.channel(addr) as ch:
        r = backend.invoke(ch, shape, f"Stub_{method}", timeout=10.0)
        assert wait_for(lambda: len(log) == 2 and events)
    # the client: DEADLINE_EXCEEDED, not CANCELLED and not a hang (grpc/grpc#29248 on aio)
    assert r.code == grpc.StatusCode.DEADLINE_EXCEEDED, r
    assert r.details == "budget gone"
    assert 0.09 <= r.elapsed < ENDED, r
    if shape in ("unary_stream", "stream_stream"):
        assert r.responses == [b"first"]  # the partial stream, then the status
    # the handler: active at first with the server's budget, then stopped
    _, active0, time_left, rem = log[0]
    assert active0 is True and 0.0 < time_left <= 0.1 and 0.0 < rem <= 0.1
    assert_stopped(backend, log[1], time_left)
    # the hook
    (ev,) = events
    assert ev.method == f"/{SERVICE}/Stub_{method}"
    assert ev.source == "max_time" and ev.budget == 0.1  # exactly max_time
    assert ev.elapsed >= 0.1
    assert (ev.interrupted, ev.cancelled) == (False, backend.name == "aio")


@pytest.mark.parametrize("shape", SHAPES)
# The server's timer fires a few ms either side of grpc marking the call
# inactive (or cancels the aio handler) at the client's deadline; the
# handler goes on until the timer has fired, so that grpc winning that race
# does not end the call first (an ASan build on a loaded machine lost it).  The handler's thread
# spins with the GIL: the native core fires without it, the pure backend's
# thread needs it (docs/guarantees.rst, "On the pure-Python backend").
@pytest.mark.native
def test_client_deadline_is_the_budget_when_smaller(backend: Backend, shape: str, stop: threading.Event) -> None:
    log: list[Any] = []
    events: list[btg.DeadlineEvent] = []
    ic = backend.mod.ServerDeadlineInterceptor(5.0, on_deadline=events.append)
    with backend.serve(backend.all_shapes("Stub", stubborn(log, stop, until=lambda: events)), (ic,)) \
            as addr, backend.channel(addr) as ch:
        r = backend.invoke(ch, shape, f"Stub_{shape}", timeout=0.15)
        assert wait_for(lambda: len(log) == 2 and events)
    assert r.code in backend.deadline_codes(shape), r
    assert 0.14 <= r.elapsed < ENDED, r
    assert 0.0 < log[0][2] <= 0.17  # time_remaining(): the client's deadline
    assert_stopped(backend, log[1], 0.0)
    assert events[0].source == "client"
    # what was left of the client's 0.15 s when the call reached the server
    assert 0.0 < events[0].budget <= 0.152


@pytest.mark.parametrize("backend", ["aio"], indirect=True)
def test_handler_that_swallows_the_cancel_still_ends_with_deadline_exceeded(backend: Backend) -> None:
    log: list[Any] = []
    CLEANUP = 0.5

    async def work(req: bytes, ctx: Any) -> bytes:
        try:
            await asyncio.sleep(3.0)
        except asyncio.CancelledError:
            log.append("swallowed")
            await asyncio.sleep(CLEANUP)  # some cleanup first
        log.append("returned")
        return b"late"

    with backend.serve(backend.all_shapes("Swallow", work), (backend.mod.ServerDeadlineInterceptor(0.05),)) \
            as addr, backend.channel(addr) as ch:
        r = backend.invoke(ch, "unary_unary", "Swallow_unary_unary")
        assert wait_for(lambda: len(log) == 2)
    assert log == ["swallowed", "returned"]
    assert r.code == grpc.StatusCode.DEADLINE_EXCEEDED and r.responses == []
    # the status was sent at the deadline: the client did not wait for the handler
    assert 0.05 <= r.elapsed < CLEANUP, r


def test_deadline_event_is_logged(backend: Backend, caplog: pytest.LogCaptureFixture,
                                  stop: threading.Event) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    with backend.serve(backend.all_shapes("Stub", stubborn([], stop)),
                       (backend.mod.ServerDeadlineInterceptor(0.05),)) as addr, backend.channel(addr) as ch:
        r = backend.invoke(ch, "unary_unary", "Stub_unary_unary")
        assert wait_for(lambda: any("budget" in rec.getMessage() for rec in caplog.records))
    assert r.code == grpc.StatusCode.DEADLINE_EXCEEDED
    (rec,) = [rec for rec in caplog.records if rec.name == LOGGER]
    msg = rec.getMessage()
    assert rec.levelno == logging.WARNING  # seen by a default-configured service
    assert f"/{SERVICE}/Stub_unary_unary" in msg and "max_time" in msg
    assert rec.grpc_method == f"/{SERVICE}/Stub_unary_unary"  # type: ignore[attr-defined]
    assert ("(handler cancelled)" in msg) == (backend.name == "aio")


@pytest.mark.parametrize("backend,shape,method", variant_params(), indirect=["backend"])
def test_call_in_time_costs_one_schedule_and_cancel(backend: Backend, shape: str, method: str,
                                                    tt: bucketimer.TimerThread,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    events: list[Any] = []
    seen: list[Any] = []
    api = grpc if backend.name == "sync" else grpc.aio

    async def work(req: bytes, ctx: Any) -> bytes:
        seen.append((is_active(ctx), btg.remaining(), isinstance(ctx, api.ServicerContext)))
        return req

    ic = backend.mod.ServerDeadlineInterceptor(5.0, on_deadline=events.append, timer_thread=tt)
    with backend.serve(backend.all_shapes("Echo", work), (ic,)) as addr, backend.channel(addr) as ch:
        before = tt.stats()
        results = [backend.invoke(ch, shape, f"Echo_{method}", payload=b"p%d" % i) for i in range(5)]
        after = tt.stats()
    assert all(r.code == grpc.StatusCode.OK for r in results), results
    assert [r.responses[-1] for r in results] == [b"p%d" % i for i in range(5)]
    assert after["scheduled"] - before["scheduled"] == 5
    assert after["cancelled"] - before["cancelled"] == 5
    assert after["fired"] == before["fired"]
    assert events == [] and not caplog.records
    assert len(seen) == 5
    assert all(active and 4.0 < rem <= 5.0 and is_context for active, rem, is_context in seen)


def test_no_budget_schedules_no_timer(backend: Backend, tt: bucketimer.TimerThread) -> None:
    seen: list[Any] = []

    async def work(req: bytes, ctx: Any) -> bytes:
        seen.append(btg.remaining())
        return req

    stream_stream = backend.variants[-1][1]  # aio: the context.write() API
    with backend.serve(backend.all_shapes("Echo", work),
                       (backend.mod.ServerDeadlineInterceptor(timer_thread=tt),)) as addr, \
            backend.channel(addr) as ch:
        results = [backend.invoke(ch, "unary_stream", "Echo_unary_stream"),
                   backend.invoke(ch, "stream_stream", f"Echo_{stream_stream}"),
                   backend.invoke(ch, "unary_unary", "Echo_unary_unary", timeout=5.0)]
    assert [r.responses for r in results] == [[b"first", b"x"], [b"first", b"x"], [b"x"]]
    assert seen[:2] == [None, None] and 4.0 < seen[2] <= 5.1
    assert tt.stats()["scheduled"] == 1


def test_handler_errors_and_aborts_pass_through(backend: Backend) -> None:
    async def boom(req: bytes, ctx: Any) -> bytes:
        raise ValueError("boom")

    async def aborting(req: bytes, ctx: Any) -> bytes:
        aborted = ctx.abort(grpc.StatusCode.NOT_FOUND, "nope")
        if inspect.isawaitable(aborted):  # aio
            await aborted
        raise AssertionError("unreachable")

    handlers = {**backend.all_shapes("Boom", boom), **backend.all_shapes("Abort", aborting)}
    with backend.serve(handlers, (backend.mod.ServerDeadlineInterceptor(5.0),)) as addr, \
            backend.channel(addr) as ch:
        for shape, method in backend.variants:
            r = backend.invoke(ch, shape, f"Boom_{method}")
            assert r.code == grpc.StatusCode.UNKNOWN and "boom" in (r.details or ""), r
            r = backend.invoke(ch, shape, f"Abort_{method}")
            assert r.code == grpc.StatusCode.NOT_FOUND and r.details == "nope", r


@pytest.mark.parametrize("backend", ["aio"], indirect=True)
def test_plain_function_handlers_on_an_aio_server_are_left_alone(backend: Backend) -> None:
    def sync_echo(req: bytes, ctx: Any) -> bytes:
        return req

    m = backend.mod
    with backend.serve({"Sync": grpc.unary_unary_rpc_method_handler(sync_echo)},
                       (m.ServerDeadlineInterceptor(1.0), m.SlowCallInterceptor(1.0))) as addr, \
            backend.channel(addr) as ch:
        r = backend.invoke(ch, "unary_unary", "Sync", payload=b"plain")
    assert r.code == grpc.StatusCode.OK and r.responses == [b"plain"]


def test_a_closed_default_timer_thread_is_replaced(backend: Backend) -> None:
    # The interceptors keep the TimerThread they use; when the default one is
    # closed (as after fork()), the next call finds the new default.
    seen: list[Any] = []

    async def work(req: bytes, ctx: Any) -> bytes:
        seen.append(btg.remaining())
        return req

    m = backend.mod
    ics = (m.SlowCallInterceptor(5.0), m.ServerDeadlineInterceptor(5.0))
    with backend.serve(backend.all_shapes("Echo", work), ics) as addr, backend.channel(addr) as ch:
        assert backend.invoke(ch, "unary_unary", "Echo_unary_unary").code == grpc.StatusCode.OK
        old = bucketimer.default_timer_thread()
        old.close()
        r = backend.invoke(ch, "unary_unary", "Echo_unary_unary")
        new = bucketimer.default_timer_thread()
    assert r.code == grpc.StatusCode.OK, r
    assert new is not old and not new.closed
    # the pair serves a unary call on one timer, re-armed only past the threshold
    assert new.stats()["scheduled"] == new.stats()["cancelled"] == 1
    assert len(seen) == 2 and all(4.0 < rem <= 5.0 for rem in seen)


def _call_classes() -> set[type]:
    """Every per-method call class made so far (the backends' subclasses)."""
    out: set[type] = set()
    todo: list[type] = [btg._common._DeadlineCall, btg._common._NativeCallMethods]
    while todo:
        for sub in todo.pop().__subclasses__():
            if sub not in out:
                out.add(sub)
                todo.append(sub)
    return out


@pytest.mark.parametrize("per_call", ["handler", "behaviour"])
def test_wrapping_is_kept_whatever_an_inner_interceptor_returns(backend: Backend, per_call: str) -> None:
    # An interceptor listed after bucketimer's that returns a new handler per
    # call (grpc's usual way to write one): the same behaviour is wrapped
    # once; a new behaviour per call gets a new wrapper, but never a new
    # class (a class per call is freed only by the cyclic GC)
    m = backend.mod

    async def echo(req: bytes, ctx: Any) -> bytes:
        return req

    def inner(details: Any) -> Any:
        if per_call == "handler":
            return grpc.unary_unary_rpc_method_handler(echo)

        async def fresh(req: bytes, ctx: Any) -> bytes:  # a new closure, as a wrapper makes one
            return await echo(req, ctx)
        return grpc.unary_unary_rpc_method_handler(fresh)

    async def inner_aio(details: Any) -> Any:
        return inner(details)

    details = types.SimpleNamespace(method=f"/{SERVICE}/Echo", invocation_metadata=())
    ics = [m.ServerDeadlineInterceptor(5.0), m.SlowCallInterceptor(5.0),
           m.ServerDeadlineSlowCallInterceptor(5.0, 10.0)]

    def through(ic: Any) -> Any:
        if backend.name == "sync":
            return ic.intercept_service(inner, details)
        return asyncio.run(ic.intercept_service(inner_aio, details))

    for ic in ics:
        through(ic)  # the method's classes, made once
    classes = _call_classes()
    behaviours = [[through(ic).unary_unary for _ in range(50)] for ic in ics]
    assert _call_classes() == classes
    if per_call == "handler":
        assert all(len({id(b) for b in bs}) == 1 for bs in behaviours)
