"""The drop-in loop under aiohttp: a real server and client on 127.0.0.1.

Every test runs on :class:`bucketimer.EventLoop` and, where uvloop is
installed, on :class:`bucketimer.loop.UVEventLoop`, each with a TimerThread
of its own whose counters show that aiohttp's timers went through the native
core and not through the loop's own heap: the client arms ``ClientTimeout``'s
``total`` once per request and its ``sock_read`` at least once per request
(again on each chunk received), and disarms them when the response is done;
the server arms a keep-alive per connection.  The counts asserted are
aiohttp's alone: the harness arms no loop timer, and the handlers' own
sleeps are taken off (``own=``).  What is pinned: keep-alive reuses
one connection for several requests; a handler that outlives the client's
``total`` timeout makes the client raise ``TimeoutError`` no earlier than
that timeout and the server cancel the handler once the client has gone; a
body that stalls longer than ``sock_read`` raises ``ServerTimeoutError``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
from _native_loop import SLACK, NativeTimers, aiohttp_served, within

aiohttp = pytest.importorskip("aiohttp")
from aiohttp import web  # noqa: E402


def test_keep_alive_reuses_one_connection(native: NativeTimers) -> None:
    peers: list[tuple[str, int]] = []

    async def hello(request: web.Request) -> web.Response:
        assert request.transport is not None
        peers.append(request.transport.get_extra_info("peername"))
        await asyncio.sleep(0.001)  # a timer on the server side too
        return web.Response(text=f"hello {len(peers)}")

    async def main() -> list[str]:
        app = web.Application()
        app.router.add_get("/", hello)
        timeout = aiohttp.ClientTimeout(total=30, sock_read=20)
        async with aiohttp_served(app) as url:
            connector = aiohttp.TCPConnector(limit=1)
            async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
                bodies = []
                for _ in range(5):
                    async with session.get(url) as resp:
                        assert resp.status == 200
                        assert resp.headers.get("Connection", "keep-alive").lower() == "keep-alive"
                        bodies.append(await resp.text())
                return bodies

    assert native.run(main()) == [f"hello {i}" for i in range(1, 6)]
    # One client socket for all five requests: the connection was reused.
    assert len(peers) == 5 and len(set(peers)) == 1, peers
    # Each request armed its total and sock_read timers and, being in time,
    # disarmed them (the handlers' five sleeps, which ran, are the test's).
    native.assert_native(own={"scheduled": 5, "ran": 5}, min_scheduled=2 * 5,
                         min_cancelled=2 * 5)


def test_handler_outliving_the_total_timeout(native: NativeTimers) -> None:
    total = 0.3
    started = asyncio.Event()
    ended = asyncio.Event()
    outcome: list[str] = []

    async def slow(request: web.Request) -> web.Response:
        started.set()
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            outcome.append("cancelled")
            ended.set()
            raise
        outcome.append("finished")
        ended.set()
        return web.Response(text="too late")

    async def main() -> tuple[type[BaseException], float]:
        app = web.Application()
        app.router.add_get("/slow", slow)
        async with aiohttp_served(app) as url:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=total)) as session:
                t0 = time.monotonic()
                with pytest.raises(TimeoutError) as exc_info:
                    async with session.get(f"{url}/slow") as resp:
                        await resp.read()
                elapsed = time.monotonic() - t0
            assert started.is_set()
            # The client closed its connection: the server cancels the handler.
            with contextlib.suppress(TimeoutError):
                await within(ended.wait(), SLACK)
            return exc_info.type, elapsed

    exc_type, elapsed = native.run(main())
    assert issubclass(exc_type, TimeoutError)
    native.assert_on_time(total, elapsed)
    assert outcome == ["cancelled"]
    # The client's total timer fired through the core (the handler's
    # one-hour sleep, cancelled with the handler, is the test's).
    native.assert_native(own={"scheduled": 1, "cancelled": 1}, min_scheduled=1, min_ran=1)


def test_body_stalling_longer_than_sock_read(native: NativeTimers) -> None:
    sock_read = 0.3
    outcome: list[str] = []

    async def stalls(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse()
        resp.content_length = 1000
        await resp.prepare(request)
        await resp.write(b"x" * 10)
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            outcome.append("cancelled")
            raise
        return resp

    async def main() -> tuple[bytes, float]:
        app = web.Application()
        app.router.add_get("/stalls", stalls)
        timeout = aiohttp.ClientTimeout(total=60, sock_read=sock_read)
        async with aiohttp_served(app) as url:
            async with aiohttp.ClientSession(timeout=timeout) as session:
                # Before the request: the sock_read timer restarts at the last
                # data received, which comes after this.
                t0 = time.monotonic()
                async with session.get(f"{url}/stalls") as resp:
                    assert resp.status == 200
                    first = await resp.content.readexactly(10)
                    with pytest.raises(aiohttp.ServerTimeoutError):
                        await resp.read()
                    return first, time.monotonic() - t0

    first, elapsed = native.run(main())
    assert first == b"x" * 10
    native.assert_on_time(sock_read, elapsed)
    # The server's clean-up cancelled the stalled handler.
    assert outcome == ["cancelled"]
    # The sock_read timer fired; the total timer was armed and disarmed
    # (the handler's one-hour sleep is the test's).
    native.assert_native(own={"scheduled": 1, "cancelled": 1}, min_scheduled=2,
                         min_cancelled=1, min_ran=1)
