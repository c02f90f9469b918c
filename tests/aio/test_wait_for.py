"""wait_for(): bucketimer's against asyncio's, each on every loop (the ``t``
and ``run`` fixtures of conftest.py), and what only bucketimer's C
coroutine has to get right (its messages, attributes and protocol).
"""

from __future__ import annotations

import asyncio
import inspect

import pytest
from _impls import PY312

import bucketimer
from bucketimer import aio


def test_wait_for_result(t, run):
    async def work():
        await asyncio.sleep(0.001)
        return 42

    async def main():
        return await t.wait_for(work(), 5)

    assert run(main()) == 42

def test_wait_for_finishing_coroutine(t, run):
    async def work():
        return "now"

    async def main():
        return [await t.wait_for(work(), 5) for _ in range(50)]

    assert run(main()) == ["now"] * 50

def test_wait_for_none(t, run):
    async def work():
        await asyncio.sleep(0.01)
        return 1

    async def main():
        return await t.wait_for(work(), None)

    assert run(main()) == 1

def test_wait_for_times_out_and_cancels_inner(t, run):
    cancelled = []

    async def work():
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    async def main():
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(TimeoutError) as ei:
            await t.wait_for(work(), 0.02)
        assert isinstance(ei.value.__cause__, asyncio.CancelledError)
        return loop.time() - t0, asyncio.current_task().cancelling()

    elapsed, cancelling = run(main())
    assert 0.015 <= elapsed < 5
    assert cancelling == 0
    assert cancelled == [True]

@pytest.mark.parametrize("timeout", [0, -1])
def test_wait_for_zero_does_not_start_coroutine(t, run, timeout):
    started = []

    async def work():
        started.append(1)

    async def main():
        with pytest.raises(TimeoutError) as ei:
            await t.wait_for(work(), timeout)
        assert isinstance(ei.value.__cause__, asyncio.CancelledError)
        return started

    assert run(main()) == []

def test_wait_for_zero_done_future(t, run):
    async def main():
        fut = asyncio.get_running_loop().create_future()
        fut.set_result("ready")
        return await t.wait_for(fut, 0)

    assert run(main()) == "ready"

def test_wait_for_future(t, run):
    async def main():
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        loop.call_later(0.005, fut.set_result, "later")
        return await t.wait_for(fut, 5)

    assert run(main()) == "later"

def test_wait_for_future_times_out_cancels_it(t, run):
    async def main():
        fut = asyncio.get_running_loop().create_future()
        with pytest.raises(TimeoutError):
            await t.wait_for(fut, 0.01)
        return fut.cancelled()

    assert run(main()) is True

def test_wait_for_cancelled_from_outside(t, run):
    inner_cancelled = []

    async def work():
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            inner_cancelled.append(True)
            raise

    async def waiter(ready):
        ready.set_result(None)
        return await t.wait_for(work(), 30)

    async def main():
        loop = asyncio.get_running_loop()
        ready = loop.create_future()
        task = asyncio.create_task(waiter(ready))
        await ready
        await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return task.cancelled()

    assert run(main()) is True
    assert inner_cancelled == [True]

def test_wait_for_suppressed_cancellation_returns_value(t, run):
    """The awaited coroutine swallows the cancellation and returns a value:
    wait_for returns that value (3.11: after waiting for the wrapped task;
    3.12+: directly)."""

    async def stubborn():
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            return "suppressed"

    async def main():
        return await t.wait_for(stubborn(), 0.01)

    assert run(main()) == "suppressed"

def test_wait_for_exception_propagates(t, run):
    async def boom():
        await asyncio.sleep(0.001)
        raise ZeroDivisionError

    async def main():
        with pytest.raises(ZeroDivisionError):
            await t.wait_for(boom(), 5)
        return asyncio.current_task().cancelling()

    assert run(main()) == 0

def test_wait_for_runs_coroutine_in_same_task_on_312(t, run):
    """3.11 wraps the coroutine in a new Task; 3.12+ awaits it in place."""

    async def who():
        return asyncio.current_task()

    async def main():
        return (await t.wait_for(who(), 5)) is asyncio.current_task()

    assert run(main()) is PY312

