"""The drop-in loop: bucketimer.loop.EventLoop (and UVEventLoop) against the stock loops.

Each behaviour is written once and run against the stock asyncio selector
loop and uvloop (the references) and bucketimer's loops.  Tests marked
"native only" check what only bucketimer promises (never early, timers in
the core, not in the loop's heap).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import gc
import io
import logging
import subprocess
import sys
import threading
import time
import warnings
import weakref
from unittest import mock

import pytest
from _native_loop import within

import bucketimer
from bucketimer import loop as bt_loop

try:
    import uvloop
except ImportError:  # pragma: no cover
    uvloop = None

LOOPS = {
    "stock": asyncio.SelectorEventLoop,
    "bucketimer": bt_loop.EventLoop,
}
if uvloop is not None:
    LOOPS["uvloop"] = uvloop.new_event_loop
    LOOPS["bucketimer-uv"] = bt_loop.UVEventLoop
NATIVE = {"bucketimer", "bucketimer-uv"}
# What the drop-in loop's native call_at/call_later return.
LoopHandle = getattr(bucketimer._core, "LoopHandle", None) if bucketimer.backend == "native" else None


@pytest.fixture(params=sorted(LOOPS))
def kind(request):
    return request.param


@pytest.fixture
def loop(kind):
    lp = LOOPS[kind]()
    yield lp
    if not lp.is_closed():
        lp.run_until_complete(lp.shutdown_asyncgens())
        lp.close()


@pytest.fixture(params=sorted(NATIVE & set(LOOPS)))
def native_loop_kind(request):
    return request.param


@pytest.fixture
def native_loop(native_loop_kind):
    lp = LOOPS[native_loop_kind]()
    yield lp
    if not lp.is_closed():
        lp.close()


def run(loop, coro, timeout=10):
    return loop.run_until_complete(asyncio.wait_for(coro, timeout))


# -- call_later / call_at ----------------------------------------------------------


def test_call_later_fires_with_args(loop):
    got = []
    loop.call_later(0.01, got.append, "x")
    loop.call_later(0.0, got.append, "y")
    run(loop, asyncio.sleep(0.05))
    assert sorted(got) == ["x", "y"]


def test_call_at_fires(loop):
    fired = loop.create_future()
    h = loop.call_at(loop.time() + 0.01, fired.set_result, "at")
    assert run(loop, fired) == "at"
    assert not h.cancelled()


@pytest.mark.native
def test_when(kind, loop):
    before = loop.time()
    h = loop.call_later(10, lambda: None)
    after = loop.time()
    assert before + 10 - 0.002 <= h.when() <= after + 10 + 0.002
    h.cancel()
    # a deadline in the future whatever the machine's uptime (a past one
    # makes uvloop hand back a plain Handle, without when())
    at = float(int(loop.time()) + 12345) + 0.5
    h2 = loop.call_at(at, lambda: None)
    if kind == "uvloop":
        # uvloop's own handle counts from libuv's millisecond clock, which
        # can tick between the time() that makes the delay and the arming
        # (34 loops in 20 000 here): the reference is exact to 1 ms only.
        assert abs(h2.when() - at) <= 0.001 + 1e-9
    else:
        assert h2.when() == at
    h2.cancel()


@pytest.mark.native
@pytest.mark.parametrize("kind", sorted(set(LOOPS) - {"uvloop"}))
def test_private_when(kind):
    """``TimerHandle._when``, which tests read (uvloop's handles have none)."""
    lp = LOOPS[kind]()
    try:
        at = float(int(lp.time()) + 12345) + 0.5
        h = lp.call_at(at, lambda: None)
        assert h._when == h.when() == at
        h.cancel()
    finally:
        lp.close()


def test_cancel_prevents_call(loop):
    got = []
    h = loop.call_later(0.01, got.append, 1)
    assert not h.cancelled()
    h.cancel()
    assert h.cancelled()
    h.cancel()  # twice is fine
    assert h.cancelled()
    run(loop, asyncio.sleep(0.03))
    assert got == []


def test_handle_methods_mean_what_asyncios_do(kind, loop):
    """One meaning per method, whichever loop made the handle: cancel()
    returns None, cancelled() is True once cancel() was called (even after
    the callback ran), when() keeps an int given to call_at."""
    got = []
    pending = loop.call_later(3600, got.append, "never")
    ran = loop.call_later(0, got.append, "ran")
    run(loop, asyncio.sleep(0.02))
    assert got == ["ran"]
    assert (pending.cancelled(), ran.cancelled()) == (False, False)
    assert (pending.cancel(), ran.cancel()) == (None, None)
    assert (pending.cancelled(), ran.cancelled()) == (True, True)
    assert pending.cancel() is None and pending.cancelled()  # twice
    at = int(loop.time()) + 3600
    h = loop.call_at(at, got.append, "never")
    try:
        # uvloop's own handles (its loop's; the uvloop-based loop's on the
        # pure backend) keep a float: libuv's clock
        uv_timers = kind == "uvloop" or (kind == "bucketimer-uv" and bucketimer.backend != "native")
        assert type(h.when()) is (float if uv_timers else int)
        if uv_timers:
            # uvloop turns call_at into a delay from time() and adds it to
            # libuv's clock when it arms the timer; a millisecond tick (more
            # on a slow, sanitized build) in between moves when() later
            assert at <= h.when() <= at + 0.05
        else:
            assert h.when() == at
    finally:
        h.cancel()
    assert got == ["ran"]


@pytest.mark.native
def test_native_loop_handle_is_not_a_timer_threads_handle(native_loop):
    h = native_loop.call_later(3600, lambda: None)
    try:
        assert type(h) is LoopHandle
        assert not isinstance(h, bucketimer.Handle)
        assert repr(h).startswith("<bucketimer.LoopHandle pending when=")
    finally:
        h.cancel()


def test_cancel_after_fire(loop):
    got = []
    h = loop.call_later(0, got.append, 1)
    run(loop, asyncio.sleep(0.02))
    assert got == [1]
    h.cancel()  # too late: nothing happens
    assert got == [1]


def test_cancel_from_earlier_callback_same_iteration(loop):
    """A timer cancelled by another callback that runs before it, both due."""
    got = []
    victim = []
    now = loop.time()  # one clock read: the order cannot depend on the machine's load
    # The canceller is scheduled first: stock uvloop turns a deadline that has
    # passed by the time call_at reads its clock again into a call_soon, so
    # after a 10 ms stall (an ASan build under load) both run in call order.
    loop.call_at(now + 0.005, lambda: victim[0].cancel())
    victim.append(loop.call_at(now + 0.01, got.append, "victim"))
    run(loop, asyncio.sleep(0.03))
    assert got == []


def test_negative_and_zero_delays(loop):
    got = []
    loop.call_later(-1, got.append, "neg")
    loop.call_at(loop.time() - 10, got.append, "past")
    loop.call_later(0, got.append, "zero")
    run(loop, asyncio.sleep(0.02))
    assert sorted(got) == ["neg", "past", "zero"]


def test_infinite_delay_can_be_cancelled(loop):
    got = []
    h = loop.call_later(float("inf"), got.append, 1)
    run(loop, asyncio.sleep(0.01))
    h.cancel()
    assert h.cancelled() and got == []


def test_none_delay_raises(loop):
    with pytest.raises(TypeError):
        loop.call_later(None, lambda: None)
    with pytest.raises(TypeError):
        loop.call_at(None, lambda: None)


@pytest.mark.native
def test_get_context_and_context_kwarg(loop, kind):
    var = contextvars.ContextVar("var", default="default")
    ctx = contextvars.copy_context()
    ctx.run(var.set, "in-ctx")
    seen = []
    h = loop.call_later(0.001, lambda: seen.append(var.get()), context=ctx)
    # uvloop's TimerHandle has no get_context(), asyncio's has it since 3.12
    has_get_context = kind in NATIVE or (kind == "stock" and hasattr(asyncio.Handle, "get_context"))
    if has_get_context:
        assert h.get_context() is ctx
    var.set("outside")
    h2 = loop.call_later(0.001, lambda: seen.append(var.get()))
    if has_get_context:
        assert isinstance(h2.get_context(), contextvars.Context)
    var.set("changed after scheduling")
    run(loop, asyncio.sleep(0.02))
    assert sorted(seen) == ["in-ctx", "outside"]


def test_order_of_distinct_deadlines(loop):
    got = []
    # deadlines from one clock reading: call_later's own reading would let
    # a slow first call (a port's set-up, a GC pause) reorder them
    now = loop.time()
    for i in (5, 1, 3, 2, 4):
        loop.call_at(now + i * 0.004, got.append, i)
    run(loop, asyncio.sleep(0.05))
    assert got == [1, 2, 3, 4, 5]


def test_many_timers_and_cancels(loop):
    got = []
    handles = [loop.call_later(0.001 * (i % 20), got.append, i) for i in range(2000)]
    for h in handles[::2]:
        h.cancel()
    run(loop, asyncio.sleep(0.06))
    assert sorted(got) == list(range(1, 2000, 2))


def test_scheduled_before_run(loop):
    got = []
    loop.call_later(0.001, got.append, "early")
    loop.call_later(0.002, loop.stop)
    loop.run_forever()
    assert got == ["early"]


def test_call_later_from_callback_and_threadsafe(loop):
    got = []

    def from_thread():
        loop.call_soon_threadsafe(lambda: loop.call_later(0.001, got.append, "thread"))

    async def main():
        t = threading.Thread(target=from_thread)
        t.start()
        t.join()
        await asyncio.sleep(0.03)

    run(loop, main())
    assert got == ["thread"]


def test_callback_exception_goes_to_handler(loop):
    errors = []
    loop.set_exception_handler(lambda lp, ctx: errors.append(ctx))

    def boom():
        raise ZeroDivisionError("boom")

    h = loop.call_later(0.001, boom)
    run(loop, asyncio.sleep(0.02))
    assert len(errors) == 1
    ctx = errors[0]
    assert isinstance(ctx["exception"], ZeroDivisionError)
    assert ctx["message"].startswith("Exception in callback")
    assert ctx["handle"] is not None
    # the loop survived
    assert run(loop, asyncio.sleep(0, "alive")) == "alive"
    del h


# -- asyncio's helpers on the loop -------------------------------------------------------


def test_asyncio_sleep(loop):
    async def main():
        t0 = loop.time()
        r = await asyncio.sleep(0.01, "r")
        return r, loop.time() - t0

    r, dt = run(loop, main())
    assert r == "r" and dt >= 0.008


def test_asyncio_sleep_cancelled(loop):
    async def main():
        task = asyncio.ensure_future(asyncio.sleep(10))
        await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run(loop, main())


def test_asyncio_timeout_and_wait_for(loop):
    async def main():
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.01):
                await asyncio.sleep(10)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(asyncio.sleep(10), 0.01)
        async with asyncio.timeout(5) as cm:
            cm.reschedule(loop.time() + 10)
            await asyncio.sleep(0.001)
        return await asyncio.wait_for(asyncio.sleep(0.001, "ok"), 5)

    assert run(loop, main()) == "ok"


