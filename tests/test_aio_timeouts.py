"""timeout(), timeout_at(), Timeout and wait_for(): bucketimer's against asyncio's.

Every behaviour is written once and run against the stock asyncio helpers
(the reference) and bucketimer.aio's, on the stock loop, on uvloop's loop
(where installed) and on bucketimer's drop-in loop.  An assertion that the
reference fails is a wrong test, not a finding.
"""

from __future__ import annotations

import asyncio
import contextvars
import decimal
import fractions
import math
import sys
import types

import pytest
from _helpers import examples
from hypothesis import given
from hypothesis import strategies as st

import bucketimer
from bucketimer import aio
from bucketimer import loop as bt_loop

try:
    import uvloop
except ImportError:  # pragma: no cover
    uvloop = None

PY312 = sys.version_info >= (3, 12)
# 3.13 (not 3.12.1) puts a TimeoutError into the chain of an exception raised
# while handling the timeout's CancelledError.
INSERTS_TIMEOUT_ERROR = hasattr(asyncio.timeouts.Timeout, "_insert_timeout_error")

def _no_warning():
    import contextlib

    return contextlib.nullcontext()


IMPLS = {
    "asyncio": types.SimpleNamespace(
        name="asyncio",
        timeout=asyncio.timeout,
        timeout_at=asyncio.timeout_at,
        Timeout=asyncio.Timeout,
        wait_for=asyncio.wait_for,
    ),
    "bucketimer": types.SimpleNamespace(
        name="bucketimer",
        timeout=aio.timeout,
        timeout_at=aio.timeout_at,
        Timeout=aio.Timeout,
        wait_for=aio.wait_for,
    ),
}

LOOPS = {"stock": asyncio.SelectorEventLoop, "bucketimer-loop": bt_loop.EventLoop}
if uvloop is not None:
    LOOPS["uvloop"] = uvloop.new_event_loop


@pytest.fixture(params=sorted(IMPLS))
def t(request):
    return IMPLS[request.param]


@pytest.fixture(params=sorted(LOOPS))
def run(request):
    """run(coroutine) on a fresh loop of the parametrized kind."""
    factory = LOOPS[request.param]

    def _run(coro):
        with asyncio.Runner(loop_factory=factory) as runner:
            return runner.run(coro)

    return _run


# -- None, zero, negative ------------------------------------------------------


def test_none_never_fires(t, run):
    async def main():
        async with t.timeout(None) as cm:
            assert cm.when() is None
            await asyncio.sleep(0.02)
        assert not cm.expired()
        return "done"

    assert run(main()) == "done"


def test_timeout_at_none(t, run):
    async def main():
        async with t.timeout_at(None) as cm:
            await asyncio.sleep(0.01)
        return cm.expired(), cm.when()

    assert run(main()) == (False, None)


@pytest.mark.parametrize("delay", [0, -1, -1e9])
def test_zero_and_negative_fire_on_next_iteration(t, run, delay):
    """A deadline already past fires on the very next loop iteration: the
    first await in the block is interrupted, even a sleep(0)."""
    steps = []

    async def main():
        with pytest.raises(TimeoutError):
            async with t.timeout(delay) as cm:
                steps.append("in")
                await asyncio.sleep(0)
                steps.append("after sleep(0)")
        assert cm.expired()
        return steps

    assert run(main()) == ["in"]


@pytest.mark.parametrize("delay", [0, -1])
def test_zero_without_await_does_not_raise(t, run, delay):
    async def main():
        async with t.timeout(delay) as cm:
            x = 1 + 1
        assert not cm.expired()
        assert asyncio.current_task().cancelling() == 0
        # the discarded expiry must not hit the task later either
        await asyncio.sleep(0.01)
        return x

    assert run(main()) == 2


def test_timeout_at_past(t, run):
    async def main():
        loop = asyncio.get_running_loop()
        with pytest.raises(TimeoutError):
            async with t.timeout_at(loop.time() - 5):
                await asyncio.sleep(10)
        return "ok"

    assert run(main()) == "ok"


# -- firing, when(), expired() -----------------------------------------------------


