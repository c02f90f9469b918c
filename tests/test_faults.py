"""Faults: fork, interpreter exit, loops that close, callbacks that misbehave,
close() racing schedulers, KeyboardInterrupt.

Where the process itself is the subject (fork, exit) the scenario runs in a
fresh interpreter (``sys.executable -c``) with a timeout, so that a deadlock
or a crash fails the test instead of taking pytest with it.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import random
import threading
import time

import pytest
from _helpers import check_ok, fd_count, run_python, wait_until

import bucketimer

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def btt():
    tt = bucketimer.TimerThread()
    try:
        yield tt
    finally:
        tt.close()


@pytest.fixture
def new_loop():
    loop = asyncio.new_event_loop()
    try:
        yield loop
    finally:
        if not loop.is_closed():
            loop.close()


# -- fork -------------------------------------------------------------------------

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
import errno, os, signal, sys, threading, time, traceback
import bucketimer
from bucketimer._cffi import ffi, lib

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
opt = ffi.new("bt_options *")
lib.bt_options_init(opt)
out = ffi.new("bt_timer_thread **")
assert lib.bt_create(opt, out) == 0
core = out[0]
pp = ffi.new("bt_port **")
assert lib.bt_port_open(core, 1, pp) == 0
port = pp[0]

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
        o = ffi.new("bt_timer_thread **")
        assert lib.bt_create(ffi.NULL, o) == 0
        assert lib.bt_stop(o[0]) == 0
        lib.bt_destroy(o[0])
        return 0
    except BaseException:
        traceback.print_exc()
        return 4

def forker():
    time.sleep(0.02)
    for i in range(20):
        pid = os.fork()
        if pid == 0:
            code = child()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        results.append(os.waitstatus_to_exitcode(status))
        time.sleep(0.002)

threads = [threading.Thread(target=hammer_py), threading.Thread(target=hammer_cffi)]
for t in threads:
    t.start()
f = threading.Thread(target=forker)
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
lib.bt_stop(core)
lib.bt_destroy(core)
print("ok", counts)
"""


def test_fork_from_a_thread_while_another_schedules():
    out = check_ok(run_python(FORK_FROM_THREAD, timeout=90, env={"PYTHONWARNINGS": "ignore::DeprecationWarning"}))
    assert out.startswith("ok")


# -- interpreter exit -------------------------------------------------------------------

EXIT_SCRIPT = r"""
import asyncio, sys, threading, time
import bucketimer

started = threading.Event()
def slow():
    started.set()
    time.sleep(30)  # still running when the interpreter exits
bucketimer.call_later(0, slow)

tt2 = bucketimer.TimerThread()
for i in range(1000):
    bucketimer.call_later(60 + i, print, "never")
    tt2.call_later(30, print, "never")

# a live loop, running in another thread, with pending timers
loop = asyncio.new_event_loop()
threading.Thread(target=loop.run_forever, daemon=True).start()
for i in range(100):
    bucketimer.call_later(30, print, "never", loop=loop)
    tt2.call_later(0, lambda: None, loop=loop)

# a loop never run nor closed, with a pending timer
idle = asyncio.new_event_loop()
bucketimer.call_later(30, print, "never", loop=idle)

assert started.wait(5)
time.sleep(0.05)
print("EXITING", time.monotonic(), flush=True)
"""


def _exit_time(script: str) -> tuple[float, object]:
    p = run_python(script, timeout=30)
    end = time.monotonic()  # CLOCK_MONOTONIC: comparable across processes
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("EXITING")]
    assert lines, f"stdout:\n{p.stdout}\nstderr:\n{p.stderr}"
    return end - float(lines[-1].split()[1]), p


def test_interpreter_exit_with_pending_timers_running_callback_and_live_loop():
    took, p = _exit_time(EXIT_SCRIPT)
    assert p.returncode == 0, p.stderr
    assert "never" not in p.stdout
    assert "Fatal Python error" not in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert took < 1.0, f"exit took {took:.3f} s"


EXIT_BY_SYSTEMEXIT_IN_CALLBACK = r"""
import asyncio, time
import bucketimer

async def main():
    loop = asyncio.get_running_loop()
    for i in range(100):
        bucketimer.call_later(30, print, "never")
    def bye():
        print("EXITING", time.monotonic(), flush=True)
        raise SystemExit(7)
    bucketimer.call_later(0.01, bye)
    await asyncio.sleep(10)

asyncio.run(main())
print("never")
"""


