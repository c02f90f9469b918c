"""bucketimer.grpc.aio (grpc.aio): real servers on 127.0.0.1, real clients.

The aio counterparts of test_grpc_sync.py: status codes and client wait
times, what the handler saw (its cancellation, ``time_remaining()``,
``remaining()``), log records and hooks, timer costs, and timeouts observed
by a downstream server -- for the four call shapes with async handlers
(async generators and the ``context.write()`` API for streaming responses).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

grpc = pytest.importorskip("grpc")
pytest.importorskip("grpc.aio")

import bucketimer  # noqa: E402
import bucketimer.grpc as btg  # noqa: E402
import bucketimer.grpc.aio as bta  # noqa: E402

SERVICE = "bt.AioTest"
SHAPES = ("unary_unary", "unary_stream", "stream_unary", "stream_stream")
LOGGER = "bucketimer.grpc"

Work = Callable[[bytes, Any], Awaitable[bytes]]


# -- harness -------------------------------------------------------------------------


def shaped(shape: str, work: Work, *, writer: bool = False) -> Any:
    """An async method handler of ``shape`` doing ``await work(request, ctx)``.

    Streaming responses first send ``b"first"``; with ``writer=True`` they
    use ``context.write()`` instead of an async generator.
    """
    if shape == "unary_unary":
        async def uu(req: bytes, ctx: Any) -> bytes:
            return await work(req, ctx)
        return grpc.unary_unary_rpc_method_handler(uu)
    if shape == "stream_unary":
        async def su(it: Any, ctx: Any) -> bytes:
            return await work(b"".join([r async for r in it]), ctx)
        return grpc.stream_unary_rpc_method_handler(su)
    streaming_requests = shape == "stream_stream"

    async def request_of(req: Any) -> bytes:
        return b"".join([r async for r in req]) if streaming_requests else req

    if writer:
        async def write_api(req: Any, ctx: Any) -> None:
            data = await request_of(req)
            await ctx.write(b"first")
            await ctx.write(await work(data, ctx))
        behavior: Any = write_api
    else:
        async def gen_api(req: Any, ctx: Any) -> AsyncIterator[bytes]:
            data = await request_of(req)
            yield b"first"
            yield await work(data, ctx)
        behavior = gen_api
    if streaming_requests:
        return grpc.stream_stream_rpc_method_handler(behavior)
    return grpc.unary_stream_rpc_method_handler(behavior)


def all_shapes(name: str, work: Work) -> dict[str, Any]:
    handlers = {f"{name}_{shape}": shaped(shape, work) for shape in SHAPES}
    for shape in ("unary_stream", "stream_stream"):
        handlers[f"{name}_{shape}_writer"] = shaped(shape, work, writer=True)
    return handlers


#: (shape, method suffix): the four shapes, plus the write() API for streams.
VARIANTS = [(s, s) for s in SHAPES] + [("unary_stream", "unary_stream_writer"),
                                       ("stream_stream", "stream_stream_writer")]
VARIANT_IDS = [v[1] for v in VARIANTS]


class Result:
    def __init__(self, responses: list[bytes], code: Any, details: str | None, elapsed: float) -> None:
        self.responses, self.code, self.details, self.elapsed = responses, code, details, elapsed

    def __repr__(self) -> str:
        return f"Result({self.responses!r}, {self.code}, {self.details!r}, {self.elapsed:.3f}s)"


async def invoke(channel: Any, shape: str, method: str, payload: bytes = b"x",
                 timeout: float | None = None) -> Result:
    """Calls ``/SERVICE/method`` in ``shape``; never raises RpcError."""
    path = f"/{SERVICE}/{method}"
    got: list[bytes] = []

    async def requests() -> AsyncIterator[bytes]:
        yield payload

    t0 = time.monotonic()
    try:
        if shape == "unary_unary":
            got.append(await channel.unary_unary(path)(payload, timeout=timeout))
        elif shape == "unary_stream":
            async for r in channel.unary_stream(path)(payload, timeout=timeout):
                got.append(r)
        elif shape == "stream_unary":
            got.append(await channel.stream_unary(path)(requests(), timeout=timeout))
        else:
            async for r in channel.stream_stream(path)(requests(), timeout=timeout):
                got.append(r)
        code, details = grpc.StatusCode.OK, None
    except grpc.RpcError as e:
        code, details = e.code(), e.details()
    return Result(got, code, details, time.monotonic() - t0)


@contextlib.asynccontextmanager
async def serve(handlers: dict[str, Any], interceptors: tuple[Any, ...] = ()) -> AsyncIterator[str]:
    server = grpc.aio.server(interceptors=list(interceptors))
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, handlers)])
    port = server.add_insecure_port("127.0.0.1:0")
    assert port
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


@contextlib.asynccontextmanager
async def channel(address: str, *interceptors: Any) -> AsyncIterator[Any]:
    ics = bta.client_interceptors(*interceptors) if interceptors else None
    async with grpc.aio.insecure_channel(address, interceptors=ics) as ch:
        yield ch


async def until(pred: Callable[[], Any], timeout: float = 3.0) -> bool:
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            return bool(pred())
        await asyncio.sleep(0.001)
    return True


def run(coro_fn: Callable[[], Awaitable[Any]], timeout: float = 20.0) -> Any:
    async def main() -> Any:
        return await asyncio.wait_for(coro_fn(), timeout)
    return asyncio.run(main())


async def echo(req: bytes, ctx: Any) -> bytes:
    return req


# -- import and arguments ----------------------------------------------------------------------


def test_aio_module_exports() -> None:
    assert bta.remaining is btg.remaining and bta.SlowCall is btg.SlowCall
    assert isinstance(bta.SlowCallInterceptor(1.0), grpc.aio.ServerInterceptor)
    assert isinstance(bta.DefaultTimeoutInterceptor(1.0), grpc.aio.UnaryUnaryClientInterceptor)
    with pytest.raises(ValueError):
        bta.ServerDeadlineInterceptor(-1.0)
    with pytest.raises(TypeError):
        bta.SlowCallInterceptor("1")
    with pytest.raises(ValueError):
        bta.DefaultTimeoutInterceptor(1.0, margin=float("nan"))


def test_client_interceptors_splits_multi_shape_interceptors() -> None:
    dt, slow = bta.DefaultTimeoutInterceptor(1.0), bta.SlowCallInterceptor(1.0)

    class OnlyStreams(grpc.aio.StreamStreamClientInterceptor):
        async def intercept_stream_stream(self, continuation: Any, details: Any, it: Any) -> Any:
            return await continuation(details, it)

    only = OnlyStreams()
    out = bta.client_interceptors(dt, only, slow)
    assert len(out) == 9 and out[4] is only
    bases = (grpc.aio.UnaryUnaryClientInterceptor, grpc.aio.UnaryStreamClientInterceptor,
             grpc.aio.StreamUnaryClientInterceptor, grpc.aio.StreamStreamClientInterceptor)
    for adapter in out[:4] + out[5:]:
        assert sum(isinstance(adapter, b) for b in bases) == 1  # one shape each
    assert [a.inner for a in out[:4]] == [dt] * 4 and [a.inner for a in out[5:]] == [slow] * 4
    with pytest.raises(TypeError):
        bta.client_interceptors(bta.ServerDeadlineInterceptor(1.0))


# -- DefaultTimeoutInterceptor ------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES)
def test_default_timeout_applies_and_explicit_is_kept(shape: str) -> None:
    seen: list[float | None] = []

    async def work(req: bytes, ctx: Any) -> bytes:
        seen.append(ctx.time_remaining())
        return req

    async def main() -> tuple[Result, Result]:
        async with serve(all_shapes("Seen", work)) as addr, \
                channel(addr, bta.DefaultTimeoutInterceptor(0.25)) as ch:
            return (await invoke(ch, shape, f"Seen_{shape}"),
                    await invoke(ch, shape, f"Seen_{shape}", timeout=30.0))

    r1, r2 = run(main)
    assert r1.code == r2.code == grpc.StatusCode.OK, (r1, r2)
    assert seen[0] is not None and 0.0 < seen[0] <= 0.27
    assert seen[1] is not None and 25.0 < seen[1] <= 30.1


@pytest.mark.parametrize("shape", SHAPES)
def test_default_timeout_expires_a_hanging_call(shape: str) -> None:
    async def work(req: bytes, ctx: Any) -> bytes:
        await asyncio.sleep(3.0)
        return req

    async def main() -> Result:
        async with serve(all_shapes("Hang", work)) as addr, \
                channel(addr, bta.DefaultTimeoutInterceptor(0.15)) as ch:
            return await invoke(ch, shape, f"Hang_{shape}")

    r = run(main)
    assert r.code == grpc.StatusCode.DEADLINE_EXCEEDED, r
    assert 0.14 <= r.elapsed < 1.5, r


# -- ServerDeadlineInterceptor -------------------------------------------------------------


def _sleeper(log: list[Any], limit: float = 3.0) -> Work:
    async def work(req: bytes, ctx: Any) -> bytes:
        t0 = time.monotonic()
        log.append(("start", ctx.time_remaining(), btg.remaining()))
        try:
            await asyncio.sleep(limit)
        except asyncio.CancelledError:
            log.append(("cancelled", time.monotonic() - t0))
            raise
        return b"late"
    return work


@pytest.mark.parametrize("shape,method", VARIANTS, ids=VARIANT_IDS)
def test_max_time_cancels_handler_and_aborts_cleanly(shape: str, method: str) -> None:
    log: list[Any] = []
    events: list[btg.DeadlineEvent] = []
    ic = bta.ServerDeadlineInterceptor(0.1, on_deadline=events.append, details="budget gone")

    async def main() -> Result:
        async with serve(all_shapes("Sleep", _sleeper(log)), (ic,)) as addr, channel(addr) as ch:
            return await invoke(ch, shape, f"Sleep_{method}", timeout=10.0)

    r = run(main)
    # not CANCELLED, not a hang (grpc/grpc#29248): DEADLINE_EXCEEDED at the budget
    assert r.code == grpc.StatusCode.DEADLINE_EXCEEDED, r
    assert r.details == "budget gone"
    assert 0.09 <= r.elapsed < 1.0, r
    if shape in ("unary_stream", "stream_stream"):
        assert r.responses == [b"first"]
    _, time_left, rem = log[0]
    assert 0.0 < time_left <= 0.1 and 0.0 < rem <= 0.1
    assert log[1][0] == "cancelled" and 0.09 <= log[1][1] < 1.0
    (ev,) = events
    assert (ev.method, ev.source, ev.cancelled) == (f"/{SERVICE}/Sleep_{method}", "max_time", True)
    assert ev.budget == 0.1 and ev.elapsed >= 0.1  # budget: exactly max_time


@pytest.mark.parametrize("shape", SHAPES)
def test_client_deadline_is_the_budget_when_smaller(shape: str) -> None:
    log: list[Any] = []
    events: list[btg.DeadlineEvent] = []
    ic = bta.ServerDeadlineInterceptor(5.0, on_deadline=events.append)

    async def main() -> Result:
        async with serve(all_shapes("Sleep", _sleeper(log)), (ic,)) as addr, channel(addr) as ch:
            r = await invoke(ch, shape, f"Sleep_{shape}", timeout=0.15)
            assert await until(lambda: len(log) == 2 and events)
            return r

    r = run(main)
    assert r.code == grpc.StatusCode.DEADLINE_EXCEEDED, r
    assert 0.14 <= r.elapsed < 1.0, r
    assert 0.0 < log[0][1] <= 0.17
    assert log[1][0] == "cancelled" and log[1][1] < 1.0
    assert events[0].source == "client" and events[0].budget == pytest.approx(0.15, abs=0.03)


def test_handler_that_swallows_the_cancel_still_ends_with_deadline_exceeded() -> None:
    log: list[Any] = []

    async def work(req: bytes, ctx: Any) -> bytes:
        try:
            await asyncio.sleep(3.0)
        except asyncio.CancelledError:
            log.append("swallowed")
            await asyncio.sleep(0.1)  # some cleanup first
        return b"late"

    async def main() -> Result:
        async with serve(all_shapes("Swallow", work), (bta.ServerDeadlineInterceptor(0.05),)) as addr, \
                channel(addr) as ch:
            return await invoke(ch, "unary_unary", "Swallow_unary_unary")

    r = run(main)
    assert log == ["swallowed"]
    assert r.code == grpc.StatusCode.DEADLINE_EXCEEDED and r.responses == []
    assert 0.14 <= r.elapsed < 1.0  # the status waits for the handler to return


def test_deadline_event_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)

    async def main() -> Result:
        async with serve(all_shapes("Sleep", _sleeper([])), (bta.ServerDeadlineInterceptor(0.05),)) as addr, \
                channel(addr) as ch:
            return await invoke(ch, "unary_unary", "Sleep_unary_unary")

    r = run(main)
    assert r.code == grpc.StatusCode.DEADLINE_EXCEEDED
    (rec,) = [rec for rec in caplog.records if rec.name == LOGGER]
    msg = rec.getMessage()
    assert rec.levelno == logging.INFO and f"/{SERVICE}/Sleep_unary_unary" in msg
    assert "max_time" in msg and "cancelled" in msg


@pytest.mark.parametrize("shape,method", VARIANTS, ids=VARIANT_IDS)
def test_call_in_time_costs_one_schedule_and_cancel(shape: str, method: str, tt: bucketimer.TimerThread,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    events: list[Any] = []
    seen: list[Any] = []

    async def work(req: bytes, ctx: Any) -> bytes:
        seen.append(btg.remaining())
        return req

    ic = bta.ServerDeadlineInterceptor(5.0, on_deadline=events.append, timer_thread=tt)

    async def main() -> list[Result]:
        async with serve(all_shapes("Echo", work), (ic,)) as addr, channel(addr) as ch:
            return [await invoke(ch, shape, f"Echo_{method}", payload=b"p%d" % i) for i in range(5)]

    before = tt.stats()
    results = run(main)
    after = tt.stats()
    assert all(r.code == grpc.StatusCode.OK for r in results), results
    assert results[3].responses[-1] == b"p3"
    assert after["scheduled"] - before["scheduled"] == 5
    assert after["cancelled"] - before["cancelled"] == 5 and after["fired"] == before["fired"]
    assert events == [] and not caplog.records
    assert all(4.0 < rem <= 5.0 for rem in seen)


def test_no_budget_schedules_no_timer(tt: bucketimer.TimerThread) -> None:
    seen: list[Any] = []

    async def work(req: bytes, ctx: Any) -> bytes:
        seen.append(btg.remaining())
        return req

    async def main() -> list[Result]:
        async with serve(all_shapes("Echo", work), (bta.ServerDeadlineInterceptor(timer_thread=tt),)) as addr, \
                channel(addr) as ch:
            return [await invoke(ch, "unary_stream", "Echo_unary_stream"),
                    await invoke(ch, "stream_stream", "Echo_stream_stream_writer"),
                    await invoke(ch, "unary_unary", "Echo_unary_unary", timeout=5.0)]

    results = run(main)
    assert [r.responses for r in results] == [[b"first", b"x"], [b"first", b"x"], [b"x"]]
    assert seen[:2] == [None, None] and 4.0 < seen[2] <= 5.1
    assert tt.stats()["scheduled"] == 1


def test_handler_errors_and_aborts_pass_through() -> None:
    async def boom(req: bytes, ctx: Any) -> bytes:
        raise ValueError("boom")

    async def aborting(req: bytes, ctx: Any) -> bytes:
        await ctx.abort(grpc.StatusCode.NOT_FOUND, "nope")
        raise AssertionError("unreachable")

    async def main() -> list[tuple[Result, Result]]:
        async with serve({**all_shapes("Boom", boom), **all_shapes("Abort", aborting)},
                         (bta.ServerDeadlineInterceptor(5.0),)) as addr, channel(addr) as ch:
            return [(await invoke(ch, s, f"Boom_{m}"), await invoke(ch, s, f"Abort_{m}")) for s, m in VARIANTS]

    for r_boom, r_abort in run(main):
        assert r_boom.code == grpc.StatusCode.UNKNOWN, r_boom
        assert r_abort.code == grpc.StatusCode.NOT_FOUND and r_abort.details == "nope", r_abort


def test_plain_function_handlers_on_an_aio_server_are_left_alone() -> None:
    def sync_echo(req: bytes, ctx: Any) -> bytes:
        return req

    async def main() -> Result:
        async with serve({"Sync": grpc.unary_unary_rpc_method_handler(sync_echo)},
                         (bta.ServerDeadlineInterceptor(1.0), bta.SlowCallInterceptor(1.0))) as addr, \
                channel(addr) as ch:
            return await invoke(ch, "unary_unary", "Sync", payload=b"plain")

    r = run(main)
    assert r.code == grpc.StatusCode.OK and r.responses == [b"plain"]


# -- SlowCallInterceptor ---------------------------------------------------------------------


async def _stuck_in_here(flag: Callable[[], bool], limit: float) -> None:
    """A recognisable frame for the task stack in the slow-call record."""
    t0 = time.monotonic()
    while not flag() and time.monotonic() - t0 < limit:
        await asyncio.sleep(0.002)


@pytest.mark.parametrize("shape,method", VARIANTS, ids=VARIANT_IDS)
def test_slow_server_call_logs_task_stack_while_stuck(shape: str, method: str,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    reports: list[btg.SlowCall] = []
    stuck_when_reported: list[bool] = []

    async def work(req: bytes, ctx: Any) -> bytes:
        await _stuck_in_here(lambda: bool(reports), 2.0)
        stuck_when_reported.append(bool(reports))
        return req

    async def main() -> Result:
        async with serve(all_shapes("Slow", work), (bta.SlowCallInterceptor(0.05, on_slow=reports.append),)) \
                as addr, channel(addr) as ch:
            r = await invoke(ch, shape, f"Slow_{method}", payload=b"ok")
            assert await until(lambda: len(reports) == 2)
            return r

    r = run(main)
    assert r.code == grpc.StatusCode.OK and r.responses[-1] == b"ok"
    assert stuck_when_reported == [True]
    first, last = reports
    full = f"/{SERVICE}/Slow_{method}"
    assert (first.method, first.side, first.finished) == (full, "server", False)
    assert first.elapsed >= 0.05 and first.stack is not None and "_stuck_in_here" in first.stack
    assert (last.finished, last.code) == (True, grpc.StatusCode.OK) and last.elapsed >= first.elapsed
    recs = [rec for rec in caplog.records if rec.name == LOGGER]
    assert len(recs) == 2 and all(rec.levelno == logging.WARNING for rec in recs)
    assert full in recs[0].getMessage() and "_stuck_in_here" in recs[0].getMessage()
    assert "finished" in recs[1].getMessage() and "OK" in recs[1].getMessage()


def test_slow_server_call_reports_its_status() -> None:
    reports: list[btg.SlowCall] = []

    async def work(req: bytes, ctx: Any) -> bytes:
        await _stuck_in_here(lambda: bool(reports), 2.0)
        await ctx.abort(grpc.StatusCode.NOT_FOUND, "gone")
        raise AssertionError("unreachable")

    async def main() -> Result:
        async with serve(all_shapes("Slow", work), (bta.SlowCallInterceptor(0.03, on_slow=reports.append),)) \
                as addr, channel(addr) as ch:
            r = await invoke(ch, "unary_unary", "Slow_unary_unary")
            assert await until(lambda: len(reports) == 2)
            return r

    r = run(main)
    assert r.code == grpc.StatusCode.NOT_FOUND
    assert reports[1].code == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize("shape", SHAPES)
def test_slow_client_call(shape: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    reports: list[btg.SlowCall] = []

    async def work(req: bytes, ctx: Any) -> bytes:
        await _stuck_in_here(lambda: bool(reports), 2.0)
        return req

    async def main() -> Result:
        async with serve(all_shapes("Slow", work)) as addr, \
                channel(addr, bta.SlowCallInterceptor(0.05, on_slow=reports.append)) as ch:
            r = await invoke(ch, shape, f"Slow_{shape}")
            assert await until(lambda: len(reports) == 2)
            return r

    r = run(main)
    assert r.code == grpc.StatusCode.OK
    first, last = reports
    full = f"/{SERVICE}/Slow_{shape}"
    assert (first.method, first.side, first.finished) == (full, "client", False)
    assert (last.method, last.side, last.finished, last.code) == (full, "client", True, grpc.StatusCode.OK)
    assert last.elapsed >= 0.05
    msgs = [rec.getMessage() for rec in caplog.records if rec.name == LOGGER]
    assert len(msgs) == 2 and "client" in msgs[0] and "finished" in msgs[1]


def test_slow_client_call_that_times_out() -> None:
    reports: list[btg.SlowCall] = []

    async def work(req: bytes, ctx: Any) -> bytes:
        await asyncio.sleep(2.0)
        return req

    async def main() -> Result:
        async with serve(all_shapes("Hang", work)) as addr, \
                channel(addr, bta.SlowCallInterceptor(0.03, on_slow=reports.append),
                        bta.DefaultTimeoutInterceptor(0.12)) as ch:
            r = await invoke(ch, "unary_unary", "Hang_unary_unary")
            assert await until(lambda: len(reports) == 2)
            return r

    r = run(main)
    assert r.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert reports[1].code == grpc.StatusCode.DEADLINE_EXCEEDED and reports[1].elapsed >= 0.1


@pytest.mark.parametrize("shape", SHAPES)
def test_fast_calls_log_nothing(shape: str, tt: bucketimer.TimerThread, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    reports: list[Any] = []
    ic = bta.SlowCallInterceptor(5.0, on_slow=reports.append, timer_thread=tt)

    async def main() -> Result:
        async with serve(all_shapes("Echo", echo), (ic,)) as addr, channel(addr, ic) as ch:
            r = await invoke(ch, shape, f"Echo_{shape}")
            assert await until(lambda: tt.stats()["cancelled"] == 2)
            return r

    r = run(main)
    assert r.code == grpc.StatusCode.OK
    stats = tt.stats()
    assert stats["scheduled"] == 2 and stats["cancelled"] == 2 and stats["fired"] == 0
    assert reports == [] and not caplog.records


@pytest.mark.parametrize("slow_first", [True, False], ids=["slow-outer", "slow-inner"])
@pytest.mark.parametrize("method", ["unary_unary", "unary_stream", "unary_stream_writer"])
def test_deadline_and_slow_interceptors_together(method: str, slow_first: bool) -> None:
    log: list[Any] = []
    reports: list[btg.SlowCall] = []
    events: list[btg.DeadlineEvent] = []
    ics = [bta.SlowCallInterceptor(0.05, on_slow=reports.append),
           bta.ServerDeadlineInterceptor(0.15, on_deadline=events.append)]
    if not slow_first:
        ics.reverse()
    shape = method.removesuffix("_writer")

    async def main() -> Result:
        async with serve(all_shapes("Sleep", _sleeper(log)), tuple(ics)) as addr, channel(addr) as ch:
            r = await invoke(ch, shape, f"Sleep_{method}")
            assert await until(lambda: len(reports) == 2)
            return r

    r = run(main)
    assert r.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert r.responses == ([b"first"] if shape == "unary_stream" else [])
    assert [x.finished for x in reports] == [False, True]
    assert "work" in (reports[0].stack or "")  # the handler's coroutine, awaiting
    assert reports[1].code == grpc.StatusCode.DEADLINE_EXCEEDED and reports[1].elapsed >= 0.15
    assert len(events) == 1


# -- deadline propagation -----------------------------------------------------------------

# A server's time_remaining() can exceed the client's timeout by a few ms
# (grpc's wire encoding and clock conversions): upper bounds allow 20 ms.


def _downstream(seen: list[float | None]) -> dict[str, Any]:
    async def work(req: bytes, ctx: Any) -> bytes:
        seen.append(ctx.time_remaining())
        return req
    return all_shapes("Down", work)


@pytest.mark.parametrize("shape", SHAPES)
def test_max_time_budget_propagates_downstream(shape: str) -> None:
    seen_down: list[float | None] = []
    seen_up: list[Any] = []

    async def main() -> Result:
        async with serve(_downstream(seen_down)) as down_addr, \
                channel(down_addr, bta.DefaultTimeoutInterceptor(30.0, margin=0.05)) as down:

            async def work(req: bytes, ctx: Any) -> bytes:
                seen_up.append(btg.remaining())
                # a task created by the handler inherits its budget
                r = await asyncio.create_task(invoke(down, shape, f"Down_{shape}"))
                assert r.code == grpc.StatusCode.OK, r
                return r.responses[-1]

            async with serve(all_shapes("Up", work), (bta.ServerDeadlineInterceptor(0.3),)) as up_addr, \
                    channel(up_addr) as up:
                return await invoke(up, "unary_unary", "Up_unary_unary", timeout=10.0)

    r = run(main)
    assert r.code == grpc.StatusCode.OK, r
    assert 0.0 < seen_up[0] <= 0.3
    assert seen_down[0] is not None and 0.0 < seen_down[0] <= 0.3 - 0.05 + 0.02


@pytest.mark.parametrize("shape", SHAPES)
def test_client_deadline_propagates_downstream(shape: str) -> None:
    seen_down: list[float | None] = []

    async def main() -> Result:
        async with serve(_downstream(seen_down)) as down_addr, \
                channel(down_addr, bta.DeadlinePropagationInterceptor(margin=0.02)) as down:

            async def work(req: bytes, ctx: Any) -> bytes:
                return (await invoke(down, "unary_unary", "Down_unary_unary", timeout=20.0)).responses[-1]

            async with serve(all_shapes("Up", work), (bta.ServerDeadlineInterceptor(),)) as up_addr, \
                    channel(up_addr) as up:
                return await invoke(up, shape, f"Up_{shape}", timeout=0.25)

    r = run(main)
    assert r.code == grpc.StatusCode.OK, r
    assert seen_down[0] is not None and 0.0 < seen_down[0] <= 0.25 - 0.02 + 0.02


def test_spent_budget_fails_downstream_call_at_once() -> None:
    seen_down: list[float | None] = []
    outcome: list[Result] = []

    async def main() -> None:
        async with serve(_downstream(seen_down)) as down_addr, \
                channel(down_addr, bta.DefaultTimeoutInterceptor(30.0, margin=0.05)) as down:

            async def work(req: bytes, ctx: Any) -> bytes:
                await asyncio.sleep(0.08)  # spend the budget but the margin
                outcome.append(await invoke(down, "unary_unary", "Down_unary_unary"))
                return b""

            async with serve(all_shapes("Up", work), (bta.ServerDeadlineInterceptor(0.1),)) as up_addr, \
                    channel(up_addr) as up:
                await invoke(up, "unary_unary", "Up_unary_unary")
                assert await until(lambda: bool(outcome))

    run(main)
    (down_result,) = outcome
    assert down_result.code == grpc.StatusCode.DEADLINE_EXCEEDED and down_result.elapsed < 0.05
    assert seen_down == []


def test_outside_a_handler_nothing_is_propagated() -> None:
    seen_down: list[float | None] = []

    async def main() -> Result:
        assert btg.remaining() is None
        async with serve(_downstream(seen_down)) as addr, \
                channel(addr, bta.DeadlinePropagationInterceptor()) as ch:
            return await invoke(ch, "unary_unary", "Down_unary_unary")

    assert run(main).code == grpc.StatusCode.OK
    assert seen_down == [None]


def test_sync_and_aio_propagation_share_the_budget() -> None:
    # an aio handler calling a sync-interceptor-free aio downstream, with the
    # budget read by the sync module's remaining() inside the aio task
    seen: list[Any] = []

    async def work(req: bytes, ctx: Any) -> bytes:
        seen.append((btg.remaining(), bta.remaining(), btg.current_deadline()))
        return req

    async def main() -> Result:
        async with serve(all_shapes("Up", work), (bta.ServerDeadlineInterceptor(0.5),)) as addr, \
                channel(addr) as ch:
            return await invoke(ch, "unary_unary", "Up_unary_unary")

    assert run(main).code == grpc.StatusCode.OK
    rem_sync, rem_aio, deadline = seen[0]
    assert 0.3 < rem_sync <= 0.5 and 0.3 < rem_aio <= 0.5
    assert deadline is not None and deadline > time.monotonic() - 1.0
