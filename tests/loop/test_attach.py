"""A stock loop's port is connected the same way whether C does it
(``ext/attach.c``, every loop after a TimerThread's first, armed from inside
the running loop) or ``TimerThread._attach`` does (the first, and whatever C
does not take): the same wake, poll, detach at close and error reports
(docs/design.rst, "Waking a stock loop").  Neither puts a hook on a
loop's ``close``: asyncio's selector loop closes its selector last, and the
``PollStamp`` that wraps it detaches the port then."""

from __future__ import annotations

import asyncio
import gc
import selectors
import socket
import time
import weakref
from typing import Any

import pytest

import bucketimer

if bucketimer.backend == "native":
    from bucketimer import _core, _timers

# Ports are the native backend's; with BUCKETIMER_PUBLIC_API, _attach
# connects every loop (the self-pipe read is off, and C needs it).
pytestmark = [
    pytest.mark.native,
    pytest.mark.skipif(bucketimer.backend != "native" or not _timers._WAKE_SELF_PIPE
                       or not _timers._WRAP_SELECTOR, reason="BUCKETIMER_PUBLIC_API"),
]


# The loops whose port TimerThread._attach connected (the rest: C).
_ATTACHED_IN_PYTHON: weakref.WeakSet[Any] = weakref.WeakSet()


@pytest.fixture(autouse=True)
def _spy_on_attach(monkeypatch: pytest.MonkeyPatch) -> None:
    attach = _timers.TimerThread._attach

    def spy(self: Any, loop: Any, port: Any) -> None:
        if loop is not None:
            _ATTACHED_IN_PYTHON.add(loop)
        attach(self, loop, port)

    monkeypatch.setattr(_timers.TimerThread, "_attach", spy)


def _connected_in_c(loop: Any) -> bool:
    return loop not in _ATTACHED_IN_PYTHON


def _life(tt: bucketimer.TimerThread, loop: Any) -> dict[str, Any]:
    """What a loop sees of its port: made by a first timer from inside the
    loop, a callback that raises, a timer left pending at close."""
    reports: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, ctx: reports.append(ctx))
    ran: list[str] = []

    def boom() -> None:
        raise ValueError("boom")

    async def main() -> Any:
        fut = loop.create_future()
        tt.call_later(0.001, ran.append, "first")
        tt.call_later(0.002, boom)
        tt.call_later(0.003, fut.set_result, None)
        await fut
        return tt.call_later(30, ran.append, "never")

    pending = loop.run_until_complete(main())
    port = tt._ports[loop]
    seen = {
        "in C": _connected_in_c(loop),
        "close hook": "close" in loop.__dict__,
        "wakes its self-pipe": port.wakes_socket,
        "its poll watches it": port.stamp is loop._selector,
        "fd registered": port.fileno() in {k.fd for k in loop._selector.get_map().values()},
        "ran": list(ran),
        "reports": [(r["message"], type(r["exception"]).__name__, type(r["handle"]).__name__)
                    for r in reports],
    }
    loop.close()
    seen.update({
        "close hook left": "close" in loop.__dict__,
        "fd after close": port.fileno(),
        "pending dropped": pending.cancel() is False and not pending.cancelled(),
        "ran after close": list(ran),
    })
    return seen


def test_c_connects_a_loop_as_attach_does(tt: bucketimer.TimerThread) -> None:
    first = _life(tt, asyncio.SelectorEventLoop())  # the TimerThread's first loop: _attach
    assert tt._fast_attach
    second = _life(tt, asyncio.SelectorEventLoop())
    assert (first.pop("in C"), second.pop("in C")) == (False, True)
    assert first == second
    assert not first["close hook"] and first["fd after close"] == -1
    assert first["wakes its self-pipe"] and not first["fd registered"]
    assert first["ran"] == ["first"]
    assert first["reports"] == [(first["reports"][0][0], "ValueError", "Handle")]
    assert first["reports"][0][0].startswith("Exception in callback ")


def test_the_drop_in_loop_is_connected_in_c_as_it_is_made(tt: bucketimer.TimerThread) -> None:
    # Its port is opened by its constructor, outside any running loop: in C
    # too, once the TimerThread has connected a first loop.
    first = _life(tt, bucketimer.EventLoop(timer_thread=tt))  # the TimerThread's first: _attach
    assert tt._fast_attach
    second = _life(tt, bucketimer.EventLoop(timer_thread=tt))
    assert (first.pop("in C"), second.pop("in C")) == (False, True)
    assert first == second
    assert first["wakes its self-pipe"] and not first["fd registered"]
    assert first["its poll watches it"] and first["fd after close"] == -1
    assert first["ran"] == ["first"] and first["pending dropped"]
    assert _core._made_loop() is None


