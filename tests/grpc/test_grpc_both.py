"""SlowCallInterceptor around ServerDeadlineInterceptor served in one
wrapper, and ServerDeadlineSlowCallInterceptor (docs/grpc.rst, "Both at
once"): one timer per call, re-armed from the earlier of the threshold and
the deadline to the later; the handler's context still answers for the
budget; the live stack is read only when a call turns slow."""

from __future__ import annotations

import asyncio
import sys
import threading
from typing import Any

import pytest

grpc = pytest.importorskip("grpc")

from _grpc_harness import (  # noqa: E402
    SERVICE,
    Backend,
    SyncBackend,
    stubborn,
    stuck_in_here,
    wait_for,
)

import bucketimer  # noqa: E402
import bucketimer.grpc as btg  # noqa: E402
import bucketimer.grpc.aio as bta  # noqa: E402

ORDERS = ["slow-outer", "combined"]


def _pair(backend: Backend, order: str, threshold: float, max_time: float | None, **kw: Any) -> tuple[Any, ...]:
    """The interceptors of one server: the two listed slow-call first,
    listed the other way round, or the combined class."""
    m = backend.mod
    tt = kw.pop("timer_thread", None)
    slow_kw = {k: kw.pop(k) for k in ("on_slow", "stack") if k in kw}
    if order == "combined":
        return (m.ServerDeadlineSlowCallInterceptor(threshold, max_time, timer_thread=tt, **slow_kw, **kw),)
    slow = m.SlowCallInterceptor(threshold, timer_thread=tt, **slow_kw)
    deadline = m.ServerDeadlineInterceptor(max_time, timer_thread=tt, **kw)
    return (slow, deadline) if order == "slow-outer" else (deadline, slow)


def _served_in_one(backend: Backend, suffix: str) -> bool:
    """Calls of this method variant are served by one wrapper: unary-unary
    calls (a streaming one has its waits for the client left out of the
    slow call's time, and its stream ended with the budget)."""
    return suffix == "unary_unary"


@pytest.mark.parametrize("order", [*ORDERS, "slow-inner"])
def test_a_call_in_time_arms_one_timer(backend: Backend, order: str, tt: bucketimer.TimerThread) -> None:
    seen: list[Any] = []

    async def work(req: bytes, ctx: Any) -> bytes:
        seen.append((ctx.time_remaining(), btg.remaining(), btg.current_deadline()))
        return req

    ics = _pair(backend, order, 5.0, 3.0, timer_thread=tt)
    expected = 0
    with backend.serve(backend.all_shapes("Echo", work), ics) as addr, backend.channel(addr) as ch:
        for shape, suffix in backend.variants:
            r = backend.invoke(ch, shape, f"Echo_{suffix}", timeout=10.0)
            assert r.code == grpc.StatusCode.OK, (suffix, r)
            expected += 1 if order != "slow-inner" and _served_in_one(backend, suffix) else 2
            assert wait_for(lambda n=expected: tt.stats()["cancelled"] == n), (suffix, tt.stats())
    stats = tt.stats()
    assert stats["scheduled"] == expected and stats["fired"] == 0
    # the handler's context and remaining() count against the budget (max_time 3 s)
    assert len(seen) == len(backend.variants)
    for ctx_left, left, deadline in seen:
        assert 2.0 < ctx_left <= 3.0 and 2.0 < left <= 3.0 and deadline is not None


@pytest.mark.parametrize("order", ORDERS)
def test_one_timer_reports_slow_then_rearms_for_the_deadline(backend: Backend, order: str,
                                                             tt: bucketimer.TimerThread,
                                                             stop: threading.Event) -> None:
    log: list[Any] = []
    reports: list[btg.SlowCall] = []
    events: list[btg.DeadlineEvent] = []
    ics = _pair(backend, order, 0.1, 0.3, timer_thread=tt, on_slow=reports.append,
                on_deadline=events.append)
    with backend.serve(backend.all_shapes("Stub", stubborn(log, stop)), ics) as addr, \
            backend.channel(addr) as ch:
        r = backend.invoke(ch, "unary_unary", "Stub_unary_unary")
        assert wait_for(lambda: len(reports) == 2 and len(events) == 1)
    assert r.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert [x.finished for x in reports] == [False, True]
    assert "stuck_in_here" in (reports[0].stack or "")
    assert reports[0].elapsed >= 0.1 and reports[1].elapsed >= 0.3
    assert reports[1].code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert (events[0].source, events[0].budget) == ("max_time", 0.3) and events[0].elapsed >= 0.3
    # the threshold's timer, then the deadline's: both fired, nothing else armed
    assert wait_for(lambda: tt.stats()["fired"] == 2)
    assert tt.stats()["scheduled"] == 2


