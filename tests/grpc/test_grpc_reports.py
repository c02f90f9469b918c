"""Where the interceptors' reports go: log records, hooks and metrics
observers are delivered on a thread of their own, in order, off the path of
the timers that end other calls on time; the queue to it is bounded
(docs/grpc.rst, "Reports")."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

grpc = pytest.importorskip("grpc")

from _grpc_harness import LOGGER, Backend, Call, is_active, stuck_in_here, wait_for  # noqa: E402

import bucketimer.grpc as btg  # noqa: E402
from bucketimer.grpc import _delivery  # noqa: E402

#: how long the slow log handler below takes per record
SLOW_RECORD = 0.1


class _SlowHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []
        self.threads: set[str] = set()

    def emit(self, record: logging.LogRecord) -> None:
        time.sleep(SLOW_RECORD)
        self.threads.add(threading.current_thread().name)
        self.records.append(record)


@pytest.fixture
def slow_log() -> Iterator[_SlowHandler]:
    handler = _SlowHandler()
    logger = logging.getLogger(LOGGER)
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        assert btg.flush_reports(30.0)
        logger.removeHandler(handler)


def test_a_slow_log_handler_does_not_hold_up_other_deadlines(backend: Backend, slow_log: _SlowHandler,
                                                             stop: threading.Event) -> None:
    # Ten calls run out of their budget together, and each deadline record
    # takes the log handler 100 ms; another server's call, whose budget runs
    # out a little later, still ends on time (a second late, were the records
    # written on the timer's path).
    expiring, budget = 10, 0.3
    hooks: list[Any] = []

    async def stuck(req: bytes, ctx: Any) -> bytes:
        await stuck_in_here(lambda: stop.is_set() or not is_active(ctx), 3.0)
        return b""

    m = backend.mod
    handlers = {"Stuck": backend.handler("unary_unary", stuck)}
    with backend.serve(handlers, (m.ServerDeadlineInterceptor(0.05, on_deadline=hooks.append),)) as a, \
            backend.serve(handlers, (m.ServerDeadlineInterceptor(budget),)) as b, \
            backend.channel(a) as to_a, backend.channel(b) as to_b:
        calls = [Call(to_a, "unary_unary", "Stuck") for _ in range(expiring)] + [
            Call(to_b, "unary_unary", "Stuck")]
        results = backend.invoke_many(calls)
        assert btg.flush_reports(30.0)
    assert {r.code for r in results} == {grpc.StatusCode.DEADLINE_EXCEEDED}
    assert results[-1].elapsed < budget + 0.4, results[-1]  # not held up by the records
    assert len(slow_log.records) == expiring + 1 and len(hooks) == expiring
    assert slow_log.threads == {"bucketimer-grpc-reports"}


def test_the_queue_is_bounded_and_says_what_it_dropped(monkeypatch: pytest.MonkeyPatch,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    monkeypatch.setattr(_delivery, "LIMIT", 3)
    started, release = threading.Event(), threading.Event()
    ran: list[int] = []
    assert btg.flush_reports(10.0)

    def blocker() -> None:
        started.set()
        release.wait(10.0)

    _delivery.put(blocker)
    assert started.wait(10.0)  # the thread is busy: what follows waits
    for i in range(5):
        _delivery.put(ran.append, i)
    release.set()
    assert btg.flush_reports(10.0)
    assert ran == [0, 1, 2]
    assert wait_for(lambda: any("2 reports dropped" in r.getMessage() for r in caplog.records))


def test_a_failing_report_does_not_stop_the_thread(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.ERROR, logger=LOGGER)
    ran: list[str] = []

    def boom() -> None:
        raise RuntimeError("a report's bug")

    _delivery.put(boom)
    _delivery.put(ran.append, "after")
    assert btg.flush_reports(10.0)
    assert ran == ["after"]
    assert any("a report's bug" in (r.exc_text or str(r.exc_info)) for r in caplog.records)


def test_a_hook_may_flush_the_reports_it_is_one_of() -> None:
    done: list[bool] = []
    _delivery.put(lambda: done.append(btg.flush_reports(1.0)))
    assert btg.flush_reports(10.0)
    assert done == [True]
