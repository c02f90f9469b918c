"""The drop-in loop under grpc.aio: a real server and client on 127.0.0.1.

grpc enforces an RPC's deadline in its own core, not with loop timers; what
runs on the loop's timers is everything around it: the handlers' sleeps, the
client's ``asyncio.timeout``.  Each test checks on the TimerThread's counters
that those went through the native core; the harness arms no loop timer (its
limits are watchdog threads: ``_native_loop.within``), so the counts are
those timers' alone.  What is pinned: a unary call and a
server-streaming call within their deadlines succeed and the handler sees the
deadline in ``time_remaining()``; a call past its deadline ends with
``DEADLINE_EXCEEDED`` no earlier than the deadline, after the messages sent
before it, and grpc cancels the handler's task (its pending native timer is
cancelled with it); an ``asyncio.timeout`` on the client cancels a call that
has no gRPC deadline, and the server sees the call cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from _native_loop import LONG, SLACK, NativeTimers, within

grpc = pytest.importorskip("grpc")
pytest.importorskip("grpc.aio")

SERVICE = "bt.LoopTest"
# grpc's core keeps deadlines on its own millisecond clock: a deadline may
# be reported this much before the client's monotonic clock reaches it.
GRPC_CLOCK = 0.01
# A handler's time_remaining() can exceed the client's timeout by about
# 0.1 s (the deadline travels as a relative timeout, re-based on the core's
# cached clock); the stock asyncio loop shows the same.
REMAINING_SKEW = 1.0


class Service:
    """The handlers, and what they saw."""

    def __init__(self) -> None:
        self.remaining: list[float | None] = []
        self.cancelled: list[str] = []
        self.done = asyncio.Event()

    async def echo(self, request: bytes, context: Any) -> bytes:
        self.remaining.append(context.time_remaining())
        await asyncio.sleep(0.01)
        return request

    async def hang(self, request: bytes, context: Any) -> bytes:
        try:
            await asyncio.sleep(LONG)
        except asyncio.CancelledError:
            self.cancelled.append("hang")
            self.done.set()
            raise
        return request

    async def count(self, request: bytes, context: Any) -> AsyncIterator[bytes]:
        self.remaining.append(context.time_remaining())
        for i in range(int(request)):
            await asyncio.sleep(0.01)
            yield str(i).encode()

    async def count_then_hang(self, request: bytes, context: Any) -> AsyncIterator[bytes]:
        for i in range(int(request)):
            yield str(i).encode()
        try:
            await asyncio.sleep(LONG)
        except asyncio.CancelledError:
            self.cancelled.append("count_then_hang")
            self.done.set()
            raise
        yield b"too late"

    def handlers(self) -> Any:
        return grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "Echo": grpc.unary_unary_rpc_method_handler(self.echo),
                "Hang": grpc.unary_unary_rpc_method_handler(self.hang),
                "Count": grpc.unary_stream_rpc_method_handler(self.count),
                "CountThenHang": grpc.unary_stream_rpc_method_handler(self.count_then_hang),
            },
        )


@contextlib.asynccontextmanager
async def serve(service: Service) -> AsyncIterator[Any]:
    """A grpc.aio server on 127.0.0.1 (a free port); yields a channel to it."""
    server = grpc.aio.server()
    server.add_generic_rpc_handlers([service.handlers()])
    port = server.add_insecure_port("127.0.0.1:0")
    assert port
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield channel
    finally:
        await server.stop(None)


async def handler_ended(service: Service) -> bool:
    """Waits (at most SLACK, with no loop timer) until a hanging handler was
    cancelled."""
    try:
        await within(service.done.wait(), SLACK)
    except TimeoutError:
        return False
    return True


def test_unary_call_within_its_deadline(native: NativeTimers) -> None:
    service = Service()

    async def main() -> list[bytes]:
        async with serve(service) as channel:
            echo = channel.unary_unary(f"/{SERVICE}/Echo")
            return [await echo(f"hi {i}".encode(), timeout=30) for i in range(3)]

    assert native.run(main()) == [b"hi 0", b"hi 1", b"hi 2"]
    assert len(service.remaining) == 3
    assert all(r is not None and 0 < r <= 30 + REMAINING_SKEW for r in service.remaining), (
        service.remaining
    )
    # The handlers' sleeps were native timers, and ran.
    native.assert_native(min_scheduled=3, min_ran=3)


def test_unary_call_past_its_deadline(native: NativeTimers) -> None:
    service = Service()
    deadline = 0.3

    async def main() -> tuple[Any, float, bool]:
        async with serve(service) as channel:
            hang = channel.unary_unary(f"/{SERVICE}/Hang")
            t0 = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as exc_info:
                await hang(b"x", timeout=deadline)
            elapsed = time.monotonic() - t0
            return exc_info.value.code(), elapsed, await handler_ended(service)

    code, elapsed, ended = native.run(main())
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert deadline - GRPC_CLOCK <= elapsed < deadline + SLACK, elapsed
    assert ended and service.cancelled == ["hang"]
    # The handler's one-hour sleep was a native timer, cancelled with it.
    native.assert_native(min_scheduled=1, min_cancelled=1)


def test_server_streaming_call_within_its_deadline(native: NativeTimers) -> None:
    service = Service()

    async def main() -> list[bytes]:
        async with serve(service) as channel:
            count = channel.unary_stream(f"/{SERVICE}/Count")
            return [m async for m in count(b"5", timeout=30)]

    assert native.run(main()) == [str(i).encode() for i in range(5)]
    (remaining,) = service.remaining
    assert remaining is not None and 0 < remaining <= 30 + REMAINING_SKEW
    native.assert_native(min_scheduled=5, min_ran=5)


def test_server_streaming_call_past_its_deadline(native: NativeTimers) -> None:
    service = Service()
    deadline = 0.5

    async def main() -> tuple[list[bytes], Any, float, bool]:
        async with serve(service) as channel:
            count = channel.unary_stream(f"/{SERVICE}/CountThenHang")
            got: list[bytes] = []
            t0 = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as exc_info:
                async for m in count(b"3", timeout=deadline):
                    got.append(m)
            elapsed = time.monotonic() - t0
            return got, exc_info.value.code(), elapsed, await handler_ended(service)

    got, code, elapsed, ended = native.run(main())
    assert got == [b"0", b"1", b"2"]
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert deadline - GRPC_CLOCK <= elapsed < deadline + SLACK, elapsed
    assert ended and service.cancelled == ["count_then_hang"]
    native.assert_native(min_scheduled=1, min_cancelled=1)


def test_asyncio_timeout_cancels_a_call_without_deadline(native: NativeTimers) -> None:
    service = Service()
    budget = 0.3

    async def main() -> tuple[float, bool]:
        async with serve(service) as channel:
            hang = channel.unary_unary(f"/{SERVICE}/Hang")
            t0 = time.monotonic()
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(budget):
                    await hang(b"x")  # no gRPC deadline
            elapsed = time.monotonic() - t0
            return elapsed, await handler_ended(service)

    elapsed, ended = native.run(main())
    assert budget <= elapsed < budget + SLACK, elapsed
    assert ended and service.cancelled == ["hang"]
    # asyncio.timeout's timer fired natively; the handler's sleep was cancelled.
    native.assert_native(min_scheduled=2, min_cancelled=1, min_ran=1)
