"""No Python code can crash the process: every type ``bucketimer._core``
defines, every member and getset it exposes (public and private), tried with
what Python allows -- delete it, set it to None, to objects of the wrong
type, to an object whose ``__del__``, ``__eq__`` and ``__call__`` call back
into bucketimer -- before the object is used and from inside its use (a
timer's callback, a handler, an awaited coroutine), and the object then
driven through its normal use.  Whatever happens must be a Python exception
(never a SystemError: C that returned NULL without one, or the like), and
the TimerThread must still fire timers afterwards.  ext/module.h states the
rule this checks; ``nox -s sanitize`` runs it under ASan+UBSan.

The types are found from the module and from the objects it hands out;
``test_every_type_is_swept`` fails when a type appears that no case drives.
Native only: the pure backend has none of these types.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import gc
import inspect
import selectors
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

import bucketimer
from bucketimer import _backend

pytestmark = [pytest.mark.native, pytest.mark.timeout(600)]

if _backend.NATIVE:
    from bucketimer import _core
    from bucketimer import aio as bt_aio

PY312 = sys.version_info >= (3, 12)

Hit = Callable[[Any], None]


def _noop(*args: Any) -> None:
    pass


class Evil:
    """A value whose ``__del__``, ``__eq__`` and ``__call__`` call back into
    bucketimer: schedule and cancel a timer, read the counters, drain the
    dispatcher's port (a second drain is refused while one runs)."""

    def __init__(self, tt: Any) -> None:
        self.tt = tt

    def _poke(self) -> None:
        tt = self.tt
        if tt.closed:
            return
        tt.call_later(0.001, _noop).cancel()
        tt.stats()
        port = tt._dispatcher
        if port is not None:
            port.drain()

    def __call__(self, *args: Any) -> None:
        self._poke()

    def __eq__(self, other: object) -> bool:
        self._poke()
        return False

    __hash__ = object.__hash__

    def __del__(self) -> None:
        try:
            self._poke()
        except Exception:
            pass


def _values(tt: Any) -> dict[str, Callable[[], Any]]:
    return {
        "None": lambda: None,
        "object()": object,
        "int": lambda: 7,
        "Evil": lambda: Evil(tt),
    }


class Sweep:
    """The outcomes of one type's sweep: what Python code got, per attempt."""

    def __init__(self) -> None:
        self.errors: list[BaseException] = []
        self.tried: set[str] = set()

    def expect_python_error(self, exc: BaseException) -> None:
        if isinstance(exc, SystemError) or not isinstance(exc, Exception):
            raise AssertionError(f"not a plain Python exception: {exc!r}") from exc
        self.errors.append(exc)

    def attempt(self, fn: Callable[[], Any]) -> None:
        try:
            fn()
        except Exception as e:
            self.expect_python_error(e)


def _attacks(tt: Any, name: str, sweep: Sweep) -> Iterator[tuple[str, Hit]]:
    """Each change Python may try on attribute ``name``."""

    def delete(obj: Any) -> None:
        sweep.attempt(lambda: delattr(obj, name))

    yield "delete", delete
    for label, make in _values(tt).items():

        def assign(obj: Any, make: Callable[[], Any] = make) -> None:
            sweep.attempt(lambda: setattr(obj, name, make()))

        yield label, assign


def _attributes(tp: type) -> list[str]:
    """The members and getsets ``tp`` itself defines."""
    return sorted(name for name, v in vars(tp).items()
                  if inspect.ismemberdescriptor(v) or inspect.isgetsetdescriptor(v))


@contextlib.contextmanager
def _unraisables(sweep: Sweep) -> Iterator[None]:
    """Exceptions C reports through sys.unraisablehook are Python ones too."""
    old = sys.unraisablehook

    def hook(u: Any) -> None:
        if u.exc_value is not None:
            sweep.expect_python_error(u.exc_value)

    sys.unraisablehook = hook
    try:
        yield
    finally:
        sys.unraisablehook = old


def _still_fires(tt: Any) -> None:
    fired = threading.Event()
    tt.call_later(0, fired.set)
    assert fired.wait(10), "the TimerThread no longer fires"


def _wait(pred: Callable[[], Any], timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.001)


def _in_a_loop(main: Callable[[], Any]) -> Any:
    return asyncio.run(asyncio.wait_for(main(), 30))