def test_fires_and_converts_to_timeout_error(t, run):
    async def main():
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(TimeoutError) as ei:
            async with t.timeout(0.02) as cm:
                assert not cm.expired()
                await asyncio.sleep(10)
        elapsed = loop.time() - t0
        assert cm.expired()
        assert isinstance(ei.value.__cause__, asyncio.CancelledError)
        assert ei.value.__context__ is ei.value.__cause__
        assert asyncio.current_task().cancelling() == 0
        return elapsed

    elapsed = run(main())
    assert 0.015 <= elapsed < 5


def test_when_is_loop_time_plus_delay(t, run):
    async def main():
        loop = asyncio.get_running_loop()
        before = loop.time()
        cm = t.timeout(10)
        after = loop.time()
        assert before + 10 <= cm.when() <= after + 10
        async with cm:
            assert before + 10 <= cm.when() <= after + 10
        assert t.timeout_at(123.5).when() == 123.5
        return "ok"

    assert run(main()) == "ok"


def test_finishes_in_time(t, run):
    async def main():
        async with t.timeout(5) as cm:
            await asyncio.sleep(0.01)
        assert not cm.expired()
        # the cancelled timer must not cancel the task afterwards
        await asyncio.sleep(0.02)
        return asyncio.current_task().cancelling()

    assert run(main()) == 0


def test_repr(t, run):
    async def main():
        cm = t.timeout_at(1000.12345)
        assert repr(cm) == "<Timeout [created]>"
        async with cm:
            assert repr(cm) == "<Timeout [active] when=1000.123>"
            cm.reschedule(None)
            assert repr(cm) == "<Timeout [active] when=None>"
        assert repr(cm) == "<Timeout [finished]>"
        with pytest.raises(TimeoutError):
            async with t.timeout(0) as cm2:
                await asyncio.sleep(1)
        assert repr(cm2) == "<Timeout [expired]>"
        return "ok"

    assert run(main()) == "ok"


def test_timeout_class_usable_directly(t, run):
    async def main():
        loop = asyncio.get_running_loop()
        with pytest.raises(TimeoutError):
            async with t.Timeout(loop.time() + 0.01) as cm:
                await asyncio.sleep(5)
        assert isinstance(cm, t.Timeout)
        return cm.expired()

    assert run(main()) is True


# -- reschedule() -----------------------------------------------------------------


def test_reschedule_earlier(t, run):
    async def main():
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(TimeoutError):
            async with t.timeout(30) as cm:
                cm.reschedule(loop.time() + 0.02)
                assert cm.when() <= loop.time() + 0.02
                await asyncio.sleep(30)
        return loop.time() - t0

    assert run(main()) < 5


def test_reschedule_later(t, run):
    async def main():
        loop = asyncio.get_running_loop()
        async with t.timeout(0.01) as cm:
            cm.reschedule(loop.time() + 30)
            await asyncio.sleep(0.05)
        assert not cm.expired()
        await asyncio.sleep(0.02)
        return asyncio.current_task().cancelling()

    assert run(main()) == 0


def test_reschedule_to_none(t, run):
    async def main():
        async with t.timeout(0.01) as cm:
            cm.reschedule(None)
            assert cm.when() is None
            await asyncio.sleep(0.05)
        return cm.expired()

    assert run(main()) is False


def test_reschedule_from_none(t, run):
    async def main():
        loop = asyncio.get_running_loop()
        with pytest.raises(TimeoutError):
            async with t.timeout(None) as cm:
                cm.reschedule(loop.time() + 0.01)
                await asyncio.sleep(10)
        return cm.expired()

    assert run(main()) is True


def test_reschedule_to_past_fires_next_iteration(t, run):
    steps = []

    async def main():
        loop = asyncio.get_running_loop()
        with pytest.raises(TimeoutError):
            async with t.timeout(30) as cm:
                cm.reschedule(loop.time() - 1)
                steps.append(1)
                await asyncio.sleep(0)
                steps.append(2)
        return steps

    assert run(main()) == [1]


def test_reschedule_many_times_keeps_one_timer(t, run):
    async def main():
        loop = asyncio.get_running_loop()
        async with t.timeout(0.01) as cm:
            for i in range(200):
                cm.reschedule(loop.time() + 0.01 + i * 0.001)
            cm.reschedule(loop.time() + 30)
            await asyncio.sleep(0.05)
        return cm.expired()

    assert run(main()) is False


