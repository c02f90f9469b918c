"""ServerDeadlineInterceptor(interrupt=True), the sync server only: the
handler thread is stopped with an asynchronous DeadlineInterrupt, which
frees the pool thread, never lands outside the handler's own code, and
cannot stop a blocking C call (docs/grpc.rst, "Interrupt mode")."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import pytest

grpc = pytest.importorskip("grpc")

from _grpc_harness import ENDED, SERVICE, SHAPES, SyncBackend, busy_until, wait_for  # noqa: E402

import bucketimer.grpc as btg  # noqa: E402

pytestmark = pytest.mark.parametrize("backend", ["sync"], indirect=True)


def _spinner(log: list[Any], stop: threading.Event) -> Any:
    """Ignores is_active() and swallows Exceptions: only an interrupt stops it."""

    async def work(req: bytes, ctx: Any) -> bytes:
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


def _one_thread() -> futures.ThreadPoolExecutor:
    return futures.ThreadPoolExecutor(max_workers=1)


@pytest.mark.parametrize("shape", SHAPES)
def test_interrupt_frees_the_only_pool_thread(backend: SyncBackend, shape: str, stop: threading.Event) -> None:
    log: list[Any] = []
    events: list[btg.DeadlineEvent] = []
    ic = btg.ServerDeadlineInterceptor(0.1, interrupt=True, on_deadline=events.append)
    handlers = {**backend.all_shapes("Spin", _spinner(log, stop)),
                "Echo": grpc.unary_unary_rpc_method_handler(lambda req, ctx: req)}
    with backend.serve(handlers, (ic,), pool=_one_thread()) as addr, backend.channel(addr) as ch:
        r1 = backend.invoke(ch, shape, f"Spin_{shape}")
        # the spinner never ends by itself: only an interrupt frees the thread
        r2 = backend.invoke(ch, "unary_unary", "Echo", payload=b"next", timeout=ENDED)
    assert r1.code == grpc.StatusCode.DEADLINE_EXCEEDED and 0.09 <= r1.elapsed < ENDED, r1
    # the one pool thread was freed: the next call was served
    assert r2.code == grpc.StatusCode.OK and r2.responses == [b"next"], r2
    assert "swallowed" not in log
    # the interrupt landed in the handler's code, and not before the budget ran out
    # (the handler's own clock starts after the interceptor's)
    assert log[0][0] is btg.DeadlineInterrupt and 0.0 < log[0][1] < ENDED
    # reported by the timer's thread after it aborted the call: it may come
    # after the client has its status and the next call was served
    assert wait_for(lambda: events)
    assert events[0].interrupted is True and events[0].elapsed >= 0.1


def test_without_interrupt_the_pool_thread_stays_busy(backend: SyncBackend, stop: threading.Event) -> None:
    # The control for the test above: same handler, no interrupt mode.
    log: list[Any] = []
    ic = btg.ServerDeadlineInterceptor(0.1)
    handlers = {**backend.all_shapes("Spin", _spinner(log, stop)),
                "Echo": grpc.unary_unary_rpc_method_handler(lambda req, ctx: req)}
    with backend.serve(handlers, (ic,), pool=_one_thread()) as addr, backend.channel(addr) as ch:
        r1 = backend.invoke(ch, "unary_unary", "Spin_unary_unary")
        r2 = backend.invoke(ch, "unary_unary", "Echo", timeout=0.3)
        stop.set()
    assert r1.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert r2.code == grpc.StatusCode.DEADLINE_EXCEEDED  # never got the thread
    assert log == [] or log[0][0] is None


#: seconds the handler below spends in one blocking call, well past its 0.05 s budget
BLOCKED = 0.6


def test_interrupt_cannot_stop_a_blocking_c_call(backend: SyncBackend, stop: threading.Event) -> None:
    # Documented limit: the exception lands when the C call returns.
    log: list[Any] = []

    def work(req: bytes, ctx: Any) -> bytes:
        t0 = time.monotonic()
        try:
            time.sleep(BLOCKED)  # one blocking C call
            log.append("after sleep")
            busy_until(stop.is_set, 2.0)
        finally:
            log.append((sys.exc_info()[0], time.monotonic() - t0))
        return b"late"

    ic = btg.ServerDeadlineInterceptor(0.05, interrupt=True)
    handlers = {"Block": grpc.unary_unary_rpc_method_handler(work),
                "Echo": grpc.unary_unary_rpc_method_handler(lambda req, ctx: req)}
    with backend.serve(handlers, (ic,), pool=_one_thread()) as addr, backend.channel(addr) as ch:
        r1 = backend.invoke(ch, "unary_unary", "Block")
        r2 = backend.invoke(ch, "unary_unary", "Echo", timeout=BLOCKED + ENDED)
    # the client's status came while the handler was still blocked
    assert r1.code == grpc.StatusCode.DEADLINE_EXCEEDED and r1.elapsed < BLOCKED - 0.1, r1
    assert r2.code == grpc.StatusCode.OK and r2.elapsed >= 0.1, r2  # waited for the sleep
    exc, at = log[-1]
    assert exc is btg.DeadlineInterrupt and at >= BLOCKED


@pytest.mark.parametrize("calls_grpc", [False, True], ids=["own-code", "calls-into-context"])
def test_interrupt_never_escapes_the_handler(backend: SyncBackend, monkeypatch: pytest.MonkeyPatch,
                                             calls_grpc: bool) -> None:
    # Budgets racing handler ends: an interrupt must land inside the handler
    # or not at all -- never in grpc's code (its request iterator's
    # bookkeeping: a lost token kills the server's polling thread), nor in
    # the pool's worker loop.  With calls_grpc the handler keeps calling into
    # grpc through its context (each call leaves the interrupt window and
    # comes back), and the handler thread must never block in the
    # interceptor's own bookkeeping: every call ends, the one pool thread
    # keeps serving.
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

    async def work(req: bytes, ctx: Any) -> bytes:
        end = time.monotonic() + int(req) * 1e-4
        while time.monotonic() < end:
            if calls_grpc:
                ctx.peer()
                for _ in range(20):  # and some time in the handler's own code
                    pass
        return req

    ic = btg.ServerDeadlineInterceptor(0.002, interrupt=True)
    codes: dict[Any, int] = {}
    with backend.serve(backend.all_shapes("Race", work), (ic,), pool=Pool(max_workers=1)) as addr, \
            backend.channel(addr) as ch:
        for i in range(400):
            shape = SHAPES[i % 4]
            r = backend.invoke(ch, shape, f"Race_{shape}", payload=b"%d" % (i % 40), timeout=5.0)
            codes[r.code] = codes.get(r.code, 0) + 1
        last = backend.invoke(ch, "unary_unary", "Race_unary_unary", payload=b"0", timeout=5.0)
        serving = [t.name for t in threading.enumerate() if "_serve" in t.name]
    assert set(codes) <= {grpc.StatusCode.OK, grpc.StatusCode.DEADLINE_EXCEEDED}, codes
    assert codes.get(grpc.StatusCode.DEADLINE_EXCEEDED, 0) > 0, codes
    assert last.code in (grpc.StatusCode.OK, grpc.StatusCode.DEADLINE_EXCEEDED)
    assert escaped == [] and thread_errors == []
    assert serving  # grpc's polling thread is alive


def test_interrupt_spares_grpc_request_iterator(backend: SyncBackend, monkeypatch: pytest.MonkeyPatch) -> None:
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
    with backend.serve(handlers, (ic,), pool=_one_thread()) as addr, backend.channel(addr) as ch:
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


def test_stuck_handlers_cost_a_backed_off_look_not_a_spin(backend: SyncBackend,
                                                          monkeypatch: pytest.MonkeyPatch,
                                                          stop: threading.Event) -> None:
    # Handlers stuck past their budget in code where an interrupt must not
    # land (here threading's Event.wait) are looked at again in rounds that
    # back off to 100 ms, all of them with one read of every thread's frame
    # -- not each every millisecond -- and are interrupted once they leave it.
    looks: list[float] = []
    frames = sys._current_frames
    monkeypatch.setattr(sys, "_current_frames", lambda: (looks.append(time.monotonic()), frames())[1])
    stuck = 8
    gate = threading.Event()
    log: list[Any] = []

    def work(req: bytes, ctx: Any) -> bytes:
        try:
            gate.wait(5.0)  # in threading: no interrupt lands here
            busy_until(stop.is_set, 5.0)  # its own code: it lands here
        except btg.DeadlineInterrupt:
            log.append("interrupted")
            raise
        return b""

    ic = btg.ServerDeadlineInterceptor(0.02, interrupt=True)
    with backend.serve({"Stuck": grpc.unary_unary_rpc_method_handler(work)}, (ic,),
                       pool=futures.ThreadPoolExecutor(max_workers=stuck)) as addr, \
            backend.channel(addr) as ch:
        method = ch.unary_unary(f"/{SERVICE}/Stuck")
        calls = [method.future(b"") for _ in range(stuck)]
        assert all(c.exception(ENDED).code() == grpc.StatusCode.DEADLINE_EXCEEDED for c in calls)
        time.sleep(0.5)
        t0, t1 = time.monotonic() - 0.4, time.monotonic()
        recent = [t for t in looks if t0 <= t <= t1]
        gate.set()  # they leave threading's code: the next round interrupts them
        assert wait_for(lambda: len(log) == stuck, ENDED)
    # after the first rounds, about one look per 100 ms for all of them
    # together (a spin takes one per handler per millisecond: 3,200 here)
    assert len(recent) <= 10, len(recent)
