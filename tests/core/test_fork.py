"""fork(): the parent's TimerThreads refuse work in the child without touching
their locks (even with another thread holding them at the fork), and a fresh
default TimerThread works there.  Each scenario runs in a fresh interpreter
with a timeout, so a deadlock fails the test instead of hanging it; the
scripts take their cffi cores and their fork loop from ``_helpers``
(:func:`~_helpers.run_python` puts ``tests/`` on their path).
"""

from __future__ import annotations

import pytest
from _helpers import check_ok, run_python

pytestmark = pytest.mark.timeout(180)


FORK_WITH_PENDING = r"""
import asyncio, os, signal, sys, threading, time, traceback
import bucketimer

parent_fired = []
all_fired = threading.Event()
def parent_cb(i):
    parent_fired.append(i)
    if len(parent_fired) == 8:
        all_fired.set()

tt = bucketimer.default_timer_thread()
own = bucketimer.TimerThread()
# A loop created (not running) before the fork, with one timer already posted
# to its port (its eventfd is readable at fork time) and one pending.
loop = asyncio.new_event_loop()
bucketimer.call_later(0, parent_cb, 7, loop=loop)
time.sleep(0.05)
t0 = time.monotonic()
pending = [bucketimer.call_later(0.3, parent_cb, i) for i in range(5)]
pending.append(own.call_later(0.3, parent_cb, 5))
far = bucketimer.call_later(60, parent_cb, -1)
bucketimer.call_later(0.3, parent_cb, 6, loop=loop)

pid = os.fork()
if pid == 0:
    signal.alarm(20)  # a hung child dies instead of outliving the test
    try:
        # The parent's TimerThreads are dead here: they refuse work, say so,
        # and their handles cancel nothing.
        assert tt.closed and own.closed
        for t in (tt, own):
            try:
                t.call_later(0, print)
            except RuntimeError:
                pass
            else:
                raise AssertionError("a parent's TimerThread accepted a timer in the child")
        assert far.cancel() is False
        fresh = bucketimer.default_timer_thread()
        assert fresh is not tt and not fresh.closed
        # The child schedules and fires on a fresh thread (dispatcher) ...
        ev = threading.Event()
        bucketimer.call_later(0.01, ev.set)
        assert ev.wait(5), "the child's timer did not fire"
        # ... and in an event loop of its own.
        async def main():
            fut = asyncio.get_running_loop().create_future()
            bucketimer.call_later(0.01, fut.set_result, 42)
            return await asyncio.wait_for(fut, 5)
        assert asyncio.run(main()) == 42
        # None of the parent's timers ever runs in the child.
        time.sleep(max(0.0, t0 + 0.4 - time.monotonic()))
        assert parent_fired == [], parent_fired
        s = fresh.stats()
        assert s["early_fires"] == 0 and s["ran"] >= 2, s
        # Closing the inherited loop (as its __del__ would) must not touch
        # what the parent shares with us: its eventfd and its epoll set.
        loop.close()
        print("child ok", flush=True)
        os._exit(0)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)

_, status = os.waitpid(pid, 0)
assert os.waitstatus_to_exitcode(status) == 0, status
# The parent's timers still fire, in the parent, the loop's ones included.
loop.run_until_complete(asyncio.sleep(0.05))
assert all_fired.wait(5), parent_fired
assert sorted(parent_fired) == [0, 1, 2, 3, 4, 5, 6, 7], parent_fired
assert far.cancel() is True
loop.close()
print("parent ok")
"""


def test_fork_with_pending_timers():
    out = check_ok(run_python(FORK_WITH_PENDING, timeout=60))
    assert "child ok" in out and "parent ok" in out


FORK_FROM_THREAD = r"""
import errno, signal, threading, traceback
import bucketimer
from bucketimer._cffi import ffi, lib
from _helpers import cffi_core, cffi_port, destroy_cffi_core, fork_children

stop = threading.Event()
counts = {"py": 0, "cffi": 0}

def noop():
    pass

def hammer_py():
    # The default TimerThread, from Python: schedule, cancel, let some fire.
    while not stop.is_set():
        h = bucketimer.call_later(0.001, noop)
        h.cancel()
        bucketimer.call_later(0, noop)
        counts["py"] += 1

# A core driven through cffi: its calls release the GIL, so at fork time this
# thread may hold a bucket mutex of `core` in the middle of a schedule.
core = cffi_core()
port = cffi_port(core)

def hammer_cffi():
    id_p = ffi.new("uint64_t *")
    buf = ffi.new("uint64_t[]", 256)
    while not stop.is_set():
        for _ in range(100):
            lib.bt_schedule_port(core, lib.bt_now_ns() + 1000, port, ffi.NULL, id_p)
            lib.bt_cancel(core, id_p[0])
            lib.bt_schedule_port(core, lib.bt_now_ns(), port, ffi.NULL, id_p)
        lib.bt_port_drain_ids(port, buf, 256)
        counts["cffi"] += 1

results = []

def child():
    signal.alarm(20)
    try:
        ev = threading.Event()
        bucketimer.call_later(0.001, ev.set)
        if not ev.wait(5):
            return 3
        # The parent's core refuses work without touching its (perhaps held) locks.
        id_p = ffi.new("uint64_t *")
        assert lib.bt_is_stopped(core) == 1
        assert lib.bt_schedule_port(core, 0, port, ffi.NULL, id_p) == -errno.ECHILD
        assert lib.bt_cancel(core, (1 << 32) | 5) == lib.BT_UNKNOWN
        assert lib.bt_next_deadline(core) == (1 << 63) - 1
        s = ffi.new("bt_stats *")
        lib.bt_get_stats(core, s)
        assert s.scheduled == 0
        lib.bt_destroy(core)  # a no-op in a child: nothing of it is freed or locked
        # And a fresh core works here.
        destroy_cffi_core(cffi_core())
        return 0
    except BaseException:
        traceback.print_exc()
        return 4

threads = [threading.Thread(target=hammer_py), threading.Thread(target=hammer_cffi)]
for t in threads:
    t.start()
f = threading.Thread(target=fork_children, args=(child, 20, results),
                     kwargs={"first_pause": 0.02, "pause": 0.002})
f.start()
f.join(120)
assert not f.is_alive(), "fork loop hung"
stop.set()
for t in threads:
    t.join(10)
assert results == [0] * 20, results
assert counts["py"] > 0 and counts["cffi"] > 0, counts
# The parent keeps working.
ev = threading.Event()
bucketimer.call_later(0.001, ev.set)
assert ev.wait(5)
destroy_cffi_core(core)
print("ok", counts)
"""