def test_reschedule_state_errors(t, run):
    async def main():
        loop = asyncio.get_running_loop()
        cm = t.timeout(1)
        with pytest.raises(RuntimeError, match="Timeout has not been entered"):
            cm.reschedule(loop.time() + 1)
        async with cm:
            pass
        with pytest.raises(RuntimeError, match="Cannot change state of finished Timeout"):
            cm.reschedule(loop.time() + 1)

        with pytest.raises(TimeoutError):
            async with t.timeout(0) as cm2:
                try:
                    await asyncio.sleep(1)
                finally:
                    # after expiry, still inside the block
                    with pytest.raises(RuntimeError, match="Cannot change state of expiring Timeout"):
                        cm2.reschedule(None)
        with pytest.raises(RuntimeError, match="Cannot change state of expired Timeout"):
            cm2.reschedule(None)
        return "ok"

    assert run(main()) == "ok"


# -- use outside a task, re-entry -------------------------------------------------------


def test_timeout_outside_running_loop(t):
    with pytest.raises(RuntimeError):
        t.timeout(1)
    # timeout_at() does not need a loop until entered
    cm = t.timeout_at(None)
    assert cm.when() is None


def test_enter_outside_task(t, run):
    """A running loop but no task: driven from a plain callback."""

    async def body(cm):
        async with cm:
            pass

    async def main():
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def drive():
            coro = body(t.timeout_at(loop.time() + 10))
            try:
                coro.send(None)
            except BaseException as e:
                fut.set_result(e)
            else:  # pragma: no cover
                fut.set_result(None)

        loop.call_soon(drive)
        return await fut

    e = run(main())
    assert isinstance(e, RuntimeError)
    assert str(e) == "Timeout should be used inside a task"


def test_enter_made_in_a_task_driven_outside_it(t, run):
    """__aenter__() only makes a coroutine: the check for a task, and the
    arming, happen when it is driven.  Made inside the task and driven from
    a plain callback, it finds no task and arms nothing."""

    async def main():
        loop = asyncio.get_running_loop()
        cm = t.timeout_at(loop.time() + 0.01)
        aw = cm.__aenter__()  # inside the task: nothing happens yet
        fut = loop.create_future()

        def drive():
            try:
                aw.send(None)
            except BaseException as e:
                fut.set_result(e)
            else:  # pragma: no cover
                fut.set_result(None)

        loop.call_soon(drive)
        e = await fut
        # nothing was armed: the task is not cancelled when `when` passes
        await asyncio.sleep(0.05)
        return e, repr(cm), asyncio.current_task().cancelling()

    e, r, cancelling = run(main())
    assert isinstance(e, RuntimeError)
    assert str(e) == "Timeout should be used inside a task"
    assert r == "<Timeout [created]>"
    assert cancelling == 0


def test_reschedule_before_enter_is_driven(t, run):
    """A Timeout whose __aenter__() was called but not awaited has not been
    entered: reschedule() refuses, and the await enters it afterwards."""

    async def main():
        loop = asyncio.get_running_loop()
        cm = t.timeout(30)
        aw = cm.__aenter__()
        with pytest.raises(RuntimeError, match="Timeout has not been entered"):
            cm.reschedule(loop.time() + 1)
        assert await aw is cm
        cm.reschedule(loop.time() + 60)
        await cm.__aexit__(None, None, None)
        return repr(cm)

    assert run(main()) == "<Timeout [finished]>"


def test_exit_happens_when_awaited(t, run):
    """__aexit__() too does its work when awaited: until then the Timeout
    stays active and its timer armed."""

    async def main():
        loop = asyncio.get_running_loop()
        cm = t.timeout(0.02)
        await cm.__aenter__()
        aw = cm.__aexit__(None, None, None)
        before = repr(cm)
        with pytest.raises(asyncio.CancelledError):
            await asyncio.sleep(1)  # the timer still fires
        with pytest.raises(TimeoutError):
            await cm.__aexit__(asyncio.CancelledError, asyncio.CancelledError(), None)
        aw.close()
        return before, cm.expired(), loop.time()

    before, expired, _ = run(main())
    assert before.startswith("<Timeout [active] when=")
    assert expired


