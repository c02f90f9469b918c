"""The drop-in loop under httpx: an HTTP client whose timeouts are anyio's.

httpx (through httpcore's anyio backend) wraps every socket operation and
every wait for a pooled connection in ``anyio.fail_after``, so each request
arms and disarms several cancel-scope deadlines, and a timeout cancels a
pending socket read or a wait on the pool rather than a sleep: the I/O side
of what ``test_with_anyio.py`` checks with sleeps.  The server is aiohttp's,
on 127.0.0.1.  What is pinned: a request in time disarms every deadline it
armed, and keep-alive serves several requests on one connection;
``read=`` raises ``httpx.ReadTimeout`` no earlier than the timeout and the
server cancels its handler once the client has closed the connection;
``pool=`` raises ``httpx.PoolTimeout`` for a request waiting on a pool whose
one connection is busy.  The TimerThread's counters show every deadline went
through the native core.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from _native_loop import LOOPS, NativeTimers

httpx = pytest.importorskip("httpx")
pytest.importorskip("aiohttp")
from aiohttp import web  # noqa: E402

LONG = 3600.0
SHORT = 0.3
# Upper bounds only; generous enough for a loaded 2-CPU machine and ASan.
SLACK = 10.0


@pytest.fixture(params=LOOPS)
def timers(request: pytest.FixtureRequest) -> Iterator[NativeTimers]:
    nt = NativeTimers(request.param)
    try:
        yield nt
    finally:
        nt.close()


def run(timers: NativeTimers, coro: Any) -> Any:
    with asyncio.Runner(loop_factory=timers.loop_factory) as runner:
        return runner.run(asyncio.wait_for(coro, 60))


class Server:
    """An aiohttp app: ``/`` answers at once, ``/hang`` never does."""

    def __init__(self) -> None:
        self.peers: list[Any] = []
        self.cancelled = asyncio.Event()
        self.hanging = asyncio.Event()
        self.app = web.Application()
        self.app.router.add_get("/", self.hello)
        self.app.router.add_get("/hang", self.hang)

    async def hello(self, request: web.Request) -> web.Response:
        assert request.transport is not None
        self.peers.append(request.transport.get_extra_info("peername"))
        return web.Response(text="hello")

    async def hang(self, request: web.Request) -> web.Response:
        self.hanging.set()
        try:
            await asyncio.sleep(LONG)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        return web.Response(text="too late")

    @contextlib.asynccontextmanager
    async def serve(self) -> AsyncIterator[str]:
        runner = web.AppRunner(self.app, handler_cancellation=True)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        try:
            host, port = runner.addresses[0][:2]
            yield f"http://{host}:{port}"
        finally:
            await runner.cleanup()


def test_requests_in_time_disarm_every_deadline(timers: NativeTimers) -> None:
    server = Server()

    async def main() -> list[str]:
        async with server.serve() as url:
            limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
            async with httpx.AsyncClient(timeout=30, limits=limits) as client:
                return [(await client.get(url)).text for _ in range(5)]

    assert run(timers, main()) == ["hello"] * 5
    assert len(server.peers) == 5 and len(set(server.peers)) == 1, server.peers
    # Per request at least a write and a read, each under its own deadline;
    # every deadline armed was disarmed, none ran.
    d = timers.assert_native(min_scheduled=10, min_cancelled=10)
    assert d["cancelled"] == d["scheduled"] and d["ran"] == 0, d


def test_read_timeout(timers: NativeTimers) -> None:
    server = Server()

    async def main() -> tuple[float, bool]:
        async with server.serve() as url:
            timeout = httpx.Timeout(30, read=SHORT)
            async with httpx.AsyncClient(timeout=timeout) as client:
                t0 = time.monotonic()
                with pytest.raises(httpx.ReadTimeout):
                    await client.get(f"{url}/hang")
                elapsed = time.monotonic() - t0
            try:
                await asyncio.wait_for(server.cancelled.wait(), SLACK)
            except TimeoutError:
                return elapsed, False
            return elapsed, True

    elapsed, handler_cancelled = run(timers, main())
    assert SHORT <= elapsed < SHORT + SLACK, elapsed
    assert handler_cancelled
    # The read deadline fired; the server's one-hour sleep was cancelled.
    timers.assert_native(min_scheduled=2, min_cancelled=2, min_ran=1)


def test_pool_timeout_while_the_only_connection_is_busy(timers: NativeTimers) -> None:
    server = Server()

    async def main() -> float:
        async with server.serve() as url:
            limits = httpx.Limits(max_connections=1)
            timeout = httpx.Timeout(30, pool=SHORT)
            async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
                busy = asyncio.create_task(client.get(f"{url}/hang"))
                await asyncio.wait_for(server.hanging.wait(), SLACK)
                t0 = time.monotonic()
                with pytest.raises(httpx.PoolTimeout):
                    await client.get(url)
                elapsed = time.monotonic() - t0
                busy.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await busy
            return elapsed

    elapsed = run(timers, main())
    assert SHORT <= elapsed < SHORT + SLACK, elapsed
    assert server.peers == []  # the second request never got a connection
    timers.assert_native(min_scheduled=3, min_cancelled=1, min_ran=1)
