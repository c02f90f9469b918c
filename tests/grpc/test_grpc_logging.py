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


def test_a_level_name_sets_the_records_level(backend: Backend, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    reports: list[Any] = []

    async def work(req: bytes, ctx: Any) -> bytes:
        await stuck_in_here(lambda: bool(reports), 2.0)
        return req

    ic = backend.mod.SlowCallInterceptor(0.05, on_slow=reports.append, level="ERROR")
    with backend.serve(backend.all_shapes("Lvl", work), (ic,)) as addr, backend.channel(addr) as ch:
        backend.invoke(ch, "unary_unary", "Lvl_unary_unary")
        assert wait_for(lambda: len(reports) == 2)
    assert [rec.levelno for rec in _logged(caplog)] == [logging.ERROR, logging.INFO]


def test_a_level_below_info_logs_the_end_at_that_level(backend: Backend,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    reports: list[Any] = []

    async def work(req: bytes, ctx: Any) -> bytes:
        await stuck_in_here(lambda: bool(reports), 2.0)
        return req

    ic = backend.mod.SlowCallInterceptor(0.05, on_slow=reports.append, level="DEBUG")
    with backend.serve(backend.all_shapes("Dbg", work), (ic,)) as addr, backend.channel(addr) as ch:
        backend.invoke(ch, "unary_unary", "Dbg_unary_unary")
        assert wait_for(lambda: len(reports) == 2)
    assert [rec.levelno for rec in _logged(caplog)] == [logging.DEBUG, logging.DEBUG]


# -- what a default-configured service sees -------------------------------------------------------


def test_a_default_configured_service_sees_one_warning_per_slow_call(
        backend: Backend, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)  # logging's default threshold
    reports: list[Any] = []

    async def work(req: bytes, ctx: Any) -> bytes:
        await stuck_in_here(lambda: bool(reports), 2.0)
        return req

    ic = backend.mod.SlowCallInterceptor(0.05, on_slow=reports.append)
    with backend.serve(backend.all_shapes("One", work), (ic,)) as addr, backend.channel(addr) as ch:
        r = backend.invoke(ch, "unary_unary", "One_unary_unary")
        assert wait_for(lambda: len(reports) == 2)
    assert r.code == grpc.StatusCode.OK
    (rec,) = _logged(caplog)
    assert rec.levelno == logging.WARNING and "still running" in rec.getMessage()


def test_a_default_configured_service_sees_a_deadline(backend: Backend, caplog: pytest.LogCaptureFixture,
                                                      stop: threading.Event) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    with backend.serve(backend.all_shapes("Dl", stubborn([], stop)),
                       (backend.mod.ServerDeadlineInterceptor(0.05),)) as addr, backend.channel(addr) as ch:
        r = backend.invoke(ch, "unary_unary", "Dl_unary_unary")
        assert wait_for(lambda: bool(_logged(caplog)))
    assert r.code == grpc.StatusCode.DEADLINE_EXCEEDED
    (rec,) = _logged(caplog)
    assert rec.levelno == logging.WARNING and "ran out of its 0.050 s budget" in rec.getMessage()


# -- the same fields on every record --------------------------------------------------------------


def test_deadline_record_fields(backend: Backend, caplog: pytest.LogCaptureFixture,
                                stop: threading.Event) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    with backend.serve(backend.all_shapes("Df", stubborn([], stop)),
                       (backend.mod.ServerDeadlineInterceptor(0.05),)) as addr, backend.channel(addr) as ch:
        backend.invoke(ch, "unary_stream", "Df_unary_stream")
        assert wait_for(lambda: bool(_logged(caplog)))
    (rec,) = _logged(caplog)
    f = _fields(rec)
    assert f["grpc_elapsed"] >= 0.05
    f["grpc_elapsed"] = None
    assert f == {"grpc_event": "deadline", "grpc_side": "server", "grpc_method": f"/{SERVICE}/Df_unary_stream",
                 "grpc_code": grpc.StatusCode.DEADLINE_EXCEEDED, "grpc_elapsed": None, "grpc_budget": 0.05,
                 "grpc_source": "max_time", "grpc_threshold": None, "grpc_finished": None}


@pytest.mark.parametrize("side", ["server", "client"])
def test_slow_record_fields(backend: Backend, caplog: pytest.LogCaptureFixture, side: str) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    reports: list[Any] = []

    async def work(req: bytes, ctx: Any) -> bytes:
        await stuck_in_here(lambda: bool(reports), 2.0)
        return req

    ic = backend.mod.SlowCallInterceptor(0.05, on_slow=reports.append, stack=False)
    server_ics = (ic,) if side == "server" else ()
    client_ics = (ic,) if side == "client" else ()
    with backend.serve(backend.all_shapes("Sf", work), server_ics) as addr, \
            backend.channel(addr, *client_ics) as ch:
        backend.invoke(ch, "stream_unary", "Sf_stream_unary")
        assert wait_for(lambda: len(reports) == 2)
    start, end = (_fields(rec) for rec in _logged(caplog))
    assert start["grpc_elapsed"] >= 0.05 and end["grpc_elapsed"] >= start["grpc_elapsed"]
    start["grpc_elapsed"] = end["grpc_elapsed"] = None
    common = {"grpc_side": side, "grpc_method": f"/{SERVICE}/Sf_stream_unary", "grpc_elapsed": None,
              "grpc_budget": None, "grpc_source": None, "grpc_threshold": 0.05}
    assert start == {**common, "grpc_event": "slow", "grpc_code": None, "grpc_finished": False}
    assert end == {**common, "grpc_event": "slow_end", "grpc_code": grpc.StatusCode.OK, "grpc_finished": True}


def test_hook_error_record_fields(backend: Backend, caplog: pytest.LogCaptureFixture,
                                  stop: threading.Event) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)

    def hook(ev: Any) -> None:
        raise RuntimeError("hook failed")

    ic = backend.mod.ServerDeadlineInterceptor(0.05, on_deadline=hook)
    with backend.serve(backend.all_shapes("Hk", stubborn([], stop)), (ic,)) as addr, backend.channel(addr) as ch:
        backend.invoke(ch, "unary_unary", "Hk_unary_unary")
        assert wait_for(lambda: len(_logged(caplog)) == 2)
    deadline, error = _logged(caplog)
    assert error.levelno == logging.ERROR and error.exc_info is not None
    f = _fields(error)
    assert f["grpc_event"] == "hook_error"
    assert {k: v for k, v in f.items() if k != "grpc_event"} == \
        {k: v for k, v in _fields(deadline).items() if k != "grpc_event"}
