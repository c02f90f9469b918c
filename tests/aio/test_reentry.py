"""Python code that the helpers run re-entering them: the loop's clock, a
deadline's comparison, a Task's cancelling() and cancel(), the loop's
is_closed() and a value's __del__ reschedule a Timeout, drop the default
TimerThread or end a coroutine while the helpers are in the middle of the
same work.  The later call wins, nothing freed is read, and no timer is left
armed behind (docs/design.rst).

Each program runs in a child interpreter under ``PYTHONMALLOC=debug`` and
``-X dev``, where reading freed memory crashes, and prints the same on both
backends (the pure backend's Timeout is asyncio's with its reschedule made
alike)."""

from __future__ import annotations

import textwrap

import pytest
from _helpers import check_ok, run_python

PRELUDE = """
import asyncio, gc, weakref
import bucketimer
from bucketimer import aio

hook = None  # called once, from the loop's time(), while set


class Loop(asyncio.SelectorEventLoop):
    def time(self):
        global hook
        t = super().time()
        h, hook = hook, None
        if h is not None:
            h(t)
        return t


def run(main, loop_class=Loop, task_class=None):
    loop = loop_class()
    if task_class is not None:
        loop.set_task_factory(lambda loop, coro, **kw: task_class(coro, loop=loop, **kw))
    try:
        return loop.run_until_complete(main())
    finally:
        loop.close()


def gone(ref):
    # whether the referent was freed (no timer holds it)
    gc.collect()
    return ref() is None
"""

# A Task whose `method` reschedules the Timeout far ahead, once.
TASK_RESCHEDULES = """
state = {{}}

class T(asyncio.Task):
    def {method}(self, *args, **kwargs):
        cm = state.pop("cm", None)
        if cm is not None:
            cm.reschedule(asyncio.get_running_loop().time() + 1000)
        return super().{method}(*args, **kwargs)

async def main():
    cm = state["cm"] = aio.timeout({delay})
    try:
        async with cm:
            await asyncio.sleep({sleep})
    except TimeoutError:
        print("TimeoutError", end=" ")
    print(cm.expired(), end=" ")
    ref = weakref.ref(cm)
    del cm
    print(gone(ref))

run(main, task_class=T)
"""

PROGRAMS = {
    # loop.time(), read while __aenter__ arms the expiry, reschedules the
    # Timeout: the deadline read was freed; a second handle was armed.
    "time() reschedules the Timeout being entered": (
        """
        async def main():
            global hook
            loop = asyncio.get_running_loop()
            cm = aio.timeout_at(loop.time() + 0.05)
            far = loop.time() + 1000.5
            hook = lambda t: cm.reschedule(far)
            async with cm:
                await asyncio.sleep(0.1)
            print(cm.when() == far, cm.expired(), end=" ")
            ref = weakref.ref(cm)
            del cm
            print(gone(ref))

        run(main)
        """,
        "True False True\n",
    ),
    # loop.time looked up while a reschedule to a later deadline reads the
    # clock: it disarms the Timeout, freeing the Handle being moved.
    "loop.time disarms the Timeout a reschedule is moving": (
        """
        hooks = []

        class L(asyncio.SelectorEventLoop):
            def __getattribute__(self, name):
                if name == "time" and hooks:
                    hooks.pop()()
                return super().__getattribute__(name)

        async def main():
            loop = asyncio.get_running_loop()
            async with aio.timeout(10) as cm:
                later = loop.time() + 20
                hooks.append(lambda: cm.reschedule(None))
                cm.reschedule(later)
                await asyncio.sleep(0.01)
            print(cm.when(), cm.expired(), end=" ")
            ref = weakref.ref(cm)
            del cm
            print(gone(ref))

        run(main, L)
        """,
        "None False True\n",
    ),
    # The deadline's __le__ reschedules the Timeout and returns
    # NotImplemented: the reflected comparison read the freed deadline.
    "the deadline's comparison reschedules the Timeout": (
        """
        state = {}

        class When(float):
            def __le__(self, other):
                cm = state.pop("cm", None)
                if cm is not None:
                    cm.reschedule(None)
                return NotImplemented

        async def main():
            loop = asyncio.get_running_loop()
            cm = state["cm"] = aio.timeout_at(When(loop.time() + 0.01))
            async with cm:
                await asyncio.sleep(0.05)
            print(cm.when(), cm.expired())

        run(main)
        """,
        "None False\n",
    ),
    # loop.is_closed(), asked while the expiry is scheduled on the default
    # TimerThread, drops that TimerThread: it was freed under the schedule.
    # (The pure Timeout's timer is the loop's: nothing to drop there.)
    "the default TimerThread is dropped while a Timeout arms on it": (
        """
        armed = []

        class L(asyncio.SelectorEventLoop):
            def is_closed(self):
                if armed:
                    armed.pop()
                    from bucketimer import _core
                    _core._set_default_class(bucketimer.TimerThread)
                    gc.collect()
                return super().is_closed()

        async def main():
            if bucketimer.backend == "native":
                armed.append(1)
            try:
                async with aio.timeout(0.01):
                    await asyncio.sleep(0.05)
            except TimeoutError:
                print("TimeoutError", armed)

        run(main, L)
        """,
        "TimeoutError []\n",
    ),
    # A Task's cancelling(), asked while entering, reschedules the Timeout:
    # entering armed a second handle over it, which kept the Timeout alive.
    "cancelling() reschedules the Timeout being entered": (
        TASK_RESCHEDULES.format(method="cancelling", delay=0.02, sleep=0.05),
        "False True\n",
    ),
    # The Task's cancel(), called by the expiry, reschedules the Timeout:
    # the expiry dropped the new handle without cancelling it.
    "cancel() reschedules the Timeout that expires": (
        TASK_RESCHEDULES.format(method="cancel", delay=0.01, sleep=1),
        "TimeoutError True True\n",
    ),
    # The value a wait_for() returned is let go of while the next one's end
    # is raised (3.12-3.14 raise one StopIteration again and again), and
    # its __del__ ends another wait_for(): the next one returned its value.
    "a returned value's __del__ ends another coroutine": (
        """
        async def returns(v):
            return v

        class D:
            def __del__(self):
                try:
                    next(aio.wait_for(returns("inner"), 10).__await__())
                except StopIteration:
                    pass

        async def main():
            await aio.wait_for(returns(D()), 10)
            print(await aio.wait_for(returns("outer"), 10))

        run(main)
        """,
        "outer\n",
    ),
}


@pytest.mark.parametrize("name", PROGRAMS)
def test_reentry(name: str) -> None:
    code, expected = PROGRAMS[name]
    p = run_python(
        PRELUDE + textwrap.dedent(code),
        timeout=60,
        env={"PYTHONMALLOC": "debug", "PYTHONDEVMODE": "1"},
    )
    assert check_ok(p) == expected
    assert p.stderr == "", p.stderr
