"""One contract on both backends, checked differentially.

Every public entry point is given the same inputs (NaN, +-inf, bools, huge
ints, Decimal, Fraction, strings, None, negatives, non-callables, wrong
contexts and loops, closed objects) on each implementation that runs here,
and must end the same way: the same exception type with the same message,
or the same outcome (fired at once, not yet, a result).  The
implementations:

* the TimerThread API: the native one against the pure one (both run in
  one process on the native backend; the pure suite has the pure one only);
* the helpers (timeout, timeout_at, reschedule, wait_for): bucketimer's
  against asyncio's own, which is what they mirror (and what the pure
  backend serves);
* the drop-in loop's call_at/call_later: bucketimer's loop against the stock
  loop.

Where bucketimer departs from asyncio on purpose, the case is listed in
DELIBERATE with the table in docs/asyncio.rst ("One contract"); every other
case must agree exactly.  Each call is made with a sentinel timer pending,
which must still fire afterwards: a refused call changes nothing already
scheduled.
"""

from __future__ import annotations

import asyncio
import contextvars
import decimal
import fractions
import inspect
import math
import re
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

import bucketimer
from bucketimer import loop as bt_loop
from bucketimer._pure import _timer_thread as pure_tt

pytestmark = pytest.mark.timeout(120)

NATIVE = bucketimer.backend == "native"

BAD: dict[str, Any] = {
    "nan": math.nan,
    "inf": math.inf,
    "-inf": -math.inf,
    "True": True,
    "False": False,
    "huge": 10**400,
    "-huge": -(10**400),
    "Decimal": decimal.Decimal("0.01"),
    "Decimal-nan": decimal.Decimal("NaN"),
    "Fraction": fractions.Fraction(1, 100),
    "str": "1",
    "None": None,
    "negative": -1,
    "complex": 1j,
    "object": object(),
}

# (entry point, input): how bucketimer differs from asyncio there, on
# purpose.  The docs' table (docs/asyncio.rst, "One contract") lists them.
# "refused": asyncio takes it and fails later, inside the loop; bucketimer
# raises at once, naming the argument.  "message": the same exception type,
# with a message naming the argument instead of asyncio's operator error.
DELIBERATE = {
    ("loop.call_at", "str"): "refused",
    ("loop.call_at", "complex"): "refused",
    ("loop.call_at", "object"): "refused",
    ("loop.call_at", "Decimal-nan"): "refused",
    ("loop.call_later", "str"): "message",
    ("loop.call_later", "complex"): "refused",
    ("loop.call_later", "object"): "message",
    ("loop.call_later", "Decimal"): "message",
    ("loop.call_later", "Decimal-nan"): "message",
}


def outcome(fn: Callable[[], Any]) -> tuple[str, ...]:
    try:
        r = fn()
    except Exception as exc:
        return ("raise", type(exc).__name__, str(exc))
    return ("ok", repr(r))


# -- the TimerThread API -----------------------------------------------------------


def timer_thread_classes() -> dict[str, Any]:
    classes: dict[str, Any] = {"pure": pure_tt.TimerThread}
    if NATIVE:
        classes["native"] = bucketimer.TimerThread
    return classes


class Fired:
    """A callback that records it ran, from any thread."""

    def __init__(self) -> None:
        self.event = threading.Event()

    def __call__(self, *args: Any) -> None:
        self.event.set()


def tt_call(tt: Any, entry: str, x: Any) -> tuple[str, ...]:
    """What ``entry`` does with ``x``: raised, or fired at once / not."""
    cb = Fired()
    calls = {
        "tt.call_later": lambda: tt.call_later(x, cb),
        "tt.call_at": lambda: tt.call_at(x, cb),
        "callback": lambda: tt.call_later(0, x),
        "context": lambda: tt.call_later(0, cb, context=x),
        "loop": lambda: tt.call_later(0, cb, loop=x),
    }
    try:
        h = calls[entry]()
    except Exception as exc:
        return ("raise", type(exc).__name__, str(exc))
    fired = cb.event.wait(0.5)
    won = h.cancel()
    return ("ok", f"fired={fired}", f"cancel={won}")


TT_ENTRIES = ["tt.call_later", "tt.call_at", "callback", "context", "loop"]