@pytest.mark.parametrize("order", ORDERS)
def test_a_deadline_before_the_threshold_rearms_for_the_threshold(backend: Backend, order: str,
                                                                  tt: bucketimer.TimerThread) -> None:
    reports: list[btg.SlowCall] = []
    events: list[btg.DeadlineEvent] = []

    async def work(req: bytes, ctx: Any) -> bytes:
        # runs on past its budget (an aio handler swallows its cancellation)
        # until the slow-call report arrived
        for _ in range(3):
            try:
                await stuck_in_here(lambda: bool(reports), 2.0)
            except asyncio.CancelledError:
                continue
            break
        return req

    ics = _pair(backend, order, 0.3, 0.1, timer_thread=tt, on_slow=reports.append,
                on_deadline=events.append)
    with backend.serve(backend.all_shapes("Late", work), ics) as addr, backend.channel(addr) as ch:
        r = backend.invoke(ch, "unary_unary", "Late_unary_unary")
        assert wait_for(lambda: len(reports) == 2)
    assert r.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert len(events) == 1 and events[0].source == "max_time"
    first, last = reports
    assert not first.finished and first.elapsed >= 0.3 and "stuck_in_here" in (first.stack or "")
    assert last.finished and last.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert tt.stats()["scheduled"] == tt.stats()["fired"] == 2


@pytest.mark.parametrize("order", ORDERS)
def test_no_budget_keeps_the_threshold(backend: Backend, order: str, tt: bucketimer.TimerThread) -> None:
    reports: list[btg.SlowCall] = []
    seen: list[Any] = []

    async def work(req: bytes, ctx: Any) -> bytes:
        seen.append((backend.no_deadline(ctx.time_remaining()), btg.remaining()))
        await stuck_in_here(lambda: bool(reports), 2.0)
        return req

    ics = _pair(backend, order, 0.05, None, timer_thread=tt, on_slow=reports.append)
    with backend.serve(backend.all_shapes("Slow", work), ics) as addr, backend.channel(addr) as ch:
        r = backend.invoke(ch, "unary_unary", "Slow_unary_unary")
        assert wait_for(lambda: len(reports) == 2)
    assert r.code == grpc.StatusCode.OK
    assert seen == [(True, None)]  # the handler got grpc's own context: no budget
    assert [x.finished for x in reports] == [False, True] and reports[1].code == grpc.StatusCode.OK
    assert tt.stats()["scheduled"] == 1  # the threshold only: nothing to re-arm for


@pytest.mark.parametrize("order", ORDERS)
def test_the_stack_is_read_only_when_a_call_turns_slow(backend: Backend, order: str,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    reads: list[int] = []
    if isinstance(backend, SyncBackend):
        frames = sys._current_frames
        monkeypatch.setattr(sys, "_current_frames", lambda: (reads.append(1), frames())[1])
    else:
        await_stack = bta._await_stack
        monkeypatch.setattr(bta, "_await_stack",
                            lambda obj, limit: (reads.append(1), await_stack(obj, limit))[1])
    reports: list[btg.SlowCall] = []

    async def work(req: bytes, ctx: Any) -> bytes:
        if req == b"slow":
            await stuck_in_here(lambda: bool(reports), 2.0)
        return req

    ics = _pair(backend, order, 0.1, 30.0, on_slow=reports.append)
    with backend.serve(backend.all_shapes("Echo", work), ics) as addr, backend.channel(addr) as ch:
        for _ in range(5):
            assert backend.invoke(ch, "unary_unary", "Echo_unary_unary").code == grpc.StatusCode.OK
        assert reads == []  # calls in time: no stack read
        r = backend.invoke(ch, "unary_unary", "Echo_unary_unary", payload=b"slow")
        assert wait_for(lambda: len(reports) == 2)
    assert r.code == grpc.StatusCode.OK
    assert len(reads) == 1 and "stuck_in_here" in (reports[0].stack or "")
    assert reports[0].method == f"/{SERVICE}/Echo_unary_unary"


def test_combined_interceptor_arguments(backend: Backend) -> None:
    m = backend.mod
    ic = m.ServerDeadlineSlowCallInterceptor(0.5, 2.0, stack=False)
    assert isinstance(ic, grpc.ServerInterceptor if isinstance(backend, SyncBackend) else grpc.aio.ServerInterceptor)
    assert isinstance(ic.slow_call_interceptor, m.SlowCallInterceptor)
    assert isinstance(ic.deadline_interceptor, m.ServerDeadlineInterceptor)
    assert ic.slow_call_interceptor.threshold == 0.5 and ic.deadline_interceptor._max_time == 2.0
    assert "threshold=0.5" in repr(ic) and "max_time=2.0" in repr(ic)
    with pytest.raises(ValueError):
        m.ServerDeadlineSlowCallInterceptor(-1.0)
    with pytest.raises(TypeError):
        m.ServerDeadlineSlowCallInterceptor(1.0, "2")
    with pytest.raises(TypeError):
        m.ServerDeadlineSlowCallInterceptor(1.0, on_slow=42)


def test_combined_interceptor_interrupt_mode() -> None:
    # interrupt mode: the two wrappers as listed (their windows are not fused)
    ic = btg.ServerDeadlineSlowCallInterceptor(1.0, 2.0, interrupt=True)
    assert ic.deadline_interceptor._interrupt
    with pytest.raises(TypeError):
        bta.ServerDeadlineSlowCallInterceptor(1.0, 2.0, interrupt=True)  # type: ignore[call-arg]
