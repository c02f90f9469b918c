"""What the service benchmark's processes share: the line protocol of its
requests and responses, the file-descriptor limit each process raises for
itself, and how a process hands its result back (one JSON line on stdout).
See docs/performance.rst, "The service benchmark"."""

from __future__ import annotations

import json
import os
import resource
import sys
from typing import Any

HOST = "127.0.0.1"
# A request: b"GET <10-digit id>\n"; its response: b"OK <the same id>\n".
REQUEST_PREFIX = b"GET "
RESPONSE_PREFIX = b"OK "
ID_DIGITS = 10
# File descriptors a process needs beside its sockets (stdio, the
# selector or libuv's, the eventfd, the interpreter's own files).
SPARE_FDS = 64


class ThreadClock:
    """The calling thread's time on a CPU and time waiting for one (ns),
    from ``/proc/thread-self/schedstat``: their sum over a window is the
    share of it the thread wanted to run, whoever else had the CPUs."""

    def __init__(self) -> None:
        self.fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY)

    def read(self) -> tuple[int, int]:
        run, wait = os.pread(self.fd, 128, 0).split()[:2]
        return int(run), int(wait)

    def close(self) -> None:
        os.close(self.fd)


def request(ident: int) -> bytes:
    return b"%s%0*d\n" % (REQUEST_PREFIX, ID_DIGITS, ident % 10**ID_DIGITS)


def raise_fd_limit(sockets: int) -> int:
    """Raises RLIMIT_NOFILE so that ``sockets`` sockets fit, the hard limit
    too where the process may (root may, up to ``fs.nr_open``); returns the
    soft limit now in force, which may still be too low."""
    want = sockets + SPARE_FDS
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= want:
        return soft
    if hard != resource.RLIM_INFINITY and hard < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, want))
            return want
        except (ValueError, OSError):
            want = hard
    resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    return want


def sockets_allowed(limit: int) -> int:
    """How many sockets fit under an fd limit of ``limit``."""
    return max(0, limit - SPARE_FDS)


def emit(result: dict[str, Any]) -> None:
    """The result of a process: one JSON line on stdout."""
    sys.stdout.write(json.dumps(result, separators=(",", ":")) + "\n")
    sys.stdout.flush()


def parse_result(stdout: str) -> dict[str, Any]:
    """The JSON line :func:`emit` wrote (the last line of ``stdout``)."""
    lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
    if not lines:
        raise ValueError(f"no result line in {stdout[-500:]!r}")
    result: dict[str, Any] = json.loads(lines[-1])
    return result
