"""One program, every mode, one trace: a differential test against asyncio.

Hypothesis generates small timer programs (tasks entering nested timeouts
with equal, distinct and already-passed deadlines, ``reschedule()`` earlier,
later and to ``None``, ``wait_for``, sleeps, the loop held by blocking code,
exceptions raised inside, ``call_at``/``call_later`` callbacks, some
cancelled, some armed by a task (already due, while the loop is held, so
that the timer thread posts them in passes of their own), a deadline of a
microsecond around code that needs two or three loop iterations, and now
and then a deadline that is infinite, a bool or an
int too large for a float) and runs each one on stock asyncio, the
reference, and on every way bucketimer can be used (:data:`MODES`): its
helpers on the stock loop, the drop-in loop, ``patch_asyncio()`` with the
drop-in loop, and the same on uvloop where it is installed.  The pure
backend runs this file in its own session (``BUCKETIMER_NO_EXTENSIONS=1``),
where every mode is the pure one.

The trace is what a program can observe and asyncio defines:

* per task, in order: each timeout entered and how it was left (normally,
  by which exception, ``expired()``), each ``wait_for``'s outcome, what
  ``Handle.cancel()`` returned, and what the task returned or raised;
* the callbacks that ran, in deadline order, and whether any ran before
  its deadline.

A microsecond's deadline, a callback armed already due, and a program
that holds the loop (``Block``) are compared where the loop's poll looks
at the core (asyncio's selector loops: docs/design.rst, "Order on the
loop"); not on uvloop, nor on the stock loop when ``BUCKETIMER_PUBLIC_API``
keeps bucketimer from wrapping its selector: there a timer runs when the
timer thread posts it (docs/asyncio.rst, "One contract"), which can be
after what a callback of the next iteration armed, or, for one that fell
due while the loop was held, in the iteration that held it.  It goes only around code
that needs two iterations or more: whether a microsecond has passed by the
time asyncio's own ``reschedule()`` compares it with the clock decides
whether asyncio queues the expiry with ``call_soon`` or on its heap, so
around a single iteration asyncio itself answers either way.

Timing is real and chosen so that a correct implementation on a loaded
machine cannot produce a difference: deadlines sit on slots ``SLOT``
seconds apart (scaled by ``BUCKETIMER_TEST_TIME_SCALE``) and a task sleeps
or blocks only until the middle of a slot, so no wake-up is near a
deadline; a run in which the machine stalled a task by half a slot anyway
is detected and run again.  Deadlines that must tie are the same float,
computed once.  What asyncio leaves undefined is not compared: the order of
callbacks with the same deadline ("the order in which they are called is
undefined", the ``call_later`` documentation; the stock loop's heap does
not keep schedule order), and the interleaving of events of different
tasks.
"""

from __future__ import annotations

import asyncio
import math
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
from _helpers import examples
from _impls import IMPLS, STOCK_POLL_LOOKS
from hypothesis import assume, example, given, note
from hypothesis import strategies as st

import bucketimer
from bucketimer import loop as bt_loop

try:
    import uvloop
except ImportError:  # pragma: no cover
    uvloop = None

#: The distance between two deadlines: far larger than the scheduling noise
#: of a loaded machine (a sleep there wakes 5-25 ms late), small enough that
#: a program lasts < 0.3 s.
SLOT = 0.05 * max(1.0, float(os.environ.get("BUCKETIMER_TEST_TIME_SCALE") or 1))
#: Deadlines are slots -1 (already passed when the program starts) to 4.
FIRST, LAST = -1, 4
#: Values a program may give for a deadline or a delay instead of a slot.
ODD = {
    "inf": float("inf"),
    "-inf": float("-inf"),
    "True": True,
    "10**400": 10**400,
}
# Not NaN: asyncio's loop runs a NaN timer on its next turn up to 3.12 and
# raises out of select() from 3.13, and uvloop refuses one, so a NaN deadline
# has no one reference to follow.  The helpers' NaN is tested against each
# of those in test_timeout.py and tests/core/test_contract.py
# (docs/asyncio.rst, "One contract").
#: A run is repeated when the machine stalled it (:meth:`_Run.check_on_time`), up to
#: this many times.
ATTEMPTS = 5


# -- programs ------------------------------------------------------------------------


@dataclass(frozen=True)
class Sleep:
    """``await asyncio.sleep`` until the middle of slot ``slot``."""

    slot: int


@dataclass(frozen=True)
class Block:
    """Hold the loop (``time.sleep``) until the middle of slot ``slot``."""

    slot: int