@pytest.mark.parametrize("entry", TT_ENTRIES)
@pytest.mark.parametrize("name", sorted(BAD))
def test_timer_thread_entry_points_agree(entry, name):
    x = BAD[name]
    if entry == "callback" and callable(x):
        pytest.skip("a callable callback is not bad input")
    seen = {}
    for impl, cls in timer_thread_classes().items():
        with cls() as tt:
            sentinel = Fired()
            tt.call_later(0.001, sentinel)
            far = tt.call_later(3600, sentinel)
            seen[impl] = tt_call(tt, entry, x)
            assert sentinel.event.wait(5), f"{impl}: the sentinel timer was lost"
            assert far.cancel() is True, f"{impl}: the far sentinel was lost"
    assert len(set(seen.values())) == 1, seen


@pytest.mark.parametrize("option", ["buckets", "drain_threshold"])
@pytest.mark.parametrize("name", sorted(BAD) + ["zero", "big"])
def test_timer_thread_options_agree(option, name):
    x = {"zero": 0, "big": 2**40}.get(name, BAD.get(name))
    seen = {}
    for impl, cls in timer_thread_classes().items():

        def make(cls: Any = cls) -> str:
            cls(**{option: x}).close()
            return "made"

        seen[impl] = outcome(make)
    assert len(set(seen.values())) == 1, seen
    if name not in ("None",):
        assert seen["pure"][0] == "raise" or isinstance(x, int), seen
    if seen["pure"][0] == "raise" and seen["pure"][1] != "OverflowError":
        assert option in seen["pure"][2], seen  # the message names the argument


@pytest.mark.parametrize("entry", ["tt.call_later", "tt.call_at"])
@pytest.mark.parametrize("name", sorted(BAD))
def test_a_closed_timer_thread_refuses_before_looking_at_arguments(entry, name):
    seen = {}
    for impl, cls in timer_thread_classes().items():
        tt = cls()
        h = tt.call_later(3600, print)
        tt.close()
        seen[impl] = (tt_call(tt, entry, BAD[name]), h.cancel(), h.cancelled())
    assert len(set(seen.values())) == 1, seen
    assert seen["pure"] == (("raise", "RuntimeError", "TimerThread is closed"), False, False)


def test_timer_thread_messages_name_the_argument():
    for cls in timer_thread_classes().values():
        with cls() as tt:
            for entry, word in [("tt.call_later", "delay"), ("tt.call_at", "when"),
                                ("callback", "callback"), ("context", "context"), ("loop", "loop")]:
                result = tt_call(tt, entry, "1")
                assert result[0] == "raise" and result[2].startswith(word), (cls, entry, result)


# -- the helpers, against asyncio's ---------------------------------------------------


def helpers() -> dict[str, Any]:
    import bucketimer.aio as ours  # on the pure backend, asyncio's own objects

    return {"asyncio": asyncio, "bucketimer": ours}


async def helper_call(mod: Any, entry: str, x: Any) -> tuple[str, ...]:
    async def body() -> str:
        await asyncio.sleep(0.2)
        return "done"

    async def run() -> Any:
        if entry == "timeout":
            async with mod.timeout(x):
                return await body()
        if entry == "timeout_at":
            async with mod.timeout_at(x):
                return await body()
        if entry == "reschedule":
            async with mod.timeout(None) as cm:
                cm.reschedule(x)
                return await body()
        coro = body()
        try:
            return await mod.wait_for(coro, x)
        finally:
            coro.close()  # refused before it was awaited: no warning

    loop = asyncio.get_running_loop()
    sentinel = loop.create_future()
    loop.call_later(0.001, sentinel.set_result, "sentinel")
    try:
        r = await run()
    except Exception as exc:
        r = ("raise", type(exc).__name__, str(exc))
    else:
        r = ("ok", r)
    assert await asyncio.wait_for(sentinel, 5) == "sentinel"
    return r


HELPER_ENTRIES = ["timeout", "timeout_at", "reschedule", "wait_for"]


@pytest.mark.parametrize("entry", HELPER_ENTRIES)
@pytest.mark.parametrize("name", sorted(BAD))
def test_helpers_agree_with_asyncio(entry, name):
    x = BAD[name]
    seen = {}
    for impl, mod in helpers().items():
        seen[impl] = asyncio.run(helper_call(mod, entry, x))
    assert seen["bucketimer"] == seen["asyncio"], seen


# -- the drop-in loop's call_at / call_later, against the stock loop -------------------------