@pytest.mark.native
def test_fork_from_a_thread_while_another_schedules():
    out = check_ok(run_python(FORK_FROM_THREAD, timeout=90, env={"PYTHONWARNINGS": "ignore::DeprecationWarning"}))
    assert out.startswith("ok")


# -- a fork while other threads hold the cores' locks --------------------------------


FORK_WHILE_LOCKS_ARE_HELD = r"""
import asyncio, errno, signal, threading, traceback
import bucketimer
from bucketimer._cffi import ffi, lib
from _helpers import cffi_core, cffi_port, destroy_cffi_core, fork_children

stop = threading.Event()
counts = {"stats": 0, "cffi_stats": 0, "loops": 0}

tt = bucketimer.TimerThread()

# A core driven through cffi (whose calls release the GIL), with many ports:
# bt_get_stats walks them under the core's ports mutex, so a fork lands
# while another thread holds it most of the time.
core = cffi_core()
for _ in range(4000):
    cffi_port(core, with_fd=False)

def hammer_stats():
    while not stop.is_set():
        tt.stats()
        counts["stats"] += 1

def hammer_cffi_stats():
    s = ffi.new("bt_stats *")
    while not stop.is_set():
        lib.bt_get_stats(core, s)
        counts["cffi_stats"] += 1

def hammer_loops():
    # Each new loop gets a port (timer_thread.c, port_for) and _attach, under its lock.
    while not stop.is_set():
        loop = asyncio.new_event_loop()
        tt.call_later(0, lambda: None, loop=loop)
        loop.close()
        counts["loops"] += 1

def child():
    signal.alarm(10)  # a hang in the child ends it with SIGALRM
    try:
        # The inherited cffi core refuses a port without touching its locks.
        p = ffi.new("bt_port **")
        rc = lib.bt_port_open(core, 1, p)
        assert rc == -errno.ECHILD, rc
        s = ffi.new("bt_stats *")
        lib.bt_get_stats(core, s)
        assert s.ports == 0
        # The inherited TimerThread: stats, refusal, close -- none may block.
        assert tt.stats()["scheduled"] == 0
        try:
            tt.call_later(0, print)
        except RuntimeError:
            pass
        else:
            raise AssertionError("an inherited TimerThread accepted a timer")
        tt.close()
        # A fresh TimerThread, the default one, and a loop all work here.
        fresh = bucketimer.TimerThread()
        ev = threading.Event()
        fresh.call_later(0.001, ev.set)
        assert ev.wait(5), "a fresh TimerThread's timer did not fire"
        async def main():
            fut = asyncio.get_running_loop().create_future()
            bucketimer.call_later(0.001, fut.set_result, 7)
            return await asyncio.wait_for(fut, 5)
        assert asyncio.run(main()) == 7
        fresh.close()
        return 0
    except BaseException:
        traceback.print_exc()
        return 4

results = []
threads = [threading.Thread(target=f) for f in (hammer_stats, hammer_cffi_stats, hammer_loops)]
for t in threads:
    t.start()
f = threading.Thread(target=fork_children, args=(child, 30, results),
                     kwargs={"first_pause": 0.05, "pause": 0.003})
f.start()
f.join(150)
stop.set()
for t in threads:
    t.join(10)
assert not f.is_alive(), "fork loop hung"
hung = sum(1 for r in results if r == -signal.SIGALRM)
print("children:", len(results), "hung:", hung, "failed:", sum(1 for r in results if r not in (0, -signal.SIGALRM)), counts)
assert results == [0] * 30, results
tt.close()
destroy_cffi_core(core)
print("ok")
"""


@pytest.mark.native
def test_fork_while_other_threads_hold_the_cores_locks():
    """A fork from one thread while others call ``stats()`` (which holds the
    core's ports mutex with the GIL released), walk a cffi core's ports and
    open loops on a TimerThread (under its lock).  In the child, nothing of
    the parent's may block: its cores refuse ports and timers without
    touching their locks, ``close()`` returns, and a fresh TimerThread, the
    default one and an event loop work."""
    p = run_python(FORK_WHILE_LOCKS_ARE_HELD, timeout=170,
                   env={"PYTHONWARNINGS": "ignore::DeprecationWarning"})
    out = check_ok(p)
    assert out.rstrip().endswith("ok"), out