def test_asyncio_wait_and_as_completed(loop):
    async def main():
        slow = asyncio.ensure_future(asyncio.sleep(10))
        fast = asyncio.ensure_future(asyncio.sleep(0.001, "fast"))
        done, pending = await asyncio.wait({slow, fast}, timeout=0.05)
        assert done == {fast} and pending == {slow}
        slow.cancel()
        results = [await f for f in asyncio.as_completed([asyncio.sleep(0.002, 2), asyncio.sleep(0.001, 1)])]
        return sorted(results)

    assert run(loop, main()) == [1, 2]


def test_sleeps_in_many_tasks(loop):
    async def one(i):
        await asyncio.sleep((i % 10) * 0.001)
        return i

    async def main():
        return await asyncio.gather(*(one(i) for i in range(300)))

    assert run(loop, main()) == list(range(300))


# -- lifecycle ---------------------------------------------------------------------------


def test_call_later_after_close_raises(loop):
    loop.close()
    with pytest.raises(RuntimeError):
        loop.call_later(1, lambda: None)
    with pytest.raises(RuntimeError):
        loop.call_at(loop.time() + 1, lambda: None)


def test_pending_timers_dropped_at_close(loop):
    got = []
    loop.call_later(0.001, got.append, 1)
    loop.close()
    time.sleep(0.01)
    assert got == []