def test_enter_and_exit_awaitables_are_one_shot(t, run):
    """What __aenter__()/__aexit__() return runs once, like any coroutine:
    driven again it refuses; closed or thrown into first, it never runs."""

    async def main():
        cm = t.timeout(30)
        aw = cm.__aenter__().__await__()
        with pytest.raises(StopIteration):
            aw.send(None)
        with pytest.raises(RuntimeError, match="cannot reuse already awaited coroutine"):
            aw.send(None)
        unused = cm.__aexit__(None, None, None)
        unused.close()
        assert repr(cm).startswith("<Timeout [active]")  # the closed exit never ran
        await cm.__aexit__(None, None, None)
        fresh = t.timeout(30)
        thrown = fresh.__aenter__().__await__()
        with pytest.raises(ValueError):
            thrown.throw(ValueError("before the start"))
        return repr(cm), repr(fresh)

    assert run(main()) == ("<Timeout [finished]>", "<Timeout [created]>")


def test_stop_iteration_that_picked_up_notes_is_not_reused(t, run):
    """bucketimer raises one StopIteration again and again while nobody else
    holds it; one that someone caught and decorated (a note, an attribute)
    must not carry that into later awaits."""

    async def main():
        first = t.timeout(30)
        try:
            first.__aenter__().__await__().send(None)
        except StopIteration as e:
            e.add_note("a note")
            e.mark = "an attribute"
        await first.__aexit__(None, None, None)
        second = t.timeout(30)
        try:
            second.__aenter__().__await__().send(None)
        except StopIteration as e:
            seen = getattr(e, "__notes__", None), getattr(e, "mark", None), e.value is second
        await second.__aexit__(None, None, None)
        return seen

    assert run(main()) == (None, None, True)


def test_reentry_raises(t, run):
    async def main():
        cm = t.timeout(10)
        async with cm:
            with pytest.raises(RuntimeError, match="Timeout has already been entered"):
                async with cm:
                    pass
        with pytest.raises(RuntimeError, match="Timeout has already been entered"):
            async with cm:
                pass
        return "ok"

    assert run(main()) == "ok"


# -- nesting -------------------------------------------------------------------------


def test_nested_inner_fires(t, run):
    async def main():
        async with t.timeout(30) as outer:
            with pytest.raises(TimeoutError):
                async with t.timeout(0.01) as inner:
                    await asyncio.sleep(10)
            await asyncio.sleep(0.01)
        return inner.expired(), outer.expired(), asyncio.current_task().cancelling()

    assert run(main()) == (True, False, 0)


def test_nested_outer_fires(t, run):
    seen = []

    async def main():
        with pytest.raises(TimeoutError):
            async with t.timeout(0.01) as outer:
                try:
                    async with t.timeout(30) as inner:
                        await asyncio.sleep(10)
                except BaseException as e:
                    seen.append(type(e))
                    raise
        return inner.expired(), outer.expired(), asyncio.current_task().cancelling()

    assert run(main()) == (False, True, 0)
    # the inner timeout lets the CancelledError through, untouched
    assert seen == [asyncio.CancelledError]


def test_nested_both_expire(t, run):
    """Both deadlines pass before the task runs again: the outer one reports."""
    seen = []

    async def main():
        loop = asyncio.get_running_loop()
        with pytest.raises(TimeoutError):
            async with t.timeout(30) as outer:
                try:
                    async with t.timeout(30) as inner:
                        inner.reschedule(loop.time() - 1)
                        outer.reschedule(loop.time() - 1)
                        await asyncio.sleep(10)
                except BaseException as e:
                    seen.append(type(e))
                    raise
        return inner.expired(), outer.expired(), asyncio.current_task().cancelling()

    assert run(main()) == (True, True, 0)
    assert seen == [asyncio.CancelledError]


def test_nested_inner_caught_then_outer_fires(t, run):
    async def main():
        loop = asyncio.get_running_loop()
        with pytest.raises(TimeoutError):
            async with t.timeout(0.05) as outer:
                with pytest.raises(TimeoutError):
                    async with t.timeout(0.005):
                        await asyncio.sleep(10)
                assert not outer.expired()
                await asyncio.sleep(10)
        return outer.expired(), loop.time()

    expired, _ = run(main())
    assert expired


# -- TaskGroups -------------------------------------------------------------------------