def test_interpreter_exit_by_systemexit_from_a_loop_callback():
    took, p = _exit_time(EXIT_BY_SYSTEMEXIT_IN_CALLBACK)
    assert p.returncode == 7, p.stderr
    assert "never" not in p.stdout
    assert "Fatal Python error" not in p.stderr, p.stderr
    assert took < 1.0, f"exit took {took:.3f} s"


# -- loops that close ----------------------------------------------------------------------


def test_loop_closed_with_pending_timers_gets_nothing_and_its_eventfd_is_closed(btt, caplog):
    # Warm up: the first loop port starts the dispatcher (its wake pipe, the
    # orphan port's eventfd); those live as long as the TimerThread.
    warm = asyncio.new_event_loop()
    warm.run_until_complete(asyncio.sleep(0))
    btt.call_later(0, lambda: None, loop=warm)
    warm.close()
    gc.collect()
    before = fd_count()

    ran = []
    loop = asyncio.new_event_loop()

    async def main():
        hs = [btt.call_later(0.05, ran.append, i) for i in range(10)]
        return hs

    handles = loop.run_until_complete(main())
    port_fd = btt._ports[loop].fileno()
    assert port_fd >= 0
    assert fd_count() == before + 4  # the loop's epoll fd and self-pipe pair, our eventfd
    # One more posted to the port (eventfd written) but never drained.
    posted_before = btt.stats()["posted"]
    posted = btt.call_later(0, ran.append, "posted", loop=loop)
    assert wait_until(lambda: btt.stats()["posted"] > posted_before)
    loop.close()
    time.sleep(0.1)  # past every deadline
    assert ran == []
    for h in handles + [posted]:
        assert h.cancel() is False
        assert not h.cancelled()
    gc.collect()
    assert fd_count() == before, "the loop's eventfd (or more) leaked"
    assert loop not in btt._ports
    # Later timers for other loops still work.
    other = asyncio.new_event_loop()
    try:
        async def again():
            fut = other.create_future()
            btt.call_later(0.001, fut.set_result, "ok")
            return await fut

        assert other.run_until_complete(again()) == "ok"
    finally:
        other.close()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert btt.stats()["early_fires"] == 0


@pytest.mark.parametrize("which", ["own", "default"])
def test_no_fd_leak_after_1000_loops(which, caplog):
    tt = bucketimer.TimerThread() if which == "own" else bucketimer.default_timer_thread()
    schedule = tt.call_later if which == "own" else bucketimer.call_later
    ran_pending = []
    late = []  # (loop index, handle) of timers due around the loop's close

    try:
        def one_loop(i: int) -> None:
            loop = asyncio.new_event_loop()

            async def main():
                fut = loop.create_future()
                schedule(0, fut.set_result, None)
                schedule(60, ran_pending.append, i)  # pending at close
                late.append((i, tt.call_later(0.0005, lambda: None, loop=loop)))
                await fut

            loop.run_until_complete(main())
            loop.close()

        one_loop(-1)
        gc.collect()
        before = fd_count()
        ports_before = tt.stats()["ports"]
        registered = set(tt._ports)  # (the default TimerThread may serve other tests' loops)
        for i in range(1000):
            one_loop(i)
        gc.collect()
        time.sleep(0.01)  # every "late" timer is due: ran before the close, or released
        assert fd_count() == before
        assert set(tt._ports) == registered, "ports of closed loops are still registered"
        assert ran_pending == []
        for _, h in late:
            assert h.cancel() is False and h.callback is None
        # Every loop got its own port (and eventfd); the core keeps their
        # (small) memory until the TimerThread is destroyed.
        assert tt.stats()["ports"] == ports_before + 1000
        assert tt.stats()["early_fires"] == 0
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    finally:
        if which == "own":
            tt.close()


# -- callbacks that misbehave --------------------------------------------------------------


def test_dispatcher_callback_that_raises_is_logged_and_others_run(btt, caplog):
    caplog.set_level(logging.ERROR, logger="bucketimer")
    done = threading.Event()
    ran = []

    def boom():
        raise ValueError("boom")

    btt.call_later(0.001, boom)
    btt.call_later(0.002, ran.append, 1)
    btt.call_later(0.003, lambda: (ran.append(2), done.set()))
    assert done.wait(5)
    assert ran == [1, 2]
    assert wait_until(lambda: any(r.exc_info and isinstance(r.exc_info[1], ValueError) for r in caplog.records))
    rec = next(r for r in caplog.records if r.exc_info)
    assert rec.name == "bucketimer" and "Exception in timer callback" in rec.getMessage()