class _OwnSetattr(asyncio.SelectorEventLoop):
    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)


class _OwnEvents(asyncio.SelectorEventLoop):
    def _process_events(self, event_list: Any) -> None:
        super()._process_events(event_list)


@pytest.mark.parametrize("make", [_OwnSetattr, _OwnEvents], ids=lambda c: c.__name__)
def test_a_loop_class_c_does_not_vet_is_left_to_attach(tt: bucketimer.TimerThread,
                                                       make: type) -> None:
    _life(tt, asyncio.SelectorEventLoop())
    seen = _life(tt, make())
    assert not seen["in C"]
    assert seen["ran"] == ["first"] and not seen["close hook left"]
    assert seen["fd after close"] == -1 and seen["pending dropped"]
    assert not seen["close hook"]  # asyncio's close: its PollStamp detaches
    assert seen["wakes its self-pipe"] == (make is not _OwnEvents)


def test_a_loop_whose_self_pipe_is_not_a_socket_is_left_to_attach(
        tt: bucketimer.TimerThread) -> None:
    _life(tt, asyncio.SelectorEventLoop())
    loop = asyncio.SelectorEventLoop()
    real = loop._csock  # type: ignore[attr-defined]
    loop._csock = _SocketLike(real)  # type: ignore[attr-defined]
    try:
        async def main() -> Any:
            fut = loop.create_future()
            tt.call_later(0.001, fut.set_result, "ran")
            return await fut

        assert loop.run_until_complete(main()) == "ran"
        assert not _connected_in_c(loop)
        assert not tt._ports[loop].wakes_socket  # an eventfd of its own
    finally:
        loop._csock = real  # type: ignore[attr-defined]
        loop.close()


class _SocketLike:
    def __init__(self, sock: Any) -> None:
        self._sock = sock

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


def test_closing_a_running_loop_refuses_as_asyncio_does(
        tt: bucketimer.TimerThread) -> None:
    _life(tt, asyncio.SelectorEventLoop())
    loop = asyncio.SelectorEventLoop()

    async def main() -> Any:
        h = tt.call_later(0.001, lambda: None)
        with pytest.raises(RuntimeError, match="Cannot close a running event loop"):
            loop.close()
        return h

    loop.run_until_complete(main())
    assert _connected_in_c(loop)
    port = tt._ports[loop]
    assert port.fileno() >= 0  # kept its port
    loop.close()
    assert port.fileno() == -1 and "close" not in loop.__dict__


def test_a_loop_outliving_its_timer_thread_closes() -> None:
    tt = bucketimer.TimerThread()
    _life(tt, asyncio.SelectorEventLoop())
    loop = asyncio.SelectorEventLoop()

    async def main(tt: bucketimer.TimerThread) -> None:
        tt.call_later(30, lambda: None)

    loop.run_until_complete(main(tt))
    assert _connected_in_c(loop)
    ref = weakref.ref(tt)
    tt.close()
    del tt
    gc.collect()
    assert ref() is None
    loop.close()
    assert loop.is_closed() and "close" not in loop.__dict__


def test_a_closed_timer_thread_connects_no_loop_in_c() -> None:
    tt = bucketimer.TimerThread()
    _life(tt, asyncio.SelectorEventLoop())
    assert tt._fast_attach
    tt.close()
    assert not tt._fast_attach
    loop = asyncio.SelectorEventLoop()

    async def main() -> None:
        with pytest.raises(RuntimeError, match="closed"):
            tt.call_later(0.001, lambda: None)

    try:
        loop.run_until_complete(main())
        assert "close" not in loop.__dict__
    finally:
        loop.close()


def test_a_dropped_loop_connected_in_c_is_collected(tt: bucketimer.TimerThread) -> None:
    _life(tt, asyncio.SelectorEventLoop())
    loop = asyncio.SelectorEventLoop()

    async def main() -> None:
        tt.call_later(30, lambda: None)

    loop.run_until_complete(main())
    assert _connected_in_c(loop)
    port = weakref.ref(tt._ports[loop])
    loop.close()
    ref = weakref.ref(loop)
    del loop
    gc.collect()
    assert ref() is None and port() is None


