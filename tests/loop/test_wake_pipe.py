"""Nothing the library writes from an event loop's thread can block it.

The first timer a loop arms wakes the TimerThread's dispatcher (it audits
the loops it serves) through a pipe; a blocking write there would stall the
loop when the pipe is full, and blocking-call detectors (blockbuster, which
anyio's and aiohttp's suites use) raise on it.
"""

from __future__ import annotations

import asyncio
import os
import threading

import pytest

import bucketimer

# The native backend's dispatcher pipe and ports: the pure backend has neither.
pytestmark = pytest.mark.native


def test_every_fd_written_is_non_blocking(monkeypatch: pytest.MonkeyPatch) -> None:
    writes: list[tuple[int, bool, str]] = []
    real_write = os.write

    def spy(fd: int, data: bytes) -> int:
        writes.append((fd, os.get_blocking(fd), threading.current_thread().name))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", spy)
    tt = bucketimer.TimerThread()
    try:
        loop = bucketimer.EventLoop(timer_thread=tt)
        try:
            # the loop's first timer: its port, the dispatcher, the poke
            assert loop.run_until_complete(asyncio.sleep(0.001, "ok")) == "ok"
        finally:
            loop.close()
    finally:
        tt.close()
    assert writes, "the dispatcher was never woken"
    assert [w for w in writes if w[1]] == [], "blocking writes"


def test_a_full_wake_pipe_is_no_reason_to_wait() -> None:
    """One pending wake is enough: a poke into a full pipe returns at once,
    and a close still stops the dispatcher."""
    tt = bucketimer.TimerThread()
    loop = bucketimer.EventLoop(timer_thread=tt)
    try:
        loop.run_until_complete(asyncio.sleep(0))
        loop.call_later(3600, print)  # the dispatcher is running now
        dispatcher = tt._thread
        assert dispatcher is not None and dispatcher.is_alive()
        r, w = os.pipe()
        os.set_blocking(w, False)
        try:
            while True:  # fill a pipe of our own and stand it in for the wake pipe
                try:
                    os.write(w, b"." * 4096)
                except BlockingIOError:
                    break
            real_w, tt._wake_w = tt._wake_w, w
            poker = threading.Thread(target=tt._poke_dispatcher, daemon=True)
            poker.start()
            poker.join(10)
            tt._wake_w = real_w
            assert not poker.is_alive(), "a poke waited for room in a full pipe"
        finally:
            os.close(r)
            os.close(w)
    finally:
        loop.close()
        tt.close()
    dispatcher.join(10)
    assert not dispatcher.is_alive()
