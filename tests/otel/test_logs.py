"""What bucketimer logs, as a log pipeline takes it: one-line messages,
the stuck handler's stack in the record's ``stack_info`` from the
handler's first frame on, every ``extra`` field JSON-serialisable
(``grpc_code`` the status code's name), and the drop-in loop's "Using
selector" line naming the selector it wraps, as asyncio's does."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from _helpers import wait_until

grpc = pytest.importorskip("grpc")

from _serving import SERVICE, sync_call, sync_server  # noqa: E402

import bucketimer  # noqa: E402
import bucketimer.grpc as btg  # noqa: E402
from bucketimer.grpc import _records  # noqa: E402


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def logged() -> Iterator[list[logging.LogRecord]]:
    logger = logging.getLogger("bucketimer.grpc")
    handler, level = Records(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield handler.records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _as_json(record: logging.LogRecord) -> dict[str, Any]:
    """The record as a JSON log handler writes it: message, fields, stack."""
    fields = {name: getattr(record, name) for name in _records.FIELDS}
    return json.loads(json.dumps({"message": record.getMessage(), "stack_info": record.stack_info,
                                  **fields}))


def waiting_handler(reported: threading.Event) -> Any:
    def stuck_handler(request: bytes, context: Any) -> bytes:
        reported.wait(10)  # until the threshold was reported
        return request

    return stuck_handler


def waiting_stream(reported: threading.Event) -> Any:
    def stuck_stream(request: bytes, context: Any) -> Iterator[bytes]:
        reported.wait(10)
        yield request

    return stuck_stream


INTERCEPTORS = {
    # (interceptor, handler factory, call shape, the handler's name)
    "unary": (lambda hook: btg.SlowCallInterceptor(0.05, on_slow=hook),
              waiting_handler, "unary_unary", "stuck_handler"),
    "stream": (lambda hook: btg.SlowCallInterceptor(0.05, on_slow=hook),
               waiting_stream, "unary_stream", "stuck_stream"),
    "both": (lambda hook: btg.ServerDeadlineSlowCallInterceptor(0.05, 10.0, on_slow=hook),
             waiting_handler, "unary_unary", "stuck_handler"),
}


@pytest.mark.parametrize("kind", INTERCEPTORS)
def test_a_slow_call_is_one_line_and_its_stack_the_handlers(
        kind: str, logged: list[logging.LogRecord]) -> None:
    make_ic, make_handler, shape, name = INTERCEPTORS[kind]
    reported = threading.Event()
    ic = make_ic(lambda info: reported.set() if not info.finished else None)
    make = grpc.unary_unary_rpc_method_handler if shape == "unary_unary" else \
        grpc.unary_stream_rpc_method_handler
    with sync_server({"Slow": make(make_handler(reported))}, [ic]) as address:
        assert sync_call(address, "Slow", shape=shape) == grpc.StatusCode.OK
    assert btg.flush_reports(10.0)  # the call's end is reported on the reports' thread
    slow, end = [r for r in logged if r.grpc_event in ("slow", "slow_end")]  # type: ignore[attr-defined]
    for record in (slow, end):
        assert "\n" not in record.getMessage(), record.getMessage()
    got = _as_json(slow)
    assert got["message"].startswith(f"slow gRPC server call /{SERVICE}/Slow still running after ")
    stack = got["stack_info"]
    assert stack.startswith("Stack (most recent call last):\n  File ")
    # from the handler's own frame on: not grpc's pool, not the interceptor
    first = stack.splitlines()[1]
    assert first.endswith(f", in {name}") and __file__ in first, stack
    for machinery in ("concurrent/futures", "grpc/_server.py", "bucketimer"):
        assert machinery not in stack, stack
    assert _as_json(end)["grpc_code"] == "OK" and end.stack_info is None


def test_grpc_code_is_the_status_codes_name(logged: list[logging.LogRecord]) -> None:
    stop = threading.Event()

    def stubborn(request: bytes, context: Any) -> bytes:
        stop.wait(10)
        return request

    ic = btg.ServerDeadlineInterceptor(0.05)
    try:
        with sync_server({"Dl": grpc.unary_unary_rpc_method_handler(stubborn)}, [ic]) as address:
            assert sync_call(address, "Dl") == grpc.StatusCode.DEADLINE_EXCEEDED
            # logged on the timer's thread once the client has its status
            assert wait_until(lambda: any(r.grpc_event == "deadline" for r in logged))  # type: ignore[attr-defined]
            stop.set()
    finally:
        stop.set()
    [deadline] = [r for r in logged if r.grpc_event == "deadline"]  # type: ignore[attr-defined]
    got = _as_json(deadline)
    assert got["grpc_code"] == "DEADLINE_EXCEEDED" and got["grpc_budget"] == 0.05
    assert "\n" not in got["message"] and got["stack_info"] is None


def _selector_logged(make_loop: Any, caplog: pytest.LogCaptureFixture) -> list[str]:
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="asyncio"):
        loop = make_loop()
        loop.close()
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("Using selector")]


def test_the_drop_in_loop_names_the_selector_it_wraps(caplog: pytest.LogCaptureFixture) -> None:
    stock = _selector_logged(asyncio.SelectorEventLoop, caplog)
    assert stock and stock == _selector_logged(bucketimer.EventLoop, caplog), stock