def test_closed_loop_with_pending_timers_is_collected(kind):
    """Closing a loop lets it go at once, pending timers or not: they would
    never run anyway, and what they hold (here a future of the loop) must
    not keep it alive until their deadlines."""
    lp = LOOPS[kind]()

    async def arm_inside():
        running = asyncio.get_running_loop()
        fut = running.create_future()
        running.call_later(100, fut.set_result, 1)

    lp.run_until_complete(arm_inside())
    fut = lp.create_future()
    lp.call_at(lp.time() + 100, fut.set_result, 2)  # from outside the loop
    lp.call_later(100, print)
    ref = weakref.ref(lp)
    lp.close()
    del lp, fut
    gc.collect()
    assert ref() is None


@contextlib.contextmanager
def _no_cycle_collector():
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


@pytest.mark.parametrize("debug_after_close", [False, True])
def test_closed_loop_is_freed_by_reference_counting(kind, debug_after_close):
    """A closed loop holds no reference cycle, as the stock one does not: its
    last reference going frees it, without the cycle collector.  Otherwise a
    reference that another thread still holds while gc.collect() runs (an
    executor's worker calling call_soon_threadsafe) keeps a closed loop alive
    until some later collection, although nothing uses it any more."""
    with _no_cycle_collector():
        lp = LOOPS[kind]()

        async def arm_inside():
            running = asyncio.get_running_loop()
            running.call_later(100, print)
            await asyncio.sleep(0.001)

        lp.run_until_complete(arm_inside())
        lp.call_later(100, print)
        lp.close()
        if debug_after_close:  # must not remake what the close let go
            lp.set_debug(True)
            lp.set_debug(False)
        ref = weakref.ref(lp)
        del lp
        assert ref() is None