# -- how each type is used ---------------------------------------------------------------------
#
# use(tt, before, inside): makes the object(s) of its type, calls
# before(obj) on each as soon as it exists and inside(obj) from within its
# use, then carries on as a program would.


def use_timer_thread(tt: Any, before: Hit, inside: Hit) -> None:
    t = bucketimer.TimerThread()
    try:
        before(t)
        ran = threading.Event()

        def cb() -> None:
            inside(t)
            ran.set()

        t.call_later(0, cb)
        assert ran.wait(10)
        t.call_at(t.time() + 30, _noop).cancel()
        t.stats(), t._ports, t._dispatcher, t.closed

        async def main() -> None:
            done = asyncio.Event()
            t.call_later(0, lambda: (inside(t), done.set()))
            await done.wait()

        _in_a_loop(main)
    finally:
        t.close()
    before(t)
    with contextlib.suppress(RuntimeError):
        t.call_later(0, _noop)


def use_handle(tt: Any, before: Hit, inside: Hit) -> None:
    ran = threading.Event()
    handles: list[Any] = []

    def cb(*args: Any) -> None:
        inside(handles[0])
        ran.set()

    h = tt.call_later(0.001, cb, 1, 2)
    handles.append(h)
    before(h)
    assert ran.wait(10)
    h.cancel(), h.cancelled(), h.when(), h.get_context(), repr(h)
    far = tt.call_later(30, cb)
    before(far)
    assert far.cancel() is True
    repr(far)

    async def main() -> None:
        done = asyncio.Event()
        loop_handles: list[Any] = []

        def in_loop() -> None:
            inside(loop_handles[0])
            done.set()

        loop_handles.append(tt.call_later(0, in_loop))
        before(loop_handles[0])
        await done.wait()

    _in_a_loop(main)


def use_loop_handle(tt: Any, before: Hit, inside: Hit) -> None:
    loop = bucketimer.EventLoop(timer_thread=tt)

    async def main() -> None:
        done = asyncio.Event()
        handles: list[Any] = []

        def cb(*args: Any) -> None:
            inside(handles[0])
            done.set()

        handles.append(loop.call_later(0.001, cb, 1, 2))
        before(handles[0])
        await done.wait()
        h = handles[0]
        h.cancel(), h.cancelled(), h.when(), h.get_context(), repr(h)
        far = loop.call_at(loop.time() + 30, cb)
        before(far)
        far.cancel(), far.cancelled(), repr(far)

    try:
        loop.run_until_complete(asyncio.wait_for(main(), 30))
    finally:
        loop.close()


def use_port(tt: Any, before: Hit, inside: Hit) -> None:
    reports: list[Any] = []

    def reporter() -> Callable[[Any, BaseException], None]:
        mine = object()  # a fresh closure each time: the port holds its only reference
        return lambda handle, exc: reports.append((mine, exc))

    async def main() -> None:
        loop = asyncio.get_running_loop()
        far = tt.call_later(30, _noop)
        port = tt._ports[loop]
        port.on_error = reporter()
        before(port)
        for _ in range(2):
            done = asyncio.Event()

            def fail(done: asyncio.Event = done) -> None:
                inside(port)
                port.on_error = reporter()  # rebinding from inside, then raising
                loop.call_soon(done.set)
                raise ValueError("raised by a callback")

            tt.call_later(0, fail)
            await done.wait()
        ok = asyncio.Event()
        tt.call_later(0, ok.set)
        await ok.wait()
        port.fileno(), port.loop, repr(port)
        far.cancel()

    _in_a_loop(main)
    # the dispatcher's port, drained by the dispatcher thread
    port = tt._port(None)
    before(port)
    ran = threading.Event()

    def fail_on_dispatcher() -> None:
        inside(port)
        ran.set()
        raise ValueError("raised on the dispatcher")

    tt.call_later(0, fail_on_dispatcher)
    assert ran.wait(10)


def use_scheduler(tt: Any, before: Hit, inside: Hit) -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        for absolute in (False, True):
            s = tt._scheduler(loop, absolute)
            before(s)
            done = asyncio.Event()
            s(loop.time() if absolute else 0, lambda s=s, done=done: (inside(s), done.set()))
            await done.wait()
            s(loop.time() + 30 if absolute else 30, _noop).cancel()

    _in_a_loop(main)