def test_loop_callback_that_raises_goes_to_the_exception_handler(btt, new_loop):
    contexts = []
    new_loop.set_exception_handler(lambda loop, ctx: contexts.append(ctx))
    ran = []

    def boom():
        raise ValueError("boom")

    async def main():
        btt.call_later(0.001, boom)
        btt.call_later(0.002, ran.append, "after")
        asyncio.get_running_loop().call_later(0.001, boom)  # the asyncio reference
        await asyncio.sleep(0.05)

    new_loop.run_until_complete(main())
    assert ran == ["after"]
    assert len(contexts) == 2
    ours, ref = sorted(contexts, key=lambda c: type(c["handle"]).__module__ != "bucketimer._core")
    assert isinstance(ours["exception"], ValueError)
    assert ours["message"].startswith("Exception in callback ")
    assert ours["message"].split(" ")[:3] == ref["message"].split(" ")[:3]
    assert "boom" in ours["message"]


def test_dispatcher_callbacks_cancel_themselves_others_and_schedule_more(btt):
    results = {}
    done = threading.Event()
    handles = {}

    def self_cancel():
        results["self"] = handles["self"].cancel()
        results["self_cancelled"] = handles["self"].cancelled()

    def cancel_other():
        results["other"] = handles["victim"].cancel()

    def victim():
        results["victim_ran"] = True

    def spawner(n):
        results.setdefault("spawned", []).append(n)
        if n < 5:
            handles[f"spawn{n}"] = btt.call_later(0, spawner, n + 1)
        else:
            done.set()

    # Same deadline: the victim sits in the same batch, posted, when it is cancelled.
    when = time.monotonic() + 0.02
    handles["self"] = btt.call_at(when, self_cancel)
    handles["canceller"] = btt.call_at(when, cancel_other)
    handles["victim"] = btt.call_at(when, victim)
    btt.call_at(when, spawner, 0)
    assert done.wait(5)
    time.sleep(0.01)
    assert results["self"] is False and results["self_cancelled"] is False
    assert results["other"] is True
    assert "victim_ran" not in results
    assert handles["victim"].cancelled()
    assert results["spawned"] == [0, 1, 2, 3, 4, 5]
    s = btt.stats()
    assert s["early_fires"] == 0 and s["scheduled"] == s["ran"] + s["cancelled"]


def test_loop_callbacks_cancel_themselves_others_and_schedule_more(btt, new_loop):
    results = {}
    handles = {}

    async def main():
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def self_cancel():
            results["self"] = handles["self"].cancel()

        def cancel_other():
            results["other"] = handles["victim"].cancel()

        def spawner(n):
            results.setdefault("spawned", []).append(n)
            if n < 5:
                btt.call_later(0, spawner, n + 1)
            else:
                done.set_result(None)

        when = loop.time() + 0.02
        handles["self"] = btt.call_at(when, self_cancel)
        handles["canceller"] = btt.call_at(when, cancel_other)
        handles["victim"] = btt.call_at(when, results.__setitem__, "victim_ran", True)
        btt.call_at(when, spawner, 0)
        await asyncio.wait_for(done, 5)

    new_loop.run_until_complete(main())
    assert results["self"] is False
    assert results["other"] is True and "victim_ran" not in results
    assert results["spawned"] == [0, 1, 2, 3, 4, 5]


def test_dispatcher_callback_that_closes_the_timer_thread():
    tt = bucketimer.TimerThread()
    ran = []
    closed = threading.Event()

    def closer():
        tt.close()  # from the dispatcher thread itself: must not wait for itself
        ran.append("closer")
        closed.set()

    when = time.monotonic() + 0.02
    tt.call_at(when, closer)
    later_same_batch = [tt.call_at(when, ran.append, i) for i in range(5)]
    far = tt.call_later(0.05, ran.append, "far")
    assert closed.wait(5)
    time.sleep(0.1)
    assert ran == ["closer"]
    assert tt.closed
    with pytest.raises(RuntimeError):
        tt.call_later(0, print)
    for h in later_same_batch + [far]:
        assert h.cancel() is False
    tt.close()  # idempotent


def test_loop_callback_that_closes_the_timer_thread(new_loop):
    tt = bucketimer.TimerThread()
    ran = []

    async def main():
        loop = asyncio.get_running_loop()
        when = loop.time() + 0.02
        tt.call_at(when, tt.close)
        for i in range(5):
            tt.call_at(when, ran.append, i)
        tt.call_later(0.05, ran.append, "far")
        await asyncio.sleep(0.1)
        with pytest.raises(RuntimeError):
            tt.call_later(0, print)

    new_loop.run_until_complete(main())
    assert ran == []
    assert tt.closed