def test_taskgroup_inside_timeout(t, run):
    started = []

    async def child():
        started.append(1)
        await asyncio.sleep(10)

    async def main():
        with pytest.raises(TimeoutError):
            async with t.timeout(0.02) as cm, asyncio.TaskGroup() as tg:
                tg.create_task(child())
                tg.create_task(child())
        return cm.expired(), asyncio.current_task().cancelling()

    assert run(main()) == (True, 0)
    assert started == [1, 1]


def test_timeout_inside_taskgroup_child(t, run):
    async def child():
        async with t.timeout(0.01):
            await asyncio.sleep(10)

    async def main():
        with pytest.raises(ExceptionGroup) as ei:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(child())
                tg.create_task(asyncio.sleep(10))
        return [type(e) for e in ei.value.exceptions]

    assert run(main()) == [TimeoutError]


def test_timeout_inside_taskgroup_child_handled(t, run):
    async def child():
        try:
            async with t.timeout(0.01):
                await asyncio.sleep(10)
        except TimeoutError:
            return "timed out"

    async def main():
        async with asyncio.TaskGroup() as tg:
            task = tg.create_task(child())
        return task.result()

    assert run(main()) == "timed out"


def _chain(e):
    """Types along an exception's __context__ chain (c: has a __cause__)."""
    out = []
    while e is not None:
        out.append(type(e).__name__ + ("(c)" if e.__cause__ is not None else ""))
        e = e.__context__
    return out


def test_taskgroup_child_fails_on_cancel_inside_timeout(t, run):
    """A child raising while the group is cancelled by the timeout: the
    group's ExceptionGroup propagates.  Whether a TimeoutError is inserted
    into the chains depends on the version's TaskGroup (3.13.0: yes, 3.12.1:
    no): compared with asyncio's own helpers on the same loop."""

    async def child():
        try:
            await asyncio.sleep(10)
        finally:
            raise ValueError("cleanup failed")

    def scenario(impl):
        async def main():
            with pytest.raises(ExceptionGroup) as ei:
                async with impl.timeout(0.01) as cm, asyncio.TaskGroup() as tg:
                    tg.create_task(child())
                    await asyncio.sleep(10)
            eg = ei.value
            return cm.expired(), _chain(eg), [_chain(e) for e in eg.exceptions]

        return run(main())

    got = scenario(t)
    assert got == scenario(IMPLS["asyncio"])
    assert got[0] is True
    assert got[2][0][0] == "ValueError"


def test_exception_group_chain_gets_timeout_error(t, run):
    """3.13: an ExceptionGroup raised while handling the timeout's
    CancelledError, and each of its members, get a TimeoutError inserted in
    front of that CancelledError (chains compared with asyncio's own)."""

    def scenario(impl):
        async def main():
            with pytest.raises(ExceptionGroup) as ei:
                async with impl.timeout(0.01):
                    try:
                        await asyncio.sleep(10)
                    except asyncio.CancelledError:
                        try:
                            raise KeyError("member")
                        except KeyError as member:
                            raise ExceptionGroup("group", [member])  # noqa: B904 - the implicit chain is the subject
            eg = ei.value
            return _chain(eg), _chain(eg.exceptions[0])

        return run(main())

    group, member = got = scenario(t)
    assert got == scenario(IMPLS["asyncio"])
    assert group[:2] == ["ExceptionGroup", "KeyError"]
    assert ("TimeoutError(c)" in member) is INSERTS_TIMEOUT_ERROR
    assert member[-1] == "CancelledError"


# -- cancelled from outside, uncancel bookkeeping ------------------------------------------


def test_outside_cancel_propagates(t, run):
    async def inner(started):
        async with t.timeout(30) as cm:
            started.set_result(cm)
            await asyncio.sleep(10)

    async def main():
        loop = asyncio.get_running_loop()
        started = loop.create_future()
        task = asyncio.create_task(inner(started))
        cm = await started
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return cm.expired(), task.cancelled()

    assert run(main()) == (False, True)


def test_outside_cancel_and_expiry_together_is_cancel(t, run):
    """The timeout expired, but somebody else cancelled the task too: the
    CancelledError must propagate, not turn into a TimeoutError."""
    seen = []

    async def main():
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        try:
            async with t.timeout(30) as cm:
                cm.reschedule(loop.time() - 1)  # expires on the next iteration
                task.cancel()  # and an outside cancel request as well
                await asyncio.sleep(10)
        except asyncio.CancelledError:
            seen.append("cancelled")
        except TimeoutError:  # pragma: no cover - the bug this guards against
            seen.append("timeout")
        return cm.expired(), task.cancelling()

    assert run(main()) == (True, 1)
    assert seen == ["cancelled"]