@dataclass(frozen=True)
class Yields:
    """``await asyncio.sleep(0)`` ``n`` times: ``n`` loop iterations."""

    n: int


@dataclass(frozen=True)
class Arm:
    """``loop.call_at(deadline of slot)`` (or ``call_later``, not ``at``) of a
    callback, from the task; slot -1 and 0 are already due."""

    slot: int
    at: bool


@dataclass(frozen=True)
class Tiny:
    """``wait_for`` of a coroutine that needs ``yields`` iterations (or, not
    ``wait``, ``async with timeout()`` around them), a microsecond's
    timeout: it expires before they are done."""

    wait: bool
    yields: int


@dataclass(frozen=True)
class Raise:
    """``raise Boom``."""


@dataclass(frozen=True)
class Cancel:
    """``Handle.cancel()`` of the program's callback ``index`` (modulo their count)."""

    index: int


@dataclass(frozen=True)
class Reschedule:
    """``reschedule()`` the innermost timeout to slot ``slot`` or to ``None``."""

    slot: Deadline


@dataclass(frozen=True)
class WaitFor:
    """``wait_for`` of a coroutine that sleeps until the middle of slot
    ``sleep`` (and raises Boom if ``fail``), with a timeout ending at slot
    ``slot`` or ``None``."""

    slot: Deadline
    sleep: int
    fail: bool


@dataclass(frozen=True)
class Timeout:
    """``async with timeout_at(slot)`` (or ``timeout(delay to slot)`` when not
    ``absolute``) around ``body``; a TimeoutError out of it is caught if
    ``catch``."""

    slot: Deadline
    absolute: bool
    catch: bool
    body: tuple[Step, ...]


Deadline = int | str | None
Step = Sleep | Block | Yields | Arm | Tiny | Raise | Cancel | Reschedule | WaitFor | Timeout


@dataclass(frozen=True)
class Callback:
    """``loop.call_at(deadline of slot)`` or ``loop.call_later(delay to it)``."""

    slot: int
    at: bool


@dataclass(frozen=True)
class Program:
    tasks: tuple[tuple[Step, ...], ...]
    callbacks: tuple[Callback, ...]

    def needs_the_poll(self) -> bool:
        """Whether a timer of it runs in the right iteration only where the
        loop's poll looks at the core: a microsecond's timeout, a callback
        armed already due (slot 0 or -1), or any deadline while a Block
        holds the loop (asyncio runs what fell due meanwhile in the next
        iteration)."""
        return bool(_NEEDS_THE_POLL.search(repr(self)))


    def asyncio_answers_either_way(self) -> bool:
        """A microsecond's timeout in a program that holds the loop: whether
        a microsecond passed between the making of asyncio's own timeout and
        its enter decides whether its expiry is queued with ``call_soon`` or
        on the heap, and so whether it runs before the task's next step or
        after it, among the deadlines that fell due while the loop was held:
        one of them an enclosing timeout's, that timeout expires too, or
        does not.  asyncio's answer is its own speed's, not a contract (here
        CPython's asyncio answers ``call_soon`` on 3.12 and later, whose
        ``wait_for`` is a timeout, and bucketimer's C, faster, the heap)."""
        text = repr(self)
        return "Tiny(" in text and "Block(" in text


_NEEDS_THE_POLL = re.compile(r"Tiny\(|Block\(|(Arm|Callback)\(slot=(0|-1),")


class Boom(Exception):
    pass


deadline_slots = st.one_of(st.none(), st.integers(FIRST, LAST), st.sampled_from(sorted(ODD)))
wake_slots = st.integers(0, LAST)
leaves = st.one_of(
    st.builds(Sleep, wake_slots),
    st.builds(Block, st.integers(0, LAST - 1)),
    st.builds(Yields, st.integers(1, 3)),
    st.builds(Arm, st.integers(FIRST, LAST), st.booleans()),
    st.builds(Tiny, st.booleans(), st.integers(2, 3)),
    st.just(Raise()),
    st.builds(Cancel, st.integers(0, 3)),
    st.builds(WaitFor, deadline_slots, wake_slots, st.booleans()),
)


def _timeouts(body: st.SearchStrategy[Step]) -> st.SearchStrategy[Step]:
    inner = st.one_of(body, st.builds(Reschedule, deadline_slots))
    return st.builds(Timeout, deadline_slots, st.booleans(), st.booleans(),
                     st.lists(inner, max_size=4).map(tuple))