def test_wait_for_inside_timeout(t, run):
    async def main():
        with pytest.raises(TimeoutError):
            async with t.timeout(0.01) as cm:
                await t.wait_for(asyncio.sleep(10), 30)
        return cm.expired(), asyncio.current_task().cancelling()

    assert run(main()) == (True, 0)

def test_wait_for_timeout_inside_outer_timeout(t, run):
    async def main():
        async with t.timeout(30) as cm:
            with pytest.raises(TimeoutError):
                await t.wait_for(asyncio.sleep(10), 0.01)
        return cm.expired(), asyncio.current_task().cancelling()

    assert run(main()) == (False, 0)

def test_wait_for_as_task_gather_and_taskgroup(t, run):
    """What wait_for() returns is a coroutine to asyncio: create_task(),
    gather() and TaskGroup.create_task() take it."""

    async def value(v, delay=0.0):
        await asyncio.sleep(delay)
        return v

    async def main():
        assert asyncio.iscoroutine(c := t.wait_for(value(0), 5))
        task = asyncio.create_task(c)
        got = [await task]
        got += await asyncio.gather(t.wait_for(value(1), 5), t.wait_for(value(2, 0.001), 5))
        async with asyncio.TaskGroup() as tg:
            tt = tg.create_task(t.wait_for(value(3), 5))
        got.append(tt.result())
        with pytest.raises(TimeoutError):
            await asyncio.create_task(t.wait_for(value(4, 10), 0.01))
        return got, repr(task).startswith("<Task finished"), task.get_stack()

    assert run(main()) == ([0, 1, 2, 3], True, [])

def test_wait_for_keywords(t, run):
    async def value():
        return "kw"

    async def main():
        return await t.wait_for(fut=value(), timeout=5)

    assert run(main()) == "kw"

def test_wait_for_not_awaitable(t, run):
    async def main():
        with pytest.raises(TypeError):
            await t.wait_for(42, 5)
        with pytest.raises(TypeError):
            await t.wait_for(42, None)
        return asyncio.current_task().cancelling()

    assert run(main()) == 0

def test_wait_for_coroutine_protocol(t, run):
    """send/throw/close by hand behave as on any coroutine."""

    async def main():
        fut = asyncio.get_running_loop().create_future()
        # thrown into before it started: raised, and it is finished
        c = t.wait_for(fut, 5)
        with pytest.raises(ValueError):
            c.throw(ValueError("before start"))
        with pytest.raises(RuntimeError, match="cannot reuse already awaited coroutine"):
            c.send(None)
        # run to completion by hand: the value comes in StopIteration (3.11
        # runs even a done future through a Task, unless without timeout)
        fut.set_result("by hand")
        c = t.wait_for(fut, 5 if PY312 else None)
        with pytest.raises(StopIteration) as si:
            c.send(None)
        with pytest.raises(RuntimeError, match="cannot reuse already awaited coroutine"):
            c.send(None)
        c.close()  # closing a finished coroutine does nothing
        # closed before it started
        c = t.wait_for(fut, 5)
        c.close()
        with pytest.raises(RuntimeError, match="cannot reuse already awaited coroutine"):
            c.send(None)
        return si.value.value

    assert run(main()) == "by hand"

@pytest.mark.parametrize("how", ["close", "collect"])
def test_wait_for_dropped_while_suspended_disarms_timer(t, run, how):
    """A wait_for closed (or garbage-collected) while it waits exits its
    timeout: the timer that would have cancelled the task never fires."""
    import gc

    async def main():
        fut = asyncio.get_running_loop().create_future()
        c = t.wait_for(fut, 0.02)
        yielded = c.send(None)  # suspended on fut
        assert isinstance(yielded, asyncio.Future)  # fut itself from 3.12 on
        if how == "close":
            c.close()
        else:
            del c, yielded
            gc.collect()
        await asyncio.sleep(0.06)  # the timeout would have cancelled us here
        return asyncio.current_task().cancelling()

    assert run(main()) == 0