def test_uncancel_restores_baseline(t, run):
    """A task already carrying a cancel request (caught, not uncancelled)
    still gets a TimeoutError, and its count is unchanged afterwards."""

    async def main():
        task = asyncio.current_task()
        task.cancel()
        try:
            await asyncio.sleep(1)
        except asyncio.CancelledError:
            pass
        assert task.cancelling() == 1
        with pytest.raises(TimeoutError):
            async with t.timeout(0.01):
                await asyncio.sleep(10)
        n = task.cancelling()
        task.uncancel()
        return n

    assert run(main()) == 1


def test_uncancel_after_expiry_back_to_zero(t, run):
    async def main():
        task = asyncio.current_task()
        for _ in range(3):
            with pytest.raises(TimeoutError):
                async with t.timeout(0.005):
                    await asyncio.sleep(10)
            assert task.cancelling() == 0
        return "ok"

    assert run(main()) == "ok"


def test_swallowed_cancellation_inside_block(t, run):
    """The body swallows the timeout's CancelledError and returns normally:
    no TimeoutError (exc_type is None), but the timeout is expired and the
    task's count goes back down."""

    async def main():
        async with t.timeout(0.01) as cm:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                pass
        return cm.expired(), asyncio.current_task().cancelling()

    assert run(main()) == (True, 0)


# -- exception chaining ------------------------------------------------------------------------


def test_error_raised_while_handling_timeout(t, run):
    """An exception raised in the block while the timeout's CancelledError is
    being handled.  3.11, 3.12.1: it propagates as is (context: the
    CancelledError).  3.13: a TimeoutError is inserted between it and the
    CancelledError."""

    async def main():
        with pytest.raises(ValueError) as ei:
            async with t.timeout(0.01):
                try:
                    await asyncio.sleep(10)
                finally:
                    raise ValueError("in finally")
        return ei.value

    exc = run(main())
    if INSERTS_TIMEOUT_ERROR:
        assert isinstance(exc.__context__, TimeoutError)
        assert isinstance(exc.__context__.__cause__, asyncio.CancelledError)
        assert exc.__context__.__context__ is exc.__context__.__cause__
    else:
        assert isinstance(exc.__context__, asyncio.CancelledError)


def test_error_unrelated_to_timeout(t, run):
    async def main():
        with pytest.raises(KeyError):
            async with t.timeout(10) as cm:
                raise KeyError("x")
        return cm.expired()

    assert run(main()) is False


def test_callback_runs_in_task_context(t, run):
    """The expiry callback (asyncio: in a copy of the context active at
    enter; bucketimer: task.cancel() without entering one) must not leak
    into or break the task's context."""
    var = contextvars.ContextVar("var", default="unset")

    async def main():
        var.set("task")
        with pytest.raises(TimeoutError):
            async with t.timeout(0.01):
                await asyncio.sleep(10)
        return var.get()

    assert run(main()) == "task"


# -- wait_for -----------------------------------------------------------------------------------


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


def test_timer_lives_in_the_core():
    tt = bucketimer.default_timer_thread()

    async def main():
        loop = asyncio.get_running_loop()
        before = tt.stats()["scheduled"]
        heap_before = len(loop._scheduled)
        async with aio.timeout(30):
            assert len(loop._scheduled) == heap_before  # nothing in asyncio's heap
        await aio.wait_for(asyncio.sleep(0), 30)
        return tt.stats()["scheduled"] - before

    with asyncio.Runner(loop_factory=asyncio.SelectorEventLoop) as r:
        assert r.run(main()) == 2