@pytest.mark.native
def test_close_cancels_its_pending_native_timers(native_loop_kind):
    """They leave the core at the close, counted once (rule 10 of
    docs/design.rst), and the handles answer as asyncio's do after a close."""
    tt = bucketimer.TimerThread()
    try:
        lp = LOOPS[native_loop_kind](timer_thread=tt)
        got = []
        handles = [lp.call_later(100 + i, got.append, i) for i in range(1000)]
        lp.run_until_complete(asyncio.sleep(0))
        lp.close()
        s = tt.stats()
        assert s["scheduled"] - s["ran"] == 1000  # asyncio.sleep(0) arms no timer
        assert s["cancelled"] + s["dropped"] == 1000
        assert not any(h.cancelled() for h in handles)  # not cancelled: dropped
        handles[0].cancel()
        assert handles[0].cancelled()
        assert got == []
    finally:
        tt.close()


def test_run_twice(loop):
    assert run(loop, asyncio.sleep(0.001, 1)) == 1
    assert run(loop, asyncio.sleep(0.001, 2)) == 2


def test_keyboard_interrupt_propagates(loop):
    def interrupt():
        raise KeyboardInterrupt

    loop.call_later(0.001, interrupt)
    with pytest.raises(KeyboardInterrupt):
        loop.run_until_complete(asyncio.sleep(1))
    # the loop is still usable
    assert loop.run_until_complete(asyncio.sleep(0.001, "again")) == "again"


# -- debug mode ------------------------------------------------------------------------------


def test_debug_checks_thread(loop):
    loop.set_debug(True)
    errors = []

    async def main():
        def other():
            try:
                loop.call_later(1, lambda: None)
            except RuntimeError as e:
                errors.append(e)

        t = threading.Thread(target=other)
        t.start()
        t.join()

    run(loop, main())
    assert len(errors) == 1 and "thread" in str(errors[0]).lower()


@pytest.mark.parametrize("kind", ["stock", "bucketimer"])  # uvloop's debug mode does not check callbacks
def test_debug_rejects_coroutine_callback(loop):
    loop.set_debug(True)

    async def coro():
        pass

    with pytest.raises(TypeError):
        loop.call_later(1, coro)


@pytest.mark.parametrize("kind", ["stock", "bucketimer"])  # uvloop reports slow callbacks its own way
def test_debug_slow_callback_names_callback(loop, caplog):
    loop.set_debug(True)
    loop.slow_callback_duration = 0.001

    def slow_timer_callback():
        time.sleep(0.01)

    with caplog.at_level(logging.WARNING, logger="asyncio"):
        loop.call_later(0.001, slow_timer_callback)
        run(loop, asyncio.sleep(0.03))
    assert any("slow_timer_callback" in r.getMessage() for r in caplog.records)


def test_debug_source_traceback_ends_at_the_caller(loop):
    """In debug mode a timer handle remembers where it was made; the last
    frame is the caller's line, as asyncio's handles have it."""
    loop.set_debug(True)
    here = sys._getframe().f_code.co_filename
    h_later = loop.call_later(1, lambda: None)
    line_later = sys._getframe().f_lineno - 1
    h_at = loop.call_at(loop.time() + 1, lambda: None)
    line_at = sys._getframe().f_lineno - 1
    frames = []
    for h in (h_later, h_at):
        tb = getattr(h, "_source_traceback", None)
        assert tb, f"{type(h).__name__} has no _source_traceback in debug mode"
        frames.append((tb[-1].filename, tb[-1].lineno))
        h.cancel()
    assert frames == [(here, line_later), (here, line_at)]