steps = st.recursive(leaves, _timeouts, max_leaves=8)
programs = st.builds(
    Program,
    st.lists(st.lists(steps, min_size=1, max_size=3).map(tuple), min_size=1, max_size=3).map(tuple),
    st.lists(st.builds(Callback, wake_slots, st.booleans()), max_size=4).map(tuple),
)


# -- running one -----------------------------------------------------------------------


class _Run:
    """One program on one running loop, with ``helpers`` (an object with
    ``timeout``, ``timeout_at`` and ``wait_for``)."""

    def __init__(self, program: Program, helpers: Any) -> None:
        self.program = program
        self.h = helpers
        self.loop = asyncio.get_running_loop()
        base = self.loop.time()
        # Computed once: equal slots are equal floats (exact ties).
        self.deadlines = {k: base + k * SLOT for k in range(FIRST, LAST + 2)}
        #: the loop's clock counts whole milliseconds (stock uvloop's, libuv's)
        self.ms_clock = uvloop is not None and getattr(type(self.loop), "time", None) is uvloop.Loop.time
        self.fired: list[tuple[int, str, bool]] = []
        self.handles: list[Any] = []
        #: the callbacks tasks armed: (name, handle); and each task's index
        self.armed: list[tuple[str, Any]] = []
        self.task_index: dict[int, int] = {}
        #: False once a task woke after the deadline that follows its
        #: wake-up slot (the process stalled for half a slot): the run did
        #: not test what the program says and is run again.
        self.on_time = True
        #: when the last Block step let the loop go (time.monotonic)
        self.unblocked = -1.0

    def deadline(self, slot: Deadline) -> Any:
        if isinstance(slot, str):
            return ODD[slot]
        return None if slot is None else self.deadlines[slot]

    def delay(self, slot: Deadline) -> Any:
        if isinstance(slot, str):
            return ODD[slot]
        if slot is None:
            return None
        self.just_after_a_tick()
        return self.deadlines[slot] - self.loop.time()

    def just_after_a_tick(self) -> None:
        """On a millisecond clock, waits for it to tick.  A relative deadline
        is ``loop.time() + (deadline - loop.time())``, two reads: a tick
        between them moves it by a millisecond, and two timeouts of one slot
        armed microseconds apart then expire in two iterations instead of
        one -- on stock uvloop too, so a trace would follow the clock, not
        the code.  Just after a tick, the next is a millisecond away."""
        if self.ms_clock:
            start = self.loop.time()
            while self.loop.time() == start:
                pass

    def wake(self, slot: int) -> tuple[float, float]:
        """Seconds from now to the middle of ``slot`` (never near a deadline),
        and the deadline before which the task is to run again: the one after
        that middle, or after now if the middle is past."""
        target = self.deadlines[slot] + SLOT / 2
        now = time.monotonic()  # uvloop's time() stands still while a Block holds the loop
        due = max(target, now)
        next_slot = math.floor((due - self.deadlines[0]) / SLOT) + 1
        return max(0.0, target - now), self.deadlines[0] + next_slot * SLOT

    def check_on_time(self, limit: float) -> None:
        """A task runs now and should have by ``limit``: if it is later, and
        no Block step of the program held the loop until just now, the
        machine stalled the run and it is void.  ``time.monotonic()``, the
        clock of every loop here (uvloop's ``time()`` is a cached one)."""
        now = time.monotonic()
        if now >= limit and now >= self.unblocked + SLOT / 2:
            self.on_time = False


    # -- callbacks

    def schedule_callbacks(self) -> None:
        for i, cb in enumerate(self.program.callbacks):
            self.handles.append(self.arm(cb.slot, cb.at, f"cb{i}"))

    def arm(self, slot: int, at: bool, name: str) -> Any:
        if at:
            when = self.deadlines[slot]
            return self.loop.call_at(when, self.on_callback, slot, name, when)
        self.just_after_a_tick()
        delay = self.deadlines[slot] - self.loop.time()
        when = self.loop.time() + delay
        return self.loop.call_later(delay, self.on_callback, slot, name, when)

    def on_callback(self, slot: int, name: str, when: float) -> None:
        # asyncio may run a timer one clock resolution (1 ns) early.
        self.fired.append((slot, name, self.loop.time() < when - 1e-6))

    def callbacks_settled(self) -> bool:
        done = {name for _, name, _ in self.fired}
        return all(f"cb{i}" in done or h.cancelled() for i, h in enumerate(self.handles)) and all(
            name in done for name, _ in self.armed)

    def callback_trace(self) -> dict[str, Any]:
        slots = [slot for slot, _, _ in self.fired]
        return {
            "ran": sorted((slot, name) for slot, name, _ in self.fired),
            "in deadline order": slots == sorted(slots),
            "early": [name for _, name, early in self.fired if early],
        }

    # -- tasks

    async def task(self, steps: tuple[Step, ...], out: list[str]) -> str:
        # Slot 0's deadline is the start: tasks begin well before slot 1's.
        self.check_on_time(self.deadlines[0] + SLOT / 2)
        await self.body(steps, out, [], 0)
        return "done"

    async def body(self, steps: tuple[Step, ...], out: list[str], cms: list[Any],
                   depth: int) -> None:
        for step in steps:
            await self.step(step, out, cms, depth)

    async def step(self, step: Step, out: list[str], cms: list[Any], depth: int) -> None:
        if isinstance(step, Sleep):
            delay, limit = self.wake(step.slot)
            await asyncio.sleep(delay)
            self.check_on_time(limit)
        elif isinstance(step, Block):
            delay, limit = self.wake(step.slot)
            time.sleep(delay)
            self.check_on_time(limit)
            self.unblocked = time.monotonic()
        elif isinstance(step, Yields):
            for _ in range(step.n):
                await asyncio.sleep(0)
        elif isinstance(step, Tiny):
            await self.tiny(step, out)
        elif isinstance(step, Arm):
            task = self.task_index[id(out)]
            name = f"t{task}a{sum(n.startswith(f't{task}a') for n, _ in self.armed)}"
            self.armed.append((name, self.arm(step.slot, step.at, name)))
        elif isinstance(step, Raise):
            raise Boom
        elif isinstance(step, Cancel):
            if self.handles:
                i = step.index % len(self.handles)
                out.append(f"cancel cb{i} -> {self.handles[i].cancel()!r}")
        elif isinstance(step, Reschedule):
            cms[-1].reschedule(self.deadline(step.slot))
        elif isinstance(step, WaitFor):
            await self.wait_for(step, out)
        else:
            await self.timeout(step, out, cms, depth)

    async def tiny(self, step: Tiny, out: list[str]) -> None:
        async def iterations() -> str:
            for _ in range(step.yields):
                await asyncio.sleep(0)
            return "value"

        try:
            if step.wait:
                out.append(f"tiny wait_for returned {await self.h.wait_for(iterations(), 1e-6)}")
            else:
                async with self.h.timeout(1e-6):
                    await iterations()
                out.append("tiny timeout left normally")
        except TimeoutError:
            out.append("tiny raised TimeoutError")

    async def wait_for(self, step: WaitFor, out: list[str]) -> None:
        async def inner() -> str:
            delay, limit = self.wake(step.sleep)
            await asyncio.sleep(delay)
            self.check_on_time(limit)
            if step.fail:
                raise Boom
            return "value"

        coro = inner()
        try:
            result = await self.h.wait_for(coro, self.delay(step.slot))
        except (TimeoutError, Boom) as e:
            out.append(f"wait_for raised {type(e).__name__}")
        else:
            out.append(f"wait_for returned {result}")
        finally:
            coro.close()  # never started when wait_for refused the timeout

    async def timeout(self, step: Timeout, out: list[str], cms: list[Any], depth: int) -> None:
        if step.absolute:
            cm = self.h.timeout_at(self.deadline(step.slot))
        else:
            cm = self.h.timeout(self.delay(step.slot))
        out.append(f"enter T{depth}")
        try:
            async with cm:
                cms.append(cm)
                try:
                    await self.body(step.body, out, cms, depth + 1)
                finally:
                    cms.pop()
        except BaseException as e:
            out.append(f"T{depth} left by {type(e).__name__}, expired={cm.expired()}")
            if step.catch and isinstance(e, TimeoutError):
                return
            raise
        out.append(f"T{depth} left normally, expired={cm.expired()}")

    async def main(self) -> dict[str, Any]:
        self.schedule_callbacks()
        outs: list[list[str]] = [[] for _ in self.program.tasks]
        self.task_index = {id(out): i for i, out in enumerate(outs)}
        tasks = [asyncio.ensure_future(self.task(steps, out))
                 for steps, out in zip(self.program.tasks, outs)]
        results = await asyncio.gather(*tasks, return_exceptions=True)
        # Every callback not cancelled runs; a lost one is missing from the trace.
        end = self.loop.time() + 2.0
        while not self.callbacks_settled() and self.loop.time() < end:
            await asyncio.sleep(0.005)
        for out, result in zip(outs, results):
            out.append(result if isinstance(result, str)
                       else f"raised {type(result).__name__}: {result}")
        return {"tasks": outs, "callbacks": self.callback_trace(), "on time": self.on_time}


