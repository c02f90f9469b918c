"""No Python object can crash bucketimer: hostile programs over every entry
point, on both backends (tests/_hostile.py says what a program is and what
it checks).

Each run starts a child (``python -X dev``, ``PYTHONMALLOC=debug``, so that a
read of freed memory fails reliably; under ``nox -s sanitize`` the child
inherits ASan and takes ``malloc_debug``) that runs hypothesis-made programs
whose argument objects, loop, callbacks and contexts re-enter bucketimer at
random points.  A crash is a signal, a fatal error or a sanitizer report;
the child writes each program to a file before running it, so the one that
crashed it is known and can be replayed (``python tests/_hostile.py replay
FILE``) and shrunk (``python tests/_hostile.py minimise FILE``).  A program
that leaves bucketimer wrong without crashing fails inside the child, where
hypothesis shrinks it.

The number of programs follows the hypothesis profile (tests/conftest.py):
a third of its ``max_examples``.

The second half: regression tests, each one program that crashed the
native backend, run in a child under the default allocator and under
``PYTHONMALLOC=debug``.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import random
import subprocess
import sys
import textwrap

import _hostile
import pytest
from _helpers import run_python
from hypothesis import settings

import bucketimer
from bucketimer import _backend

pytestmark = pytest.mark.timeout(900)


def _tail(text: str, lines: int = 60) -> str:
    return "\n".join(text.splitlines()[-lines:])


def test_hostile_programs(tmp_path):
    examples = max(10, settings().max_examples // 3)
    seed = random.randrange(2**32)
    last = tmp_path / "last.json"
    args = ["run", "--examples", str(examples), "--seed", str(seed), "--last", str(last)]
    how = (f"seed {seed}; replay the last program with "
           f"`python -X dev {_hostile.__file__} replay {last}` (PYTHONMALLOC=debug)")
    try:
        p = _hostile.child(args, timeout=60 + 5 * examples)
    except subprocess.TimeoutExpired as e:
        program = last.read_text() if last.exists() else "(none)"
        raise AssertionError(f"the child hung; {how}\nlast program: {program}\n"
                             f"stderr:\n{_tail(str(e.stderr))}") from None
    if _hostile.crashed(p):
        program = json.loads(last.read_text())
        raise AssertionError(
            f"a program crashed the process (rc {p.returncode}); {how}\n"
            f"program: {json.dumps(program)}\n{_hostile.describe(program)}\n"
            f"stderr:\n{_tail(p.stderr)}")
    assert p.returncode == 0, f"rc {p.returncode}; {how}\nstdout:\n{_tail(p.stdout)}\nstderr:\n{_tail(p.stderr, 120)}"
    # (and the known crashes first, hypothesis's explicit examples)
    assert f"hostile: {examples + len(_hostile.KNOWN)} programs run" in p.stdout, p.stdout


# -- what the programs reach ----------------------------------------------------------------


#: types of bucketimer._core no program kind stands for, and why
UNREACHED_TYPES = {
    "GrpcCall": "exists only inside a GrpcUnary call, as the handler's context: the 'grpc' "
                "step makes one per call (its fields: test_attribute_sweep.py)",
    "GrpcAioUnary": "grpc.aio's fused wrapper: its calls need grpc.aio's servicer context "
                    "(test_grpc_fused_aio.py drives it on a real server)",
}


def test_every_type_and_name_is_reached():
    """Every public name of the package and every type of ``_core`` is a
    kind the programs call into (the names of each kind are read from the
    type itself, so a new method is called as soon as it exists), or is
    listed as left out, with the reason; nothing is listed that is gone."""
    kinds = _hostile.kind_types()
    surface = set(_hostile.surface())
    for module, kind in ((bucketimer, "module"), (bucketimer.aio, "aio"),
                         (bucketimer.loop, "loopmod")):
        for name in module.__all__:
            assert (kind, name) in surface or (kind, name) in _hostile.EXCLUDED, (kind, name)
    for (kind, name), why in _hostile.EXCLUDED.items():
        obj = kinds.get(kind)
        if obj is not None and not (kind.endswith("mod") or kind in ("module", "aio")):
            assert hasattr(obj, name), f"{kind}.{name} is gone: {why}"
    if _backend.NATIVE:
        from bucketimer import _core

        covered = {base.__name__ for tp in kinds.values() if isinstance(tp, type)
                   for base in tp.__mro__}
        for name, tp in vars(_core).items():
            if isinstance(tp, type) and not issubclass(tp, BaseException):
                assert name in covered or name in UNREACHED_TYPES, f"_core.{name}: no kind"
        assert not set(UNREACHED_TYPES) & covered
    assert {"tt", "handle", "timeout", "loop"} <= set(kinds)
    for kind, obj in kinds.items():
        if inspect.isclass(obj):
            assert [n for k, n in surface if k == kind], f"kind {kind} has no names"


# -- regressions: programs that crashed the native backend ----------------------------------

#: what each script below starts with: run(main, loop class) runs main()
#: on a new loop of that class, not in debug mode (the child's -X dev would
#: give the drop-in loop asyncio's timers), and prints "ok" if it returns
PRELUDE = """
import asyncio, gc, bucketimer

def run(main, loop_class=asyncio.SelectorEventLoop):
    loop = loop_class()
    loop.set_debug(False)
    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
    print("ok")
