"""bucketimer.grpc (sync grpc): real servers on 127.0.0.1, real clients.

Every behaviour is checked on the wire: the status code the client gets and
how long it waited, what the handler saw (``is_active()``, ``time_remaining()``,
``remaining()``), the log records on ``bucketimer.grpc`` and the hooks, the
interrupt mode freeing the only pool thread, and timeouts observed by a
downstream server.  Methods are generic handlers on bytes (no protobuf), in
all four call shapes.
"""

from __future__ import annotations

import contextlib
import logging
import pathlib
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import pytest

grpc = pytest.importorskip("grpc")

import bucketimer  # noqa: E402
import bucketimer.grpc as btg  # noqa: E402

SERVICE = "bt.Test"
SHAPES = ("unary_unary", "unary_stream", "stream_unary", "stream_stream")
LOGGER = "bucketimer.grpc"


# -- harness -------------------------------------------------------------------------


def _wait(pred: Callable[[], Any], timeout: float = 3.0) -> bool:
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            return bool(pred())
        time.sleep(0.001)
    return True


def shaped(shape: str, work: Callable[[bytes, Any], bytes]) -> Any:
    """A method handler of ``shape`` whose real work is ``work(request, context)``.

    Streaming responses first yield ``b"first"`` (so the client sees a partial
    stream before any status); streaming requests are joined first.
    """
    if shape == "unary_unary":
        return grpc.unary_unary_rpc_method_handler(lambda req, ctx: work(req, ctx))
    if shape == "unary_stream":
        def us(req: bytes, ctx: Any) -> Iterator[bytes]:
            yield b"first"
            yield work(req, ctx)
        return grpc.unary_stream_rpc_method_handler(us)
    if shape == "stream_unary":
        return grpc.stream_unary_rpc_method_handler(lambda it, ctx: work(b"".join(it), ctx))
    if shape == "stream_stream":
        def ss(it: Iterator[bytes], ctx: Any) -> Iterator[bytes]:
            req = b"".join(it)
            yield b"first"
            yield work(req, ctx)
        return grpc.stream_stream_rpc_method_handler(ss)
    raise AssertionError(shape)


def all_shapes(name: str, work: Callable[[bytes, Any], bytes]) -> dict[str, Any]:
    return {f"{name}_{shape}": shaped(shape, work) for shape in SHAPES}


class Result:
    def __init__(self, responses: list[bytes], code: Any, details: str | None, elapsed: float) -> None:
        self.responses, self.code, self.details, self.elapsed = responses, code, details, elapsed

    def __repr__(self) -> str:
        return f"Result({self.responses!r}, {self.code}, {self.details!r}, {self.elapsed:.3f}s)"


def invoke(channel: Any, shape: str, method: str, payload: bytes = b"x",
           timeout: float | None = None) -> Result:
    """Calls ``/SERVICE/method`` in ``shape``; never raises RpcError."""
    path = f"/{SERVICE}/{method}"
    got: list[bytes] = []
    t0 = time.monotonic()
    try:
        if shape == "unary_unary":
            got.append(channel.unary_unary(path)(payload, timeout=timeout))
        elif shape == "unary_stream":
            for r in channel.unary_stream(path)(payload, timeout=timeout):
                got.append(r)
        elif shape == "stream_unary":
            got.append(channel.stream_unary(path)(iter([payload]), timeout=timeout))
        else:
            for r in channel.stream_stream(path)(iter([payload]), timeout=timeout):
                got.append(r)
        code, details = grpc.StatusCode.OK, None
    except grpc.RpcError as e:
        code, details = e.code(), e.details()
    return Result(got, code, details, time.monotonic() - t0)


@contextlib.contextmanager
def serve(handlers: dict[str, Any], interceptors: tuple[Any, ...] = (),
          pool: futures.ThreadPoolExecutor | None = None) -> Iterator[str]:
    """A grpc server on 127.0.0.1 (port 0) serving ``handlers``; yields its address."""
    pool = pool or futures.ThreadPoolExecutor(max_workers=4)
    server = grpc.server(pool, interceptors=list(interceptors))
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, handlers)])
    port = server.add_insecure_port("127.0.0.1:0")
    assert port
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        # stop() waits forever when grpc's polling thread died: bound it.
        stopper = threading.Thread(target=server.stop, args=(None,), daemon=True)
        stopper.start()
        stopper.join(10.0)
        pool.shutdown(wait=False)
        assert not stopper.is_alive(), "the grpc server did not stop"


@contextlib.contextmanager
def channel(address: str, *interceptors: Any) -> Iterator[Any]:
    ch = grpc.insecure_channel(address)
    try:
        yield grpc.intercept_channel(ch, *interceptors) if interceptors else ch
    finally:
        ch.close()


@pytest.fixture
def stop() -> Iterator[threading.Event]:
    """Set at teardown: lets handlers that ignore their deadline end."""
    ev = threading.Event()
    yield ev
    ev.set()