def use_poll_stamp(tt: Any, before: Hit, inside: Hit) -> None:
    """A drop-in loop's selector: its timers are drained up to each poll."""
    stamps: list[Any] = []

    class Inner(selectors.DefaultSelector):  # type: ignore[misc,valid-type]
        def select(self, timeout: float | None = None) -> Any:
            if stamps:
                inside(stamps[0])
            return super().select(timeout)

    bare = _core.PollStamp(selectors.DefaultSelector())
    before(bare)
    bare.select(0), bare.polled_ns, bare.selector
    bare.selector.close()
    loop = bucketimer.EventLoop(Inner(), timer_thread=tt)
    stamps.append(loop._bt_polled)
    before(loop._bt_polled)

    async def main() -> None:
        fired = asyncio.Event()
        loop.call_later(0.001, fired.set)
        await fired.wait()
        with contextlib.suppress(TimeoutError):
            async with bt_aio.timeout(0.001):
                await asyncio.sleep(1)

    try:
        loop.run_until_complete(main())
    finally:
        loop.close()


def use_timeout(tt: Any, before: Hit, inside: Hit) -> None:
    async def main() -> None:
        tm = bt_aio.timeout(5)
        before(tm)
        async with tm:
            inside(tm)
            await asyncio.sleep(0)
        tm.when(), tm.expired(), repr(tm)
        tm = bt_aio.timeout(0.001)
        before(tm)
        with contextlib.suppress(TimeoutError):
            async with tm:
                inside(tm)
                await asyncio.sleep(5)
        tm = bt_aio.timeout_at(None)
        async with tm:
            tm.reschedule(asyncio.get_running_loop().time() + 5)
            inside(tm)

    _in_a_loop(main)


def use_step(tt: Any, before: Hit, inside: Hit) -> None:
    async def main() -> None:
        tm = bt_aio.timeout(5)
        enter = tm.__aenter__()
        before(enter)
        assert await enter is tm
        inside(enter)
        leave = tm.__aexit__(None, None, None)
        before(leave)
        await leave
        # driven by hand: send, throw and close
        tm = bt_aio.timeout(5)
        step = tm.__aenter__()
        before(step)
        with contextlib.suppress(StopIteration):
            step.send(None)
        inside(step)
        step.close()
        tm = bt_aio.timeout(5)
        step = tm.__aenter__()
        with contextlib.suppress(KeyError):
            step.throw(KeyError("k"))

    _in_a_loop(main)


def use_wait_for(tt: Any, before: Hit, inside: Hit) -> None:
    async def main() -> None:
        mine: list[Any] = []

        async def work() -> int:
            inside(mine[0])
            await asyncio.sleep(0)
            inside(mine[0])
            return 1

        c = bt_aio.wait_for(work(), 5)
        mine.append(c)
        before(c)
        assert await c == 1
        # expired, then dropped while suspended
        mine.clear()
        c = bt_aio.wait_for(asyncio.sleep(5), 0.001)
        before(c)
        with contextlib.suppress(TimeoutError):
            await c
        fut = asyncio.get_running_loop().create_future()
        c = bt_aio.wait_for(fut, 5)
        c.send(None)
        before(c)
        c.close()
        inner = work()
        c = bt_aio.wait_for(inner, 5)
        before(c)
        c.close()
        inner.close()

    _in_a_loop(main)


# -- the gRPC wrappers -----------------------------------------------------------------------------


class SyncContext:
    """The parts of a sync servicer context the interceptors use."""

    def __init__(self, left: float | None) -> None:
        self.left = left

    def time_remaining(self) -> float | None:
        return self.left

    def code(self) -> Any:
        return None

    def is_active(self) -> bool:
        return True

    def cancel(self) -> None:
        pass

    def abort(self, code: Any, details: str) -> None:
        raise RuntimeError(f"aborted: {code}")

    def peer(self) -> str:
        return "ipv4:127.0.0.1:1"

    def set_code(self, code: Any) -> None:
        pass

    def set_details(self, details: str) -> None:
        pass

    def details(self) -> Any:
        return None


class AioContext(SyncContext):
    async def abort(self, code: Any, details: str) -> None:  # type: ignore[override]
        raise RuntimeError(f"aborted: {code}")

    def done(self) -> bool:
        return False


