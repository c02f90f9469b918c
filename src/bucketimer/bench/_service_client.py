"""The service benchmark's load generator, a process of its own: opens N
connections to the server, then each sends a request, waits for its
response and sends the next (closed loop, no pipelining), for a warm-up and
then a measured window bounded in time and in requests.  It is written to
cost the server's CPU as little as possible -- raw asyncio Protocols on
uvloop when installed, one fixed request per connection -- so that the
server is the bottleneck; its own CPU time over the window is reported so
that this can be checked (its time on a CPU and waiting for one).  It writes one JSON line: requests in the window,
the window's bounds (time.monotonic, the server's heartbeat clock), latency
quantiles and CPU time (docs/performance.rst, "The service benchmark").

    python -m bucketimer.bench._service_client --port P --conns 1000 --warmup 1 --duration 3
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import struct
import sys
import time
from array import array
from typing import Any, cast

from ._contenders import uvloop
from ._records import quantile
from ._service_wire import HOST, RESPONSE_PREFIX, ThreadClock, emit, raise_fd_limit, request

monotonic_ns = time.monotonic_ns
# Connections being opened at once (the server's listen backlog is larger).
CONNECT_CONCURRENCY = 256
CONNECT_LIMIT = 60.0  # s for all connections to open
# Close with a reset: thousands of sockets per turn left in TIME_WAIT would
# pile up over a run.
_LINGER_RESET = struct.pack("ii", 1, 0)


class _Conn(asyncio.Protocol):
    __slots__ = ("gen", "req", "transport", "sent", "buf", "done", "first", "last")

    def __init__(self, gen: LoadGenerator, ident: int) -> None:
        self.gen = gen
        self.req = request(ident)
        self.transport: asyncio.Transport | None = None
        self.sent = 0
        self.buf = b""
        self.done = 0  # responses in the window
        self.first = self.last = 0  # when the first and last of them came

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses.
        self.transport = cast(asyncio.Transport, transport)

    def send(self) -> None:
        self.sent = monotonic_ns()
        self.transport.write(self.req)  # type: ignore[union-attr]

    def data_received(self, data: bytes) -> None:
        if self.buf:
            data = self.buf + data
        if data[-1:] != b"\n":  # one request in flight: a response ends the data
            self.buf = data
            return
        self.buf = b""
        self.gen.answered(self, data)

    def connection_lost(self, exc: Exception | None) -> None:
        self.gen.lost(self)


class LoadGenerator:
    """N connections, each a closed loop of one request at a time."""

    def __init__(self, conns: int, max_requests: int) -> None:
        self.n = conns
        self.max_requests = max_requests
        self.conns: list[_Conn] = []
        self.running = False
        self.measuring = False
        self.count = 0
        self.errors = 0
        self.lost_early = 0
        self.latencies: array[int] = array("q")
        self.full: asyncio.Future[None] | None = None

    def answered(self, conn: _Conn, data: bytes) -> None:
        if self.measuring:
            now = monotonic_ns()
            self.latencies.append(now - conn.sent)
            self.count += 1
            if not conn.done:
                conn.first = now
            conn.done += 1
            conn.last = now
            if not data.startswith(RESPONSE_PREFIX):
                self.errors += 1
            if self.count >= self.max_requests and self.full is not None \
                    and not self.full.done():
                self.full.set_result(None)
        if self.running:
            conn.send()

    def lost(self, conn: _Conn) -> None:
        if self.running:
            self.lost_early += 1

    async def connect(self, port: int) -> None:
        loop = asyncio.get_running_loop()
        gate = asyncio.Semaphore(CONNECT_CONCURRENCY)

        async def one(i: int) -> None:
            async with gate:
                _, proto = await loop.create_connection(lambda: _Conn(self, i), HOST, port)
                self.conns.append(proto)

        await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(self.n))), CONNECT_LIMIT)

    async def run(self, warmup: float, duration: float) -> dict[str, Any]:
        loop = asyncio.get_running_loop()
        self.full = loop.create_future()
        self.running = True
        for c in self.conns:
            c.send()
        await asyncio.sleep(warmup)
        clock = ThreadClock()
        run0, wait0 = clock.read()
        t0 = monotonic_ns()
        self.measuring = True
        try:
            await asyncio.wait_for(self.full, duration)
        except TimeoutError:
            pass
        self.measuring = False
        t1 = monotonic_ns()
        run1, wait1 = clock.read()
        clock.close()
        self.running = False
        self.close()
        lat = sorted(self.latencies)
        # Requests/s as the sum over connections of each one's own rate
        # between its first and last response in the window: under
        # thousands of connections a saturated loop answers them in waves
        # (one loop iteration reads them all, the next answers them all),
        # and a count over the window would be off by up to a wave.
        # A connection answered fewer than twice adds what it got.
        paced = [c for c in self.conns if c.done >= 2 and c.last > c.first]
        rate = sum((c.done - 1) / (c.last - c.first) for c in paced) * 1e9
        rate += sum(c.done for c in self.conns if c.done < 2 or c.last <= c.first) / (
            (t1 - t0) / 1e9)
        return {
            "conns": len(self.conns), "requests": self.count, "errors": self.errors,
            "lost": self.lost_early, "t0": t0 / 1e9, "t1": t1 / 1e9,
            "rps": rate,
            "rps_count": self.count / ((t1 - t0) / 1e9), "paced": len(paced),
            "p50_ns": quantile(lat, 0.5), "p99_ns": quantile(lat, 0.99),
            "max_ns": float(lat[-1]) if lat else None,
            "busy": (run1 - run0 + wait1 - wait0) / (t1 - t0),
            "cpu": (run1 - run0) / (t1 - t0),
            "loop": type(loop).__module__ + "." + type(loop).__name__,
        }

    def close(self) -> None:
        for c in self.conns:
            t = c.transport
            if t is None or t.is_closing():
                continue
            sock = t.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
            t.close()


async def _main(args: argparse.Namespace) -> dict[str, Any]:
    gen = LoadGenerator(args.conns, args.max_requests)
    await gen.connect(args.port)
    if args.wait_go:
        # The runner says when the server serves every connection.
        print("CONNECTED", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    result = await gen.run(args.warmup, args.duration)
    await asyncio.sleep(0)  # the closes go out
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bucketimer.bench._service_client")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--conns", type=int, required=True)
    p.add_argument("--warmup", type=float, default=1.0, help="s before the window")
    p.add_argument("--duration", type=float, default=3.0, help="s of the measured window")
    p.add_argument("--max-requests", type=int, default=5_000_000,
                   help="end the window early at this many responses")
    p.add_argument("--wait-go", action="store_true",
                   help="once connected, print CONNECTED and wait for a line on stdin")
    args = p.parse_args(argv)
    limit = raise_fd_limit(args.conns)
    loop = uvloop.new_event_loop() if uvloop is not None else asyncio.new_event_loop()
    try:
        result = loop.run_until_complete(_main(args))
    finally:
        loop.close()
    result["fd_limit"] = limit
    emit(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
