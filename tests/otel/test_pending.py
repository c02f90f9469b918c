"""What a TimerThread holds, as an operator asks in an incident:
``TimerThread.pending()`` lists the timers scheduled and not yet run,
cancelled or dropped, by callback, with their deadlines and loops, and,
while ``bucketimer.trace_timers()`` is on, where each was scheduled; the
same on either backend."""

from __future__ import annotations

import asyncio
import functools
import os
import re
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator

import pytest
from _helpers import wait_until

import bucketimer
from bucketimer import PendingGroup


class Connection:
    def idle(self) -> None: ...


def arm_idle(tt: bucketimer.TimerThread, delay: float) -> bucketimer.Handle:
    return tt.call_later(delay, Connection().idle)


@pytest.fixture
def tracing() -> Iterator[None]:
    bucketimer.trace_timers(4)
    try:
        yield
    finally:
        bucketimer.trace_timers(0)


def test_pending_timers_by_callback(tt: bucketimer.TimerThread) -> None:
    handles = [arm_idle(tt, 30 + i) for i in range(5)]
    tt.call_later(60, functools.partial(print, "a"))
    tt.call_later(61, print).cancel()
    ran = threading.Event()
    tt.call_later(0, ran.set)
    assert handles[4].cancel()
    assert ran.wait(5) and wait_until(lambda: tt.stats()["ran"] == 1)
    snap = tt.pending(limit=2)
    assert snap.count == 5
    assert [(g.callback, g.count) for g in snap.groups] == [
        (f"{__name__}.Connection.idle", 4), ("print", 1)]
    idle = snap.groups[0]
    assert isinstance(idle, PendingGroup)
    assert [t.when for t in idle.timers] == [h.when() for h in handles[:2]]  # the earliest two
    assert (idle.earliest, idle.latest) == (handles[0].when(), handles[3].when())
    first = idle.timers[0]
    assert first.loop is None and first.args == () and first.armed is None  # not traced
    assert first.callback is not None and first.callback.__func__ is Connection.idle  # type: ignore[attr-defined]
    assert snap.groups[1].timers[0].callback.args == ("a",)  # type: ignore[union-attr]
    text = str(snap)
    assert re.match(r"5 pending timers\n {8}4  test_pending\.Connection\.idle, due in (29\.9|30\.0)\d\d"
                    r" to (32\.9|33\.0)\d\d s\n {11}due in ", text), text


def test_where_each_was_armed(tt: bucketimer.TimerThread, tracing: None) -> None:
    arm_idle(tt, 30)
    line = arm_idle.__code__.co_firstlineno + 1
    [group] = tt.pending().groups
    armed = group.timers[0].armed
    assert armed is not None
    # innermost last, from the caller's own frame: none of bucketimer's
    assert (armed[-1].filename, armed[-1].lineno, armed[-1].name) == (__file__, line, "arm_idle")
    assert armed[-2].name == "test_where_each_was_armed"
    assert len(armed) == 4 and armed[-1].line == "return tt.call_later(delay, Connection().idle)"
    assert "arm_idle" in str(tt.pending())
    bucketimer.trace_timers(0)  # off: new timers are not traced (the traced one keeps its record)
    arm_idle(tt, 40)
    assert [t.armed is None for t in tt.pending().groups[0].timers] == [False, True]


def test_a_loops_timers_name_their_loop(tt: bucketimer.TimerThread) -> None:
    loop = asyncio.new_event_loop()
    try:
        tt.call_later(30, print, loop=loop)
        due = tt.call_later(0, print, loop=loop)  # posted to the loop, which is not running
        snap = tt.pending()
        assert snap.count == 2 and {t.loop for t in snap.groups[0].timers} == {loop}
        assert min(t.when for t in snap.groups[0].timers) == due.when()
    finally:
        loop.close()
    assert tt.pending().count == 0  # the loop's close dropped them


def test_nothing_pending_after_close_and_bad_limits(tt: bucketimer.TimerThread) -> None:
    tt.call_later(30, print)
    with pytest.raises(TypeError, match="limit must be an int, not float"):
        tt.pending(limit=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="limit must be >= 0, got -1"):
        tt.pending(limit=-1)
    assert tt.pending(limit=0).groups[0].timers == []
    tt.close()
    assert tt.pending().count == 0 and str(tt.pending()) == "0 pending timers"


def test_trace_timers_from_the_environment_and_bad_frames() -> None:
    code = textwrap.dedent("""\
        import bucketimer
        tt = bucketimer.TimerThread()
        tt.call_later(30, print)
        [timer] = tt.pending().groups[0].timers
        print(len(timer.armed), timer.armed[-1].lineno)
        tt.close()
    """)
    env = {**os.environ, "BUCKETIMER_TRACE_TIMERS": "2"}
    out = subprocess.run([sys.executable, "-c", code], env=env, check=True,
                         capture_output=True, text=True, timeout=60).stdout
    assert out == "1 3\n"  # one frame only: the module's (line 3)
    with pytest.raises(ValueError, match="frames must be >= 0"):
        bucketimer.trace_timers(-1)
    with pytest.raises(TypeError, match="frames must be an int, not str"):
        bucketimer.trace_timers("5")  # type: ignore[arg-type]