def test_wait_for_timeout_error_chain_inside_except(t, run):
    """Awaited inside an ``except`` block, the TimeoutError has the timeout's
    CancelledError as its cause, and from 3.12 (the interpreter chains it as
    it enters the awaiting frame) the exception being handled there as its
    context."""

    async def main():
        try:
            raise KeyError("being handled")
        except KeyError:
            try:
                await t.wait_for(asyncio.sleep(10), 0.01)
            except TimeoutError as e:
                return type(e.__cause__), type(e.__context__), e.__suppress_context__

    # 3.11's wait_for raises it in its own frame, after which nothing
    # chains it again on the way into the awaiting one
    assert run(main()) == (asyncio.CancelledError, KeyError if PY312 else asyncio.CancelledError,
                           True)


# -- bucketimer specifics (not in the reference) --------------------------------------------

def test_wait_for_coroutine_states(t, run):
    """inspect.getcoroutinestate() through a wait_for's life: the C
    coroutine has no frame, but reports its states as asyncio's does."""
    states = []

    async def work(outer):
        states.append(inspect.getcoroutinestate(outer[0]))
        await asyncio.sleep(0)
        return 1

    async def main():
        outer = []
        c = t.wait_for(work(outer), 5)
        outer.append(c)
        states.append(inspect.getcoroutinestate(c))
        task = asyncio.ensure_future(c)
        await asyncio.sleep(0)
        states.append(inspect.getcoroutinestate(c))
        assert await task == 1
        states.append(inspect.getcoroutinestate(c))
        inner = work([None])
        c = t.wait_for(inner, 5)
        c.close()
        states.append(inspect.getcoroutinestate(c))
        inner.close()

    run(main())
    # 3.11's wait_for runs the coroutine in a task of its own
    in_work = inspect.CORO_RUNNING if PY312 else inspect.CORO_SUSPENDED
    assert states == [inspect.CORO_CREATED, in_work, inspect.CORO_SUSPENDED, inspect.CORO_CLOSED,
                      inspect.CORO_CLOSED]


@pytest.mark.parametrize("where", ["suspended", "before the start"])
def test_wait_for_throw_of_a_class_inside_except(t, run, where):
    """throw(ValueError) (the class) from inside an ``except`` block raises
    a ValueError made where the coroutine waits: the caller's handled
    exception is not its __context__ (as for asyncio's coroutine)."""

    async def main():
        fut = asyncio.get_running_loop().create_future()
        c = t.wait_for(fut, 5)
        if where == "suspended":
            c.send(None)
        try:
            raise KeyError("the caller's")
        except KeyError:
            with pytest.raises(ValueError) as ei:
                c.throw(ValueError)
        fut.cancel()
        return ei.value

    exc = run(main())
    assert type(exc) is ValueError and exc.args == ()
    assert exc.__context__ is None and exc.__cause__ is None


def test_wait_for_never_awaited_warns_as_asyncio_does(t):
    """Dropped unawaited, the coroutine warns under asyncio's name for it."""
    import gc
    import warnings

    fut = asyncio.Future(loop=asyncio.new_event_loop())
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            c = t.wait_for(fut, 5)
            del c
            gc.collect()
    finally:
        fut.get_loop().close()
    assert [str(w.message) for w in caught if w.category is RuntimeWarning] == [
        "coroutine 'wait_for' was never awaited"]


@pytest.mark.parametrize("timeout", [0, 30])
def test_wait_for_task_refused_closes_the_coroutine(t, run, timeout):
    """A loop that refuses the coroutine's Task (its task factory raises
    RuntimeError) gets the error back, and the coroutine is closed, not
    left to warn that it was never awaited.  (From 3.12 only ``timeout <= 0``
    makes a Task.)"""
    import gc
    import warnings

    started = []

    async def work():
        started.append(True)

    def refuse(loop, coro, **kwargs):
        raise RuntimeError("no tasks here")

    async def main():
        loop = asyncio.get_running_loop()
        loop.set_task_factory(refuse)
        coro = work()
        try:
            with pytest.raises(RuntimeError, match="no tasks here"):
                await t.wait_for(coro, timeout)
        finally:
            loop.set_task_factory(None)
        return inspect.getcoroutinestate(coro)

    if PY312 and timeout > 0:  # awaited in the calling task: no Task to refuse
        return
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        assert run(main()) == inspect.CORO_CLOSED
        gc.collect()
    assert started == []