def test_debug_toggle_keeps_timers_working(loop):
    got = []
    loop.call_later(0.01, got.append, "before")
    loop.set_debug(True)
    loop.call_later(0.005, got.append, "debug")
    loop.set_debug(False)
    loop.call_later(0.001, got.append, "after")
    run(loop, asyncio.sleep(0.03))
    assert sorted(got) == ["after", "before", "debug"]


# -- policy, install, loop_factory -------------------------------------------------------------


def test_new_event_loop():
    lp = bt_loop.new_event_loop()
    try:
        assert isinstance(lp, bt_loop.EventLoop)
        assert isinstance(lp, asyncio.SelectorEventLoop)
    finally:
        lp.close()


POLICIES_DEPRECATED = sys.version_info >= (3, 14)


def _policy_warning():
    """From 3.14 asyncio deprecates its event loop policies, and so does
    bucketimer for its own policy names: the warning names the caller's line."""
    if not POLICIES_DEPRECATED:
        return contextlib.nullcontext()
    return pytest.warns(DeprecationWarning, match="loop_factory=bucketimer.new_event_loop")


@pytest.mark.skipif(sys.version_info >= (3, 16), reason="asyncio's policies are gone")
def test_install_and_policy():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # asyncio's own, on 3.14+
        old = asyncio.get_event_loop_policy()
    try:
        with _policy_warning() as record:
            bucketimer.install()
        if record is not None:
            assert record[0].filename == __file__
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            policy = asyncio.get_event_loop_policy()
        with _policy_warning():
            assert isinstance(policy, bucketimer.EventLoopPolicy)
        with _policy_warning():
            assert bt_loop.EventLoopPolicy is bucketimer.loop.EventLoopPolicy
        lp = asyncio.new_event_loop()
        try:
            assert isinstance(lp, bt_loop.EventLoop)
        finally:
            lp.close()

        async def main():
            return type(asyncio.get_running_loop())

        assert asyncio.run(main()) is bt_loop.EventLoop
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            asyncio.set_event_loop_policy(old)


@pytest.mark.skipif(uvloop is None, reason="uvloop is not installed")
@pytest.mark.skipif(sys.version_info >= (3, 16), reason="asyncio's policies are gone")
def test_uv_policy():
    with _policy_warning():
        policy = bt_loop.UVEventLoopPolicy()
    lp = policy.new_event_loop()
    try:
        assert isinstance(lp, bt_loop.UVEventLoop)
    finally:
        lp.close()


