"""Reliability at the edges of a timer's life: loops that close while their
timers fall due, ids that cross TimerThreads, fork while another thread holds
the core's locks.

Each test here reproduces a way the core once broke a promise of
``docs/guarantees.rst``; the guarantee names the test.
"""

from __future__ import annotations

import asyncio
import os
import random
import time

import pytest
from _helpers import check_ok, run_python, wait_until

import bucketimer

pytestmark = pytest.mark.timeout(180)


def _noop() -> None:
    pass


def _settled(tt: bucketimer.TimerThread) -> bool:
    s = tt.stats()
    return s["slots_free"] == s["slots"] and s["list_size"] == 0 and s["heap_size"] == 0


def test_loop_closed_while_its_timers_fall_due_strands_none():
    """A loop closes while the timer thread posts a batch of 50 000 of its
    timers.  Each of them must end up released (run before the close, dropped
    by the close, or released by the orphan port): none may stay POSTED in
    the closed loop's port, where nobody would ever take it."""
    tt = bucketimer.TimerThread()
    rng = random.Random(11)
    stranded_per_trial = []
    slots_per_trial = []
    try:
        for _ in range(8):
            loop = asyncio.new_event_loop()
            when = time.monotonic() + 0.05
            handles = [tt.call_at(when, _noop, loop=loop) for _ in range(50_000)]
            # Close somewhere in the pass that posts them: it pops and stages
            # 50 000 timers, which takes milliseconds.
            close_at = when + rng.uniform(-0.0005, 0.003)
            while time.monotonic() < close_at:
                pass
            loop.close()
            # Everything is due; once the orphan port's consumer (the
            # dispatcher) has released what came due after the close, every
            # slot is free again -- unless some timer was stranded.
            wait_until(lambda: _settled(tt), timeout=5)
            stranded_per_trial.append(sum(h.cancel() for h in handles))
            slots_per_trial.append(tt.stats()["slots"])
        assert stranded_per_trial == [0] * 8, (
            f"handles still cancellable after their loop closed, per trial: {stranded_per_trial}"
        )
        assert len(set(slots_per_trial)) == 1, f"slots grew across trials: {slots_per_trial}"
        assert _settled(tt), tt.stats()
        s = tt.stats()
        assert s["early_fires"] == 0
        # Every timer ran, or a cancel won, or a consumer dropped it.
        assert s["scheduled"] == s["ran"] + s["cancelled"] + s["dropped"], s
    finally:
        tt.close()


def test_an_id_from_one_core_cancels_nothing_on_another():
    """Through the C API (``bucketimer._cffi``): a core answers BT_UNKNOWN for
    another core's ids and keeps its own timers, both for the first timer a
    thread schedules on each core and after slots were reused."""
    from bucketimer._cffi import ffi, lib

    def manual_core():
        opt = ffi.new("bt_options *")
        lib.bt_options_init(opt)
        opt.manual_clock = 1
        opt.manual_start_ns = 1000
        out = ffi.new("bt_timer_thread **")
        assert lib.bt_create(opt, out) == 0
        port = ffi.new("bt_port **")
        assert lib.bt_port_open(out[0], 0, port) == 0
        return out[0], port[0]

    (a, pa), (b, pb) = manual_core(), manual_core()
    try:
        ids = ffi.new("uint64_t[2]")
        buf = ffi.new("uint64_t[4]")
        for round_ in range(3):  # first use of the slots, then reused ones
            deadline = 2000 + round_
            assert lib.bt_schedule_port(a, deadline, pa, ffi.NULL, ids + 0) == 0
            assert lib.bt_schedule_port(b, deadline, pb, ffi.NULL, ids + 1) == 0
            id_a, id_b = ids[0], ids[1]
            assert id_a != id_b
            assert lib.bt_cancel(a, id_b) == lib.BT_UNKNOWN
            assert lib.bt_cancel(b, id_a) == lib.BT_UNKNOWN
            # Both timers are still there: they fire, on their own core.
            assert lib.bt_advance(a, deadline) == 1 and lib.bt_advance(b, deadline) == 1
            assert lib.bt_port_drain_ids(pa, buf, 4) == 1 and buf[0] == id_a
            assert lib.bt_port_drain_ids(pb, buf, 4) == 1 and buf[0] == id_b
    finally:
        lib.bt_destroy(a)
        lib.bt_destroy(b)


FORK_WHILE_LOCKS_ARE_HELD = r"""
import asyncio, errno, os, signal, sys, threading, time, traceback
import bucketimer
from bucketimer._cffi import ffi, lib

stop = threading.Event()
counts = {"stats": 0, "cffi_stats": 0, "loops": 0}

tt = bucketimer.TimerThread()

# A core driven through cffi (whose calls release the GIL), with many ports:
# bt_get_stats walks them under the core's ports mutex, so a fork lands
# while another thread holds it most of the time.
out = ffi.new("bt_timer_thread **")
assert lib.bt_create(ffi.NULL, out) == 0
core = out[0]
pp = ffi.new("bt_port **")
for _ in range(4000):
    assert lib.bt_port_open(core, 0, pp) == 0

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
    # Each new loop goes through TimerThread._port_for, under its lock.
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
def forker():
    time.sleep(0.05)
    for _ in range(30):
        pid = os.fork()
        if pid == 0:
            code = child()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        results.append(os.waitstatus_to_exitcode(status))
        time.sleep(0.003)

threads = [threading.Thread(target=f) for f in (hammer_stats, hammer_cffi_stats, hammer_loops)]
for t in threads:
    t.start()
f = threading.Thread(target=forker)
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
lib.bt_stop(core)
lib.bt_destroy(core)
print("ok")
"""


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