# -- close() racing call_later ---------------------------------------------------------------


@pytest.mark.parametrize("target", ["dispatcher", "loop-thread"])
def test_close_racing_call_later(target, loop_thread_factory):
    for round_ in range(5):
        _close_race_round(target, loop_thread_factory, seed=round_)


def _close_race_round(target, loop_thread_factory, seed):
    tt = bucketimer.TimerThread()
    loop = loop_thread_factory() if target == "loop-thread" else None
    closed_returned = threading.Event()
    started_after_close = []
    runs = []
    results = []  # per worker: (handles, n_raised, error-or-None)
    barrier = threading.Barrier(4)

    def cb(key):
        if closed_returned.is_set():
            started_after_close.append(key)
        runs.append(key)

    def work(idx):
        rng = random.Random(seed * 10 + idx)
        handles, raised, bad = [], 0, None
        barrier.wait()
        t_stop = time.monotonic() + 20
        i = 0
        while time.monotonic() < t_stop:
            i += 1
            try:
                h = tt.call_later(rng.choice([0, 0, 0.0002, 0.002, 60]), cb, (idx, i), loop=loop)
            except RuntimeError:
                raised += 1
                if raised >= 50:
                    break
                continue
            except BaseException as e:
                bad = repr(e)
                break
            if raised:
                bad = "call_later succeeded after it had raised RuntimeError"
                break
            handles.append(((idx, i), h))
            if rng.random() < 0.3:
                h.cancel()
        results.append((handles, raised, bad))

    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(3)]
    for t in threads:
        t.start()
    barrier.wait()
    time.sleep(0.01 + seed * 0.005)
    tt.close()
    closed_returned.set()
    n_runs = len(runs)
    for t in threads:
        t.join(30)
        assert not t.is_alive()
    time.sleep(0.05)
    for _handles, raised, bad in results:
        assert bad is None, bad
        assert raised >= 50, "a worker never saw RuntimeError after close()"
    if target == "dispatcher":
        # close() joined the dispatcher: nothing started after it returned.
        assert started_after_close == []
        assert len(runs) == n_runs
    else:
        # A loop in another thread may have claimed one callback just before
        # close() dropped the rest; its body can start after close() returns.
        assert len(started_after_close) <= 1, started_after_close
        assert len(runs) <= n_runs + 1
    assert len(runs) == len(set(runs)), "a callback ran twice"
    ran = set(runs)
    for handles, _, _ in results:
        for key, h in handles:
            assert h.cancel() is False  # everything is finished or dropped
            if h.cancelled():
                assert key not in ran, f"{key} was cancelled and ran"
    total = sum(len(h) for h, _, _ in results)
    assert total > 0 and len(ran) <= total


@pytest.fixture
def loop_thread_factory():
    made = []

    def make():
        loop = asyncio.new_event_loop()
        ready = threading.Event()

        def main():
            asyncio.set_event_loop(loop)
            loop.call_soon(ready.set)
            loop.run_forever()

        t = threading.Thread(target=main, daemon=True)
        t.start()
        assert ready.wait(5)
        made.append((loop, t))
        return loop

    yield make
    for loop, t in made:
        loop.call_soon_threadsafe(loop.stop)
        t.join(5)
        loop.close()


# -- KeyboardInterrupt --------------------------------------------------------------------------


def test_keyboardinterrupt_in_a_loop_callback_propagates_and_the_rest_run_later(btt, new_loop):
    ran = []

    def interrupt():
        raise KeyboardInterrupt

    async def main():
        loop = asyncio.get_running_loop()
        when = loop.time() + 0.01
        btt.call_at(when, ran.append, "before")
        btt.call_at(when, interrupt)
        btt.call_at(when, ran.append, "after1")
        btt.call_at(when, ran.append, "after2")
        await asyncio.sleep(1)

    with pytest.raises(KeyboardInterrupt):
        new_loop.run_until_complete(main())
    assert ran == ["before"]
    new_loop.run_until_complete(asyncio.sleep(0.02))
    assert ran == ["before", "after1", "after2"]
    _cancel_all_tasks(new_loop)