def _grpc_call_type(tt: Any, aio: bool, inside: Hit) -> Any:
    """A GrpcCall class for one method, whose first timer's callback calls
    ``inside`` on the call (on the dispatcher thread, or in the loop)."""
    pytest.importorskip("grpc.aio")  # (tests/grpc/ is a namespace package "grpc")
    if aio:
        import bucketimer.grpc.aio as g
    else:
        import bucketimer.grpc as g  # type: ignore[no-redef]
    async def aio_echo(req: Any, ctx: Any) -> Any:
        return req

    ic = g.ServerDeadlineSlowCallInterceptor(5.0, 5.0, timer_thread=tt)
    echo = aio_echo if aio else (lambda req, ctx: req)
    base = ic._wrap(echo, "/sweep.Svc/M", False, False).call_type
    fire = base._fire

    def _fire(call: Any) -> None:
        inside(call)
        fire(call)

    return type(base.__name__, (base,), {"__slots__": (), "_fire": _fire})


def use_grpc_unary(tt: Any, before: Hit, inside: Hit) -> None:
    cls = _grpc_call_type(tt, False, _noop)
    wrappers: list[Any] = []

    def behavior(req: Any, ctx: Any) -> Any:
        inside(wrappers[0])
        if req == "slow":
            time.sleep(0.006)
        return req

    w = _core.GrpcUnary(cls, behavior, contextvars.ContextVar("d"), lambda: tt, 0.002, 0.005)
    wrappers.append(w)
    before(w)
    for req, left in (("fast", None), ("fast", 1.0), ("slow", 1.0), ("slow", None)):
        with contextlib.suppress(RuntimeError):
            w(req, SyncContext(left))
    w.behavior, w.call_type, w.free_calls  # noqa: B018


def use_grpc_call(tt: Any, before: Hit, inside: Hit) -> None:
    """The call, in the sync wrapper: changed as the handler starts (before)
    and from the first timer's callback (inside), both timers firing."""
    cls = _grpc_call_type(tt, False, inside)

    def behavior(req: Any, ctx: Any) -> Any:
        before(ctx)
        time.sleep(0.006)  # past the threshold and the deadline
        return req

    w = _core.GrpcUnary(cls, behavior, contextvars.ContextVar("d"), lambda: tt, 0.002, 0.005)
    for left in (1.0, 0.001):
        with contextlib.suppress(RuntimeError):
            w("r", SyncContext(left))
    _aio_calls(tt, before, inside)


def _aio_calls(tt: Any, before: Hit, inside: Hit) -> None:
    if not PY312:
        return
    cls = _grpc_call_type(tt, True, inside)

    async def behavior(req: Any, ctx: Any) -> Any:
        before(ctx)
        await asyncio.sleep(0.006)
        return req

    w = _core.GrpcAioUnary(cls, behavior, contextvars.ContextVar("d"), lambda: tt, 0.002, 0.005,
                           asyncio.current_task)

    async def main() -> None:
        for left in (1.0, 0.001):
            with contextlib.suppress(RuntimeError, asyncio.CancelledError):
                await w("r", AioContext(left))

    _in_a_loop(main)


def use_grpc_aio_unary(tt: Any, before: Hit, inside: Hit) -> None:
    cls = _grpc_call_type(tt, True, _noop)
    wrappers: list[Any] = []

    async def behavior(req: Any, ctx: Any) -> Any:
        inside(wrappers[0])
        await asyncio.sleep(0.006 if req == "slow" else 0)
        return req

    w = _core.GrpcAioUnary(cls, behavior, contextvars.ContextVar("d"), lambda: tt, 0.002, 0.005,
                           asyncio.current_task)
    wrappers.append(w)
    before(w)

    async def main() -> None:
        for req, left in (("fast", None), ("slow", 1.0)):
            with contextlib.suppress(RuntimeError, asyncio.CancelledError):
                await w(req, AioContext(left))

    _in_a_loop(main)


