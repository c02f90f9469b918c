"""Where a request's time goes in the service benchmark's server: a sampling
profile (py-spy) of one contender's server under load, summed by what the
frames are doing.

    python benchmarks/profile_service.py [--conns 1000] [CONTENDER ...]

Each contender's server (the kit's, ``workloads.start_service_server``) runs under the
kit's load generator; after the warm-up, ``py-spy record --nonblocking``
samples it for a few seconds.  Printed per contender: the share of samples
whose stack passes through asyncio's ``Timeout`` (``asyncio/timeouts.py``),
the stock loop's timer calls (``call_at``, ``TimerHandle``, ``cancel``),
streams, the selector transport (whose ``sock.recv``/``sock.send`` are the
system calls), the selector's poll, and the functions with the most samples
of their own.  C code (bucketimer's, heapq) is charged to the Python line
that called it.  Needs py-spy (``pip install py-spy``) and, in a container,
the right to trace the server (root, or ``CAP_SYS_PTRACE``).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

from bucketimer.bench.workloads import start_service_client, start_service_server

CATEGORIES: list[tuple[str, Callable[[str], bool]]] = [
    ("asyncio Timeout (timeouts.py)", lambda f: "asyncio/timeouts.py" in f),
    ("stock timer calls (call_at, TimerHandle, cancel)",
     lambda f: re.search(r"BaseEventLoop\.call_(at|later)|TimerHandle\.|Handle\.cancel ", f)
     is not None),
    ("either of the two: the timeouts' share",
     lambda f: "asyncio/timeouts.py" in f or re.search(
         r"BaseEventLoop\.call_(at|later)|TimerHandle\.|Handle\.cancel ", f) is not None),
    ("streams (streams.py)", lambda f: "asyncio/streams.py" in f),
    ("selector transport (recv/send system calls)", lambda f: "selector_events.py" in f),
    ("selector poll", lambda f: "selectors.py" in f),
    ("heartbeat (the stall probe)", lambda f: "heartbeat" in f),
]


def profile(contender: str, conns: int, seconds: int, out: str) -> None:
    """Samples the server of ``contender`` under ``conns`` connections
    (shares overlap: a stack counts in every category it passes through)."""
    server, port = start_service_server(contender, conns)
    try:
        client = start_service_client(port, conns, 1, seconds + 2, stdout=subprocess.DEVNULL)
        time.sleep(2)
        subprocess.run(["py-spy", "record", "--pid", str(server.pid), "-d", str(round(seconds)),
                        "-r", "250", "--nonblocking", "--format", "raw", "-o", out],
                       check=True, capture_output=True)
        client.wait(timeout=seconds + 30)
    finally:
        server.send_signal(signal.SIGTERM)
        server.communicate(timeout=30)


def summarize(path: str) -> list[str]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                stack, n = line.rstrip().rsplit(" ", 1)
                rows.append((stack.split(";"), int(n)))
    total = sum(n for _, n in rows) or 1
    lines = [f"{total} samples"]
    for name, hit in CATEGORIES:
        k = sum(n for st, n in rows if any(hit(fr) for fr in st))
        lines.append(f"  {100 * k / total:5.1f}%  {name}")
    own: collections.Counter[str] = collections.Counter()
    for st, n in rows:
        own[st[-1]] += n
    lines.append("  most samples of their own:")
    lines += [f"  {100 * n / total:5.1f}%  {fr}" for fr, n in own.most_common(8)]
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("contenders", nargs="*", default=["asyncio", "drop-in", "bucketimer"])
    p.add_argument("--conns", type=int, default=1000)
    p.add_argument("--seconds", type=int, default=5)
    args = p.parse_args()
    if shutil.which("py-spy") is None:
        print("py-spy is not on PATH (pip install py-spy)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as d:
        for name in args.contenders:
            out = os.path.join(d, f"{name}.raw")
            profile(name, args.conns, args.seconds, out)
            print(f"== {name}, {args.conns} connections: " + "\n".join(summarize(out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