def test_refused_close_of_a_running_loop_keeps_its_timers():
    """``loop.close()`` on a running loop raises (asyncio refuses it) and must
    leave the loop's timers alone: the loop goes on running and so do they."""
    tt = bucketimer.TimerThread()

    async def main():
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        tt.call_later(0.02, fut.set_result, "ran")
        with pytest.raises(RuntimeError, match="running"):
            loop.close()
        later = loop.create_future()
        tt.call_later(0.02, later.set_result, "also ran")
        return await asyncio.wait_for(asyncio.gather(fut, later), 2)

    try:
        assert asyncio.run(main()) == ["ran", "also ran"]
        assert tt.stats()["early_fires"] == 0
    finally:
        tt.close()


def test_loop_whose_close_misses_the_hook_is_found_and_released():
    """A loop's thread looks up ``loop.close`` while another thread schedules
    the loop's first timer (which installs bucketimer's close hook), then
    calls the close it looked up: the hook does not run.  The TimerThread
    must find the closed loop (its dispatcher audits its loops about once a
    second), release the loop's timers unrun and close its eventfd, and
    refuse timers for it from then on -- not keep them forever."""
    tt = bucketimer.TimerThread()
    try:
        tt.call_later(0, _noop)  # the dispatcher exists
        loop = asyncio.new_event_loop()
        close = loop.close  # the loop's thread, about to close it
        h = tt.call_later(0.01, _noop, loop=loop)  # another thread's first timer
        fd = tt._ports[loop].fileno()
        close()  # without bucketimer's hook
        # Until the audit, the fast path may still take a timer for it.
        h2 = tt.call_later(0, _noop, loop=loop)
        assert wait_until(lambda: loop not in tt._ports, timeout=5), "closed loop never found"
        with pytest.raises(RuntimeError):
            tt.call_later(0, _noop, loop=loop)
        time.sleep(0.05)  # every timer is due: posted to the orphans, or released
        assert wait_until(lambda: _settled(tt), timeout=5), tt.stats()
        assert h.cancel() is False and h2.cancel() is False
        s = tt.stats()
        assert s["scheduled"] == s["ran"] + s["cancelled"] + s["dropped"], s
        with pytest.raises(OSError):
            os.fstat(fd)  # the port's eventfd is closed
    finally:
        tt.close()


def test_first_timer_for_a_loop_from_another_thread_while_it_starts_and_closes():
    """One thread opens, briefly runs and closes loop after loop; another
    schedules each loop's first timers from outside it, with ``loop=``,
    while the loop starts, runs, stops or closes.  Each schedule returns a
    handle or raises RuntimeError (loop closed): no Port may be freed under
    a schedule (a borrowed reference once was: ``OSError: call_later failed:
    Invalid argument``, and a heap-use-after-free under ASan), and asyncio's
    selector is never touched from outside the loop's thread.  Every timer
    ends counted; no fd is left behind."""
    import threading

    tt = bucketimer.TimerThread()
    tt.call_later(0, _noop)
    wait_until(lambda: tt.stats()["ran"] == 1)
    current: list = [None]
    stop = threading.Event()
    errors: list[BaseException] = []
    ran = [0]

    def count() -> None:
        ran[0] += 1

    def loops() -> None:
        rng = random.Random(5)
        while not stop.is_set():
            loop = asyncio.new_event_loop()
            current[0] = loop
            time.sleep(rng.uniform(0, 0.0005))  # not running yet
            loop.run_until_complete(asyncio.sleep(rng.uniform(0, 0.002)))
            current[0] = None
            loop.close()

    def scheduler() -> None:
        handles = 0
        while not stop.is_set():
            loop = current[0]
            if loop is None:
                continue
            try:
                tt.call_later(0, count, loop=loop)
                handles += 1
            except RuntimeError:
                pass  # closed under us: allowed
            except BaseException as e:  # anything else is a bug
                errors.append(e)
                return

    before = len(os.listdir("/proc/self/fd"))
    threads = [threading.Thread(target=loops), threading.Thread(target=scheduler)]
    for t in threads:
        t.start()
    time.sleep(4.0)
    stop.set()
    for t in threads:
        t.join(10)
    try:
        assert not errors, repr(errors[0])
        assert wait_until(lambda: _settled(tt) and not tt._ports, timeout=5), tt.stats()
        s = tt.stats()
        assert s["scheduled"] == s["ran"] + s["cancelled"] + s["dropped"], s
        assert s["ran"] == ran[0] + 1
        assert len(os.listdir("/proc/self/fd")) <= before
    finally:
        tt.close()