def loop_call(factory: Callable[[], asyncio.AbstractEventLoop], entry: str, x: Any) -> tuple[str, ...]:
    lp = factory()
    try:
        sentinel = lp.create_future()
        lp.call_later(0.001, sentinel.set_result, "sentinel")
        fired = []
        fn = lp.call_at if entry == "loop.call_at" else lp.call_later
        try:
            h = fn(x, fired.append, "x")
        except Exception as exc:
            r: tuple[str, ...] = ("raise", type(exc).__name__, str(exc))
        else:
            lp.run_until_complete(asyncio.sleep(0.05))
            when = h.when()
            r = ("ok", f"fired={bool(fired)}", f"when={when!r}" if not isinstance(when, float)
                 or not math.isfinite(when) else "when=finite")
            h.cancel()
        assert lp.run_until_complete(asyncio.wait_for(sentinel, 5)) == "sentinel"
        return r
    finally:
        lp.close()


@pytest.mark.parametrize("entry", ["loop.call_later", "loop.call_at"])
@pytest.mark.parametrize("name", sorted(BAD))
def test_drop_in_loop_agrees_with_the_stock_loop(entry, name):
    x = BAD[name]
    ours = loop_call(bt_loop.EventLoop, entry, x)
    kind = DELIBERATE.get((entry, name))
    if kind == "refused":
        assert ours[0] == "raise" and ours[1] in ("TypeError", "ValueError"), ours
        assert ours[2].startswith(entry.replace("loop.call_at", "when must").replace(
            "loop.call_later", "delay must")), ours
        return
    stock = loop_call(asyncio.SelectorEventLoop, entry, x)
    if kind == "message":
        assert ours[:2] == stock[:2] and ours[2].startswith("delay must"), (ours, stock)
        return
    assert ours == stock


# -- signatures ----------------------------------------------------------------------------


def public_callables() -> dict[str, Any]:
    """Every public callable of the API, by name, on the running backend."""
    out: dict[str, Any] = {}
    for name in bucketimer.__all__:
        obj = getattr(bucketimer, name)
        if callable(obj):
            out[name] = obj
        if inspect.isclass(obj):
            for attr in dir(obj):
                if attr.startswith("_") and attr not in ("__init__", "__aenter__", "__aexit__"):
                    continue
                member = inspect.getattr_static(obj, attr)
                if callable(member) or isinstance(member, (staticmethod, classmethod)):
                    out[f"{name}.{attr}"] = getattr(obj, attr)
    return out


def signature(obj: Any) -> str:
    """The parameters' names, kinds and defaults (C callables have no
    annotations to compare)."""
    sig = inspect.signature(obj)
    params = [p.replace(annotation=p.empty) for p in sig.parameters.values()]
    if params and params[0].name == "self":  # passed by position, whatever it says
        params[0] = params[0].replace(kind=inspect.Parameter.POSITIONAL_ONLY)
    return str(sig.replace(parameters=params, return_annotation=sig.empty))


def test_every_public_callable_has_a_signature():
    missing = []
    for name, obj in public_callables().items():
        if name in ("Stats",) or name.startswith(("Stats.", "EventLoop.", "EventLoopPolicy")):
            continue  # a TypedDict, and asyncio's own loop methods
        try:
            inspect.signature(obj)
        except (ValueError, TypeError) as exc:
            missing.append(f"{name}: {exc}")
    assert missing == []


@pytest.mark.native
def test_signatures_agree_across_backends():
    """Each public callable's signature is the same on the native backend
    and the pure one (whose helpers are asyncio's)."""
    from bucketimer._pure import _default, _handle

    pairs = {  # a Handle is made by call_later, never by its class
        "TimerThread": (bucketimer.TimerThread, pure_tt.TimerThread,
                        ("__init__", "call_later", "call_at", "close", "stats", "time")),
        "Handle": (bucketimer.Handle, _handle.Handle,
                   ("cancel", "cancelled", "when", "get_context")),
    }
    diffs = []
    for cls_name, (native, pure, attrs) in pairs.items():
        for attr in attrs:
            if True:
                a, b = signature(getattr(native, attr)), signature(getattr(pure, attr))
                if a != b:
                    diffs.append((f"{cls_name}.{attr}", a, b))
    for name, native, pure in [
        ("call_later", bucketimer.call_later, _default.call_later),
        ("call_at", bucketimer.call_at, _default.call_at),
        ("default_timer_thread", bucketimer.default_timer_thread, _default.default_timer_thread),
        ("timeout", bucketimer.timeout, asyncio.timeout),
        ("timeout_at", bucketimer.timeout_at, asyncio.timeout_at),
        ("wait_for", bucketimer.wait_for, asyncio.wait_for),
        ("monotonic_ns", bucketimer.monotonic_ns, lambda: time.monotonic_ns()),
        ("Timeout", bucketimer.Timeout, asyncio.Timeout),
        ("Timeout.reschedule", bucketimer.Timeout.reschedule, asyncio.Timeout.reschedule),
        ("Timeout.when", bucketimer.Timeout.when, asyncio.Timeout.when),
        ("Timeout.expired", bucketimer.Timeout.expired, asyncio.Timeout.expired),
    ]:
        a, b = signature(native), signature(pure)
        if a != b:
            diffs.append((name, a, b))
    assert diffs == []


