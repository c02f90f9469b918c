"""A real gRPC server on 127.0.0.1 for tests/otel/, sync or aio: one
service ``demo.S`` whose handlers are given, bytes in and out (no
protobuf), and one call to it."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import grpc
import grpc.aio

SERVICE = "demo.S"


@contextlib.contextmanager
def sync_server(handlers: dict[str, Any], interceptors: list[Any]) -> Iterator[str]:
    """A ``grpc.server`` serving ``handlers`` (name -> RpcMethodHandler):
    its address."""
    pool = futures.ThreadPoolExecutor(max_workers=4)
    server = grpc.server(pool, interceptors=interceptors)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, handlers)])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(None).wait(10)
        pool.shutdown(wait=False)


def sync_call(address: str, method: str, *, timeout: float = 10.0,
              shape: str = "unary_unary") -> grpc.StatusCode:
    """One call of ``/demo.S/method``: its status."""
    with grpc.insecure_channel(address) as channel:
        path = f"/{SERVICE}/{method}"
        try:
            if shape == "unary_unary":
                channel.unary_unary(path)(b"x", timeout=timeout)
            else:
                list(channel.unary_stream(path)(b"x", timeout=timeout))
        except grpc.RpcError as e:
            return e.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


class AioServer:
    """A ``grpc.aio.server`` on an event loop in a thread of its own, so
    that a test calls it as it calls a sync one."""

    def __init__(self, handlers: dict[str, Any], interceptors: list[Any]) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

        async def start() -> tuple[Any, int]:
            server = grpc.aio.server(interceptors=interceptors)
            server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, handlers)])
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            return server, port

        self.server, port = self.run(start())
        self.address = f"127.0.0.1:{port}"

    def run(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    def close(self) -> None:
        self.run(self.server.stop(None))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@contextlib.contextmanager
def server(api: str, work: Callable[..., Any], interceptors: list[Any],
           method: str = "M") -> Iterator[str]:
    """A server of ``api`` ("sync" or "aio") whose unary method ``method``
    runs ``work(request, context)`` (a coroutine function on aio): its
    address."""
    handlers = {method: grpc.unary_unary_rpc_method_handler(work)}
    if api == "sync":
        with sync_server(handlers, interceptors) as address:
            yield address
        return
    aio = AioServer(handlers, interceptors)
    try:
        yield aio.address
    finally:
        aio.close()
