"""What the interceptors log, as an operator sees it: every record on
``bucketimer.grpc`` carries the same ``extra`` fields; ``level=`` takes what
``logging`` takes; a deadline that ends a call is a WARNING and one slow call
is one warning; sync and aio, against a real server on 127.0.0.1."""

from __future__ import annotations

import logging
import threading
from typing import Any

import pytest

grpc = pytest.importorskip("grpc")

from _grpc_harness import LOGGER, SERVICE, Backend, stubborn, stuck_in_here, wait_for  # noqa: E402

FIELDS = ("grpc_event", "grpc_side", "grpc_method", "grpc_code", "grpc_elapsed", "grpc_budget",
          "grpc_source", "grpc_threshold", "grpc_finished")


def _logged(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [rec for rec in caplog.records if rec.name == LOGGER]


def _fields(rec: logging.LogRecord) -> dict[str, Any]:
    return {name: getattr(rec, name) for name in FIELDS}


def test_the_documented_fields_are_the_fields() -> None:
    from bucketimer.grpc import _records

    assert tuple(_records.FIELDS) == FIELDS


# -- level= ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("level,number", [("WARNING", logging.WARNING), ("DEBUG", logging.DEBUG),
                                          (logging.ERROR, logging.ERROR), (25, 25)])
def test_level_takes_what_logging_takes(backend: Backend, level: Any, number: int) -> None:
    m = backend.mod
    assert m.SlowCallInterceptor(1, level=level)._level == number
    both = m.ServerDeadlineSlowCallInterceptor(1, 2, level=level)
    assert both.slow_call_interceptor._level == number


@pytest.mark.parametrize("level,error", [("warning", ValueError), ("LOUD", ValueError),
                                         (1.5, TypeError), (True, TypeError), (None, TypeError)])
def test_bad_level_names_the_argument(backend: Backend, level: Any, error: type[Exception]) -> None:
    with pytest.raises(error, match="^level must be an int or a logging level name"):
        backend.mod.SlowCallInterceptor(1, level=level)


def slow_call(backend: Backend, shape: str = "unary_unary", side: str = "server", **options: Any) -> Any:
    """One call that passes a SlowCallInterceptor(0.05, **options) on
    ``side``: its handler stays until the threshold was reported; its status."""
    reports: list[Any] = []

    async def work(req: bytes, ctx: Any) -> bytes:
        await stuck_in_here(lambda: bool(reports), 2.0)
        return req

    ic = backend.mod.SlowCallInterceptor(0.05, on_slow=reports.append, **options)
    with backend.serve(backend.all_shapes("Slow", work), (ic,) if side == "server" else ()) as addr, \
            backend.channel(addr, *((ic,) if side == "client" else ())) as ch:
        r = backend.invoke(ch, shape, f"Slow_{shape}")
        assert wait_for(lambda: len(reports) == 2)
    return r.code


def expired_call(backend: Backend, caplog: pytest.LogCaptureFixture, stop: threading.Event,
                 shape: str = "unary_unary", records: int = 1, **options: Any) -> Any:
    """One call that runs out of a ServerDeadlineInterceptor(0.05, **options)
    budget, once ``records`` records are logged; its status."""
    ic = backend.mod.ServerDeadlineInterceptor(0.05, **options)
    with backend.serve(backend.all_shapes("Dl", stubborn([], stop)), (ic,)) as addr, backend.channel(addr) as ch:
        r = backend.invoke(ch, shape, f"Dl_{shape}")
        assert wait_for(lambda: len(_logged(caplog)) >= records)
    return r.code


@pytest.mark.parametrize("level,levels", [
    ("ERROR", [logging.ERROR, logging.INFO]),
    ("DEBUG", [logging.DEBUG, logging.DEBUG]),  # the end: INFO, or level if lower
])
def test_a_level_name_sets_the_records_level(backend: Backend, caplog: pytest.LogCaptureFixture,
                                             level: str, levels: list[int]) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    slow_call(backend, level=level)
    assert [rec.levelno for rec in _logged(caplog)] == levels


# -- what a default-configured service sees -------------------------------------------------------


def test_a_default_configured_service_sees_one_warning_per_slow_call(
        backend: Backend, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)  # logging's default threshold
    assert slow_call(backend) == grpc.StatusCode.OK
    (rec,) = _logged(caplog)
    assert rec.levelno == logging.WARNING and "still running" in rec.getMessage()


def test_a_default_configured_service_sees_a_deadline(backend: Backend, caplog: pytest.LogCaptureFixture,
                                                      stop: threading.Event) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    assert expired_call(backend, caplog, stop) == grpc.StatusCode.DEADLINE_EXCEEDED
    (rec,) = _logged(caplog)
    assert rec.levelno == logging.WARNING and "ran out of its 0.050 s budget" in rec.getMessage()


# -- the same fields on every record --------------------------------------------------------------


def test_deadline_record_fields(backend: Backend, caplog: pytest.LogCaptureFixture,
                                stop: threading.Event) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    expired_call(backend, caplog, stop, "unary_stream")
    (rec,) = _logged(caplog)
    f = _fields(rec)
    assert f["grpc_elapsed"] >= 0.05
    f["grpc_elapsed"] = None
    assert f == {"grpc_event": "deadline", "grpc_side": "server", "grpc_method": f"/{SERVICE}/Dl_unary_stream",
                 "grpc_code": "DEADLINE_EXCEEDED", "grpc_elapsed": None, "grpc_budget": 0.05,
                 "grpc_source": "max_time", "grpc_threshold": None, "grpc_finished": None}


@pytest.mark.parametrize("side", ["server", "client"])
def test_slow_record_fields(backend: Backend, caplog: pytest.LogCaptureFixture, side: str) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    slow_call(backend, "stream_unary", side, stack=False)
    start, end = (_fields(rec) for rec in _logged(caplog))
    assert start["grpc_elapsed"] >= 0.05 and end["grpc_elapsed"] >= start["grpc_elapsed"]
    start["grpc_elapsed"] = end["grpc_elapsed"] = None
    common = {"grpc_side": side, "grpc_method": f"/{SERVICE}/Slow_stream_unary", "grpc_elapsed": None,
              "grpc_budget": None, "grpc_source": None, "grpc_threshold": 0.05}
    assert start == {**common, "grpc_event": "slow", "grpc_code": None, "grpc_finished": False}
    assert end == {**common, "grpc_event": "slow_end", "grpc_code": "OK", "grpc_finished": True}


def test_hook_error_record_fields(backend: Backend, caplog: pytest.LogCaptureFixture,
                                  stop: threading.Event) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)

    def hook(ev: Any) -> None:
        raise RuntimeError("hook failed")

    expired_call(backend, caplog, stop, records=2, on_deadline=hook)
    deadline, error = _logged(caplog)
    assert error.levelno == logging.ERROR and error.exc_info is not None
    f = _fields(error)
    assert f["grpc_event"] == "hook_error"
    assert {k: v for k, v in f.items() if k != "grpc_event"} == \
        {k: v for k, v in _fields(deadline).items() if k != "grpc_event"}
