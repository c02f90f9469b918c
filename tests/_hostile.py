"""Hostile programs: Python objects that re-enter bucketimer from their
dunder methods, a loop's ``time()``, a callback or a context, at random
points, while bucketimer works on them.

A *program* is JSON: a loop kind, a list of *steps* (an entry point of the
API and the values it is called with) and a list of *triggers* (at the n-th
call of a hook point -- ``__float__``, ``__repr__``, ``loop.time``,
``callback``, ... -- perform an action: cancel a handle, reschedule a
Timeout, close a TimerThread or the loop, replace the default TimerThread,
drop the program's references, ``gc.collect()``, raise, or call the same
entry point again).  :func:`run_program` runs one on the backend loaded and
raises :class:`Broken` when bucketimer was left wrong:

* an exception that is not a plain Python one (``SystemError``: C returned
  NULL without an exception, or the like), raised, given to the loop's
  exception handler, to ``sys.unraisablehook`` or to a thread's excepthook;
* a timer lost or run twice: every timer the program did not cancel, whose
  TimerThread and loop stayed open, fires exactly once when it is due, a
  cancel() that won means it never runs, a far one can still be cancelled;
* on the native backend, ``stats()`` not at rest once every known timer is
  done: ``scheduled == ran + cancelled + dropped`` (a timer still pending
  that no handle of the program holds was leaked).

Programs that call private names (``_port``, ``_forget``, a Port's
``detach``...) are checked for crashes and exceptions only: those names may
legitimately lose timers.

A crash kills the process, so programs run in a child (``python -X dev``,
``PYTHONMALLOC=debug``): tests/core/test_hostile.py starts it.  Run by hand::

    python tests/_hostile.py run --examples 500 --seed 1 --last /tmp/last.json
    python tests/_hostile.py replay /tmp/last.json
    python tests/_hostile.py minimise /tmp/last.json     # a crash, smaller

``run`` writes each program to ``--last`` before running it, so the program
that crashed the child is the one the file holds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import gc
import json
import logging
import math
import os
import selectors
import subprocess
import sys
import threading
import time
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import bucketimer
import bucketimer.loop
from bucketimer import _backend

NATIVE = _backend.NATIVE
if NATIVE:
    from bucketimer import _core

PY312 = sys.version_info >= (3, 12)


class Broken(Exception):
    """bucketimer was left wrong by a program (not a crash)."""


class HostileError(Exception):
    """What the ``raise`` action raises."""


# -- the world a program runs in ------------------------------------------------------------

#: The program running now: hooks of objects that outlive it do nothing.
WORLD: World | None = None

#: Actions a hook may run from a thread that is not the loop's (the
#: dispatcher's callbacks, a __del__ there): the loop and its Timeouts
#: belong to the loop's thread.
THREAD_ACTIONS = {"cancel", "close_tt", "close_default", "gc", "raise"}

ACTIONS = ["cancel", "reschedule", "close_tt", "close_default", "replace_default",
           "close_loop", "drop", "gc", "raise", "recurse", "debug", "patch_time"]
if NATIVE:  # a Port's methods, from inside a callback or a dunder
    ACTIONS += ["detach", "drain", "cancel_pending"]

POINTS = ["__float__", "__index__", "__repr__", "__eq__", "__hash__", "__del__", "__bool__",
          "__lt__", "__le__", "__add__", "__round__", "callback", "context", "awaited",
          "loop.time", "loop.is_closed", "loop.__hash__", "loop.__eq__", "loop.get.time",
          "loop.call_soon", "loop.call_at", "loop._bt_polled", "select", "grpc.behavior",
          "grpc.time_remaining"]


def hook(point: str) -> None:
    w = WORLD
    if w is not None and w.active:
        w.hook(point)


class Record:
    """A timer the program made: its handle (weakly: dropping the program's
    references must not keep it), whom it belongs to and when it is due."""

    __slots__ = ("cancel_called", "cancel_won", "due", "handle", "key", "kind", "loop", "owner")

    def __init__(self, handle: Any, key: int | None, kind: str, owner: Any, loop: Any,
                 due: float | None) -> None:
        self.handle = weakref.ref(handle)
        self.key = key
        self.kind = kind  # "tt": a TimerThread's Handle; "loop": a loop's handle
        # the TimerThread (kind "tt"), weakly: a program may drop the last
        # reference to one (a default replaced) while bucketimer uses it
        self.owner = None if owner is None else weakref.ref(owner)
        self.loop = loop  # the loop it runs on, or None (dispatcher)
        self.due = due  # monotonic seconds, or None: not known
        self.cancel_called = False
        self.cancel_won = False


class World:
    def __init__(self, program: dict[str, Any]) -> None:
        self.program = program
        self.triggers = [list(t) for t in program.get("triggers", [])]
        self.done = [False] * len(self.triggers)
        self.step_no = -2  # the top-level step running (-2: none)
        self.step_counts: Counter[str] = Counter()  # hooks so far in that step
        self.counts: Counter[str] = Counter()
        self.active = False
        self.holder: list[Any] = []  # the program's references ("drop" clears them)
        self.records: list[Record] = []
        self.fired: Counter[int] = Counter()
        self.next_key = 0
        self.timeouts: list[Any] = []  # every Timeout made (strong: exited at the end)
        self.stack: list[Any] = []  # the Timeouts entered by "enter_timeout", innermost last
        self.loops: list[Any] = []  # other loops made, closed at the end
        self.tts: list[Any] = []  # other TimerThreads made, closed at the end
        self.bad: list[str] = []
        self.errors: Counter[str] = Counter()
        self.private = False
        self.steps_run: list[Any] = []  # the step running, innermost last ("recurse")
        self.loop: Any = None
        self.tt: Any = None
        self.main_thread = threading.get_ident()
        self.t0 = time.monotonic()
        self.hung = False
        self.leaky = False  # a timer may be left pending by design (see _call)
        self.raised = False  # a "raise" action ran

    # -- hooks and actions

    def hook(self, point: str) -> None:
        for counts in (self.counts, self.step_counts):
            counts[point] += 1
            counts["*"] += 1
        for k, (where, nth, action, arg, step) in enumerate(self.triggers):
            if self.done[k]:
                continue
            if step == -1:  # counted over the whole program
                n = self.counts[where]
            elif step == self.step_no:  # counted within one step
                n = self.step_counts[where]
            else:
                continue
            if (where == point or where == "*") and n == nth:
                self.done[k] = True
                if not point.startswith("loop."):
                    self.act(action, arg, point)
                    continue
                # asyncio's own loop code calls these too, and does not
                # survive them raising (a task whose step was lost waits
                # forever): what the action raises stops here
                try:
                    self.act(action, arg, point)
                except Exception as e:
                    self.note(e, f"action {action} at {point}")

    def act(self, action: str, arg: int, point: str) -> None:
        if threading.get_ident() != self.main_thread and action not in THREAD_ACTIONS:
            return
        if action == "cancel":
            live = [r for r in self.records if r.handle() is not None]
            if live:
                self.cancel(live[arg % len(live)])
        elif action == "reschedule":
            if self.timeouts:
                tm = self.timeouts[arg % len(self.timeouts)]
                tm.reschedule(self.when_for(arg))
        elif action == "close_tt":
            self.tt.close()
        elif action == "close_default":
            bucketimer.default_timer_thread().close()
        elif action == "replace_default":
            # the program lets go of what holds the old default (its
            # handles hold it): the new one frees it
            bucketimer.default_timer_thread().close()
            self.holder.clear()
            bucketimer.default_timer_thread()
            gc.collect()
        elif action == "close_loop":
            loops = [self.loop, *self.loops]
            loops[arg % len(loops)].close()
        elif action == "drop":
            self.holder.clear()
            gc.collect()
        elif action == "gc":
            gc.collect()
        elif action == "raise":
            # OverflowError: what a number too large for a double raises,
            # which makes it +-inf (never, or at once): what a timer made
            # meanwhile means is no longer what its spec says
            self.raised = True
            raise [HostileError, OverflowError, TypeError][arg % 3](f"hostile raise #{arg}")
        elif action == "recurse":
            if self.steps_run and len(self.steps_run) < 3 and not ENTRIES[self.steps_run[-1][0]].is_async:
                run_step(self, self.steps_run[-1])
        elif action == "debug":
            self.loop.set_debug(bool(arg % 2))
        elif action in ("detach", "drain", "cancel_pending"):
            # a loop's port (or the dispatcher's) taken apart mid-call:
            # private, so the program's timers may be lost
            self.private = True
            ports = _objects_of(self, "port")
            if ports:
                getattr(ports[arg % len(ports)], action)()
        elif action == "patch_time":
            loop = self.loop
            if arg % 2:
                loop.time = lambda: asyncio.BaseEventLoop.time(loop)
            elif "time" in getattr(loop, "__dict__", {}):
                del loop.time

    def when_for(self, arg: int) -> Any:
        """A deadline for reschedule(): None, passed, near, far, or hostile."""
        now = time.monotonic()
        return [None, now - 1, now + 0.005, now + 1000, Hostile(now + 0.01),
                HFloat(now + 1000), HInt(int(now) + 10**30), math.nan][arg % 8]

    # -- timers

    def key(self) -> int:
        self.next_key += 1
        return self.next_key

    def track(self, handle: Any, key: int | None, kind: str, owner: Any, loop: Any,
              due: float | None) -> None:
        self.holder.append(handle)
        self.records.append(Record(handle, key, kind, owner, loop, due))

    def cancel(self, r: Record) -> None:
        h = r.handle()
        if h is None:
            return
        r.cancel_called = True
        if h.cancel() is True:
            r.cancel_won = True

    def note(self, exc: BaseException, where: str) -> None:
        """A Python exception that reached the program: fine, unless it is
        not a plain one."""
        self.errors[type(exc).__name__] += 1
        if isinstance(exc, SystemError) or not isinstance(exc, Exception) and not isinstance(
                exc, asyncio.CancelledError):
            self.bad.append(f"{where}: {type(exc).__name__}: {exc}")


class Tracked:
    """A callback that counts its calls, and whose call, __repr__ and
    __del__ are hook points."""

    __slots__ = ("key", "__weakref__")

    def __init__(self, key: int) -> None:
        self.key = key

    def __call__(self, *args: Any) -> None:
        w = WORLD
        if w is not None:
            w.fired[self.key] += 1
        hook("callback")

    def __repr__(self) -> str:
        hook("__repr__")
        return f"Tracked({self.key})"

    def __del__(self) -> None:
        hook("__del__")


# -- hostile values -------------------------------------------------------------------------


# Each dunder reads what it needs and deletes ``self`` before its hook
# runs: a hook that makes bucketimer let go of the object then frees it
# while the C code that called the dunder may still hold it borrowed (a
# frame, or a traceback's, holding ``self`` would keep it alive).


def _v(o: Any) -> Any:
    return o.v if isinstance(o, (Hostile, HIndex, HFloat, HInt)) else o


def _op(name: str, point: str, fn: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Any]:
    """A binary dunder: the hook, then ``fn(value, other's value)``."""
    def op(self: Any, other: Any) -> Any:
        v = self.v
        del self
        hook(point)
        return fn(v, _v(other))
    op.__name__ = name
    return op


def _unary(point: str, fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """A unary dunder: the hook, then ``fn(value)``."""
    def op(self: Any) -> Any:
        v = self.v
        del self
        hook(point)
        return fn(v)
    op.__name__ = point
    return op


def _round(self: Any, n: int | None = None) -> Any:
    v = self.v
    del self
    hook("__round__")
    return round(v, n)


def _del(self: Any) -> None:
    hook("__del__")


class Hostile:
    """A real number (``__float__``, ``__index__``) whose every operation is
    a hook point; also callable (counting its calls as a Tracked does)."""

    __slots__ = ("key", "v", "__weakref__")

    def __init__(self, v: Any) -> None:
        self.v = v
        self.key = 0

    __float__ = _unary("__float__", float)
    __index__ = _unary("__index__", lambda v: int(v) if math.isfinite(v) else 0)
    __repr__ = _unary("__repr__", lambda v: f"Hostile({v!r})")
    __hash__ = _unary("__hash__", hash)
    __bool__ = _unary("__bool__", bool)
    __round__ = _round
    __del__ = _del
    __eq__ = _op("__eq__", "__eq__", lambda a, b: bool(a == b))  # type: ignore[assignment]
    __lt__ = _op("__lt__", "__lt__", lambda a, b: bool(a < b))
    __le__ = _op("__le__", "__le__", lambda a, b: bool(a <= b))
    __gt__ = _op("__gt__", "__lt__", lambda a, b: bool(a > b))
    __ge__ = _op("__ge__", "__le__", lambda a, b: bool(a >= b))
    __add__ = _op("__add__", "__add__", lambda a, b: Hostile(a + b))
    __radd__ = __add__
    __sub__ = _op("__sub__", "__add__", lambda a, b: Hostile(a - b))
    __rsub__ = _op("__rsub__", "__add__", lambda a, b: Hostile(b - a))

    def __call__(self, *args: Any) -> None:
        key = self.key
        del self
        w = WORLD
        if w is not None and key:
            w.fired[key] += 1
        hook("callback")


class HIndex:
    """An integer only through ``__index__``."""

    __slots__ = ("v", "__weakref__")

    def __init__(self, v: Any) -> None:
        self.v = v

    __index__ = Hostile.__index__
    __repr__ = _unary("__repr__", lambda v: f"HIndex({v!r})")
    __del__ = _del


class HFloat(float):
    """A float subclass: C takes its value directly, and calls its methods
    when it formats, compares or hashes it."""

    @property
    def v(self) -> float:
        return float.__float__(self)

    __repr__ = _unary("__repr__", lambda v: f"HFloat({v!r})")
    __hash__ = Hostile.__hash__
    __float__ = Hostile.__float__
    __round__ = _round
    __bool__ = Hostile.__bool__
    __del__ = _del
    __eq__ = _op("__eq__", "__eq__", lambda a, b: a == b)  # type: ignore[assignment]
    __lt__ = _op("__lt__", "__lt__", lambda a, b: a < b)  # type: ignore[assignment]
    __le__ = _op("__le__", "__le__", lambda a, b: a <= b)  # type: ignore[assignment]
    __add__ = _op("__add__", "__add__", lambda a, b: HFloat(a + b))  # type: ignore[assignment]
    __radd__ = __add__  # type: ignore[assignment]


class HInt(int):
    """An int subclass, as HFloat."""

    @property
    def v(self) -> int:
        return int.__index__(self)

    __repr__ = _unary("__repr__", lambda v: f"HInt({v!r})")
    __hash__ = Hostile.__hash__
    __float__ = Hostile.__float__
    __index__ = _unary("__index__", int)
    __del__ = _del
    __eq__ = _op("__eq__", "__eq__", lambda a, b: a == b)  # type: ignore[assignment]
    __lt__ = _op("__lt__", "__lt__", lambda a, b: a < b)  # type: ignore[assignment]
    __le__ = _op("__le__", "__le__", lambda a, b: a <= b)  # type: ignore[assignment]
    __add__ = _op("__add__", "__add__", lambda a, b: HFloat(a + float(b)))  # type: ignore[assignment]
    __radd__ = __add__  # type: ignore[assignment]


#: what a spec ["h", variant, x] makes of x
VARIANTS: dict[str, Callable[[Any], Any]] = {
    "obj": Hostile,
    "index": HIndex,
    "float": lambda x: HFloat(x),
    "int": lambda x: HInt(int(x)) if math.isfinite(x) else HInt(10**30 if x > 0 else -(10**30)),
}

#: what a spec ["bad", kind] makes
BADS: dict[str, Callable[[], Any]] = {
    "none": lambda: None,
    "str": lambda: "1",
    "bool": lambda: True,
    "object": object,
    "list": lambda: [1],
}


def value(spec: Any, offset: float = 0.0) -> tuple[Any, float | None]:
    """The object a value spec stands for (``offset`` added: the clock, for
    a deadline), and the float it means (None if it means none)."""
    kind = spec[0]
    if kind == "bad":
        return BADS[spec[1]](), None
    x = spec[-1]
    if isinstance(x, float) and not math.isfinite(x):
        meant: float | None = None if math.isnan(x) else x
        return (x if kind == "n" else VARIANTS[spec[1]](x)), meant
    if offset and abs(x) < 1e15:
        x = x + offset if isinstance(x, float) else int(x + offset)
    try:
        meant = float(x)
    except OverflowError:
        meant = math.inf if x > 0 else -math.inf
    return (x if kind == "n" else VARIANTS[spec[1]](x)), meant


def context_for(world: World, i: int) -> Any:
    """None, a copy of the current context, or one holding a hostile value
    (released when the timer finishes: its __del__ is a hook point)."""
    c = i % 3
    if c == 0:
        return None
    ctx = contextvars.copy_context()
    if c == 2:
        ctx.run(_VAR.set, Hostile(0.0))
    return ctx


_VAR: contextvars.ContextVar[Any] = contextvars.ContextVar("hostile_var")


# -- hostile loops ---------------------------------------------------------------------------


class _Hooks:
    """Hook points of a loop: is_closed, __hash__/__eq__ (its key in the
    TimerThread's record), call_soon/call_at, the lookup of ``time``."""

    def is_closed(self) -> bool:
        hook("loop.is_closed")
        return super().is_closed()  # type: ignore[misc, no-any-return]

    def __hash__(self) -> int:
        hook("loop.__hash__")
        return object.__hash__(self)

    def __eq__(self, other: object) -> bool:
        hook("loop.__eq__")
        return self is other

    def call_soon(self, *args: Any, **kwargs: Any) -> Any:
        hook("loop.call_soon")
        return super().call_soon(*args, **kwargs)  # type: ignore[misc]

    def call_at(self, *args: Any, **kwargs: Any) -> Any:
        hook("loop.call_at")
        return super().call_at(*args, **kwargs)  # type: ignore[misc]

    def __getattribute__(self, name: str) -> Any:
        if name == "time":
            hook("loop.get.time")
        return super().__getattribute__(name)

    @property
    def _bt_polled(self) -> Any:
        """Read by the core on any loop (a drop-in loop's says when it polled)."""
        hook("loop._bt_polled")
        polled = getattr(bucketimer.EventLoop, "_bt_polled", None)
        return polled.fget(self) if isinstance(self, bucketimer.EventLoop) and polled else None


class _Clock:
    """A clock of the loop's own (the same readings, through Python)."""

    def time(self) -> float:
        hook("loop.time")
        return time.monotonic()


class HostileLoop(_Hooks, asyncio.SelectorEventLoop):  # type: ignore[misc]
    pass


class HostileClockLoop(_Clock, _Hooks, asyncio.SelectorEventLoop):  # type: ignore[misc]
    pass


class HostileDropIn(_Hooks, bucketimer.EventLoop):
    pass


class HostileDropInClock(_Clock, bucketimer.EventLoop):
    pass


def _loop_factories() -> dict[str, Callable[[World], Any]]:
    f: dict[str, Callable[[World], Any]] = {
        "stock": lambda w: asyncio.SelectorEventLoop(),
        "dropin": lambda w: bucketimer.EventLoop(),
        "dropin_tt": lambda w: bucketimer.EventLoop(timer_thread=w.tt),
        "hostile": lambda w: HostileLoop(),
        "hostile_clock": lambda w: HostileClockLoop(),
        "hostile_dropin": lambda w: HostileDropIn(),
        "hostile_dropin_clock": lambda w: HostileDropInClock(),
    }
    uv = getattr(bucketimer.loop, "UVEventLoop", None)
    if uv is not None:
        f["uv"] = lambda w: uv(timer_thread=w.tt)
    return f


LOOPS = _loop_factories()


class HostileSelector(selectors.DefaultSelector):  # type: ignore[misc, valid-type]
    """A selector whose select() is a hook point (for PollStamp)."""

    def select(self, timeout: float | None = None) -> Any:
        hook("select")
        return super().select(0 if timeout is None else min(float(timeout), 0.001))


# -- the API surface, from introspection -----------------------------------------------------


def _bucketimer_names(cls: type) -> set[str]:
    """Names a class defines in bucketimer (not asyncio's, not object's)."""
    names: set[str] = set()
    for c in cls.__mro__:
        if c.__module__.startswith("bucketimer"):
            names.update(vars(c))
    return names


#: object's dunders worth calling on every type (the rest are object's own)
_DUNDERS = {"__repr__", "__str__", "__hash__", "__eq__", "__ne__", "__init__", "__call__",
            "__aenter__", "__aexit__", "__enter__", "__exit__", "__await__", "__iter__",
            "__next__", "__del__", "__setattr__", "__delattr__"}


def _type_names(tp: type, own_only: bool = False) -> list[str]:
    names = _bucketimer_names(tp) if own_only else set(dir(tp))
    obj = set(dir(object))
    keep = []
    for n in names:
        if n.startswith("__") and n.endswith("__"):
            if n not in _DUNDERS:
                continue
            if n in obj and getattr(tp, n, None) is getattr(object, n, None):
                continue  # object's, not the type's
        keep.append(n)
    return sorted(keep)


def kind_types() -> dict[str, Any]:
    """The kinds of object the generic steps work on: each is a type (or a
    module) of the API, and what the surface of that kind is read from."""
    k: dict[str, Any] = {
        "module": bucketimer,
        "aio": bucketimer.aio,
        "loopmod": bucketimer.loop,
        "tt": bucketimer.TimerThread,
        "handle": bucketimer.Handle,
        "timeout": bucketimer.Timeout,
        "loop": bucketimer.EventLoop,
    }
    if NATIVE:
        k.update({
            "loophandle": _core.LoopHandle,
            "port": _core.Port,
            "scheduler": _core.Scheduler,
            "pollstamp": bucketimer.loop._PollStamp,
            "step": _step_type(),
            "grpc_unary": _core.GrpcUnary,
        })
        if PY312:
            k["waitfor"] = _core.WaitFor
    return k


def _step_type() -> type:
    tm = bucketimer.timeout_at(None)
    s = tm.__aenter__()
    s.close()
    return type(s)


#: (kind, name) the generic steps leave out, and why
EXCLUDED: dict[tuple[str, str], str] = {
    ("module", "install"): "sets the process's asyncio policy (asyncio's machinery)",
    ("loopmod", "install"): "sets the process's asyncio policy (asyncio's machinery)",
    ("module", "EventLoopPolicy"): "asyncio's policy class",
    ("loopmod", "EventLoopPolicy"): "asyncio's policy class",
    ("loopmod", "UVEventLoopPolicy"): "uvloop's policy class",
    ("pollstamp", "select"): "blocks for the timeout given: the 'pollstamp' step bounds it",
    ("loop", "__init__"): "asyncio's loop set-up, run twice on a live loop",
    ("pollstamp", "__init__"): "BaseSelector's",
    ("tt", "_test_hold"): "test only: holds the timer thread until close(), and a Timeout whose "
                          "deadline has passed then waits for it (bt_deliver_due) forever",
}


def surface() -> list[tuple[str, str]]:
    """Every (kind, name) of the API the generic steps call or read."""
    out = []
    for kind, obj in kind_types().items():
        if isinstance(obj, type):
            names = _type_names(obj, own_only=kind in ("loop", "pollstamp"))
        else:
            names = sorted(getattr(obj, "__all__", []))
        out.extend((kind, n) for n in names if (kind, n) not in EXCLUDED)
    return out


def _objects_of(world: World, kind: str) -> list[Any]:
    """The live objects of a kind the program can reach now."""
    if kind == "module":
        return [bucketimer]
    if kind == "aio":
        return [bucketimer.aio]
    if kind == "loopmod":
        return [bucketimer.loop]
    if kind == "tt":
        return [world.tt, bucketimer.default_timer_thread(), *world.tts]
    if kind in ("handle", "loophandle"):
        tp = kind_types()[kind]
        return [h for r in world.records if (h := r.handle()) is not None and type(h) is tp]
    if kind == "timeout":
        return list(world.timeouts)
    if kind == "loop":
        return [lp for lp in (world.loop, *world.loops) if isinstance(lp, bucketimer.EventLoop)]
    if kind == "port":
        ports = []
        for tt in (world.tt, bucketimer.default_timer_thread()):
            ports.extend(tt._ports.values())
            if tt._dispatcher is not None:
                ports.append(tt._dispatcher)
        return ports
    if kind == "scheduler":
        return [s for s in (getattr(world.loop, "__dict__", {}).get(n) for n in ("call_at", "call_later"))
                if s is not None]
    if kind == "pollstamp":
        p = getattr(world.loop, "_bt_polled", None)
        return [p] if p is not None else []
    if kind == "step":
        tm = bucketimer.timeout_at(None)
        world.timeouts.append(tm)
        return [tm.__aenter__(), tm.__aexit__(None, None, None)]
    if kind == "waitfor":
        return [bucketimer.wait_for(_awaitable(world), Hostile(0.01))]
    if kind == "grpc_unary":
        return [grpc_wrapper(world)]
    return []


# -- steps -----------------------------------------------------------------------------------


class Entry:
    def __init__(self, fn: Callable[..., Any], is_async: bool = False) -> None:
        self.fn = fn
        self.is_async = is_async


ENTRIES: dict[str, Entry] = {}


def entry(name: str, is_async: bool = False) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        ENTRIES[name] = Entry(fn, is_async)
        return fn
    return deco


def _schedule(world: World, fn: Callable[..., Any], a: Any, i: int, absolute: bool,
              kind: str, owner: Any, loop: Any, **kw: Any) -> None:
    now = time.monotonic()
    # the values are the callee's alone: an action that makes it let go
    # of one frees it
    v, meant = value(a, now if absolute else 0.0)
    key = world.key()
    cb = Tracked(key) if i % 4 else Hostile(0.0)
    if isinstance(cb, Hostile):
        cb.key = key
    args = (Hostile(1.0),) if i % 5 == 0 else ()
    h = fn(v, cb, *args, **kw)
    due = None if meant is None else (meant if absolute else now + meant)
    world.track(h, key, kind, owner, loop, due)


def _tt_of(world: World, i: int) -> Any:
    return world.tt if i % 3 else bucketimer.default_timer_thread()


@entry("tt.call_later")
def _tt_call_later(world: World, a: Any, b: Any, i: int) -> None:
    tt = _tt_of(world, i)
    _schedule(world, tt.call_later, a, i, False, "tt", tt, world.loop,
              context=context_for(world, i))


@entry("tt.call_at")
def _tt_call_at(world: World, a: Any, b: Any, i: int) -> None:
    tt = _tt_of(world, i)
    _schedule(world, tt.call_at, a, i, True, "tt", tt, world.loop,
              context=context_for(world, i))


@entry("tt.call_later@dispatcher")
def _tt_dispatcher(world: World, a: Any, b: Any, i: int) -> None:
    """A timer for the dispatcher thread: scheduled where no loop runs."""
    tt = _tt_of(world, i)
    err: list[BaseException] = []

    def sched() -> None:
        try:
            _schedule(world, tt.call_later if i % 2 else tt.call_at, a, i, not i % 2, "tt", tt,
                      None)
        except BaseException as e:
            err.append(e)

    t = threading.Thread(target=sched)
    t.start()
    t.join()
    if err:
        raise err[0]


@entry("call_later")
def _call_later(world: World, a: Any, b: Any, i: int) -> None:
    tt = bucketimer.default_timer_thread()
    _schedule(world, bucketimer.call_later, a, i, False, "tt", tt, world.loop,
              context=context_for(world, i))


@entry("call_at")
def _call_at(world: World, a: Any, b: Any, i: int) -> None:
    tt = bucketimer.default_timer_thread()
    _schedule(world, bucketimer.call_at, a, i, True, "tt", tt, world.loop,
              context=context_for(world, i))


def _for_asyncio(a: Any) -> Any:
    """A value spec an asyncio heap can order: asyncio's loop takes any
    object as a deadline and breaks on the first it cannot subtract or
    compare (every later iteration raises), so a loop's call_at/call_later
    get floats and ints, of subclasses too, but nothing else."""
    if a[0] == "bad":
        return ["n", 0.0]
    if a[0] == "h" and a[1] not in ("float", "int"):
        return ["h", "float", a[2]]
    return a


def _loop_tt(world: World) -> Any:
    """The TimerThread a drop-in loop's timers may be in (closing it drops them)."""
    return getattr(world.loop, "timer_thread", None) if NATIVE else None


@entry("loop.call_later")
def _loop_call_later(world: World, a: Any, b: Any, i: int) -> None:
    _schedule(world, world.loop.call_later, _for_asyncio(a), i, False, "loop", _loop_tt(world),
              world.loop, context=context_for(world, i))


@entry("loop.call_at")
def _loop_call_at(world: World, a: Any, b: Any, i: int) -> None:
    _schedule(world, world.loop.call_at, _for_asyncio(a), i, True, "loop", _loop_tt(world),
              world.loop, context=context_for(world, i))


@entry("other_loop")
def _other_loop(world: World, a: Any, b: Any, i: int) -> None:
    """A timer for a loop that is not running (closed by a later action, or
    at the end)."""
    lp = bucketimer.EventLoop() if i % 2 else asyncio.SelectorEventLoop()
    world.loops.append(lp)
    tt = _tt_of(world, i)
    _schedule(world, tt.call_later, a, i, False, "tt", tt, lp, loop=lp)


@entry("cancel")
def _cancel(world: World, a: Any, b: Any, i: int) -> None:
    if world.records:
        world.cancel(world.records[i % len(world.records)])


@entry("repr")
def _repr(world: World, a: Any, b: Any, i: int) -> None:
    objs = [h for r in world.records if (h := r.handle()) is not None] + world.timeouts
    if objs:
        repr(objs[i % len(objs)])


@entry("enter_timeout", is_async=True)
async def _enter_timeout(world: World, a: Any, b: Any, i: int) -> None:
    how = i % 3
    now = asyncio.get_running_loop().time()
    v, _ = value(a, now if how else 0.0)
    if a[0] == "n" and isinstance(v, (int, float)) and how == 0:
        v = min(v, 0.05) if math.isfinite(v) else v
    tm = (bucketimer.timeout(v) if how == 0 else bucketimer.timeout_at(v) if how == 1
          else bucketimer.Timeout(v))
    del v  # the Timeout's alone
    world.timeouts.append(tm)
    await tm.__aenter__()
    world.stack.append(tm)


@entry("exit_timeout", is_async=True)
async def _exit_timeout(world: World, a: Any, b: Any, i: int) -> None:
    if world.stack:
        tm = world.stack.pop()
        await tm.__aexit__(None, None, None)


@entry("reschedule")
def _reschedule(world: World, a: Any, b: Any, i: int) -> None:
    if world.timeouts:
        tm = world.timeouts[i % len(world.timeouts)]
        v, _ = value(a, asyncio.get_running_loop().time()) if i % 4 else (world.when_for(i), 0)
        tm.reschedule(v)


@entry("sleep", is_async=True)
async def _sleep(world: World, a: Any, b: Any, i: int) -> None:
    await asyncio.sleep([0, 0.001, 0.004][i % 3])


def _awaitable(world: World) -> Any:
    async def inner() -> int:
        hook("awaited")
        await asyncio.sleep(0.002)
        hook("awaited")
        return 1
    return inner()


@entry("wait_for", is_async=True)
async def _wait_for(world: World, a: Any, b: Any, i: int) -> None:
    v, _ = value(a)
    if isinstance(v, (int, float)) and math.isfinite(v):
        v = min(v, 0.05)
    wf = bucketimer.wait_for(_awaitable(world), v)
    if PY312:
        world.holder.append(wf)
    await wf


@entry("pollstamp")
def _pollstamp(world: World, a: Any, b: Any, i: int) -> None:
    if not NATIVE:
        return
    if i % 2:
        ps = _core.PollStamp(HostileSelector())
        world.holder.append(ps)
    else:
        ps = getattr(world.loop, "_bt_polled", None)
        if ps is None:
            return
    ps.select(Hostile(0.0) if i % 3 else None if i % 2 else 0)


@entry("grpc")
def _grpc(world: World, a: Any, b: Any, i: int) -> None:
    w = grpc_wrapper(world)
    if w is None:
        return
    v, _ = value(a)
    ctx = FakeGrpcContext(v)
    world.holder.append(ctx)
    w(Hostile(0.0), ctx)


@entry("call")
def _call(world: World, a: Any, b: Any, i: int) -> None:
    """Any name of the surface: called with 0 to 2 of the step's values,
    or read when it is not callable."""
    kind, name = SURFACE[i % len(SURFACE)]
    if name.startswith("_") and not name.startswith("__"):
        world.private = True
    if kind in ("port", "scheduler", "pollstamp", "step", "waitfor", "grpc_unary"):
        world.private = True
    objs = _objects_of(world, kind)
    if not objs:
        return
    obj = objs[(i // len(SURFACE)) % len(objs)]
    world.holder.append(obj)
    attr = getattr(obj, name)
    if not callable(attr) or isinstance(attr, (type, Tracked, Hostile)):
        repr(attr)  # (a handle's callback is read, not run: that would count as a fire)
        return
    if name == "wait_for" and not PY312:
        # asyncio's wait_for of 3.11 arms its timer before it looks at its
        # awaitable and leaves it armed when that raises; bucketimer's
        # does the same (one behaviour): a timer pending that nobody holds
        world.leaky = True
    # a deadline where the name says so, else a delay
    clock = time.monotonic() if name.endswith("_at") or name == "reschedule" else 0.0
    args = [value(s, clock)[0] for s in (a, b)][: (i // 7) % 3]
    if name == "cancel" and kind in ("handle", "loophandle") and not args:
        # the settling checks must know of it, as of the cancel step's
        world.cancel(next(r for r in world.records if r.handle() is obj))
        return
    _adopt(world, attr(*args))


@entry("set")
def _set(world: World, a: Any, b: Any, i: int) -> None:
    """Any attribute of the surface set to one of the step's values (or deleted)."""
    kind, name = SURFACE[i % len(SURFACE)]
    world.private = True
    if kind in ("module", "aio", "loopmod"):
        return
    objs = [world.tt] if kind == "tt" else _objects_of(world, kind)
    if not objs or not hasattr(getattr(type(objs[0]), name, None), "__set__"):
        return  # only data attributes: a method shadowed on a shared object breaks the next programs
    obj = objs[0]
    if i % 5 == 0:
        delattr(obj, name)
    else:
        setattr(obj, name, value(a)[0])


def _adopt(world: World, r: Any) -> None:
    """What a generic call returned: timers, Timeouts, loops and
    TimerThreads are kept track of; a coroutine is driven one step and
    closed."""
    tps = kind_types()
    if isinstance(r, (tps["handle"], *([tps["loophandle"]] if "loophandle" in tps else []))):
        world.track(r, None, "tt", None, None, None)
    elif isinstance(r, asyncio.AbstractEventLoop):
        world.loops.append(r)
    elif isinstance(r, bucketimer.TimerThread):
        world.tts.append(r)
    elif isinstance(r, tps["timeout"]):
        world.timeouts.append(r)
    elif hasattr(r, "send") and hasattr(r, "close") and not asyncio.isfuture(r):
        world.holder.append(r)
        try:
            r.send(None)
        except StopIteration:
            pass
        finally:
            r.close()


def run_step(world: World, step: Any) -> Any:
    name, a, b, i = step
    world.steps_run.append(step)
    try:
        return ENTRIES[name].fn(world, a, b, i)
    finally:
        world.steps_run.pop()


# -- gRPC's fused wrapper, without a server -------------------------------------------------


class FakeGrpcContext:
    """The servicer context grpc would pass: ``time_remaining()`` returns
    the step's value (a hook point)."""

    def __init__(self, remaining: Any) -> None:
        self.remaining = remaining

    def time_remaining(self) -> Any:
        hook("grpc.time_remaining")
        return self.remaining

    def abort(self, code: Any, details: str) -> None:
        raise HostileError(f"aborted: {code}")

    def is_active(self) -> bool:
        return True

    def set_code(self, code: Any) -> None:
        pass

    def set_details(self, details: str) -> None:
        pass

    def add_callback(self, cb: Any) -> bool:
        return False

    def invocation_metadata(self) -> tuple[()]:
        return ()

    def peer(self) -> str:
        return "hostile"


def grpc_wrapper(world: World) -> Any:
    """The sync fused unary wrapper (``_core.GrpcUnary`` on the native
    backend) of a ServerDeadlineSlowCallInterceptor, on the world's
    TimerThread; None without grpc."""
    try:
        import grpc

        from bucketimer.grpc import ServerDeadlineSlowCallInterceptor
    except ImportError:
        return None

    def behavior(request: Any, context: Any) -> Any:
        hook("grpc.behavior")
        return request

    class Details:
        method = "/hostile.Service/Call"

    ic = ServerDeadlineSlowCallInterceptor(threshold=0.5, max_time=1.0, timer_thread=world.tt)
    handler = ic.intercept_service(lambda d: grpc.unary_unary_rpc_method_handler(behavior),
                                   Details())
    return handler.unary_unary


# -- running one program ----------------------------------------------------------------------


SURFACE: list[tuple[str, str]] = []


async def _main(world: World) -> None:
    for k, step in enumerate(world.program["steps"]):
        world.step_no = k
        world.step_counts.clear()
        entry_ = ENTRIES[step[0]]
        try:
            if entry_.is_async:
                world.steps_run.append(step)
                try:
                    await entry_.fn(world, *step[1:])
                finally:
                    world.steps_run.pop()
            else:
                run_step(world, step)
        except (Exception, asyncio.CancelledError) as e:
            world.note(e, f"step {step[0]}")
            if world.hung:
                raise
    world.step_no = -2
    await _settle(world)


async def _exit_all(world: World) -> None:
    """Exits every Timeout still entered, innermost first (each __aexit__'s
    complaint about one that is not is a Python exception)."""
    for tm in [*reversed(world.stack), *world.timeouts]:
        try:
            await tm.__aexit__(None, None, None)
        except (Exception, asyncio.CancelledError) as e:
            world.errors[type(e).__name__] += 1
            if isinstance(e, SystemError):
                world.bad.append(f"__aexit__: {e!r}")
    world.stack.clear()


def _closed(r: Record) -> bool:
    """The timer may have been dropped: its TimerThread or its loop closed."""
    if r.owner is not None and (r.owner() is None or r.owner().closed):
        return True
    lp = r.loop
    return lp is not None and (lp.is_closed() or not lp.is_running())


#: loops whose timers are the default TimerThread's, which closing makes
#: anew: they must still schedule after any program
ON_DEFAULT = {"dropin", "hostile_dropin"}

#: checks a long run may turn off once what they find is known
#: (HOSTILE_IGNORE=sleep,rest): "sleep", the drop-in loop's sleep after the
#: default TimerThread was closed; "rest", stats() at rest
IGNORE = set(filter(None, os.environ.get("HOSTILE_IGNORE", "").split(",")))


async def _settle(world: World) -> None:
    """Lets every near timer come due and checks what became of each."""
    await _exit_all(world)
    world.active = False  # no action from here on
    try:
        await asyncio.sleep(0.0001)
    except Exception as e:
        world.note(e, "sleep after the program")
        if (world.program["loop"] in ON_DEFAULT and not world.private
                and not world.loop.get_debug() and "sleep" not in IGNORE):
            world.bad.append(f"the loop cannot sleep after the program: {e!r}")
    for lp in world.loops:
        if not lp.is_closed() and not lp.is_running():
            lp.close()
    checked = not world.private
    end = time.monotonic() + 2.0
    while time.monotonic() < end:
        waiting = [r for r in world.records
                   if checked and r.due is not None and r.due < time.monotonic() + 0.05
                   and not r.cancel_won and not r.cancel_called and not _closed(r)
                   and world.fired[r.key or 0] == 0 and r.key]
        if not waiting:
            break
        try:
            await asyncio.sleep(0.002)
        except asyncio.CancelledError as e:
            world.note(e, "settle")
            if world.hung:
                raise
    now = time.monotonic()
    for r in world.records:
        fired = world.fired[r.key] if r.key else 0
        h = r.handle()
        what = f"timer #{r.key} ({r.kind}, due {None if r.due is None else r.due - now:+.3f}s, {h!r})"
        if not checked or r.key is None:  # (a private call may run it: the pure Handle._run)
            continue
        if fired > 1:
            world.bad.append(f"{what} ran {fired} times")
        if r.cancel_won and fired:
            world.bad.append(f"{what} ran after a cancel() that won")
        if _closed(r):
            continue
        if (r.due is not None and r.due < now - 0.2 and not r.cancel_called and fired != 1
                and not world.raised):
            world.bad.append(f"{what} was due and never ran")
        if h is not None and (r.due is None or r.due > now + 100) and not r.cancel_called:
            won = h.cancel()
            if r.kind == "tt" and won is not True and not fired:
                world.bad.append(f"{what}: cancel() of a far timer did not win")
        elif h is None and not fired and not r.cancel_called and (r.due is None or r.due > now):
            world.bad.append(f"{what}: its handle is gone, it never ran and was never cancelled")
    for r in world.records:
        h = r.handle()
        if h is not None:
            h.cancel()
    if NATIVE and checked and not world.leaky and "rest" not in IGNORE:
        await _check_at_rest(world)


async def _check_at_rest(world: World) -> None:
    """stats() at rest: nothing pending that the program does not know of."""
    for tt in (world.tt, bucketimer.default_timer_thread()):
        if tt.closed:
            continue
        for _ in range(200):
            s = tt.stats()
            left = s["scheduled"] - s["ran"] - s["cancelled"] - s["dropped"]
            if left == 0:
                break
            await asyncio.sleep(0.002)
            if world.hung:
                return
        else:
            world.bad.append(f"{tt!r} not at rest: scheduled {s['scheduled']} != ran {s['ran']} "
                             f"+ cancelled {s['cancelled']} + dropped {s['dropped']} "
                             f"({left} timers pending that no handle of the program holds)")


def _install_reporters(world: World) -> Any:
    def unraisable(u: Any) -> None:
        if u.exc_value is not None:
            world.note(u.exc_value, f"unraisable ({u.err_msg})")

    def excepthook(args: Any) -> None:
        if args.exc_value is not None:
            world.note(args.exc_value, "thread")

    class Handler(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.exc_info and record.exc_info[1] is not None:
                world.note(record.exc_info[1], f"log {record.name}")

    handler = Handler()
    logging.getLogger("bucketimer").addHandler(handler)
    logging.getLogger("asyncio").addHandler(handler)
    old = sys.unraisablehook, threading.excepthook
    sys.unraisablehook, threading.excepthook = unraisable, excepthook

    def restore() -> None:
        sys.unraisablehook, threading.excepthook = old
        logging.getLogger("bucketimer").removeHandler(handler)
        logging.getLogger("asyncio").removeHandler(handler)
    return restore


#: seconds after which a program is stopped: a private call may stop its
#: loop's timers, and a hook that raised inside asyncio's own code may leave
#: a task that never runs again (neither is bucketimer's failure)
HANG = 5.0


def _watch(world: World, loop: Any, task: Any) -> threading.Event:
    """Stops a program that hangs: its task is cancelled until it ends."""
    done = threading.Event()

    def watch() -> None:
        if done.wait(HANG):
            return
        world.hung = True
        while not done.wait(0.2):
            try:
                loop.call_soon_threadsafe(task.cancel)
            except RuntimeError:  # the loop closed
                return

    threading.Thread(target=watch, daemon=True).start()
    return done


def run_program(program: dict[str, Any]) -> World:
    """Runs one program on the backend loaded; raises Broken if it left
    bucketimer wrong."""
    global WORLD
    if not SURFACE:
        SURFACE.extend(surface())
    world = World(program)
    restore = _install_reporters(world)
    WORLD = world
    try:
        world.tt = bucketimer.TimerThread()
        world.loop = loop = LOOPS[program["loop"]](world)
        loop.set_debug(bool(program.get("debug")))

        def on_error(lp: Any, context: dict[str, Any]) -> None:
            exc = context.get("exception")
            if exc is not None:
                world.note(exc, f"loop: {context.get('message')}")

        loop.set_exception_handler(on_error)
        task = loop.create_task(_main(world))
        world.active = True
        watchdog = _watch(world, loop, task)
        for _ in range(20):
            try:
                loop.run_until_complete(task)
                break
            except (Exception, asyncio.CancelledError) as e:
                # a hook that raised inside the loop's own machinery
                world.note(e, "run_until_complete")
                if task.done() or loop.is_closed():
                    break
        else:
            # a hook that raised inside asyncio's own code can leave its
            # loop unable to finish a task: asyncio's, not bucketimer's
            world.errors["task never finished"] += 1
        watchdog.set()
        if world.hung:  # likewise (a hang in C is the child's timeout's)
            world.errors["hung"] += 1
        world.active = False
        for lp in [loop, *world.loops]:
            if not lp.is_closed():
                lp.close()
        for tt in [world.tt, *world.tts]:
            tt.close()
    finally:
        world.active = False
        WORLD = None
        restore()
        # each program starts with a default TimerThread of its own
        bucketimer.default_timer_thread().close()
        world.holder.clear()
        gc.collect()
    if os.environ.get("HOSTILE_VERBOSE"):
        print(f"took {time.monotonic() - world.t0:.3f}s", end=" ")
        fired = sum(world.done)
        print(f"program: loop={program['loop']} steps={len(program['steps'])} "
              f"records={len(world.records)} triggers fired={fired}/{len(world.triggers)} "
              f"errors={dict(world.errors)} private={world.private}", flush=True)
    if world.bad:
        raise Broken("\n".join(world.bad))
    return world


# -- hypothesis ----------------------------------------------------------------------------------


NEAR = [0, 0.0, -1.0, 0.001, 0.005, 0.01, -0.0]
FAR = [1000.0, 1e6, 1e12, 1e300, 2**70, 10**400]
SPECIAL = [math.nan, math.inf, -math.inf, -(2**70), 5e-324]


def programs() -> Any:
    """The hypothesis strategy of programs (for this backend's surface)."""
    from hypothesis import strategies as st

    if not SURFACE:
        SURFACE.extend(surface())
    number = st.one_of(st.sampled_from(NEAR), st.floats(-0.01, 0.02), st.sampled_from(FAR),
                       st.sampled_from(SPECIAL))
    plain = st.tuples(st.just("n"), number)
    hostile = st.tuples(st.just("h"), st.sampled_from(sorted(VARIANTS)), number)
    spec = st.one_of(plain, hostile, plain, hostile, hostile,
                     st.tuples(st.just("bad"), st.sampled_from(sorted(BADS)))).map(list)
    # the entry points that keep Python objects across Python code come twice
    names = sorted(ENTRIES) + sorted(FREQUENT)
    step = st.tuples(st.sampled_from(names), spec, spec,
                     st.integers(0, 64 * len(SURFACE))).map(list)
    # "*": the n-th hook of any kind; counted within one step (mostly an
    # early one), or over the whole program (-1)
    trigger = st.tuples(st.sampled_from(POINTS) | st.just("*"),
                        st.integers(1, 3) | st.integers(1, 12),
                        st.sampled_from(ACTIONS + ["cancel", "reschedule", "replace_default"]),
                        st.integers(0, 15),
                        st.sampled_from([-1, 0, 1, 2]) | st.integers(0, 9)).map(list)
    fresh = st.fixed_dictionaries({
        "loop": st.sampled_from(sorted(LOOPS)),
        "debug": st.sampled_from([False, False, False, True]),
        "steps": st.lists(step, min_size=1, max_size=6),
        "triggers": st.lists(trigger, max_size=6),
    })

    # the known crashes' neighbours: another loop, another action or hook,
    # one more step or trigger (the same mistake elsewhere); of those
    # HOSTILE_NEIGHBOURS lists (indices into KNOWN), if set
    chosen = os.environ.get("HOSTILE_NEIGHBOURS")
    near = [KNOWN[int(k)] for k in chosen.split(",")] if chosen else KNOWN

    @st.composite
    def neighbour(draw: Any) -> dict[str, Any]:
        p = json.loads(json.dumps(draw(st.sampled_from(near))))
        if draw(st.booleans()):
            p["loop"] = draw(st.sampled_from(sorted(LOOPS)))
        t = p["triggers"][draw(st.integers(0, len(p["triggers"]) - 1))]
        t[0] = draw(st.just(t[0]) | st.sampled_from(POINTS) | st.just("*"))
        t[1] = draw(st.just(t[1]) | st.integers(1, 4))
        t[2] = draw(st.just(t[2]) | st.sampled_from(ACTIONS))
        t[3] = draw(st.just(t[3]) | st.integers(0, 15))
        if draw(st.booleans()):
            p["steps"].insert(draw(st.integers(0, len(p["steps"]))), draw(step))
        if draw(st.booleans()):
            p["triggers"].append(draw(trigger))
        return p

    if os.environ.get("HOSTILE_NO_NEIGHBOURS"):  # only new programs
        return fresh
    return fresh | fresh | fresh | neighbour()


FREQUENT = {"enter_timeout", "reschedule", "repr", "loop.call_at", "tt.call_at", "call_later",
            "cancel"}

#: Programs that crashed the native backend, run first (hypothesis's
#: explicit examples) unless HOSTILE_NO_EXAMPLES is set (a long run that
#: looks for new ones).  tests/core/test_hostile.py has each as a plain script.
KNOWN = [
    # Handle_repr: %R of `when` cancels the handle, frees the callback
    {"loop": "dropin", "debug": False, "steps": [["loop.call_at", ["h", "float", 1000.0], ["n", 0], 1], ["repr", ["n", 0], ["n", 0], 0]], "triggers": [["__repr__", 1, "cancel", 0, 1]]},
    # timeout_arm/deadline_reached: loop.time() reschedules, frees `when`
    {"loop": "hostile_clock", "debug": False, "steps": [["enter_timeout", ["h", "int", 1000.0], ["n", 0], 1]], "triggers": [["loop.time", 2, "reschedule", 3, 0]]},
    # timeout_postpone: the loop's __getattribute__ disarms, frees the handle
    {"loop": "hostile", "debug": False, "steps": [["enter_timeout", ["n", 1000.0], ["n", 0], 1], ["reschedule", ["n", 2000.0], ["n", 0], 1]], "triggers": [["loop.get.time", 2, "reschedule", 0, 1]]},
    # expire_at/ext_to_seconds: __float__ frees `when`, OverflowError
    {"loop": "stock", "debug": False, "steps": [["enter_timeout", ["h", "obj", 1000.0], ["n", 0], 1]], "triggers": [["__float__", 1, "reschedule", 0, 0], ["__float__", 1, "raise", 1, 0]]},
    # expire_at: loop.is_closed() replaces (frees) the default TimerThread
    {"loop": "hostile", "debug": False, "steps": [["enter_timeout", ["n", 1000.0], ["n", 0], 1]], "triggers": [["loop.is_closed", 1, "replace_default", 0, 0]]},
    # deliver_to: loop.__hash__ replaces (frees) the default TimerThread
    {"loop": "hostile", "debug": False, "steps": [["call_later", ["n", 1000.0], ["n", 0], 1], ["enter_timeout", ["n", -1.0], ["n", 0], 1]], "triggers": [["loop.__hash__", 3, "replace_default", 0, 1]]},
]


def describe(program: dict[str, Any]) -> str:
    """The program, with each generic step's (kind, name) spelt out."""
    lines = [f"loop={program['loop']} debug={program.get('debug')}"]
    for s in program["steps"]:
        extra = f"  -> {SURFACE[s[3] % len(SURFACE)]}" if s[0] in ("call", "set") else ""
        lines.append(f"  step {json.dumps(s)}{extra}")
    for t in program.get("triggers", []):
        lines.append(f"  trigger {json.dumps(t)}")
    return "\n".join(lines)


def run_many(examples: int, seed: int | None, last: str | None) -> int:
    """Runs ``examples`` programs under hypothesis; the count run."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import seed as hseed

    ran = [0]

    @settings(max_examples=examples, deadline=None, database=None, print_blob=True,
              suppress_health_check=list(HealthCheck))
    @given(programs())
    def check(program: dict[str, Any]) -> None:
        ran[0] += 1
        if last:
            with open(last, "w") as f:
                json.dump(program, f)
            with open(last + ".count", "w") as f:
                f.write(str(ran[0]))
        run_program(program)

    if seed is not None:
        check = hseed(seed)(check)
    if not os.environ.get("HOSTILE_NO_EXAMPLES"):
        from hypothesis import example

        for program in reversed(KNOWN):
            check = example(program)(check)
    try:
        check()
    finally:
        print(f"hostile: {ran[0]} programs run", flush=True)
    return ran[0]


# -- the child and its parent -------------------------------------------------------------------


def child_env() -> dict[str, str]:
    """The environment of a child: PYTHONMALLOC=debug (freed memory is
    overwritten, so a read of it fails reliably); under a sanitizer its
    malloc-based twin, so ASan sees each free."""
    env = dict(os.environ)
    sanitized = any(lib in os.environ.get("LD_PRELOAD", "") for lib in ("libasan", "libtsan"))
    env["PYTHONMALLOC"] = "malloc_debug" if sanitized else "debug"
    env["PYTHONFAULTHANDLER"] = "1"
    here = os.path.dirname(os.path.abspath(__file__))
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)
    return env


def child(args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-X", "dev", os.path.abspath(__file__), *args],
                          capture_output=True, text=True, timeout=timeout, env=child_env())


def crashed(p: subprocess.CompletedProcess[str]) -> bool:
    """Killed by a signal, or a fatal error or a sanitizer's report (ASan
    aborts; UBSan, halting, exits 1)."""
    return p.returncode != 0 and (p.returncode < 0 or "Fatal Python error" in p.stderr
                                  or "Sanitizer" in p.stderr or " runtime error: " in p.stderr)


def minimise(program: dict[str, Any], still_fails: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    """A smaller program that still fails: steps and triggers dropped one
    at a time, values made plain, while ``still_fails`` says so."""
    best = json.loads(json.dumps(program))

    def candidates(p: dict[str, Any]) -> Iterator[dict[str, Any]]:
        for field in ("steps", "triggers"):
            for k in range(len(p[field])):
                q = json.loads(json.dumps(p))
                del q[field][k]
                if q["steps"]:
                    yield q
        for k, s in enumerate(p["steps"]):
            for j in (1, 2):
                if s[j] != ["n", 0]:
                    q = json.loads(json.dumps(p))
                    q["steps"][k][j] = ["n", 0]
                    yield q
        if p.get("debug"):
            yield {**p, "debug": False}
        for simpler in ("stock", "dropin", "hostile"):
            if p["loop"] != simpler:
                yield {**p, "loop": simpler}

    improved = True
    while improved:
        improved = False
        for q in candidates(best):
            if still_fails(q):
                best, improved = q, True
                break
    return best


def _replay_crashes(program: dict[str, Any]) -> bool:
    for _ in range(2):  # a crash that depends on timing: twice
        with open(_TMP, "w") as f:
            json.dump(program, f)
        try:
            if crashed(child(["replay", _TMP], 60)):
                return True
        except subprocess.TimeoutExpired:
            return False
    return False


_TMP = f"/tmp/hostile-minimise-{os.getpid()}.json"


def campaign(minutes: float, examples: int, out: str) -> None:
    """Children one after another, each running ``examples`` programs with
    a new seed, for ``minutes``: each crash's program and each failure's
    report go to ``out``; the totals are printed."""
    os.makedirs(out, exist_ok=True)
    end = time.monotonic() + 60 * minutes
    ran = crashes = failures = children = 0
    while time.monotonic() < end:
        seed = int.from_bytes(os.urandom(4), "little")
        last = os.path.join(out, "last.json")
        try:
            p = child(["run", "--examples", str(examples), "--seed", str(seed), "--last", last],
                      timeout=60 + 5 * examples)
            stdout, stderr, rc = p.stdout, p.stderr, p.returncode
        except subprocess.TimeoutExpired as e:
            stdout, stderr, rc = str(e.stdout or ""), str(e.stderr or ""), "hang"
        children += 1
        with open(last + ".count") as f:
            ran += int(f.read())
        tag = f"{seed}"
        if rc == "hang" or crashed(subprocess.CompletedProcess([], rc, stdout, stderr)):
            crashes += 1
            os.replace(last, os.path.join(out, f"crash-{tag}.json"))
            with open(os.path.join(out, f"crash-{tag}.txt"), "w") as f:
                f.write(f"rc {rc}\n{stderr[-20000:]}")
        elif rc != 0:
            failures += 1
            with open(os.path.join(out, f"failure-{tag}.txt"), "w") as f:
                f.write(f"rc {rc}\n{stdout[-20000:]}\n{stderr[-20000:]}")
        print(f"campaign: children {children} programs {ran} crashes {crashes} "
              f"failures {failures}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("campaign")
    c.add_argument("--minutes", type=float, default=10)
    c.add_argument("--examples", type=int, default=300)
    c.add_argument("--out", default="hostile-campaign")
    r = sub.add_parser("run")
    r.add_argument("--examples", type=int, default=100)
    r.add_argument("--seed", type=int)
    r.add_argument("--last")
    p = sub.add_parser("replay")
    p.add_argument("program")
    m = sub.add_parser("minimise")
    m.add_argument("program")
    a = ap.parse_args()
    if a.cmd == "campaign":
        campaign(a.minutes, a.examples, a.out)
    elif a.cmd == "run":
        run_many(a.examples, a.seed, a.last)
    elif a.cmd == "replay":
        with open(a.program) as f:
            program = json.load(f)
        SURFACE.extend(surface())
        print(describe(program), flush=True)
        run_program(program)
        print("replay: no failure", flush=True)
    else:
        with open(a.program) as f:
            program = json.load(f)
        SURFACE.extend(surface())
        if not _replay_crashes(program):
            sys.exit("minimise: the program does not crash")
        small = minimise(program, _replay_crashes)
        print(json.dumps(small))
        print(describe(small))


if __name__ == "__main__":
    main()