def busy_until(pred: Callable[[], bool], limit: float) -> float:
    """A Python-level wait (short sleeps, so an async exception can land)."""
    t0 = time.monotonic()
    while not pred() and time.monotonic() - t0 < limit:
        time.sleep(0.002)
    return time.monotonic() - t0


# -- import hygiene -----------------------------------------------------------------------


def test_import_bucketimer_does_not_import_grpc() -> None:
    code = ("import sys, bucketimer\n"
            "assert 'bucketimer.grpc' not in sys.modules\n"
            "assert 'grpc' not in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_clear_import_error_without_grpcio() -> None:
    code = ("import sys\n"
            "sys.modules['grpc'] = None  # as if grpcio were not installed\n"
            "try:\n"
            "    import bucketimer.grpc\n"
            "except ImportError as e:\n"
            "    print(e)\n"
            "else:\n"
            "    raise SystemExit('imported without grpcio')\n")
    out = subprocess.run([sys.executable, "-c", code], check=True, timeout=60,
                         capture_output=True, text=True).stdout
    assert "grpcio" in out and "bucketimer[grpc]" in out


def test_real_grpc_module_is_used() -> None:
    assert grpc.__name__ == "grpc" and hasattr(grpc, "server")
    assert btg.grpc is grpc


# -- argument checking -----------------------------------------------------------------------


@pytest.mark.parametrize("make", [
    lambda: btg.DefaultTimeoutInterceptor("1"),
    lambda: btg.DefaultTimeoutInterceptor(True),
    lambda: btg.ServerDeadlineInterceptor("1"),
    lambda: btg.SlowCallInterceptor(None),
    lambda: btg.ServerDeadlineInterceptor(1.0, on_deadline=3),
    lambda: btg.SlowCallInterceptor(1.0, on_slow="no"),
])
def test_bad_arguments_type(make: Callable[[], Any]) -> None:
    with pytest.raises(TypeError):
        make()


@pytest.mark.parametrize("make", [
    lambda: btg.DefaultTimeoutInterceptor(0),
    lambda: btg.DefaultTimeoutInterceptor(-1.0),
    lambda: btg.DefaultTimeoutInterceptor(float("nan")),
    lambda: btg.DefaultTimeoutInterceptor(1.0, margin=-0.1),
    lambda: btg.ServerDeadlineInterceptor(0.0),
    lambda: btg.SlowCallInterceptor(-1),
])
def test_bad_arguments_value(make: Callable[[], Any]) -> None:
    with pytest.raises(ValueError):
        make()


def test_remaining_outside_a_handler_is_none() -> None:
    assert btg.remaining() is None
    assert btg.current_deadline() is None


# -- DefaultTimeoutInterceptor ------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES)
def test_default_timeout_applies_to_calls_without_one(shape: str) -> None:
    seen: list[float] = []

    def work(req: bytes, ctx: Any) -> bytes:
        seen.append(ctx.time_remaining())
        return req

    with serve(all_shapes("Seen", work)) as addr, \
            channel(addr, btg.DefaultTimeoutInterceptor(0.25)) as ch:
        r = invoke(ch, shape, f"Seen_{shape}")
    assert r.code == grpc.StatusCode.OK, r
    assert len(seen) == 1 and 0.0 < seen[0] <= 0.3


@pytest.mark.parametrize("shape", SHAPES)
def test_default_timeout_expires_a_hanging_call(shape: str, stop: threading.Event) -> None:
    def work(req: bytes, ctx: Any) -> bytes:
        busy_until(lambda: stop.is_set() or not ctx.is_active(), 3.0)
        return req

    with serve(all_shapes("Hang", work)) as addr, \
            channel(addr, btg.DefaultTimeoutInterceptor(0.15)) as ch:
        r = invoke(ch, shape, f"Hang_{shape}")
    assert r.code == grpc.StatusCode.DEADLINE_EXCEEDED, r
    assert 0.14 <= r.elapsed < 1.5, r


@pytest.mark.parametrize("shape", SHAPES)
def test_explicit_timeout_is_kept(shape: str) -> None:
    seen: list[float] = []

    def work(req: bytes, ctx: Any) -> bytes:
        seen.append(ctx.time_remaining())
        return req

    with serve(all_shapes("Seen", work)) as addr, \
            channel(addr, btg.DefaultTimeoutInterceptor(0.2)) as ch:
        r = invoke(ch, shape, f"Seen_{shape}", timeout=30.0)
    assert r.code == grpc.StatusCode.OK, r
    assert 25.0 < seen[0] <= 30.5


def test_no_default_and_no_propagation_leaves_calls_alone() -> None:
    seen: list[float] = []

    def work(req: bytes, ctx: Any) -> bytes:
        seen.append(ctx.time_remaining())
        return req

    with serve(all_shapes("Seen", work)) as addr, \
            channel(addr, btg.DeadlinePropagationInterceptor(margin=0.01)) as ch:
        r = invoke(ch, "unary_unary", "Seen_unary_unary")
    assert r.code == grpc.StatusCode.OK
    assert seen[0] > 1e6  # grpc's "no deadline"


# -- ServerDeadlineInterceptor -------------------------------------------------------------


def _stubborn(log: list[Any], stop: threading.Event, limit: float = 3.0) -> Callable[[bytes, Any], bytes]:
    """A handler that keeps working past its budget, watching is_active()."""

    def work(req: bytes, ctx: Any) -> bytes:
        t0 = time.monotonic()
        log.append(("start", ctx.is_active(), ctx.time_remaining(), btg.remaining()))
        waited = busy_until(lambda: stop.is_set() or not ctx.is_active(), limit)
        log.append(("inactive", ctx.is_active(), waited, time.monotonic() - t0))
        return b"late"

    return work


@pytest.mark.parametrize("shape", SHAPES)
def test_max_time_gives_client_deadline_exceeded_promptly(shape: str, stop: threading.Event) -> None:
    log: list[Any] = []
    events: list[btg.DeadlineEvent] = []
    ic = btg.ServerDeadlineInterceptor(0.1, on_deadline=events.append, details="budget gone")
    with serve(all_shapes("Stub", _stubborn(log, stop)), (ic,)) as addr, channel(addr) as ch:
        r = invoke(ch, shape, f"Stub_{shape}", timeout=10.0)
        assert _wait(lambda: len(log) == 2 and events)
    # the client: DEADLINE_EXCEEDED, not CANCELLED and not a hang
    assert r.code == grpc.StatusCode.DEADLINE_EXCEEDED, r
    assert r.details == "budget gone"
    assert 0.09 <= r.elapsed < 1.0, r
    if shape.endswith("stream") and shape != "stream_unary":
        assert r.responses == [b"first"]  # the partial stream, then the status
    # the handler: active at first with the server's budget, then not active
    _, active0, time_left, rem = log[0]
    assert active0 is True and 0.0 < time_left <= 0.1 and 0.0 < rem <= 0.1
    _, active1, waited, _ = log[1]
    assert active1 is False and 0.08 <= waited < 1.0
    # the hook
    (ev,) = events
    assert ev.method == f"/{SERVICE}/Stub_{shape}"
    assert ev.source == "max_time" and ev.budget == 0.1  # exactly max_time
    assert ev.elapsed >= 0.1 and ev.interrupted is False


@pytest.mark.parametrize("shape", SHAPES)
def test_client_deadline_is_the_budget_when_smaller(shape: str, stop: threading.Event) -> None:
    log: list[Any] = []
    events: list[btg.DeadlineEvent] = []
    ic = btg.ServerDeadlineInterceptor(5.0, on_deadline=events.append)
    with serve(all_shapes("Stub", _stubborn(log, stop)), (ic,)) as addr, channel(addr) as ch:
        r = invoke(ch, shape, f"Stub_{shape}", timeout=0.15)
        assert _wait(lambda: len(log) == 2 and events)
    assert r.code == grpc.StatusCode.DEADLINE_EXCEEDED, r
    assert 0.14 <= r.elapsed < 1.0, r
    assert 0.0 < log[0][2] <= 0.17  # time_remaining(): the client's deadline
    assert log[1][1] is False and log[1][2] < 1.0
    assert events[0].source == "client"
    assert events[0].budget == pytest.approx(0.15, abs=0.03)


def test_deadline_event_is_logged(caplog: pytest.LogCaptureFixture, stop: threading.Event) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    log: list[Any] = []
    with serve(all_shapes("Stub", _stubborn(log, stop)), (btg.ServerDeadlineInterceptor(0.05),)) as addr, \
            channel(addr) as ch:
        r = invoke(ch, "unary_unary", "Stub_unary_unary")
        assert _wait(lambda: any("budget" in rec.getMessage() for rec in caplog.records))
    assert r.code == grpc.StatusCode.DEADLINE_EXCEEDED
    (rec,) = [rec for rec in caplog.records if rec.name == LOGGER]
    assert rec.levelno == logging.INFO
    assert f"/{SERVICE}/Stub_unary_unary" in rec.getMessage() and "max_time" in rec.getMessage()
    assert rec.grpc_method == f"/{SERVICE}/Stub_unary_unary"  # type: ignore[attr-defined]


@pytest.mark.parametrize("shape", SHAPES)
def test_call_in_time_costs_one_schedule_and_cancel(shape: str, tt: bucketimer.TimerThread,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    events: list[Any] = []
    seen: list[Any] = []

    def work(req: bytes, ctx: Any) -> bytes:
        seen.append((ctx.is_active(), btg.remaining()))
        return req

    ic = btg.ServerDeadlineInterceptor(5.0, on_deadline=events.append, timer_thread=tt)
    with serve(all_shapes("Echo", work), (ic,)) as addr, channel(addr) as ch:
        before = tt.stats()
        results = [invoke(ch, shape, f"Echo_{shape}", payload=b"p%d" % i) for i in range(5)]
        after = tt.stats()
    assert all(r.code == grpc.StatusCode.OK for r in results), results
    assert results[0].responses[-1] == b"p0"
    assert after["scheduled"] - before["scheduled"] == 5
    assert after["cancelled"] - before["cancelled"] == 5
    assert after["fired"] == before["fired"]
    assert events == [] and not caplog.records
    assert all(active and 4.0 < rem <= 5.0 for active, rem in seen)


def test_no_budget_schedules_no_timer(tt: bucketimer.TimerThread) -> None:
    seen: list[Any] = []

    def work(req: bytes, ctx: Any) -> bytes:
        seen.append(btg.remaining())
        return req

    with serve(all_shapes("Echo", work), (btg.ServerDeadlineInterceptor(timer_thread=tt),)) as addr, \
            channel(addr) as ch:
        assert invoke(ch, "unary_stream", "Echo_unary_stream").code == grpc.StatusCode.OK
        assert invoke(ch, "unary_unary", "Echo_unary_unary", timeout=5.0).code == grpc.StatusCode.OK
    assert seen[0] is None and 4.0 < seen[1] <= 5.1
    assert tt.stats()["scheduled"] == 1


def test_handler_exception_passes_through() -> None:
    def work(req: bytes, ctx: Any) -> bytes:
        raise ValueError("boom")

    def aborting(req: bytes, ctx: Any) -> bytes:
        ctx.abort(grpc.StatusCode.NOT_FOUND, "nope")
        raise AssertionError("unreachable")

    handlers = {**all_shapes("Boom", work), **all_shapes("Abort", aborting)}
    with serve(handlers, (btg.ServerDeadlineInterceptor(5.0),)) as addr, channel(addr) as ch:
        for shape in SHAPES:
            r = invoke(ch, shape, f"Boom_{shape}")
            assert r.code == grpc.StatusCode.UNKNOWN and "boom" in (r.details or ""), r
            r = invoke(ch, shape, f"Abort_{shape}")
            assert r.code == grpc.StatusCode.NOT_FOUND and r.details == "nope", r


# -- interrupt mode -------------------------------------------------------------------------


def _spinner(log: list[Any], stop: threading.Event) -> Callable[[bytes, Any], bytes]:
    """Ignores is_active() and swallows Exceptions: only an interrupt stops it."""

    def work(req: bytes, ctx: Any) -> bytes:
        t0 = time.monotonic()
        try:
            while not stop.is_set():
                try:
                    time.sleep(0.002)
                except Exception:  # does not catch DeadlineInterrupt
                    log.append("swallowed")
        finally:
            log.append((sys.exc_info()[0], time.monotonic() - t0))
        return b"late"

    return work


@pytest.mark.parametrize("shape", SHAPES)
def test_interrupt_frees_the_only_pool_thread(shape: str, stop: threading.Event) -> None:
    log: list[Any] = []
    events: list[btg.DeadlineEvent] = []
    ic = btg.ServerDeadlineInterceptor(0.1, interrupt=True, on_deadline=events.append)
    handlers = {**all_shapes("Spin", _spinner(log, stop)),
                "Echo": grpc.unary_unary_rpc_method_handler(lambda req, ctx: req)}
    with serve(handlers, (ic,), pool=futures.ThreadPoolExecutor(max_workers=1)) as addr, \
            channel(addr) as ch:
        r1 = invoke(ch, shape, f"Spin_{shape}")
        r2 = invoke(ch, "unary_unary", "Echo", payload=b"next", timeout=2.0)
    assert r1.code == grpc.StatusCode.DEADLINE_EXCEEDED and 0.09 <= r1.elapsed < 1.0, r1
    # the one pool thread was freed: the next call was served at once
    assert r2.code == grpc.StatusCode.OK and r2.responses == [b"next"], r2
    assert r2.elapsed < 1.0
    assert "swallowed" not in log
    assert log[0][0] is btg.DeadlineInterrupt and 0.09 <= log[0][1] < 1.0
    assert events[0].interrupted is True


def test_without_interrupt_the_pool_thread_stays_busy(stop: threading.Event) -> None:
    # The control for the test above: same handler, no interrupt mode.
    log: list[Any] = []
    ic = btg.ServerDeadlineInterceptor(0.1)
    handlers = {**all_shapes("Spin", _spinner(log, stop)),
                "Echo": grpc.unary_unary_rpc_method_handler(lambda req, ctx: req)}
    with serve(handlers, (ic,), pool=futures.ThreadPoolExecutor(max_workers=1)) as addr, \
            channel(addr) as ch:
        r1 = invoke(ch, "unary_unary", "Spin_unary_unary")
        r2 = invoke(ch, "unary_unary", "Echo", timeout=0.3)
        stop.set()
    assert r1.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert r2.code == grpc.StatusCode.DEADLINE_EXCEEDED  # never got the thread
    assert log == [] or log[0][0] is None


def test_interrupt_cannot_stop_a_blocking_c_call(stop: threading.Event) -> None:
    # Documented limit: the exception lands when the C call returns.
    log: list[Any] = []

    def work(req: bytes, ctx: Any) -> bytes:
        t0 = time.monotonic()
        try:
            time.sleep(0.3)  # one blocking C call
            log.append("after sleep")
            busy_until(stop.is_set, 2.0)
        finally:
            log.append((sys.exc_info()[0], time.monotonic() - t0))
        return b"late"

    ic = btg.ServerDeadlineInterceptor(0.05, interrupt=True)
    handlers = {"Block": grpc.unary_unary_rpc_method_handler(work),
                "Echo": grpc.unary_unary_rpc_method_handler(lambda req, ctx: req)}
    with serve(handlers, (ic,), pool=futures.ThreadPoolExecutor(max_workers=1)) as addr, \
            channel(addr) as ch:
        r1 = invoke(ch, "unary_unary", "Block")
        r2 = invoke(ch, "unary_unary", "Echo", timeout=2.0)
    assert r1.code == grpc.StatusCode.DEADLINE_EXCEEDED and r1.elapsed < 0.25, r1
    assert r2.code == grpc.StatusCode.OK and r2.elapsed >= 0.1, r2  # waited for the sleep
    exc, at = log[-1]
    assert exc is btg.DeadlineInterrupt and at >= 0.29


def test_interrupt_never_escapes_the_handler(monkeypatch: pytest.MonkeyPatch) -> None:
    # Budgets racing handler ends: an interrupt must land inside the handler
    # or not at all -- never in grpc's code (its request iterator's
    # bookkeeping: a lost token kills the server's polling thread), nor in
    # the pool's worker loop.
    escaped: list[BaseException] = []
    thread_errors: list[Any] = []
    monkeypatch.setattr(threading, "excepthook", thread_errors.append)

    class Pool(futures.ThreadPoolExecutor):
        def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
            def guarded() -> Any:
                try:
                    return fn(*args, **kwargs)
                except BaseException as e:
                    escaped.append(e)
                    raise
            return super().submit(guarded)

    def work(req: bytes, ctx: Any) -> bytes:
        end = time.monotonic() + int(req) * 1e-4
        while time.monotonic() < end:
            pass
        return req

    ic = btg.ServerDeadlineInterceptor(0.002, interrupt=True)
    codes: dict[Any, int] = {}
    with serve(all_shapes("Race", work), (ic,), pool=Pool(max_workers=1)) as addr, channel(addr) as ch:
        for i in range(400):
            shape = SHAPES[i % 4]
            r = invoke(ch, shape, f"Race_{shape}", payload=b"%d" % (i % 40), timeout=5.0)
            codes[r.code] = codes.get(r.code, 0) + 1
        last = invoke(ch, "unary_unary", "Race_unary_unary", payload=b"0", timeout=5.0)
        serving = [t.name for t in threading.enumerate() if "_serve" in t.name]
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.DEADLINE_EXCEEDED}, codes
    assert codes.get(grpc.StatusCode.DEADLINE_EXCEEDED, 0) > 0, codes
    assert last.code in (grpc.StatusCode.OK, grpc.StatusCode.DEADLINE_EXCEEDED)
    assert escaped == [] and thread_errors == []
    assert serving  # grpc's polling thread is alive


def test_interrupt_spares_grpc_request_iterator(monkeypatch: pytest.MonkeyPatch) -> None:
    # A handler that spends its budget pulling requests: the interrupt must
    # not land inside grpc's request iterator (between starting a receive and
    # recording it), or grpc's polling thread dies on a KeyError and the
    # server stops serving.  Without the interceptor's protections this breaks
    # within a few dozen calls.
    thread_errors: list[Any] = []
    monkeypatch.setattr(threading, "excepthook", thread_errors.append)

    def consume(it: Iterator[bytes], ctx: Any) -> bytes:
        return b"%d" % sum(1 for _ in it)

    ic = btg.ServerDeadlineInterceptor(0.003, interrupt=True)
    handlers = {"Consume": grpc.stream_unary_rpc_method_handler(consume)}
    codes: dict[Any, int] = {}
    with serve(handlers, (ic,), pool=futures.ThreadPoolExecutor(max_workers=1)) as addr, \
            channel(addr) as ch:
        method = ch.stream_unary(f"/{SERVICE}/Consume")
        for _ in range(120):
            try:
                method(iter([b"x"] * 300), timeout=1.0)
                code = grpc.StatusCode.OK
            except grpc.RpcError as e:
                code = e.code()
            codes[code] = codes.get(code, 0) + 1
            assert not thread_errors, thread_errors
        serving = [t.name for t in threading.enumerate() if "_serve" in t.name]
    assert codes.get(grpc.StatusCode.DEADLINE_EXCEEDED, 0) > 0 and set(codes) <= {
        grpc.StatusCode.OK, grpc.StatusCode.DEADLINE_EXCEEDED}, codes
    assert serving and not thread_errors


# -- SlowCallInterceptor ---------------------------------------------------------------------


def _stuck_in_here(flag: Callable[[], bool], limit: float) -> None:
    """A recognisable frame for the stack in the slow-call record."""
    busy_until(flag, limit)


@pytest.mark.parametrize("shape", SHAPES)
def test_slow_server_call_logs_stack_while_stuck(shape: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    reports: list[btg.SlowCall] = []
    seen_while_stuck: list[bool] = []

    def work(req: bytes, ctx: Any) -> bytes:
        # stays stuck until the slow report arrived (or 2 s)
        _stuck_in_here(lambda: bool(reports), 2.0)
        seen_while_stuck.append(bool(reports))
        return req

    ic = btg.SlowCallInterceptor(0.05, on_slow=reports.append)
    with serve(all_shapes("Slow", work), (ic,)) as addr, channel(addr) as ch:
        r = invoke(ch, shape, f"Slow_{shape}", payload=b"ok")
        assert _wait(lambda: len(reports) == 2)
    assert r.code == grpc.StatusCode.OK and r.responses[-1] == b"ok"
    assert seen_while_stuck == [True]  # reported while the handler was stuck
    method = f"/{SERVICE}/Slow_{shape}"
    first, last = reports
    assert (first.method, first.side, first.finished) == (method, "server", False)
    assert first.elapsed >= 0.05 and first.code is None
    assert first.stack is not None and "_stuck_in_here" in first.stack
    assert (last.method, last.finished, last.code) == (method, True, grpc.StatusCode.OK)
    assert last.elapsed >= first.elapsed and last.stack is None
    recs = [rec for rec in caplog.records if rec.name == LOGGER]
    assert len(recs) == 2 and all(rec.levelno == logging.WARNING for rec in recs)
    assert method in recs[0].getMessage() and "still running" in recs[0].getMessage()
    assert "_stuck_in_here" in recs[0].getMessage()
    assert "finished" in recs[1].getMessage() and "OK" in recs[1].getMessage()
    assert recs[1].grpc_elapsed >= 0.05  # type: ignore[attr-defined]


def test_slow_server_call_reports_its_status(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    reports: list[btg.SlowCall] = []

    def work(req: bytes, ctx: Any) -> bytes:
        busy_until(lambda: bool(reports), 2.0)
        ctx.abort(grpc.StatusCode.NOT_FOUND, "gone")
        raise AssertionError("unreachable")

    with serve(all_shapes("Slow", work), (btg.SlowCallInterceptor(0.03, on_slow=reports.append),)) as addr, \
            channel(addr) as ch:
        r = invoke(ch, "unary_unary", "Slow_unary_unary")
        assert _wait(lambda: len(reports) == 2)
    assert r.code == grpc.StatusCode.NOT_FOUND
    assert reports[1].code == grpc.StatusCode.NOT_FOUND
    assert "NOT_FOUND" in caplog.records[-1].getMessage()


@pytest.mark.parametrize("shape", SHAPES)
def test_fast_call_logs_nothing(shape: str, caplog: pytest.LogCaptureFixture, tt: bucketimer.TimerThread) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    reports: list[Any] = []
    ic = btg.SlowCallInterceptor(5.0, on_slow=reports.append, timer_thread=tt)
    with serve(all_shapes("Echo", lambda req, ctx: req), (ic,)) as addr, channel(addr, ic) as ch:
        r = invoke(ch, shape, f"Echo_{shape}")
        assert _wait(lambda: tt.stats()["cancelled"] == 2)
    assert r.code == grpc.StatusCode.OK
    stats = tt.stats()
    assert stats["scheduled"] == 2 and stats["cancelled"] == 2 and stats["fired"] == 0  # client + server
    assert reports == [] and not caplog.records


@pytest.mark.parametrize("shape", SHAPES)
def test_slow_client_call(shape: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    reports: list[btg.SlowCall] = []

    def work(req: bytes, ctx: Any) -> bytes:
        busy_until(lambda: bool(reports), 2.0)
        return req

    ic = btg.SlowCallInterceptor(0.05, on_slow=reports.append)
    with serve(all_shapes("Slow", work)) as addr, channel(addr, ic) as ch:
        r = invoke(ch, shape, f"Slow_{shape}")
        assert _wait(lambda: len(reports) == 2)
    assert r.code == grpc.StatusCode.OK
    first, last = reports
    method = f"/{SERVICE}/Slow_{shape}"
    assert (first.method, first.side, first.finished, first.stack) == (method, "client", False, None)
    assert (last.side, last.finished, last.code) == ("client", True, grpc.StatusCode.OK)
    assert last.elapsed >= 0.05
    msgs = [rec.getMessage() for rec in caplog.records if rec.name == LOGGER]
    assert len(msgs) == 2 and "client" in msgs[0] and method in msgs[1]


def test_slow_client_call_that_fails(caplog: pytest.LogCaptureFixture, stop: threading.Event) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    reports: list[btg.SlowCall] = []

    def work(req: bytes, ctx: Any) -> bytes:
        busy_until(lambda: stop.is_set() or not ctx.is_active(), 2.0)
        return req

    with serve(all_shapes("Hang", work)) as addr, \
            channel(addr, btg.SlowCallInterceptor(0.03, on_slow=reports.append),
                    btg.DefaultTimeoutInterceptor(0.12)) as ch:
        r = invoke(ch, "unary_unary", "Hang_unary_unary")
        assert _wait(lambda: len(reports) == 2)
    assert r.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert reports[1].code == grpc.StatusCode.DEADLINE_EXCEEDED and reports[1].elapsed >= 0.1


def test_on_slow_hook_errors_are_logged(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    calls: list[Any] = []

    def hook(info: btg.SlowCall) -> None:
        calls.append(info)
        raise RuntimeError("hook bug")

    def work(req: bytes, ctx: Any) -> bytes:
        busy_until(lambda: bool(calls), 2.0)
        return req

    with serve(all_shapes("Slow", work), (btg.SlowCallInterceptor(0.02, on_slow=hook),)) as addr, \
            channel(addr) as ch:
        r = invoke(ch, "unary_unary", "Slow_unary_unary")
        assert _wait(lambda: len(calls) == 2)
    assert r.code == grpc.StatusCode.OK
    assert sum("hook bug" in (rec.exc_text or str(rec.exc_info)) for rec in caplog.records) == 2


# -- deadline propagation -----------------------------------------------------------------


# A server's time_remaining() can exceed the client's timeout by a few ms
# (grpc's wire encoding and clock conversions): upper bounds allow 20 ms.


def _downstream(seen: list[float]) -> dict[str, Any]:
    def work(req: bytes, ctx: Any) -> bytes:
        seen.append(ctx.time_remaining())
        return req
    return all_shapes("Down", work)


@pytest.mark.parametrize("shape", SHAPES)
def test_max_time_budget_propagates_downstream(shape: str) -> None:
    seen_down: list[float] = []
    seen_up: list[Any] = []
    with serve(_downstream(seen_down)) as down_addr, \
            channel(down_addr, btg.DefaultTimeoutInterceptor(30.0, margin=0.05)) as down:

        def work(req: bytes, ctx: Any) -> bytes:
            seen_up.append(btg.remaining())
            r = invoke(down, shape, f"Down_{shape}")
            assert r.code == grpc.StatusCode.OK, r
            return r.responses[-1]

        with serve(all_shapes("Up", work), (btg.ServerDeadlineInterceptor(0.3),)) as up_addr, \
                channel(up_addr) as up:
            r = invoke(up, "unary_unary", "Up_unary_unary", timeout=10.0)
    assert r.code == grpc.StatusCode.OK, r
    assert 0.0 < seen_up[0] <= 0.3
    # downstream got the upstream's remaining budget minus the margin, not 30 s
    assert 0.0 < seen_down[0] <= 0.3 - 0.05 + 0.02  # the upper bound is the point


@pytest.mark.parametrize("shape", SHAPES)
def test_client_deadline_propagates_downstream(shape: str) -> None:
    seen_down: list[float] = []
    with serve(_downstream(seen_down)) as down_addr, \
            channel(down_addr, btg.DeadlinePropagationInterceptor(margin=0.02)) as down:

        def work(req: bytes, ctx: Any) -> bytes:
            return invoke(down, "unary_unary", "Down_unary_unary", timeout=20.0).responses[-1]

        with serve(all_shapes("Up", work), (btg.ServerDeadlineInterceptor(),)) as up_addr, \
                channel(up_addr) as up:
            r = invoke(up, shape, f"Up_{shape}", timeout=0.25)
    assert r.code == grpc.StatusCode.OK, r
    # an explicit downstream timeout (20 s) is capped by the budget (less
    # the margin) too; how much of the 0.25 s is left depends on how long
    # the upstream call took to reach its handler (~170 ms once under ASan)
    assert 0.0 < seen_down[0] <= 0.25 - 0.02 + 0.02


def test_spent_budget_fails_downstream_call_at_once(stop: threading.Event) -> None:
    seen_down: list[float] = []
    outcome: list[Result] = []
    with serve(_downstream(seen_down)) as down_addr, \
            channel(down_addr, btg.DefaultTimeoutInterceptor(30.0, margin=0.05)) as down:

        def work(req: bytes, ctx: Any) -> bytes:
            busy_until(stop.is_set, 0.08)  # spend the budget but the margin
            outcome.append(invoke(down, "unary_unary", "Down_unary_unary"))
            return b""

        with serve(all_shapes("Up", work), (btg.ServerDeadlineInterceptor(0.1),)) as up_addr, \
                channel(up_addr) as up:
            invoke(up, "unary_unary", "Up_unary_unary")
            assert _wait(lambda: bool(outcome))
    (down_result,) = outcome
    assert down_result.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert down_result.elapsed < 0.05
    assert seen_down == []  # never reached the downstream handler


def test_outside_a_handler_propagation_changes_nothing() -> None:
    seen_down: list[float] = []
    with serve(_downstream(seen_down)) as addr, channel(addr, btg.DefaultTimeoutInterceptor(0.5)) as ch:
        assert invoke(ch, "unary_unary", "Down_unary_unary").code == grpc.StatusCode.OK
    assert 0.25 < seen_down[0] <= 0.52  # the 0.5 s default, less the time in transit


def test_propagation_can_be_turned_off() -> None:
    seen_down: list[float] = []
    with serve(_downstream(seen_down)) as down_addr, \
            channel(down_addr, btg.DefaultTimeoutInterceptor(2.0, propagate=False)) as down:

        def work(req: bytes, ctx: Any) -> bytes:
            return invoke(down, "unary_unary", "Down_unary_unary").responses[-1]

        with serve(all_shapes("Up", work), (btg.ServerDeadlineInterceptor(0.3),)) as up_addr, \
                channel(up_addr) as up:
            assert invoke(up, "unary_unary", "Up_unary_unary").code == grpc.StatusCode.OK
    assert 1.5 < seen_down[0] <= 2.02


@pytest.mark.parametrize("slow_first", [True, False], ids=["slow-outer", "slow-inner"])
@pytest.mark.parametrize("shape", ["unary_unary", "unary_stream"])
def test_deadline_and_slow_interceptors_together(shape: str, slow_first: bool,
                                                 stop: threading.Event) -> None:
    log: list[Any] = []
    reports: list[btg.SlowCall] = []
    events: list[btg.DeadlineEvent] = []
    ics = [btg.ServerDeadlineInterceptor(0.15, on_deadline=events.append),
           btg.SlowCallInterceptor(0.05, on_slow=reports.append)]
    if slow_first:
        ics.reverse()
    with serve(all_shapes("Stub", _stubborn(log, stop)), tuple(ics)) as addr, channel(addr) as ch:
        r = invoke(ch, shape, f"Stub_{shape}")
        assert _wait(lambda: len(reports) == 2 and len(log) == 2)
    assert r.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert [x.finished for x in reports] == [False, True]
    assert "busy_until" in (reports[0].stack or "")
    # either way round, the slow call's end reports the call's real status
    assert reports[1].code == grpc.StatusCode.DEADLINE_EXCEEDED and reports[1].elapsed >= 0.15
    assert len(events) == 1


# -- the documentation's examples ------------------------------------------------------------

DOCS = pathlib.Path(__file__).resolve().parents[1] / "docs" / "grpc.rst"

#: what each example of docs/grpc.rst must print (stdout + stderr), in order
DOC_EXPECTS = [
    ["StatusCode.DEADLINE_EXCEEDED after 0.2", "b'hi'"],
    ["StatusCode.DEADLINE_EXCEEDED Deadline Exceeded after 0.1", "handler: budget 0.",
     "handler: no longer active, stopping", "/demo.Svc/Work max_time 0.1"],
    ["StatusCode.DEADLINE_EXCEEDED", "b'next'", "handler interrupted"],
    ["frontend budget 0.", "backend saw 0.4"],
    ["slow gRPC server call /demo.Svc/Work still running", "in query_database",
     "slow gRPC client call /demo.Svc/Work still running",
     "slow gRPC server call /demo.Svc/Work finished", "(OK)"],
    ["handler cancelled at the deadline", "StatusCode.DEADLINE_EXCEEDED after 0.1"],
]


def _doc_examples() -> list[str]:
    lines = DOCS.read_text(encoding="utf-8").splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if lines[i].strip() == ".. code-block:: python":
            i += 1
            body = []
            while i < len(lines) and (not lines[i].strip() or lines[i].startswith("    ")):
                body.append(lines[i])
                i += 1
            blocks.append(textwrap.dedent("\n".join(body)))
        else:
            i += 1
    return blocks


@pytest.mark.skipif(not DOCS.exists(), reason="docs/ not present (installed tests)")
@pytest.mark.parametrize("index", range(len(DOC_EXPECTS)))
def test_docs_example_runs(index: int, tmp_path: pathlib.Path) -> None:
    examples = _doc_examples()
    assert len(examples) == len(DOC_EXPECTS), "docs/grpc.rst examples changed: update DOC_EXPECTS"
    script = tmp_path / "example.py"
    script.write_text(examples[index], encoding="utf-8")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "Traceback" not in out, out
    pos = 0
    for expected in DOC_EXPECTS[index]:
        found = out.find(expected, pos) if index != 4 else out.find(expected)
        assert found >= 0, f"{expected!r} missing from:\n{out}"
        pos = found