def test_importing_bucketimer_touches_no_deprecated_name():
    """``python -W error::DeprecationWarning -c 'import bucketimer'``: on
    3.14+ importing must not touch asyncio's deprecated policy names."""
    code = (
        "import warnings; warnings.simplefilter('error', DeprecationWarning)\n"
        "import bucketimer, bucketimer.loop, bucketimer.aio\n"
        "import asyncio\n"
        "async def main():\n"
        "    async with bucketimer.timeout(1):\n"
        "        await bucketimer.wait_for(asyncio.sleep(0), 1)\n"
        "    return type(asyncio.get_running_loop()).__name__\n"
        "print(bucketimer.run(main()))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "EventLoop"


@pytest.mark.native
def test_run_on_the_drop_in_loop():
    async def main(x):
        await asyncio.sleep(0.001)
        loop = asyncio.get_running_loop()
        return x, type(loop), loop.get_debug()

    assert bucketimer.run(main(1)) == (1, bt_loop.EventLoop, False)
    assert bucketimer.run(main(2), debug=True) == (2, bt_loop.EventLoop, True)
    tt = bucketimer.TimerThread()
    try:
        factory = lambda: bt_loop.EventLoop(timer_thread=tt)  # noqa: E731
        assert bucketimer.run(main(3), loop_factory=factory)[1] is bt_loop.EventLoop
        assert tt.stats()["scheduled"] >= 1
    finally:
        tt.close()
    with pytest.raises(RuntimeError, match="cannot be called from a running event loop"):
        bucketimer.run(_run_inside_a_loop())


async def _run_inside_a_loop():
    coro = asyncio.sleep(0)
    try:
        bucketimer.run(coro)
    finally:
        coro.close()


@pytest.mark.skipif(uvloop is None, reason="uvloop is not installed")
def test_run_on_the_uvloop_based_loop():
    async def main():
        return type(asyncio.get_running_loop())

    assert bucketimer.run(main(), loop_factory=bt_loop.new_uv_event_loop) is bt_loop.UVEventLoop


@pytest.mark.skipif(sys.version_info < (3, 13), reason="IsolatedAsyncioTestCase.loop_factory is 3.13+")
def test_isolated_asyncio_testcase_loop_factory():
    import unittest

    seen = []

    class Case(unittest.IsolatedAsyncioTestCase):
        loop_factory = bucketimer.EventLoop  # a class: a function would bind as a method

        async def test_it(self):
            seen.append(type(asyncio.get_running_loop()))
            async with bucketimer.timeout(1):
                await asyncio.sleep(0.001)

    result = unittest.TextTestRunner(stream=io.StringIO()).run(Case("test_it"))
    assert result.wasSuccessful(), result.errors + result.failures
    assert seen == [bt_loop.EventLoop]


@pytest.mark.skipif(sys.version_info < (3, 12), reason="asyncio.run(loop_factory=) is 3.12+")
def test_asyncio_run_loop_factory():
    async def main():
        await asyncio.sleep(0.001)
        return type(asyncio.get_running_loop())

    assert asyncio.run(main(), loop_factory=bt_loop.new_event_loop) is bt_loop.EventLoop


def test_runner_loop_factory():
    with asyncio.Runner(loop_factory=bt_loop.new_event_loop) as r:
        assert r.run(asyncio.sleep(0.001, "ok")) == "ok"
        assert isinstance(r.get_loop(), bt_loop.EventLoop)


@pytest.mark.native
def test_explicit_timer_thread():
    with bucketimer.TimerThread() as tt:
        lp = bt_loop.EventLoop(timer_thread=tt)
        try:
            assert lp.timer_thread is tt
            lp.run_until_complete(asyncio.sleep(0.001))
            assert tt.stats()["fired"] == 1
        finally:
            lp.close()
    # a bad argument is refused before a selector loop is made: no unclosed
    # loop is left for the GC to warn about
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        with pytest.raises(TypeError):
            bt_loop.EventLoop(timer_thread=object())
        gc.collect()
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)]


# -- native only ---------------------------------------------------------------------------------


@pytest.mark.native
def test_native_timers_live_in_core(native_loop):
    loop = native_loop
    tt = loop.timer_thread
    before = tt.stats()["scheduled"]

    async def main():
        await asyncio.sleep(0.001)
        async with asyncio.timeout(30):
            await asyncio.sleep(0)
        await asyncio.wait_for(asyncio.sleep(0), 30)
        h = loop.call_later(30, lambda: None)
        assert isinstance(h, LoopHandle)
        if hasattr(loop, "_scheduled"):
            assert len(loop._scheduled) == 0  # asyncio's heap stays empty
        h.cancel()

    run(loop, main())
    # sleep, timeout, wait_for (3.11: its own call_later; 3.12+: a timeout),
    # call_later, and the run() helper's own wait_for
    assert tt.stats()["scheduled"] - before >= 5


@pytest.mark.native
def test_native_never_early(native_loop):
    loop = native_loop
    lateness = []

    def cb(deadline):
        lateness.append(time.monotonic() - deadline)

    for i in range(200):
        deadline = time.monotonic() + (i % 17) * 0.0007
        loop.call_at(deadline, cb, deadline)
    run(loop, asyncio.sleep(0.05))
    assert len(lateness) == 200
    assert min(lateness) >= -1e-9  # float rounding only


@pytest.mark.native
def test_native_equal_deadlines_in_schedule_order(native_loop):
    loop = native_loop
    got = []
    when = loop.time() + 0.005
    for i in range(100):
        loop.call_at(when, got.append, i)
    run(loop, asyncio.sleep(0.02))
    assert got == list(range(100))


@pytest.mark.native
def test_native_fast_path_installed(native_loop):
    loop = native_loop
    assert "call_later" in loop.__dict__
    loop.set_debug(True)
    assert "call_later" not in loop.__dict__
    h = loop.call_later(1, lambda: None)
    assert not isinstance(h, LoopHandle)  # debug mode: the stock path
    h.cancel()
    loop.set_debug(False)
    assert "call_later" in loop.__dict__
    loop.close()
    assert "call_later" not in loop.__dict__