def test_context_is_checked_as_a_context_not_by_duck_typing():
    ctx = contextvars.copy_context()
    for cls in timer_thread_classes().values():
        with cls() as tt:
            h = tt.call_later(3600, print, context=ctx)
            assert h.get_context() is ctx
            assert h.cancel() is True


@pytest.mark.parametrize("when", [-math.inf, -1e300, 0.0])
@pytest.mark.parametrize("factory", [asyncio.new_event_loop, bt_loop.new_event_loop],
                         ids=["stock loop", "drop-in loop"])
def test_a_deadline_long_past_runs_inside_a_running_loop(factory, when):
    """A TimerThread's timer due at -inf (or far in the past), scheduled
    inside its running loop, runs in the next iteration, as asyncio's does."""
    ran: list[str] = []

    async def main() -> None:
        bucketimer.call_at(when, ran.append, "tt")
        asyncio.get_running_loop().call_at(when, ran.append, "loop")
        for _ in range(100):
            if len(ran) == 2:
                return
            await asyncio.sleep(0.001)

    loop = factory()
    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
    assert sorted(ran) == ["loop", "tt"]


class _Named:
    """A callback with a repr of its own, as a log line shows it."""

    def __init__(self) -> None:
        self.event = threading.Event()

    def __call__(self) -> None:
        self.seen = repr(self.handle)
        self.event.set()

    def __repr__(self) -> str:
        return "<the callback>"


def _life_of_reprs(tt: Any, in_loop: bool) -> list[str]:
    """A handle's repr at each step of its life, its id and deadline masked."""

    def masked(h: Any) -> str:
        return re.sub(r"id=\d+", "id=N", repr(h).replace(repr(h.when()), "W"))

    seen = []
    cb = _Named()

    async def in_a_loop() -> None:
        cb.handle = tt.call_later(0.01, cb)
        seen.append(masked(cb.handle))
        while not cb.event.is_set():
            await asyncio.sleep(0.005)

    if in_loop:
        asyncio.run(in_a_loop())
    else:
        cb.handle = tt.call_later(0.01, cb)
        seen.append(masked(cb.handle))
        assert cb.event.wait(10)
    seen.append(re.sub(r"id=\d+", "id=N", cb.seen.replace(repr(cb.handle.when()), "W")))
    time.sleep(0.02)  # (the dispatcher's run ends after the callback returns)
    seen.append(masked(cb.handle))
    h = tt.call_later(3600, cb)
    h.cancel()
    seen.append(masked(h))
    return seen


@pytest.mark.parametrize("in_loop", [False, True], ids=["dispatcher", "in a loop"])
def test_a_handles_repr_says_its_state_in_the_same_words_on_both_backends(in_loop):
    """What a log line shows of a handle (asyncio's exception handler prints
    its repr): a pending one's deadline and callback, then "ran" (from the
    call of its callback on), "cancelled" or "dropped" and its id; on every
    implementation alike."""
    for name, cls in timer_thread_classes().items():
        with cls() as tt:
            assert _life_of_reprs(tt, in_loop) == [
                "<bucketimer.Handle pending when=W <the callback>>",
                "<bucketimer.Handle ran id=N>",
                "<bucketimer.Handle ran id=N>",
                "<bucketimer.Handle cancelled id=N>",
            ], name
    for name, cls in timer_thread_classes().items():
        tt = cls()
        h = tt.call_later(3600, print)
        tt.close()
        assert re.sub(r"id=\d+", "id=N", repr(h)) == "<bucketimer.Handle dropped id=N>", name