@pytest.mark.skipif(PY312 or bucketimer.backend != "python",
                    reason="the pure-Python backend's 3.11 wait_for")
@pytest.mark.parametrize("loop_factory", ["stock", "drop-in"])
def test_pure_wait_for_timer_is_on_the_loops_heap(loop_factory, monkeypatch):
    """On the pure backend 3.11's ``wait_for`` pushes its timer on the loop's
    heap itself, on asyncio's loop and on the drop-in loop, where the loop's
    ``call_later`` would push it there; and cancels it once the wait ends.
    A loop whose ``call_later`` is replaced (here on the instance) has it
    called instead, as asyncio's ``wait_for`` calls it."""
    from asyncio.events import TimerHandle

    from bucketimer._pure import aio as pure_aio

    pushed = []
    push = pure_aio.push

    def counting_push(loop, when, callback, args, context):
        pushed.append(when)
        return push(loop, when, callback, args, context)

    monkeypatch.setattr(pure_aio, "push", counting_push)

    def timers(loop):
        return [h for h in loop._scheduled
                if type(h) is TimerHandle and h._callback is not None
                and getattr(h._callback, "__name__", "") == "release_waiter"]

    async def work(seen):
        loop = asyncio.get_running_loop()
        seen.extend(timers(loop))
        return len(seen)

    async def main():
        loop = asyncio.get_running_loop()
        seen = []
        t0 = loop.time()
        assert await aio.wait_for(work(seen), 30) == 1
        (timer,) = seen
        assert t0 + 30 <= timer.when() <= loop.time() + 30
        assert pushed == [timer.when()]
        assert timer.cancelled() and timers(loop) == []
        calls = []
        real = loop.call_later

        def call_later(delay, callback, *args, **kwargs):
            calls.append(delay)
            return real(delay, callback, *args, **kwargs)

        loop.call_later = call_later
        try:
            assert await aio.wait_for(work([]), 30) == 1
        finally:
            del loop.call_later
        return calls

    factory = asyncio.SelectorEventLoop if loop_factory == "stock" else bucketimer.EventLoop
    with asyncio.Runner(loop_factory=factory) as r:
        assert r.run(main()) == [30]
    assert len(pushed) == 1


@pytest.mark.skipif(not PY312, reason="the C wait_for is for 3.12 and later")
@pytest.mark.native
def test_c_wait_for_matches_asyncio_messages_and_attributes():
    class ReturnsInt:
        def __await__(self):
            return 42

    made = []

    class ReturnsCoroutine:
        def __await__(self):
            made.append(asyncio.sleep(0))  # a coroutine, not an iterator
            return made[-1]

    async def main():
        msgs = []
        for bad in (42, ReturnsInt(), ReturnsCoroutine()):
            for wf in (asyncio.wait_for, aio.wait_for):
                try:
                    await wf(bad, 5)
                except TypeError as e:
                    msgs.append(str(e))
        fut = asyncio.get_running_loop().create_future()
        c = aio.wait_for(fut, 5)
        attrs = [c.cr_await, c.cr_running, c.cr_frame.f_code.co_name, c.__name__]
        c.send(None)
        attrs.append(c.cr_await is not None)
        c.close()
        attrs.append(c.cr_await)
        return msgs, attrs

    with asyncio.Runner(loop_factory=asyncio.SelectorEventLoop) as r:
        msgs, attrs = r.run(main())
    # each worded as the running interpreter words it
    assert len(msgs) == 6
    assert msgs[0] == msgs[1] and "int" in msgs[0]
    assert msgs[2] == msgs[3] and "int" in msgs[2]
    assert msgs[4] == msgs[5] and "coroutine" in msgs[4]
    for c in made:
        c.close()
    assert attrs == [None, False, "wait_for", "wait_for", True, None]

@pytest.mark.skipif(not PY312, reason="the C wait_for is for 3.12 and later")
def test_c_wait_for_never_awaited_warns():
    async def work():
        pass

    coro = work()
    with pytest.warns(RuntimeWarning, match="coroutine 'wait_for' was never awaited"):
        c = aio.wait_for(coro, 5)
        del c
        import gc

        gc.collect()
    coro.close()


# -- any delay: the same outcome as asyncio's (property-based) -------------------------------