@pytest.mark.parametrize("kind", ["stock", "bucketimer"])
def test_few_instance_attributes_on_the_selector_loops(kind):
    """asyncio's loop has 24 to 27 instance attributes; past about 29,
    CPython stops keeping them inline and every loop iteration slows down
    (bucketimer.loop._LoopTimers).  With timers, the helpers and a close,
    the drop-in loop adds its two schedulers and a stock loop that runs the
    helpers adds none (its wrapped selector detaches its port at close), or
    a hook on its ``close`` where its selector is not wrapped
    (``BUCKETIMER_PUBLIC_API``)."""
    stock = asyncio.SelectorEventLoop()
    baseline = set(vars(stock))
    stock.close()
    loop = LOOPS[kind]()

    async def main():
        loop.call_later(3600, print).cancel()
        await asyncio.sleep(0.001)
        async with bucketimer.timeout(3600):
            await bucketimer.wait_for(asyncio.sleep(0), 3600)

    loop.run_until_complete(main())
    added = set(vars(loop)) - baseline
    native = bucketimer.backend == "native"
    if kind == "bucketimer":
        assert added == ({"call_at", "call_later"} if native else set())
    else:
        hooked = native and not isinstance(loop._selector, bucketimer._timers.PollStamp)
        assert added == ({"close"} if hooked else set())
    loop.close()
    assert set(vars(loop)) - baseline == set()


@pytest.mark.native
def test_native_subclass_overrides_respected(native_loop_kind):
    calls = []
    base = LOOPS[native_loop_kind]

    class Logging(base):
        def call_at(self, when, callback, *args, context=None):
            calls.append(when)
            return super().call_at(when, callback, *args, context=context)

    lp = Logging()
    try:
        assert lp.run_until_complete(asyncio.sleep(0.001, "ok")) == "ok"
    finally:
        lp.close()
    assert calls  # call_later (asyncio.sleep) went through the subclass's call_at


@pytest.mark.parametrize("kind", ["stock", "bucketimer"])
def test_timers_follow_a_patched_time(kind):
    """A test that moves time forward by replacing ``loop.time`` on the
    instance sees timers fall due as on the stock loop, and the loop's own
    timers come back once the replacement is undone."""
    lp = LOOPS[kind]()
    fired = []

    async def main():
        real = lp.time()
        with mock.patch.object(lp, "time", return_value=real):
            at = lp.create_future()
            lp.call_at(real + 3600, at.set_result, "at")
            sleeper = asyncio.ensure_future(asyncio.sleep(3600, "slept"))
            await asyncio.sleep(0)  # the sleep arms its timer
            lp.time.return_value = real + 7200
            fired.append(await at)
            fired.append(await sleeper)
        assert ("call_later" in vars(lp)) == (kind in NATIVE and bucketimer.backend == "native")
        fired.append(await asyncio.sleep(0.001, "after"))

    try:
        # a thread's watchdog: the loop's timers go by the patched clock
        lp.run_until_complete(within(main(), 60))
    finally:
        lp.close()
    assert fired == ["at", "slept", "after"]


@pytest.mark.native
@pytest.mark.skipif(uvloop is None, reason="uvloop is not installed")
def test_native_patched_time_on_the_uvloop_based_loop_gets_uvloops_timers():
    lp = LOOPS["bucketimer-uv"]()
    try:
        with mock.patch.object(lp, "time", return_value=0.0):
            h = lp.call_later(3600, lambda: None)
            assert not isinstance(h, LoopHandle)
            h.cancel()
        h = lp.call_later(3600, lambda: None)
        assert isinstance(h, LoopHandle)
        h.cancel()
    finally:
        lp.close()


@pytest.mark.native
def test_native_handle_is_not_a_timer_handle(native_loop):
    h = native_loop.call_later(3600, lambda: None)
    try:
        assert not isinstance(h, asyncio.TimerHandle)  # docs/asyncio.rst says why
    finally:
        h.cancel()


def test_native_virtual_clock_subclass_gets_stock_timers():
    class Virtual(bt_loop.EventLoop):
        def time(self):
            return super().time() + 1000.0

    lp = Virtual()
    try:
        h = lp.call_later(0.001, lambda: None)
        assert isinstance(h, asyncio.TimerHandle)
        assert lp.run_until_complete(asyncio.sleep(0.001, "ok")) == "ok"
    finally:
        lp.close()