"""

CRASHES = {
    # repr() of a drop-in loop handle: formatting `when` (%R) runs its
    # __repr__, which cancels the handle and frees the callback the second
    # %R then formats.
    "loophandle-repr": """
        holder = []

        class When(float):
            def __repr__(self):
                holder.pop().cancel()
                return "When"

        class Callback:
            def __call__(self):
                pass

        async def main():
            loop = asyncio.get_running_loop()
            h = loop.call_at(When(loop.time() + 1000), Callback())
            holder.append(h)
            r = repr(h)
            assert isinstance(r, str) and h.cancelled(), (r, h.cancelled())

        run(main, bucketimer.EventLoop)
    """,
    # Entering a Timeout on a loop with a clock of its own: its time()
    # reschedules the Timeout being entered, which lets go of the deadline
    # the entry is comparing.
    "timeout-enter-own-clock": """
        holder = []

        class Loop(asyncio.SelectorEventLoop):
            def time(self):
                if holder:
                    holder.pop().reschedule(super().time() + 2000)
                return super().time()

        async def main():
            cm = bucketimer.timeout_at(int(asyncio.get_running_loop().time()) + 10**30)
            holder.append(cm)
            async with cm:
                pass
            assert not cm.expired()

        run(main, Loop)
    """,
    # reschedule() to a later deadline asks the loop for its `time`
    # attribute; the loop's __getattribute__ reschedules the same Timeout to
    # None, which cancels and frees the expiry handle being postponed.
    "timeout-postpone-getattribute": """
        holder = []

        class Loop(asyncio.SelectorEventLoop):
            def __getattribute__(self, name):
                if name == "time" and holder:
                    holder.pop().reschedule(None)
                return super().__getattribute__(name)

        async def main():
            now = asyncio.BaseEventLoop.time(asyncio.get_running_loop())
            async with bucketimer.timeout_at(now + 1000.0) as cm:
                holder.append(cm)
                cm.reschedule(now + 2000.0)

        run(main, Loop)
    """,
    # Arming a Timeout on the default TimerThread: the loop's is_closed(),
    # asked while the loop's port is opened, replaces the default
    # TimerThread; the one being armed on is freed under the arming.
    "timeout-arm-default-replaced": """
        armed = []

        class Loop(asyncio.SelectorEventLoop):
            def is_closed(self):
                if armed:
                    armed.clear()
                    bucketimer.default_timer_thread().close()
                    bucketimer.default_timer_thread()
                    gc.collect()
                return super().is_closed()

        async def main():
            armed.append(1)
            async with bucketimer.timeout(1000):
                pass

        run(main, Loop)
    """,
    # A Timeout whose deadline has passed first has the default TimerThread
    # hand over the loop's due timers; looking the loop up in its record of
    # ports runs the loop's __hash__, which replaces (and frees) that
    # TimerThread.  (The pure backend deadlocked there: its lock was held
    # around the lookup, and close() takes it.)
    "deliver-due-loop-hash": """
        holder = []

        class Loop(asyncio.SelectorEventLoop):
            def __hash__(self):
                if holder and "[active]" in repr(holder[0]):
                    holder.clear()
                    bucketimer.default_timer_thread().close()
                    bucketimer.default_timer_thread()
                    gc.collect()
                return object.__hash__(self)

            def __eq__(self, other):
                return self is other

        def callback():
            pass

        async def main():
            loop = asyncio.get_running_loop()
            bucketimer.call_later(1000, callback).cancel()  # a port for this loop
            cm = bucketimer.timeout_at(loop.time() - 1)
            holder.append(cm)
            try:
                async with cm:
                    await asyncio.sleep(0)
            except TimeoutError:
                pass

        run(main, Loop)
    """,
    # A deadline that is not a float: its __float__ makes the Timeout let
    # go of it, then raises OverflowError, after which its sign is asked
    # (beyond the double range: +-inf) of the freed object.
    "deadline-float-overflow": """
        holder = []

        class When:
            def __le__(self, other):
                return False

            def __float__(self):
                tm = holder.pop()
                del self
                tm.reschedule(None)
                raise OverflowError("too large")

        async def main():
            cm = bucketimer.timeout_at(When())
            holder.append(cm)
            try:
                async with cm:
                    pass
            except OverflowError:
                pass

        run(main)
    """,
}


@pytest.mark.parametrize("malloc", ["", "debug"], ids=["malloc-default", "malloc-debug"])
@pytest.mark.parametrize("name", sorted(CRASHES))
def test_crash_regression(name, malloc):
    env = {"PYTHONMALLOC": malloc} if malloc else {}
    if _hostile.child_env()["PYTHONMALLOC"] == "malloc_debug":  # under ASan
        env = {"PYTHONMALLOC": "malloc_debug" if malloc else "malloc"}
    p = run_python(PRELUDE + textwrap.dedent(CRASHES[name]), timeout=30, env=env)
    assert p.returncode == 0 and p.stdout.split() == ["ok"], (
        f"{name} ({bucketimer.backend}, Python {sys.version.split()[0]}, "
        f"PYTHONMALLOC={env.get('PYTHONMALLOC', '')}): rc {p.returncode}\n"
        f"stdout:\n{p.stdout}\nstderr:\n{_tail(p.stderr)}")


def test_drop_in_loop_sleeps_after_the_default_timer_thread_closed():
    """The default TimerThread is made anew once closed: a running drop-in
    loop on it keeps its timers working (its fast path must not stay bound
    to the closed one)."""
    async def main() -> str:
        await asyncio.sleep(0.001)
        bucketimer.default_timer_thread().close()
        await asyncio.sleep(0.001)
        return "slept"

    loop = bucketimer.new_event_loop()
    loop.set_debug(False)
    try:
        assert loop.run_until_complete(main()) == "slept"
    finally:
        loop.close()