# -- the modes ---------------------------------------------------------------------------

ASYNCIO = IMPLS["asyncio"]
BUCKETIMER = IMPLS["bucketimer"]


def _until_on_time(run_once: Callable[[Program], Any]) -> Callable[[Program], Any]:
    """``run_once`` again while the machine stalls it (the trace's "on
    time" is false), :data:`ATTEMPTS` times at most; the trace, without
    that flag, or what the loop raised."""

    def run(program: Program) -> Any:
        global RERUNS
        for _ in range(ATTEMPTS):
            try:
                trace = run_once(program)
            except Exception as e:
                return {"loop raised": f"{type(e).__name__}: {e}"}
            if trace.pop("on time"):
                return trace
            RERUNS += 1
        raise AssertionError(f"the machine stalled {ATTEMPTS} runs in a row by half a slot "
                             f"({SLOT / 2 * 1000:.1f} ms): raise BUCKETIMER_TEST_TIME_SCALE")

    return run


def _on(factory: Callable[[], asyncio.AbstractEventLoop], helpers: Any) -> Callable[[Program], Any]:
    def run(program: Program) -> Any:
        async def main() -> Any:
            return await _Run(program, helpers).main()

        with asyncio.Runner(loop_factory=factory) as runner:
            return runner.run(main())

    return _until_on_time(run)