@pytest.mark.native
@pytest.mark.parametrize("kind", sorted(NATIVE & set(LOOPS)))
def test_native_attribute_stores_run_no_python(kind):
    """A drop-in loop stores its attributes in C (asyncio sets some 30 in a
    loop's life): no Python function runs for one, until the name is
    ``time``, whose store and delete switch the loop's timers.
    ``object.__setattr__`` works on it as on the stock loop."""
    lp = LOOPS[kind]()
    calls: list[str] = []

    def profile(frame, event, arg):
        if event == "call":
            calls.append(frame.f_code.co_name)

    try:
        sys.setprofile(profile)
        try:
            lp._bt_probe = 1
            del lp._bt_probe
        finally:
            sys.setprofile(None)
        assert [c for c in calls if c != "profile"] == []
        real = lp.time
        lp.time = lambda: 0.0
        assert "call_later" not in vars(lp)
        del lp.time
        assert "call_later" in vars(lp) and lp.time == real
        object.__setattr__(lp, "time", lambda: 0.0)  # (object's: no switch)
        object.__delattr__(lp, "time")
        assert "call_later" in vars(lp)
    finally:
        lp.close()


@pytest.mark.native
def test_native_attribute_stores_refuse_what_object_refuses():
    """The drop-in loop's C ``__setattr__``/``__delattr__`` given what Python
    allows: object's errors, and a clock-change hook that is missing, not
    callable, raises or calls back into bucketimer leaves the store done and
    the loop usable."""
    from bucketimer import _core

    lp = bt_loop.EventLoop()
    try:
        for bad in [(), ("time",), ("a", 1, 2)]:
            with pytest.raises(TypeError, match="expected"):
                _core._loop_setattr(lp, *bad)
        with pytest.raises(TypeError, match="expected"):
            _core._loop_delattr(lp)
        with pytest.raises(AttributeError):
            _core._loop_setattr(object(), "x", 1)  # no __dict__: object's error
        with pytest.raises(TypeError, match="attribute name must be string"):
            _core._loop_setattr(lp, 1, 2)
        with pytest.raises(AttributeError):
            del lp.nothing_here

        class Name(str):
            def __eq__(self, other):
                raise AssertionError("a name's __eq__ is not asked")

            __hash__ = str.__hash__

        setattr(lp, Name("tame"), 1)

        def refuses():
            raise LookupError("no")

        for hook in (lambda: bucketimer.call_later(0.001, print).cancel(), None, refuses):
            lp._bt_clock_changed = hook
            with contextlib.suppress(TypeError, LookupError):
                lp.time = lp.time
            assert "time" in vars(lp)
            with contextlib.suppress(TypeError, LookupError):
                del lp.time
            assert "time" not in vars(lp)
            del lp._bt_clock_changed
        lp.time = lambda: 0.0
        assert "call_later" not in vars(lp)
        del lp.time
        assert lp.run_until_complete(asyncio.sleep(0.001, "ok")) == "ok"
    finally:
        lp.close()


@pytest.mark.native
def test_native_a_setattr_further_up_the_mro_is_still_called():
    """A class after the loop's in a subclass's MRO with a ``__setattr__``
    (or ``__delattr__``) of its own has it called, as ``super()`` calls it,
    and ``time`` still switches the timers."""
    seen: list[tuple[str, str]] = []

    class Stores(asyncio.SelectorEventLoop):
        def __setattr__(self, name, value):
            seen.append(("set", name))
            super().__setattr__(name, value)

        def __delattr__(self, name):
            seen.append(("del", name))
            super().__delattr__(name)

    class Loop(bt_loop._NativeTimersMixin, Stores):
        _bt_stock_time = asyncio.BaseEventLoop.time

        def __init__(self):
            super().__init__()
            self._bt_init(None)

    class Mine(bt_loop.EventLoop):  # its own, calling the drop-in loop's
        def __setattr__(self, name, value):
            seen.append(("mine", name))
            super().__setattr__(name, value)

    for lp in (Loop(), Mine()):
        try:
            assert ("set", "_ready") in seen or ("mine", "_ready") in seen
            assert "call_later" in vars(lp)
            lp.time = lambda: 0.0
            assert "call_later" not in vars(lp)
            del lp.time
            assert "call_later" in vars(lp)
        finally:
            lp.close()
    assert {("set", "time"), ("del", "time"), ("mine", "time")} <= set(seen)
