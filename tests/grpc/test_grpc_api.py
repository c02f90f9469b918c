"""bucketimer.grpc and bucketimer.grpc.aio as modules: importing them,
their names, argument checking, and registering aio client interceptors."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest

grpc = pytest.importorskip("grpc")

from _grpc_harness import Backend  # noqa: E402

import bucketimer.grpc as btg  # noqa: E402
import bucketimer.grpc.aio as bta  # noqa: E402


def test_import_bucketimer_does_not_import_grpc() -> None:
    code = ("import sys, bucketimer\n"
            "assert 'bucketimer.grpc' not in sys.modules\n"
            "assert 'grpc' not in sys.modules\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.parametrize("module", ["bucketimer.grpc", "bucketimer.grpc.aio"])
def test_clear_import_error_without_grpcio(module: str) -> None:
    code = ("import sys\n"
            "sys.modules['grpc'] = None  # as if grpcio were not installed\n"
            "try:\n"
            f"    import {module}\n"
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


def test_public_names() -> None:
    shared = {"DeadlineEvent", "SlowCall", "current_deadline", "remaining", "flush_reports",
              "DefaultTimeoutInterceptor",
              "DeadlinePropagationInterceptor", "ServerDeadlineInterceptor", "SlowCallInterceptor",
              "ServerDeadlineSlowCallInterceptor"}
    assert set(btg.__all__) == shared | {"DeadlineInterrupt"}
    assert set(bta.__all__) == shared | {"client_interceptors"}
    for name in btg.__all__:
        assert getattr(btg, name) is getattr(btg.sync, name)
    # what both backends share is one object, not two
    assert bta.remaining is btg.remaining and bta.SlowCall is btg.SlowCall
    assert bta.DeadlineEvent is btg.DeadlineEvent and bta.current_deadline is btg.current_deadline
    assert btg.DEFAULT_DETAILS == bta.DEFAULT_DETAILS == "Deadline Exceeded"
    assert btg.logger.name == "bucketimer.grpc"


def test_interceptor_interfaces(backend: Backend) -> None:
    m = backend.mod
    api = grpc if backend.name == "sync" else grpc.aio
    assert isinstance(m.SlowCallInterceptor(1.0), api.ServerInterceptor)
    assert isinstance(m.ServerDeadlineInterceptor(1.0), api.ServerInterceptor)
    for ic in (m.SlowCallInterceptor(1.0), m.DefaultTimeoutInterceptor(1.0), m.DeadlinePropagationInterceptor()):
        for shape in ("UnaryUnary", "UnaryStream", "StreamUnary", "StreamStream"):
            assert isinstance(ic, getattr(api, f"{shape}ClientInterceptor"))
    assert repr(m.DefaultTimeoutInterceptor(1.0)).startswith("DefaultTimeoutInterceptor(timeout=1.0")


# -- argument checking -----------------------------------------------------------------------


@pytest.mark.parametrize("make", [
    lambda m: m.DefaultTimeoutInterceptor("1"),
    lambda m: m.DefaultTimeoutInterceptor(True),
    lambda m: m.ServerDeadlineInterceptor("1"),
    lambda m: m.SlowCallInterceptor(None),
    lambda m: m.SlowCallInterceptor("1"),
    lambda m: m.ServerDeadlineInterceptor(1.0, on_deadline=3),
    lambda m: m.SlowCallInterceptor(1.0, on_slow="no"),
])
def test_bad_arguments_type(backend: Backend, make: Callable[[Any], Any]) -> None:
    with pytest.raises(TypeError):
        make(backend.mod)


@pytest.mark.parametrize("make", [
    lambda m: m.DefaultTimeoutInterceptor(0),
    lambda m: m.DefaultTimeoutInterceptor(-1.0),
    lambda m: m.DefaultTimeoutInterceptor(float("nan")),
    lambda m: m.DefaultTimeoutInterceptor(1.0, margin=-0.1),
    lambda m: m.DefaultTimeoutInterceptor(1.0, margin=float("nan")),
    lambda m: m.ServerDeadlineInterceptor(0.0),
    lambda m: m.ServerDeadlineInterceptor(-1.0),
    lambda m: m.SlowCallInterceptor(-1),
])
def test_bad_arguments_value(backend: Backend, make: Callable[[Any], Any]) -> None:
    with pytest.raises(ValueError):
        make(backend.mod)


def test_remaining_outside_a_handler_is_none() -> None:
    assert btg.remaining() is None
    assert btg.current_deadline() is None


# -- registering aio client interceptors --------------------------------------------------------


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
    assert repr(out[1]) == f"<unary-stream {dt!r}>"
    with pytest.raises(TypeError):
        bta.client_interceptors(bta.ServerDeadlineInterceptor(1.0))
