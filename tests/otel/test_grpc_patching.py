"""What importing bucketimer.grpc does to grpc, said and undone: it wraps
the four grpc functions that take interceptors (``patch_grpc()``, all four
on every grpcio supported: ``nox -s grpc-bounds`` runs this on the oldest
and the newest), ``unpatch_grpc()`` gives them back, and with
``BUCKETIMER_GRPC_PATCH=0`` nothing of grpc's is touched while the
interceptors still serve every call kind given through
``client_interceptors()``."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

grpc = pytest.importorskip("grpc")

import bucketimer.grpc as btg  # noqa: E402
from bucketimer.grpc import _registration  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TARGETS = ["grpc.aio._channel.Channel.__init__", "grpc.aio._server.Server.__init__",
           "grpc._server._Server.__init__", "grpc._interceptor.intercept_channel"]


def _run(code: str, **env: str) -> str:
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_importing_wraps_the_four_and_says_so() -> None:
    # all four found in this grpcio: patch_grpc() names them (and wraps nothing twice)
    assert btg.patch_grpc() == TARGETS
    import grpc.aio._channel

    wrapped = grpc.aio._channel.Channel.__init__
    assert wrapped._bucketimer_fix is _registration._aio_channel  # type: ignore[attr-defined]
    btg.unpatch_grpc()
    try:
        original = grpc.aio._channel.Channel.__init__
        assert not hasattr(original, "_bucketimer_fix") and wrapped.__wrapped__ is original  # type: ignore[attr-defined]
        assert grpc._interceptor.intercept_channel.__module__ == "grpc._interceptor"
    finally:
        assert btg.patch_grpc() == TARGETS


def test_opting_out_touches_nothing_of_grpcs() -> None:
    out = _run("""
        import asyncio, grpc, grpc.aio, grpc._server, grpc._interceptor, grpc.aio._channel
        import grpc.aio._server
        before = [grpc.aio._channel.Channel.__init__, grpc.aio._server.Server.__init__,
                  grpc._server._Server.__init__, grpc._interceptor.intercept_channel]
        import bucketimer.grpc, bucketimer.grpc.aio as bta
        after = [grpc.aio._channel.Channel.__init__, grpc.aio._server.Server.__init__,
                 grpc._server._Server.__init__, grpc._interceptor.intercept_channel]
        print(all(a is b for a, b in zip(before, after)))

        async def main():
            # grpc's own checks, not bucketimer's TypeError naming the class to use
            try:
                grpc.aio.server(interceptors=[bucketimer.grpc.SlowCallInterceptor(1.0)])
            except ValueError as e:
                print("grpc:", str(e).split(",")[0])
            async def stream(request, context):
                yield context.time_remaining() is not None and b"deadline" or b"none"
            server = grpc.aio.server()
            server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
                "demo.S", {"M": grpc.unary_stream_rpc_method_handler(stream)})])
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            # a unary-stream call gets the default timeout through client_interceptors()
            ics = bta.client_interceptors(bta.DefaultTimeoutInterceptor(5.0))
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", interceptors=ics) as ch:
                print([r async for r in ch.unary_stream("/demo.S/M")(b"")])
            await server.stop(None)

        asyncio.run(main())
    """, BUCKETIMER_GRPC_PATCH="0")
    assert out == "True\ngrpc: Interceptor must be ServerInterceptor\n[b'deadline']\n"


def test_the_readme_names_the_patch_and_its_opt_out() -> None:
    readme = (ROOT / "README.rst").read_text(encoding="utf-8")
    for what in ("patch_grpc", "unpatch_grpc", "BUCKETIMER_GRPC_PATCH=0", "client_interceptors",
                 "grpc-bounds"):
        assert what in readme, what