def test_reschedule_later_moves_the_timer_in_place():
    """A later deadline moves the armed timer in the core (an idle timeout
    reset on every message): no new timer, no cancelled entry left behind,
    no allocation, and it still fires at the last deadline, never before."""
    tt = bucketimer.default_timer_thread()

    async def main():
        loop = asyncio.get_running_loop()
        async with aio.timeout(30) as cm:
            whens = [loop.time() + 30 + i * 1e-6 for i in range(2000)]
            cm.reschedule(whens[0])  # warm: everything below exists already
            before, blocks = tt.stats(), sys.getallocatedblocks()
            for when in whens:
                cm.reschedule(when)
            grew = sys.getallocatedblocks() - blocks
            after = tt.stats()
        moved = {k: after[k] - before[k] for k in ("scheduled", "cancelled", "postponed", "dead")}
        # ... and the moved timer fires at its last deadline
        t0 = loop.time()
        with pytest.raises(TimeoutError):
            async with aio.timeout(30) as cm:
                for i in range(50):
                    cm.reschedule(loop.time() + 0.02)
                    await asyncio.sleep(0.001)
                last = cm.when()
                await asyncio.sleep(10)
        return moved, grew, loop.time() >= last, loop.time() - t0

    with asyncio.Runner(loop_factory=asyncio.SelectorEventLoop) as r:
        moved, grew, not_early, elapsed = r.run(main())
    assert moved == {"scheduled": 0, "cancelled": 0, "postponed": 2000, "dead": 0}
    assert grew < 10, grew
    assert not_early
    assert elapsed < 5


def test_reschedule_earlier_or_past_rearms():
    """An earlier or already-passed deadline cannot move the timer in place:
    it is re-armed (asyncio's way), and fires when asked."""
    tt = bucketimer.default_timer_thread()

    async def main():
        loop = asyncio.get_running_loop()
        before = tt.stats()
        with pytest.raises(TimeoutError):
            async with aio.timeout(30) as cm:
                cm.reschedule(loop.time() + 0.01)  # earlier: re-armed
                await asyncio.sleep(10)
        after = tt.stats()
        return after["scheduled"] - before["scheduled"], after["postponed"] - before["postponed"]

    with asyncio.Runner(loop_factory=asyncio.SelectorEventLoop) as r:
        assert r.run(main()) == (2, 0)


def test_timer_thread_replaced_after_close():
    """When the default TimerThread is closed, the helpers move to the new one."""

    async def main():
        with pytest.raises(TimeoutError):
            async with aio.timeout(0.01):
                await asyncio.sleep(10)

    with asyncio.Runner(loop_factory=asyncio.SelectorEventLoop) as r:
        r.run(main())
    first = bucketimer.default_timer_thread()
    fired = first.stats()["fired"]
    first.close()
    with asyncio.Runner(loop_factory=asyncio.SelectorEventLoop) as r:
        r.run(main())
    second = bucketimer.default_timer_thread()
    assert second is not first
    assert fired >= 1
    assert second.stats()["fired"] == 1


def test_enter_value_when_stop_iteration_is_kept(t, run):
    """Whoever keeps the StopIteration that delivered __aenter__'s value
    keeps it unchanged, and later `async with ... as cm` still bind their
    own Timeout (bucketimer reuses that exception while nobody holds it)."""

    async def main():
        first = t.timeout(30)
        it = first.__aenter__().__await__()
        with pytest.raises(StopIteration) as kept:
            it.send(None)
        assert kept.value.value is first
        others = []
        for _ in range(3):
            async with t.timeout(30) as cm:
                others.append(cm)
        await first.__aexit__(None, None, None)
        return kept.value.value is first, [type(c) for c in others], len({id(c) for c in others})

    held, types_, distinct = run(main())
    assert held
    assert types_ == [t.Timeout] * 3
    assert distinct == 3


def test_throw_into_enter_and_wait_for_by_hand(t, run):
    """throw() by hand into __aenter__'s awaitable and into a wait_for that
    has not started: the exception comes straight back, in both spellings,
    and a value beside an instance is a TypeError."""

    async def main():
        got = []
        aw = t.timeout(30).__aenter__().__await__()
        with pytest.raises(KeyError) as ei:
            aw.throw(KeyError("instance"))
        got.append(ei.value.args)
        fut = asyncio.get_running_loop().create_future()
        c = t.wait_for(fut, 5)
        with pytest.raises(KeyError) as ei:
            c.throw(KeyError, "type and value")
        got.append(ei.value.args)
        c = t.wait_for(fut, 5)
        with pytest.raises(TypeError):
            c.throw(KeyError("instance"), "value")
        c.close()
        return got

    with pytest.warns(DeprecationWarning) if PY312 and t.name == "asyncio" else _no_warning():
        assert run(main()) == [("instance",), ("type and value",)]


