"""SlowCallInterceptor, client and server: the record at the threshold
(with the stuck handler's stack on the server: its thread's on the sync
server, its await chain on the aio one), the record at the end with the
call's status, the hook, and silence for calls in time."""

from __future__ import annotations

import inspect
import logging
import threading
from typing import Any

import pytest

grpc = pytest.importorskip("grpc")

from _grpc_harness import (  # noqa: E402
    LOGGER,
    SERVICE,
    SHAPES,
    AioBackend,
    Backend,
    SyncBackend,
    is_active,
    stubborn,
    stuck_in_here,
    variant_params,
    wait_for,
)

import bucketimer  # noqa: E402
import bucketimer.grpc as btg  # noqa: E402


def _logged(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [rec for rec in caplog.records if rec.name == LOGGER]


@pytest.mark.parametrize("backend,shape,method", variant_params(), indirect=["backend"])
def test_slow_server_call_logs_stack_while_stuck(backend: Backend, shape: str, method: str,
                                                 caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    reports: list[btg.SlowCall] = []
    seen_while_stuck: list[bool] = []

    async def work(req: bytes, ctx: Any) -> bytes:
        # stays stuck until the slow report arrived (or 2 s)
        await stuck_in_here(lambda: bool(reports), 2.0)
        seen_while_stuck.append(bool(reports))
        return req

    # 0.1 s: time for a streaming handler to write its first response and
    # reach its stuck point, on a loaded machine, before the report.
    ic = backend.mod.SlowCallInterceptor(0.1, on_slow=reports.append)
    with backend.serve(backend.all_shapes("Slow", work), (ic,)) as addr, backend.channel(addr) as ch:
        r = backend.invoke(ch, shape, f"Slow_{method}", payload=b"ok")
        assert wait_for(lambda: len(reports) == 2)
    assert r.code == grpc.StatusCode.OK and r.responses[-1] == b"ok"
    assert seen_while_stuck == [True]  # reported while the handler was stuck
    full = f"/{SERVICE}/Slow_{method}"
    first, last = reports
    assert (first.method, first.side, first.finished) == (full, "server", False)
    assert first.elapsed >= 0.1 and first.code is None
    assert first.stack is not None and "stuck_in_here" in first.stack
    assert (last.method, last.finished, last.code) == (full, True, grpc.StatusCode.OK)
    assert last.elapsed >= first.elapsed and last.stack is None
    recs = _logged(caplog)
    assert [rec.levelno for rec in recs] == [logging.WARNING, logging.INFO]  # one warning
    assert full in recs[0].getMessage() and "still running" in recs[0].getMessage()
    assert "stuck_in_here" in (recs[0].stack_info or "")  # the stack beside the one-line message
    assert "finished" in recs[1].getMessage() and "OK" in recs[1].getMessage()
    assert recs[1].grpc_elapsed >= 0.1  # type: ignore[attr-defined]


def test_slow_server_call_reports_its_status(backend: Backend, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    reports: list[btg.SlowCall] = []

    async def work(req: bytes, ctx: Any) -> bytes:
        await stuck_in_here(lambda: bool(reports), 2.0)
        aborted = ctx.abort(grpc.StatusCode.NOT_FOUND, "gone")
        if inspect.isawaitable(aborted):  # aio
            await aborted
        raise AssertionError("unreachable")

    ic = backend.mod.SlowCallInterceptor(0.03, on_slow=reports.append)
    with backend.serve(backend.all_shapes("Slow", work), (ic,)) as addr, backend.channel(addr) as ch:
        r = backend.invoke(ch, "unary_unary", "Slow_unary_unary")
        assert wait_for(lambda: len(reports) == 2)
    assert r.code == grpc.StatusCode.NOT_FOUND
    assert reports[1].code == grpc.StatusCode.NOT_FOUND
    assert "NOT_FOUND" in _logged(caplog)[-1].getMessage()


@pytest.mark.parametrize("shape", SHAPES)
def test_fast_call_logs_nothing(backend: Backend, shape: str, caplog: pytest.LogCaptureFixture,
                                tt: bucketimer.TimerThread) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    reports: list[Any] = []

    async def echo(req: bytes, ctx: Any) -> bytes:
        return req

    ic = backend.mod.SlowCallInterceptor(5.0, on_slow=reports.append, timer_thread=tt)
    with backend.serve(backend.all_shapes("Echo", echo), (ic,)) as addr, backend.channel(addr, ic) as ch:
        r = backend.invoke(ch, shape, f"Echo_{shape}")
        assert wait_for(lambda: tt.stats()["cancelled"] == 2)
    assert r.code == grpc.StatusCode.OK
    stats = tt.stats()
    assert stats["scheduled"] == 2 and stats["cancelled"] == 2 and stats["fired"] == 0  # client + server
    assert reports == [] and not caplog.records


@pytest.mark.parametrize("shape", SHAPES)
def test_slow_client_call(backend: Backend, shape: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    reports: list[btg.SlowCall] = []

    async def work(req: bytes, ctx: Any) -> bytes:
        await stuck_in_here(lambda: bool(reports), 2.0)
        return req

    ic = backend.mod.SlowCallInterceptor(0.05, on_slow=reports.append)
    with backend.serve(backend.all_shapes("Slow", work)) as addr, backend.channel(addr, ic) as ch:
        r = backend.invoke(ch, shape, f"Slow_{shape}")
        assert wait_for(lambda: len(reports) == 2)
    assert r.code == grpc.StatusCode.OK
    first, last = reports
    full = f"/{SERVICE}/Slow_{shape}"
    assert (first.method, first.side, first.finished, first.stack) == (full, "client", False, None)
    assert (last.method, last.side, last.finished, last.code) == (full, "client", True, grpc.StatusCode.OK)
    assert last.elapsed >= 0.05
    msgs = [rec.getMessage() for rec in _logged(caplog)]
    assert len(msgs) == 2 and "client" in msgs[0] and full in msgs[1] and "finished" in msgs[1]


def test_slow_client_call_that_fails(backend: Backend, caplog: pytest.LogCaptureFixture,
                                     stop: threading.Event) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    reports: list[btg.SlowCall] = []

    async def work(req: bytes, ctx: Any) -> bytes:
        await stuck_in_here(lambda: stop.is_set() or not is_active(ctx), 2.0)
        return req

    m = backend.mod
    with backend.serve(backend.all_shapes("Hang", work)) as addr, \
            backend.channel(addr, m.SlowCallInterceptor(0.03, on_slow=reports.append),
                            m.DefaultTimeoutInterceptor(0.12)) as ch:
        r = backend.invoke(ch, "unary_unary", "Hang_unary_unary")
        assert wait_for(lambda: len(reports) == 2)
    assert r.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert reports[1].code == grpc.StatusCode.DEADLINE_EXCEEDED and reports[1].elapsed >= 0.1


def test_on_slow_hook_errors_are_logged(backend: Backend, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    calls: list[Any] = []

    def hook(info: btg.SlowCall) -> None:
        calls.append(info)
        raise RuntimeError("hook bug")

    async def work(req: bytes, ctx: Any) -> bytes:
        await stuck_in_here(lambda: bool(calls), 2.0)
        return req

    with backend.serve(backend.all_shapes("Slow", work), (backend.mod.SlowCallInterceptor(0.02, on_slow=hook),)) \
            as addr, backend.channel(addr) as ch:
        r = backend.invoke(ch, "unary_unary", "Slow_unary_unary")
        assert wait_for(lambda: len(calls) == 2)
    assert r.code == grpc.StatusCode.OK
    # (the hook's error is logged after it returns: the second may still be
    # on its way when the second call is seen)
    assert wait_for(lambda: sum("hook bug" in (rec.exc_text or str(rec.exc_info))
                                for rec in caplog.records) == 2)


TOGETHER = [pytest.param(b, m, id=f"{b}-{m}")
            for b, cls in (("sync", SyncBackend), ("aio", AioBackend))
            for m in ("unary_unary", "unary_stream", "unary_stream_writer")
            if m in {suffix for _, suffix in cls.variants}]


@pytest.mark.parametrize("slow_first", [True, False], ids=["slow-outer", "slow-inner"])
@pytest.mark.parametrize("backend,method", TOGETHER, indirect=["backend"])
def test_deadline_and_slow_interceptors_together(backend: Backend, method: str, slow_first: bool,
                                                 stop: threading.Event) -> None:
    log: list[Any] = []
    reports: list[btg.SlowCall] = []
    events: list[btg.DeadlineEvent] = []
    m = backend.mod
    # The threshold leaves the handler time to reach its stuck point (a
    # streaming one first writes a response) on a loaded machine.
    ics = [m.SlowCallInterceptor(0.1, on_slow=reports.append),
           m.ServerDeadlineInterceptor(0.3, on_deadline=events.append)]
    if not slow_first:
        ics.reverse()
    shape = method.removesuffix("_writer")
    with backend.serve(backend.all_shapes("Stub", stubborn(log, stop)), tuple(ics)) as addr, \
            backend.channel(addr) as ch:
        r = backend.invoke(ch, shape, f"Stub_{method}")
        assert wait_for(lambda: len(reports) == 2 and len(log) == 2)
    assert r.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert r.responses == ([b"first"] if shape == "unary_stream" else [])
    assert [x.finished for x in reports] == [False, True]
    # the handler's frames, stuck where it waits
    assert "work" in (reports[0].stack or "") and "stuck_in_here" in (reports[0].stack or "")
    # either way round, the slow call's end reports the call's real status;
    # an outer slow call's clock starts first, so it ran at least the budget;
    # an inner one's starts after the deadline's set-up, which a loaded
    # machine stretches by whole scheduler slices (29 ms seen, with the GIL
    # handed to grpc's threads in between), so only most of it is certain
    assert reports[1].code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert reports[1].elapsed >= (0.3 if slow_first else 0.2)
    # reported by the timer's thread after it ended the call, maybe after
    # the handler's end was (sync)
    assert wait_for(lambda: len(events) == 1)

