"""The dispatcher thread, where a TimerThread's no-loop timers run one after
another: a callback that holds it too long is logged once it returns
(``slow_callback_duration``), and the timers an interpreter's exit drops
are counted in one record (README.rst, "Timers from any thread")."""

from __future__ import annotations

import logging
import math
import os
import threading
import time

import pytest
from _helpers import check_ok, run_python

import bucketimer


def _slow_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if hasattr(r, "timer_elapsed")]


def _run_then_wait(tt: bucketimer.TimerThread, *callbacks_args: tuple) -> None:
    """Schedules each (callback, *args) due now, then waits until a last
    timer behind them has run: every one of them has returned."""
    for callback, *args in callbacks_args:
        tt.call_later(0, callback, *args)
    done = threading.Event()
    tt.call_later(0, done.set)
    assert done.wait(10.0)


def test_a_slow_callback_is_logged_once(
        tt: bucketimer.TimerThread, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="bucketimer")
    started = time.monotonic()
    _run_then_wait(tt, (time.sleep, 0.15), (print, "fast"))
    (record,) = _slow_records(caplog)
    assert record.levelno == logging.WARNING
    assert record.name == "bucketimer"
    assert record.threadName == "bucketimer-dispatcher"
    assert record.timer_callback == "sleep(0.15)"  # type: ignore[attr-defined]
    # the native port times on CLOCK_MONOTONIC_COARSE, a tick (1-4 ms) per
    # read; the read just after the sleep's wake-up can lag further on a
    # virtual machine whose ticks arrive late (6 ms has been seen), so the
    # lower bound leaves 10 ms: still well above the 0.1 s threshold
    elapsed: float = record.timer_elapsed  # type: ignore[attr-defined]
    assert 0.14 <= elapsed <= time.monotonic() - started + 0.005
    assert record.timer_threshold == 0.1  # type: ignore[attr-defined]
    message = record.getMessage()
    assert "sleep(0.15) took 0.1" in message and "dispatcher thread" in message
    assert "executor" in message


def test_callbacks_within_the_threshold_log_nothing(
        tt: bucketimer.TimerThread, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="bucketimer")
    _run_then_wait(tt, *[(time.sleep, 0.001)] * 20)
    assert _slow_records(caplog) == []


def test_a_callback_that_raises_is_timed_too(
        tt: bucketimer.TimerThread, caplog: pytest.LogCaptureFixture) -> None:
    def slow_then_raise() -> None:
        time.sleep(0.15)
        raise RuntimeError("boom")

    caplog.set_level(logging.WARNING, logger="bucketimer")
    _run_then_wait(tt, (slow_then_raise,))
    assert len(_slow_records(caplog)) == 1
    assert any(r.exc_info and isinstance(r.exc_info[1], RuntimeError) for r in caplog.records)


def test_slow_callback_duration_is_per_timer_thread_and_settable(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="bucketimer")
    with bucketimer.TimerThread(slow_callback_duration=None) as tt:
        assert tt.slow_callback_duration is None
        _run_then_wait(tt, (time.sleep, 0.15))
        assert _slow_records(caplog) == []
        # set while its dispatcher runs: the next callback is timed against it
        tt.slow_callback_duration = 0.05
        _run_then_wait(tt, (int,), (time.sleep, 0.1))
        (record,) = _slow_records(caplog)
        assert record.timer_callback == "sleep(0.1)"  # type: ignore[attr-defined]
        assert record.timer_threshold == 0.05  # type: ignore[attr-defined]
        tt.slow_callback_duration = math.inf
        _run_then_wait(tt, (time.sleep, 0.1))
        assert len(_slow_records(caplog)) == 1
    with bucketimer.TimerThread() as default:
        assert default.slow_callback_duration == 0.1


@pytest.mark.parametrize("value, error, text", [
    ("0.1", TypeError, "slow_callback_duration must be a number of seconds or None, not str"),
    (True, TypeError, "slow_callback_duration must be a number of seconds or None, not bool"),
    (-1, ValueError, "slow_callback_duration must be >= 0 seconds, not -1"),
    (math.nan, ValueError, "slow_callback_duration must be >= 0 seconds, not nan"),
])
def test_bad_slow_callback_duration(value: object, error: type[Exception], text: str) -> None:
    with pytest.raises(error, match=f"^{text}$"):
        bucketimer.TimerThread(slow_callback_duration=value)  # type: ignore[arg-type]
    with bucketimer.TimerThread() as tt, pytest.raises(error, match=f"^{text}$"):
        tt.slow_callback_duration = value  # type: ignore[assignment]
    assert tt.slow_callback_duration == 0.1


def test_timers_dropped_at_exit_are_counted() -> None:
    p = run_python("""
        import time
        import bucketimer

        tt = bucketimer.TimerThread()
        tt.call_later(30, print, "never printed")
        tt.call_at(time.monotonic() + 30, print, "nor this")
        tt.call_later(30, print, "cancelled").cancel()
        bucketimer.call_later(30, print, "the default's")
        print("exiting")
    """)
    assert check_ok(p) == "exiting\n"
    assert p.stderr == (
        "3 pending timers dropped at exit without running (no-loop timers run on a daemon "
        "thread: wait for the ones that must run before the program ends)\n")


def test_an_exit_with_nothing_pending_says_nothing() -> None:
    p = run_python("""
        import asyncio
        import threading
        import bucketimer

        tt = bucketimer.TimerThread()
        done = threading.Event()
        tt.call_later(0.01, done.set)
        tt.call_later(30, print, "cancelled").cancel()
        assert done.wait(10)

        async def main():
            tt.call_later(30, print, "a loop's: dropped with its loop")

        asyncio.run(main())
    """)
    check_ok(p)
    assert p.stderr == ""


def test_the_dispatcher_serves_fds_past_fd_setsize() -> None:
    """A process that holds more than 1024 fds (a server with that many
    connections) and then makes a TimerThread: its dispatcher's fds are past
    select()'s FD_SETSIZE, and its no-loop timers still run."""
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        with bucketimer.TimerThread() as tt:
            ran = threading.Event()
            tt.call_later(0, ran.set)
            assert ran.wait(5)
    finally:
        for fd in held:
            os.close(fd)