def _run_drop_in(program: Program) -> Any:
    async def main() -> Any:
        return await _Run(program, ASYNCIO).main()

    return bucketimer.run(main())


#: ``bucketimer.run`` with asyncio's helpers
_drop_in = _until_on_time(_run_drop_in)


def _patched(run: Callable[[Program], Any]) -> Callable[[Program], Any]:
    """``run`` with ``patch_asyncio()`` on, the helpers looked up on the
    ``asyncio`` package at call time."""

    def patched(program: Program) -> Any:
        bucketimer.patch_asyncio()
        try:
            return run(program)
        finally:
            bucketimer.unpatch_asyncio()

    return patched


#: The references: asyncio's helpers on a stock loop.  What uvloop itself
#: does differently from asyncio is not bucketimer's (its timers run before
#: the callbacks that ``call_soon`` queued; its cached clock stands still
#: while a callback holds the loop, so a timer armed then fires early; its
#: ``call_at`` refuses NaN and ints too large for a float): a mode on uvloop
#: passes when it behaves as stock asyncio or as stock uvloop does, the
#: first of its references being the one it is meant to follow (the drop-in
#: uvloop reads ``time.monotonic()`` and keeps its timers in the core, as the
#: drop-in loop does).
REFERENCES: dict[str, Callable[[Program], Any]] = {
    "asyncio": _on(asyncio.SelectorEventLoop, ASYNCIO),
}
#: each mode: (the references it may match, how it runs a program, whether
#: its loop's poll looks at what is due: the programs that need it
#: (:meth:`Program.needs_the_poll`) are compared only there)
MODES: dict[str, tuple[tuple[str, ...], Callable[[Program], Any], bool]] = {
    "helpers on the stock loop": (("asyncio",), _on(asyncio.SelectorEventLoop, BUCKETIMER),
                                  STOCK_POLL_LOOKS),
    "drop-in loop (bucketimer.run)": (("asyncio",), _drop_in, True),
    "patch_asyncio() + drop-in loop": (("asyncio",),
                                       _patched(_on(bt_loop.EventLoop, asyncio)), True),
    "patch_asyncio() + stock loop": (("asyncio",),
                                     _patched(_on(asyncio.SelectorEventLoop, asyncio)),
                                     STOCK_POLL_LOOKS),
}
if uvloop is not None:
    REFERENCES["uvloop"] = _on(uvloop.new_event_loop, ASYNCIO)
    on_uvloop = bucketimer.backend == "python"  # uvloop's own timers there
    MODES["helpers on uvloop"] = (("uvloop", "asyncio"),
                                  _on(uvloop.new_event_loop, BUCKETIMER), on_uvloop)
    MODES["drop-in uvloop (UVEventLoop)"] = (("asyncio", "uvloop"),
                                             _on(bt_loop.UVEventLoop, ASYNCIO), on_uvloop)
    MODES["patch_asyncio() + drop-in uvloop"] = (
        ("asyncio", "uvloop"), _patched(_on(bt_loop.UVEventLoop, asyncio)), on_uvloop)
