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
through the native core.  They count httpx's alone: the server runs on a stock
loop in a thread of its own, and the harness arms no loop timer.
"""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
from _native_loop import LONG, SLACK, NativeTimers, aiohttp_served_elsewhere

httpx = pytest.importorskip("httpx")
pytest.importorskip("aiohttp")
from aiohttp import web  # noqa: E402

# A timeout that must fire.
SHORT = 0.3


class Server:
    """An aiohttp app: ``/`` answers at once, ``/hang`` never does.  It runs
    in another thread (:func:`aiohttp_served_elsewhere`): it tells the test
    through a ``threading.Event``, which the test waits for in a worker
    thread (``asyncio.to_thread``), not with a loop timer."""

    def __init__(self) -> None:
        self.peers: list[Any] = []
        self.cancelled = threading.Event()
        self.hanging = threading.Event()
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


def test_requests_in_time_disarm_every_deadline(native: NativeTimers) -> None:
    server = Server()

    async def main() -> list[str]:
        async with aiohttp_served_elsewhere(server.app) as url:
            limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
            async with httpx.AsyncClient(timeout=30, limits=limits) as client:
                return [(await client.get(url)).text for _ in range(5)]

    assert native.run(main()) == ["hello"] * 5
    assert len(server.peers) == 5 and len(set(server.peers)) == 1, server.peers
    # Per request at least a write and a read, each under its own deadline;
    # every deadline armed was disarmed, none ran.
    d = native.assert_native(min_scheduled=2 * 5, min_cancelled=2 * 5)
    assert d["cancelled"] == d["scheduled"] and d["ran"] == 0, d


def test_read_timeout(native: NativeTimers) -> None:
    server = Server()

    async def main() -> tuple[float, bool]:
        async with aiohttp_served_elsewhere(server.app) as url:
            timeout = httpx.Timeout(30, read=SHORT)
            async with httpx.AsyncClient(timeout=timeout) as client:
                t0 = time.monotonic()
                with pytest.raises(httpx.ReadTimeout):
                    await client.get(f"{url}/hang")
                elapsed = time.monotonic() - t0
            return elapsed, await asyncio.to_thread(server.cancelled.wait, SLACK)

    elapsed, handler_cancelled = native.run(main())
    native.assert_on_time(SHORT, elapsed)
    assert handler_cancelled
    # The connect and write deadlines were disarmed in time, the read
    # deadline fired.
    native.assert_native(min_scheduled=3, min_cancelled=2, min_ran=1)


def test_pool_timeout_while_the_only_connection_is_busy(native: NativeTimers) -> None:
    server = Server()

    async def main() -> float:
        async with aiohttp_served_elsewhere(server.app) as url:
            limits = httpx.Limits(max_connections=1)
            timeout = httpx.Timeout(30, pool=SHORT)
            async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
                busy = asyncio.create_task(client.get(f"{url}/hang"))
                assert await asyncio.to_thread(server.hanging.wait, SLACK)
                t0 = time.monotonic()
                with pytest.raises(httpx.PoolTimeout):
                    await client.get(url)
                elapsed = time.monotonic() - t0
                busy.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await busy
            return elapsed

    elapsed = native.run(main())
    native.assert_on_time(SHORT, elapsed)
    assert server.peers == []  # the second request never got a connection
    # The busy request's connect and write deadlines were disarmed in time,
    # its read deadline when it was cancelled; the waiting request's pool
    # deadline fired.
    native.assert_native(min_scheduled=4, min_cancelled=3, min_ran=1)