def use_grpc_aio_coro(tt: Any, before: Hit, inside: Hit) -> None:
    cls = _grpc_call_type(tt, True, _noop)
    coros: list[Any] = []

    async def behavior(req: Any, ctx: Any) -> Any:
        inside(coros[-1])
        await asyncio.sleep(0)
        inside(coros[-1])
        return req

    w = _core.GrpcAioUnary(cls, behavior, contextvars.ContextVar("d"), lambda: tt, 5.0, 5.0,
                           asyncio.current_task)

    async def main() -> None:
        c = w("r", AioContext(1.0))
        coros.append(c)
        before(c)
        with contextlib.suppress(RuntimeError):
            await c
        c = w("r", AioContext(1.0))
        coros.append(c)
        c.send(None)
        before(c)
        c.close()
        c = w("r", AioContext(1.0))
        before(c)
        c.close()

    _in_a_loop(main)


#: type name -> how it is used
USES: dict[str, Callable[[Any, Hit, Hit], None]] = {
    "TimerThread": use_timer_thread,
    "Handle": use_handle,
    "LoopHandle": use_loop_handle,
    "Port": use_port,
    "Scheduler": use_scheduler,
    "PollStamp": use_poll_stamp,
    "Timeout": use_timeout,
    "_TimeoutStep": use_step,
    "GrpcUnary": use_grpc_unary,
    "GrpcCall": use_grpc_call,
    "WaitFor": use_wait_for,
    "GrpcAioUnary": use_grpc_aio_unary,
    "GrpcAioCoro": use_grpc_aio_coro,
}
#: 3.12 and later only
NEW_IN_312 = {"WaitFor", "GrpcAioUnary", "GrpcAioCoro"}


def _is_the_extensions(tp: type) -> bool:
    return tp.__module__ == "bucketimer._core" or getattr(_core, tp.__name__, None) is tp


def _found_types(tt: Any) -> dict[str, type]:
    """The extension's types: those the module names, and the types (and
    their bases) of what it hands out."""
    objects: list[Any] = [v for v in vars(_core).values() if isinstance(v, type)]
    seen: list[Any] = []

    def keep(*args: Any) -> None:
        seen.extend(args)

    use_step(tt, keep, keep)
    if PY312:
        use_wait_for(tt, keep, keep)
        # a GrpcAioUnary's coroutine, without grpc: closed before it starts
        cls = type("Call", (_core.GrpcCall,), {"__slots__": (), "_fire": _noop, "_tail": _noop})
        w = _core.GrpcAioUnary(cls, _noop, contextvars.ContextVar("d"), lambda: tt, 1.0, None,
                               asyncio.current_task)
        c = w(None, None)
        c.close()
        keep(c)
    use_scheduler(tt, keep, keep)
    objects += [type(o) for o in seen]
    found: dict[str, type] = {}
    for o in objects:
        for tp in o.__mro__:
            if tp is not object and _is_the_extensions(tp):
                found[tp.__name__] = tp
    return found


def test_every_type_is_swept(tt: bucketimer.TimerThread) -> None:
    found = _found_types(tt)
    expected = set(USES) if PY312 else set(USES) - NEW_IN_312
    assert set(found) == expected
    counts = {name: len(_attributes(tp)) for name, tp in sorted(found.items())}
    print(f"\n{len(found)} types, {sum(counts.values())} members and getsets: {counts}")


@pytest.mark.parametrize("name", sorted(USES))
def test_no_change_python_can_make_crashes(tt: bucketimer.TimerThread, name: str) -> None:
    if name in NEW_IN_312 and not PY312:
        pytest.skip("a type of 3.12 and later")
    if name.startswith("Grpc"):
        pytest.importorskip("grpc.aio")
    use = USES[name]
    tp = _found_types(tt)[name]
    sweep = Sweep()
    # every member and getset, and an attribute the type does not declare
    names = [*_attributes(tp), "_bt_sweep_undeclared"]
    with _unraisables(sweep):
        for attr in names:
            for label, hit in _attacks(tt, attr, sweep):
                for mode in ("before", "inside"):
                    sweep.tried.add(f"{attr}:{label}:{mode}")
                    before, inside = (hit, _noop) if mode == "before" else (_noop, hit)
                    sweep.attempt(lambda b=before, i=inside: use(tt, b, i))
                    _still_fires(tt)
            gc.collect()  # what was dropped, Evil values among it, and cycles
    assert len(sweep.tried) == len(names) * 5 * 2
    # the same object used as a program uses it, after all that
    use(tt, _noop, _noop)
    _still_fires(tt)
