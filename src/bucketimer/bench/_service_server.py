"""The service benchmark's server process: an asyncio streams server on
127.0.0.1 whose connections each send requests back to back.  It handles
each request under ``async with timeout(...)`` and keeps an idle timeout
that it moves on every request with ``Timeout.reschedule()`` -- the same
code for every contender; only the loop and which ``timeout`` it uses
differ (``patched drop-in`` runs asyncio's after ``patch_asyncio()``).  A heartbeat task measures its own lateness (the loop's stalls), the
RSS and the process's CPU time; on SIGTERM the server writes those beats as
one JSON line and exits (docs/performance.rst, "The service benchmark").

    python -m bucketimer.bench._service_server --contender asyncio --conns 1000
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import time
from array import array
from collections.abc import Callable, Coroutine
from contextlib import AbstractAsyncContextManager
from typing import Any

import bucketimer

from ._contenders import BUCKETIMER, PATCHED, new_loop
from ._service_wire import (
    HOST,
    REQUEST_PREFIX,
    RESPONSE_PREFIX,
    ThreadClock,
    emit,
    raise_fd_limit,
    sockets_allowed,
)

IDLE_TIMEOUT = 30.0  # s without a request before a connection is closed
REQUEST_TIMEOUT = 10.0  # s a request may take
BEAT = 0.010  # s between two heartbeats
# wake-up time (s), lateness (s), RSS (bytes), the loop thread's time on a
# CPU and waiting for one (ns), the process's CPU time (s, every thread)
BEAT_FIELDS = 6

TimeoutFn = Callable[[float], AbstractAsyncContextManager[Any]]
Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Coroutine[Any, Any, None]]


def connection_handler(timeout: TimeoutFn, on_open: Callable[[], None] | None = None
                       ) -> Handler:
    """The server's code for one connection, written as a service would;
    ``on_open()`` is called as each connection's handler starts."""

    async def respond(line: bytes) -> bytes:
        return RESPONSE_PREFIX + line[len(REQUEST_PREFIX):]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        if on_open is not None:
            on_open()
        try:
            async with timeout(IDLE_TIMEOUT) as idle:
                while True:
                    line = await reader.readline()
                    if not line:
                        break
                    idle.reschedule(loop.time() + IDLE_TIMEOUT)
                    async with timeout(REQUEST_TIMEOUT):
                        writer.write(await respond(line))
                        await writer.drain()
        except (TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()

    return handle


async def heartbeat(beats: array[float], interval: float = BEAT) -> None:
    """Sleeps ``interval`` over and over and records, per wake-up, its time
    (time.monotonic, the clock the client's window is in), how late it woke
    (the longest callback or loop iteration in between), the RSS, and the
    loop thread's time on and waiting for a CPU, and the process's CPU time."""
    mono, process_time = time.monotonic, time.process_time
    page = os.sysconf("SC_PAGE_SIZE")
    statm = os.open("/proc/self/statm", os.O_RDONLY)
    clock = ThreadClock()  # this task runs on the loop's thread
    try:
        while True:
            t0 = mono()
            await asyncio.sleep(interval)
            t1 = mono()
            rss = int(os.pread(statm, 128, 0).split()[1]) * page
            run, wait = clock.read()
            beats.extend((t1, t1 - t0 - interval, float(rss), float(run), float(wait),
                          process_time()))
    finally:
        os.close(statm)
        clock.close()


async def serve(contender: str, conns: int, lifetime: float) -> dict[str, Any]:
    limit = raise_fd_limit(conns)
    timeout: TimeoutFn = bucketimer.timeout if contender == BUCKETIMER else asyncio.timeout
    loop = asyncio.get_running_loop()
    stop = loop.create_future()

    def done() -> None:
        if not stop.done():
            stop.set_result(None)

    loop.add_signal_handler(signal.SIGTERM, done)
    # Bounded even if the parent never signals.
    loop.call_later(lifetime, done)
    opened = [0]

    def on_open() -> None:
        # Under load uvloop admits one new connection per loop iteration:
        # the load starts only once every connection is being served.
        opened[0] += 1
        if opened[0] == conns:
            print("READY", flush=True)

    server = await asyncio.start_server(connection_handler(timeout, on_open), HOST, 0,
                                        backlog=min(conns, 4096))
    port = server.sockets[0].getsockname()[1]
    beats: array[float] = array("d")
    beat_task = asyncio.create_task(heartbeat(beats))
    print(f"PORT {port} SOCKETS {sockets_allowed(limit)}", flush=True)
    await stop
    beat_task.cancel()
    server.close()
    return {"contender": contender, "loop": type(loop).__module__ + "." + type(loop).__name__,
            "beat_fields": BEAT_FIELDS, "beats": beats.tolist()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bucketimer.bench._service_server")
    p.add_argument("--contender", required=True)
    p.add_argument("--conns", type=int, required=True, help="connections to expect")
    p.add_argument("--lifetime", type=float, default=300.0, help="s before exiting anyway")
    args = p.parse_args(argv)
    if args.contender == PATCHED:
        bucketimer.patch_asyncio()
    loop = new_loop(args.contender)
    try:
        result = loop.run_until_complete(serve(args.contender, args.conns, args.lifetime))
    finally:
        loop.close()
    emit(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