REFERENCE = REFERENCES["asyncio"]

#: how many programs this session ran, each on the references and every mode
PROGRAMS_RUN = 0
#: how many runs were repeated because the machine stalled them
RERUNS = 0


def differences(program: Program) -> dict[str, tuple[Any, Any]]:
    """Runs ``program`` on the references and on every mode; returns the
    modes whose trace differs from each of their references', with (the
    first reference's trace, that trace)."""
    global PROGRAMS_RUN
    PROGRAMS_RUN += 1
    assert asyncio.timeout is ASYNCIO.timeout, "asyncio is patched: no reference"
    expected = {name: run(program) for name, run in REFERENCES.items()}
    found = {}
    for name, (references, run, exact) in MODES.items():
        if program.needs_the_poll() and not exact:
            continue
        got = run(program)
        if not _matches(got, [expected[reference] for reference in references]):
            found[name] = (expected[references[0]], got)
    return found


def _matches(got: Any, refs: list[Any]) -> bool:
    """``got`` is one of ``refs``; or, for a mode with two references (the
    uvloop ones), each part of the trace (the tasks', the callbacks') is that
    part of one of them: uvloop's own differences touch the parts
    independently (its call_at refusing a huge int, the tasks'; its timers
    running before call_soon's callbacks, which of the callbacks a cancel
    reaches in time), so one program can show both.  With one reference
    this is plain equality."""
    if got in refs:
        return True
    if not all(isinstance(r, dict) and r.keys() == got.keys() for r in refs):
        return False
    return all(_part_matches(got[key], [r[key] for r in refs]) for key in got)


def _part_matches(got: Any, refs: list[Any]) -> bool:
    """One part of a trace against the references' same part; the tasks'
    part task by task, which uvloop's differences also touch independently
    (one task's ``wait_for`` of a huge int raising or not, another's timeout
    expiring before or after its ``call_soon``)."""
    if got in refs:
        return True
    if not isinstance(got, list) or not all(isinstance(r, list) and len(r) == len(got)
                                            for r in refs):
        return False
    return all(any(r[i] == got[i] for r in refs) for i in range(len(got)))


@pytest.fixture(scope="module", autouse=True)
def _count() -> Any:
    yield
    print(f"\ntest_differential: {PROGRAMS_RUN} programs on {len(REFERENCES)} references "
          f"and {len(MODES)} modes ({bucketimer.backend} backend), {RERUNS} runs repeated")


@pytest.mark.timeout(300)
@examples(default=15, slow=300)
@given(programs)
# due timers posted by separate passes while the loop is held, the earlier
# deadline armed second
@example(Program(tasks=((Arm(0, False), Block(0), Arm(-1, True), Block(1), Yields(1)),),
                 callbacks=()))
# a microsecond's timeout around two and three iterations
@example(Program(tasks=((Tiny(True, 2), Tiny(False, 3)),), callbacks=()))
def test_every_mode_traces_as_asyncio(program: Program) -> None:
    assume(not program.asyncio_answers_either_way())
    found = differences(program)
    for name, (expected, got) in found.items():
        report = f"{name}:\n  reference:  {expected}\n  bucketimer: {got}"
        note(report)
        # Also to the captured output, which pytest shows for every call
        # of a failure Hypothesis could not repeat (a FlakyFailure).
        print(f"{program}\n{report}")
    assert not found, sorted(found)


def test_the_trace_sees_what_it_compares() -> None:
    """The trace tells a timeout that expired from one that did not and a
    callback that ran from one cancelled, the same on every run of the
    reference: a comparison of traces can fail, and only for a cause."""
    program = Program(
        tasks=((Timeout(1, True, True, (Sleep(2),)), Cancel(1)),
               (Timeout(3, False, False, (Sleep(2),)),)),
        callbacks=(Callback(0, True), Callback(4, False), Callback(2, True)),
    )
    for _ in range(2):
        assert REFERENCE(program) == {
            "tasks": [["enter T0", "T0 left by TimeoutError, expired=True",
                       "cancel cb1 -> None", "done"],
                      ["enter T0", "T0 left normally, expired=False", "done"]],
            "callbacks": {"ran": [(0, "cb0"), (2, "cb2")], "in deadline order": True,
                          "early": []},
        }