def test_keyboardinterrupt_in_a_loop_callback_matches_asyncio(new_loop):
    """The asyncio reference: the same propagation for a loop.call_later handle."""
    ran = []

    def interrupt():
        raise KeyboardInterrupt

    async def main():
        loop = asyncio.get_running_loop()
        loop.call_later(0.01, ran.append, "before")
        loop.call_later(0.01, interrupt)
        loop.call_later(0.01, ran.append, "after")
        await asyncio.sleep(1)

    with pytest.raises(KeyboardInterrupt):
        new_loop.run_until_complete(main())
    assert ran == ["before"]
    new_loop.run_until_complete(asyncio.sleep(0.02))
    assert ran == ["before", "after"]
    _cancel_all_tasks(new_loop)


def _cancel_all_tasks(loop):
    tasks = asyncio.all_tasks(loop)
    for t in tasks:
        t.cancel()
    loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))


def test_keyboardinterrupt_in_a_loop_callback_propagates_out_of_asyncio_run(btt):
    def interrupt():
        raise KeyboardInterrupt

    async def main():
        btt.call_later(0.01, interrupt)
        await asyncio.sleep(5)

    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        asyncio.run(main())
    assert time.monotonic() - t0 < 4


@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit])
def test_keyboardinterrupt_in_a_dispatcher_callback_is_logged_and_dispatch_continues(btt, caplog, exc):
    caplog.set_level(logging.ERROR, logger="bucketimer")
    ran = []
    done = threading.Event()

    def interrupt():
        raise exc

    when = time.monotonic() + 0.01
    btt.call_at(when, interrupt)
    btt.call_at(when, ran.append, "same batch")
    btt.call_later(0.05, lambda: (ran.append("later"), done.set()))
    assert done.wait(5), ran
    assert ran == ["same batch", "later"]
    assert wait_until(lambda: any(r.exc_info and r.exc_info[0] is exc for r in caplog.records))
    assert btt._thread.is_alive()


# -- the timer thread never needs the GIL ---------------------------------------------------


def test_timers_fire_while_python_holds_the_gil(btt):
    """With a switch interval of 100 s, this thread keeps the GIL while it
    spins for 200 ms: a timer thread that needed the GIL could not fire anything.  The
    core fires (and posts) every due timer anyway; only running the callbacks,
    on the dispatcher thread, waits for the GIL."""
    import sys

    ran = []
    btt.call_later(0, ran.append, "warm")
    assert wait_until(lambda: ran)  # the dispatcher exists
    old = sys.getswitchinterval()
    n = 50
    try:
        sys.setswitchinterval(100.0)
        t_end = time.monotonic() + 0.2
        for i in range(n):
            btt.call_later(0.005, ran.append, i)
        while time.monotonic() < t_end:  # spin, GIL held, nothing blocks
            pass
        n_ran = len(ran)
        s = btt.stats()  # (releases the GIL: read n_ran first)
    finally:
        sys.setswitchinterval(old)
    assert n_ran == 1, "a callback ran while this thread held the GIL"
    assert s["fired"] == n + 1 and s["posted"] == n + 1, s
    assert wait_until(lambda: len(ran) == n + 1)


DEV_MODE_WORKLOAD = r"""
import asyncio, gc, threading, time
import bucketimer

# -X dev: PYTHONMALLOC=debug, whose hooks abort ("Python memory allocator
# called without holding the GIL") if any thread allocates or frees a Python
# object without the GIL -- e.g. a timer thread releasing a Handle.
tt = bucketimer.TimerThread()
ran = []
def cb(*a):
    ran.append(a)
    gc.collect(0)

async def main():
    loop = asyncio.get_running_loop()
    for r in range(20):
        hs = [tt.call_later(0.0005 * (i % 5), cb, [i], {"r": r}) for i in range(200)]
        hs += [bucketimer.call_later(0.0005 * (i % 5), cb, [i]) for i in range(100)]
        hs += [tt.call_later(0.0005 * (i % 5), cb, [i], loop=None) for i in range(100)]
        for h in hs[::3]:
            h.cancel()
        await asyncio.sleep(0.004)
    for i in range(1000):  # pending at close: dropped, never run
        tt.call_later(60, cb, [i])
        tt.call_later(60, cb, [i], loop=None)

asyncio.run(main())
time.sleep(0.05)
tt.close()
del tt
gc.collect()
print("ok", len(ran))
"""


def test_timer_thread_never_touches_python_objects_debug_allocators():
    p = run_python(DEV_MODE_WORKLOAD, timeout=60, env={"PYTHONDEVMODE": "1", "PYTHONMALLOC": "debug"})
    out = check_ok(p)
    assert out.startswith("ok"), out
    assert "without holding the GIL" not in p.stderr, p.stderr