def test_two_hundred_short_loops_connected_in_c_each_run_their_timer(
        tt: bucketimer.TimerThread) -> None:
    """Many short loops, each connected in C, each running its timers."""
    _life(tt, asyncio.SelectorEventLoop())
    t0 = time.monotonic()
    for i in range(200):
        loop = asyncio.SelectorEventLoop()
        try:
            async def main(i: int = i) -> int:
                fut = asyncio.get_running_loop().create_future()
                tt.call_later(0.0005, fut.set_result, i)
                return await fut

            assert loop.run_until_complete(main()) == i
            assert _connected_in_c(loop)
        finally:
            loop.close()
    assert time.monotonic() - t0 < 20


def test_a_selector_that_registers_another_stamp_class_as_it_is_read_is_no_crash(
        tt: bucketimer.TimerThread) -> None:
    """Making the stamp reads ``selector.select``, Python code: one that
    registers another stamp class meanwhile (the first then held by nothing
    else) must not pull the class being made out from under it."""
    from bucketimer import _core
    from bucketimer._reporting import report_to_loop

    def register(stamp_class: type) -> None:
        _core._set_attach(_timers._attach_class, stamp_class, report_to_loop, socket.socket,
                          selectors.BaseSelector)

    class Sneaky(selectors.DefaultSelector):  # type: ignore[misc, valid-type]
        def __getattribute__(self, name: str) -> Any:
            if name == "select":
                register(_timers.PollStamp)
            return super().__getattribute__(name)

    _life(tt, asyncio.SelectorEventLoop())
    register(type("Passing", (_timers.PollStamp,), {}))
    loop = asyncio.SelectorEventLoop(Sneaky())
    try:
        async def main() -> str:
            fut = asyncio.get_running_loop().create_future()
            tt.call_later(0.001, fut.set_result, "ran")
            return await fut

        assert loop.run_until_complete(main()) == "ran"
        gc.collect()
    finally:
        register(_timers.PollStamp)
        loop.close()


def test_loops_one_after_another_keep_the_c_path_until_idle(monkeypatch: pytest.MonkeyPatch) -> None:
    """A process that runs a loop per request, test or cell, with gaps
    between them longer than the audit period, connects every loop after the
    first in C; only once no loop has had a port for ``_AUDIT_IDLE`` does the
    dispatcher stop its audits, and the next loop goes through ``_attach``."""
    monkeypatch.setattr(_timers, "_AUDIT_PERIOD", 0.02)
    monkeypatch.setattr(_timers, "_AUDIT_IDLE", 0.5)
    tt = bucketimer.TimerThread()
    try:
        seen = []
        for _ in range(3):
            loop = asyncio.SelectorEventLoop()
            seen.append(_life(tt, loop)["in C"])
            time.sleep(0.15)  # several audits, each finding no loop
        assert seen == [False, True, True]
        assert tt._fast_attach
        deadline = time.monotonic() + 10
        while tt._fast_attach and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not tt._fast_attach  # idle: audits stopped
        assert _life(tt, asyncio.SelectorEventLoop())["in C"] is False
        assert tt._fast_attach  # and started again
    finally:
        tt.close()


class _OwnClose(asyncio.SelectorEventLoop):
    def close(self) -> None:
        super().close()


class _OwnIsClosed(asyncio.SelectorEventLoop):
    def is_closed(self) -> bool:
        return super().is_closed()


@pytest.mark.parametrize("cls", [_OwnClose, _OwnIsClosed])
def test_a_loop_class_with_its_own_close_or_is_closed_connects_in_python(
        tt: bucketimer.TimerThread, cls: type[asyncio.AbstractEventLoop]) -> None:
    """The C path takes this thread's running loop for open without asking
    it, which holds for asyncio's ``close`` and ``is_closed`` only: a class
    with its own goes through ``_attach``, which asks.  A close of its own
    need not close the selector last, so the port is detached by a hook on
    the loop's ``close``, before it runs."""
    _life(tt, asyncio.SelectorEventLoop())
    assert tt._fast_attach
    seen = _life(tt, cls())
    assert seen["in C"] is False and seen["ran"] == ["first"]
    assert seen["close hook"] == (cls is _OwnClose) and not seen["close hook left"]
    assert seen["fd after close"] == -1 and seen["pending dropped"]