def test_timeout_not_kept_alive_after_exit(t, run):
    import weakref

    async def main():
        async with t.timeout(30) as cm:
            pass
        ref = weakref.ref(cm)
        del cm
        return ref() is None

    assert run(main())


def test_no_running_loop_after_a_loop_ran(t, run):
    """Once a loop has run and stopped in this thread, there is again no
    running loop (3.13: bucketimer reads the loop from the thread state)."""

    async def main():
        async with t.timeout(30):
            pass
        return asyncio.get_running_loop()

    run(main())
    with pytest.raises(RuntimeError):
        t.timeout(1)


@pytest.mark.skipif(not PY312, reason="the C wait_for is for 3.12 and later")
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
        attrs = [c.cr_await, c.cr_running, c.cr_frame, c.__name__]
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
    assert attrs == [None, False, None, "wait_for", True, None]


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

_DELAYS = st.one_of(
    st.none(),
    st.booleans(),
    st.floats(allow_nan=False, allow_infinity=True, width=64),
    st.floats(min_value=-1e-3, max_value=0.02),
    st.integers(min_value=-(2**1100), max_value=2**1100),
    st.integers(min_value=-3, max_value=3),
    st.decimals(allow_nan=False, places=3, min_value=-1, max_value=1),
    st.fractions(min_value=-1, max_value=1, max_denominator=100),
    st.sampled_from(["1", b"1", 1j, [], object()]),
)


def _outcome(make):
    """("ok", value) or ("raises", exception type) of awaiting make()."""

    async def one():
        try:
            return "ok", await make()
        except BaseException as e:  # the type is the answer
            return "raises", type(e)

    return one


@pytest.mark.filterwarnings("ignore:coroutine .* was never awaited:RuntimeWarning")
@examples(default=60, slow=400)
@given(delay=_DELAYS, sleeps=st.booleans())
def test_any_delay_same_outcome_as_asyncio(delay, sleeps):
    """timeout(d) and wait_for(aw, d) end as asyncio's do for the same d, for
    numbers of every kind and size and for things that are not numbers:
    the value, TimeoutError, or the same exception type (TypeError,
    OverflowError).  The awaited coroutine either returns at once or sleeps
    5 ms.  (NaN is left out: see test_nan_delay_is_an_error.)"""

    async def work():
        if sleeps:
            await asyncio.sleep(0.005)
        return "done"

    def in_timeout(timeout):
        async def run():
            async with timeout(delay):
                return await work()

        return run

    def with_wait_for(wait_for):
        async def run():
            return await wait_for(work(), delay)

        return run

    async def main():
        got = []
        for ours, ref in ((aio.timeout, asyncio.timeout), (aio.wait_for, asyncio.wait_for)):
            make = in_timeout if ours is aio.timeout else with_wait_for
            got.append((await _outcome(make(ours))(), await _outcome(make(ref))()))
        return got

    with asyncio.Runner(loop_factory=asyncio.SelectorEventLoop) as r:
        for ours, ref in r.run(main()):
            if ref == ("raises", TimeoutError) and ours == ("ok", "done") or \
                    ours == ("raises", TimeoutError) and ref == ("ok", "done"):
                # a deadline within the 5 ms sleep can go either way
                assert sleeps and isinstance(delay, (int, float, decimal.Decimal,
                                                     fractions.Fraction)) and 0 < delay < 0.05
                continue
            assert ours == ref, (delay, ours, ref)


@pytest.mark.filterwarnings("ignore:coroutine .* was never awaited:RuntimeWarning")
def test_nan_delay_is_an_error():
    """asyncio takes a NaN deadline (and arms a timer that never orders
    properly in its heap); bucketimer refuses it with ValueError, as every
    other bucketimer API does, and leaves the task as it was."""

    async def main():
        for make in (lambda: aio.timeout(math.nan), lambda: aio.timeout_at(math.nan)):
            with pytest.raises(ValueError, match="NaN"):
                async with make():
                    pass
        with pytest.raises(ValueError, match="NaN"):
            await aio.wait_for(asyncio.sleep(0), math.nan)
        return asyncio.current_task().cancelling()

    with asyncio.Runner(loop_factory=asyncio.SelectorEventLoop) as r:
        assert r.run(main()) == 0
