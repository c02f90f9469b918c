"""A TimerThread's and a loop's end: close() with pending and posted timers,
close racing call_later, loops that close (while their timers fall due, with
or without our hook, refused while running), interpreter exit.  Nothing
runs after close() returns, nothing is stranded, no fd leaks.

Where the process itself is the subject (exit) the scenario runs in a fresh
interpreter (``sys.executable -c``) with a timeout, so that a deadlock or a
crash fails the test instead of taking pytest with it.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import random
import threading
import time
import weakref

import pytest
from _helpers import check_ok, dispatcher_held, fd_count, posted_at_least, run_python, wait_until

import bucketimer

pytestmark = pytest.mark.timeout(180)


def test_close_drops_pending_timers_and_releases_their_callbacks(loop_thread):
    tt = bucketimer.TimerThread()
    ran = []
    refs, handles = [], []
    for i in range(20):

        def cb(i=i):
            ran.append(i)

        refs.append(weakref.ref(cb))
        loop = loop_thread.loop if i % 2 else None
        handles.append(tt.call_later(0.05 + 0.001 * i, cb, loop=loop))
        del cb
    tt.close()
    assert all(r() is None for r in refs), "close() kept a dropped callback alive"
    time.sleep(0.15)  # past every deadline
    assert ran == []
    for h in handles:
        assert h.cancel() is False
        assert not h.cancelled()
        assert h.callback is None


def test_close_drops_a_timer_already_posted_but_not_run(wait_until):
    """The dispatcher is busy in a callback while a second timer is posted;
    close() then drops it: it never runs, and its callback is released."""
    tt = bucketimer.TimerThread()
    started, release = threading.Event(), threading.Event()
    ran = []

    def blocker():
        started.set()
        release.wait(5)

    def victim():
        ran.append("victim")

    ref = weakref.ref(victim)
    tt.call_later(0, blocker)
    assert started.wait(5)
    hv = tt.call_later(0, victim)
    del victim
    assert wait_until(posted_at_least(tt, 2), 5)
    timer = threading.Timer(0.1, release.set)  # close() joins the dispatcher
    timer.start()
    try:
        tt.close()
    finally:
        release.set()
        timer.join()
    gc.collect()
    time.sleep(0.05)
    assert ran == []
    assert ref() is None
    assert hv.cancel() is False


UNRUN_CASES = {
    # what ends the timer: which counter takes it (docs/design.rst, "Counters")
    "close(), pending": "cancelled",
    "the loop's close, pending": "cancelled",
    "the loop's close, handed to it": "dropped",
    "close(), handed to the loop": "cancelled",
}


@pytest.mark.parametrize("case", UNRUN_CASES)
def test_a_timer_ended_unrun_is_counted_alike_on_both_backends(case, wait_until):
    """Each way a timer can end without running is counted once, in the same
    counter on the native and the pure backend; the handle says neither
    cancelled nor cancellable afterwards."""
    tt = bucketimer.TimerThread()
    loop = asyncio.new_event_loop()
    try:
        if case == "close(), pending":
            h = tt.call_later(10, print)
            tt.close()
        elif case == "the loop's close, pending":
            h = tt.call_later(10, print, loop=loop)
            loop.close()
        else:
            h = tt.call_later(0, print, loop=loop)
            assert wait_until(posted_at_least(tt, 1), 10)
            loop.close() if case == "the loop's close, handed to it" else tt.close()
        assert wait_until(lambda: tt.stats()[UNRUN_CASES[case]] == 1, 5), tt.stats()
        s = tt.stats()
        assert (s["scheduled"], s["ran"], s["cancelled"] + s["dropped"]) == (1, 0, 1), s
        assert not h.cancelled()
        assert h.cancel() is False
    finally:
        loop.close()
        tt.close()


def test_close_from_inside_a_dispatcher_callback():
    tt = bucketimer.TimerThread()
    done = threading.Event()
    ran = []

    def closer():
        tt.close()
        done.set()

    # Both armed with the dispatcher held: a closer due now could otherwise
    # run before the next line, and a closed TimerThread refuses new timers.
    with dispatcher_held(tt):
        tt.call_later(0, closer)
        tt.call_later(0.05, ran.append, 1)
    assert done.wait(5)
    time.sleep(0.1)
    assert ran == []
    assert tt.closed


@pytest.mark.native
def test_close_whose_core_refused_can_be_closed_again():
    """A close() whose core could not be stopped (its join failed: see
    docs/guarantees.rst, "Close"; no Python test can make a real join fail,
    so the core's answer is faked here) undoes nothing else, and the next
    close() finishes: timers dropped, scheduling refused."""

    class Refusing(bucketimer.TimerThread):
        refusals = 1

        def _close_core(self) -> int | None:
            if self.refusals:
                self.refusals -= 1
                raise RuntimeError("its timer thread could not be joined")
            return super()._close_core()

    tt = Refusing()
    fired: list[int] = []
    tt.call_later(30, fired.append, 1)
    with pytest.raises(RuntimeError, match="could not be joined"):
        tt.close()
    tt.close()
    assert tt.closed
    with pytest.raises(RuntimeError, match="closed"):
        tt.call_later(0, fired.append, 2)
    assert tt.stats()["cancelled"] == 1 and fired == []  # dropped, never run


def test_close_with_a_loop_port_then_close_the_loop(run):
    tt = bucketimer.TimerThread()

    async def main():
        fut = asyncio.get_running_loop().create_future()
        tt.call_later(0, fut.set_result, 1)
        tt.call_later(30, print)
        return await fut

    assert run(main) == 1
    tt.close()
    assert tt.stats()["ran"] == 1


# -- exceptions ----------------------------------------------------------------------------


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


# How long the callbacks still running at exit sleep, and the nearest
# pending deadline: an exit that waited for either would take this long
# (the exit itself waits about _EXIT_JOIN_BUDGET; how fast is the machine's
# affair).
SLOW_CALLBACK_S = 30


def _exit_time(script: str) -> tuple[float, object]:
    p = run_python(script, timeout=2 * SLOW_CALLBACK_S)
    end = time.monotonic()  # CLOCK_MONOTONIC: comparable across processes
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("EXITING")]
    assert lines, f"stdout:\n{p.stdout}\nstderr:\n{p.stderr}"
    return end - float(lines[-1].split()[1]), p


def test_interpreter_exit_with_pending_timers_running_callback_and_live_loop():
    took, p = _exit_time(EXIT_SCRIPT)
    assert p.returncode == 0, p.stderr
    assert "never" not in p.stdout
    assert "Fatal Python error" not in p.stderr and "Traceback" not in p.stderr, p.stderr
    assert took < SLOW_CALLBACK_S / 2, f"exit took {took:.3f} s"


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
    assert took < SLOW_CALLBACK_S / 2, f"exit took {took:.3f} s"


# -- loops that close ----------------------------------------------------------------------


@pytest.mark.native
def test_loop_closed_with_pending_timers_gets_nothing_and_its_eventfd_is_closed(tt, caplog):
    # Warm up: the first loop port starts the dispatcher (its wake pipe, the
    # orphan port's eventfd); those live as long as the TimerThread.
    warm = asyncio.new_event_loop()
    warm.run_until_complete(asyncio.sleep(0))
    tt.call_later(0, lambda: None, loop=warm)
    warm.close()
    gc.collect()
    before = fd_count()

    ran = []
    loop = asyncio.new_event_loop()

    async def main():
        hs = [tt.call_later(0.05, ran.append, i) for i in range(10)]
        return hs

    handles = loop.run_until_complete(main())
    port_fd = tt._ports[loop].fileno()
    assert port_fd >= 0
    assert fd_count() == before + 4  # the loop's epoll fd and self-pipe pair, our eventfd
    # One more posted to the port (eventfd written) but never drained.
    posted_before = tt.stats()["posted"]
    posted = tt.call_later(0, ran.append, "posted", loop=loop)
    assert wait_until(lambda: tt.stats()["posted"] > posted_before)
    loop.close()
    time.sleep(0.1)  # past every deadline
    assert ran == []
    for h in handles + [posted]:
        assert h.cancel() is False
        assert not h.cancelled()
    gc.collect()
    assert fd_count() == before, "the loop's eventfd (or more) leaked"
    assert loop not in tt._ports
    # Later timers for other loops still work.
    other = asyncio.new_event_loop()
    try:
        async def again():
            fut = other.create_future()
            tt.call_later(0.001, fut.set_result, "ok")
            return await fut

        assert other.run_until_complete(again()) == "ok"
    finally:
        other.close()
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert tt.stats()["early_fires"] == 0


@pytest.mark.parametrize("which", ["own", "default"])
@pytest.mark.native
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


@pytest.mark.native
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


@pytest.mark.native
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



_IMPORT_START = """
    import asyncio, os, sys, threading, time
    import bucketimer

    def dispatchers():
        return [t for t in threading.enumerate() if t.name == "bucketimer-dispatcher"]

    lazy = os.environ.get("BUCKETIMER_LAZY_START") == "1"
    deadline = time.monotonic() + (0.3 if lazy else 20)
    while not dispatchers() and time.monotonic() < deadline:
        time.sleep(0.01)
    before = len(dispatchers())

    async def first():
        bucketimer.call_later(30, print).cancel()

    asyncio.run(first())
    print(before, len(dispatchers()))
"""


@pytest.mark.native
@pytest.mark.parametrize("lazy", ["0", "1"])
def test_import_starts_the_default_timer_thread_unless_lazy(lazy):
    """Importing bucketimer makes the default TimerThread and its dispatcher
    in the background, so the process's first timer makes neither
    (docs/asyncio.rst, "The first timer"); BUCKETIMER_LAZY_START=1 leaves
    them to that first timer.  Either way there is one dispatcher after it."""
    out = check_ok(run_python(_IMPORT_START, env={"BUCKETIMER_LAZY_START": lazy}))
    assert out.split() == (["0", "1"] if lazy == "1" else ["1", "1"])


_PURE_IMPORT = """
    import asyncio, threading
    import bucketimer
    from bucketimer._pure import _default

    made = _default._default
    threads = threading.active_count()

    async def first():
        bucketimer.call_later(30, print).cancel()

    asyncio.run(first())
    print(bucketimer.backend, made is not None, threads,
          made is None or made is _default._default)
"""


@pytest.mark.parametrize("lazy", ["0", "1"])
def test_pure_import_makes_the_default_timer_thread_unless_lazy(lazy):
    """On the pure backend importing bucketimer makes the default
    TimerThread, so that the process's first timer does not (it starts no
    thread: a timer on a loop's heap needs none); BUCKETIMER_LAZY_START=1
    leaves it to that first timer."""
    env = {"BUCKETIMER_LAZY_START": lazy, "BUCKETIMER_NO_EXTENSIONS": "1"}
    out = check_ok(run_python(_PURE_IMPORT, env=env))
    assert out.split() == ["python", "False" if lazy == "1" else "True", "1", "True"]
