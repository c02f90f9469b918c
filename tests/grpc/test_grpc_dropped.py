"""The gRPC interceptors' state, dropped: servers and channels that used
every interceptor (deadlines fired and cancelled, slow calls reported) are
stopped and closed as grpc asks, the interceptors simply dropped (they have
no ``close()``); after :data:`tests.test_dropped.ROUNDS` of that the
process's fds and threads are back where they were, on either backend."""

from __future__ import annotations

import asyncio
import threading
from concurrent import futures
from typing import Any

import pytest

grpc = pytest.importorskip("grpc")

from test_dropped import _given_back  # noqa: E402

import bucketimer.grpc as btg  # noqa: E402
import bucketimer.grpc.aio as btg_aio  # noqa: E402

SERVICE = "bt.Dropped"


def _handlers(sleep: Any) -> Any:
    """``Quick`` returns at once (its timers cancelled), ``Late`` outlives
    its 10 ms budget (its deadline fires and is reported)."""
    async_ = asyncio.iscoroutinefunction(sleep)

    if async_:
        async def quick(request: bytes, context: Any) -> bytes:
            return request

        async def late(request: bytes, context: Any) -> bytes:
            try:
                await sleep(0.03)
            except asyncio.CancelledError:
                pass
            return request
    else:
        def quick(request: bytes, context: Any) -> bytes:  # type: ignore[misc]
            return request

        def late(request: bytes, context: Any) -> bytes:  # type: ignore[misc]
            sleep(0.03)
            return request

    return grpc.method_handlers_generic_handler(SERVICE, {
        "Quick": grpc.unary_unary_rpc_method_handler(quick),
        "Late": grpc.unary_unary_rpc_method_handler(late),
    })


def _interceptors(m: Any = btg) -> tuple[list[Any], list[Any]]:
    """A slow-call threshold of 5 ms and a budget of 10 ms on the server (one
    wrapper, both timers), a default timeout on the client: of module ``m``
    (``bucketimer.grpc``, or ``bucketimer.grpc.aio``)."""
    return ([m.ServerDeadlineSlowCallInterceptor(0.005, 0.01)],
            [m.DefaultTimeoutInterceptor(5.0)])


def _sync_round() -> None:
    server_ics, client_ics = _interceptors()
    pool = futures.ThreadPoolExecutor(max_workers=2)
    server = grpc.server(pool, interceptors=server_ics)
    server.add_generic_rpc_handlers([_handlers(threading.Event().wait)])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as plain:
            channel = grpc.intercept_channel(plain, *client_ics)
            quick = channel.unary_unary(f"/{SERVICE}/Quick")
            late = channel.unary_unary(f"/{SERVICE}/Late")
            assert quick(b"q") == b"q"
            with pytest.raises(grpc.RpcError) as ei:
                late(b"l")
            assert ei.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    finally:
        server.stop(None).wait()
        pool.shutdown(wait=True)
    btg.flush_reports(5.0)


async def _aio_call() -> None:
    server_ics, client_ics = _interceptors(btg_aio)
    server = grpc.aio.server(interceptors=server_ics)
    server.add_generic_rpc_handlers([_handlers(asyncio.sleep)])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}", interceptors=client_ics) as ch:
            assert await ch.unary_unary(f"/{SERVICE}/Quick")(b"q") == b"q"
            with pytest.raises(grpc.aio.AioRpcError) as ei:
                await ch.unary_unary(f"/{SERVICE}/Late")(b"l")
            assert ei.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    finally:
        await server.stop(None)


def _aio_round() -> None:
    asyncio.run(_aio_call())
    btg.flush_reports(5.0)


@pytest.mark.parametrize("api", ["sync", "aio"])
def test_interceptors_dropped_give_back_fds_and_threads(api: str) -> None:
    once = _sync_round if api == "sync" else _aio_round
    once()  # grpc's own process-wide threads and fds, started once
    _given_back(once)
