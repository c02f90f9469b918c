"""A loop's timers wake it through the loop's own self-pipe where asyncio's
selector loop is in charge of it, and through an eventfd of their own
everywhere else (docs/design.rst, "Waking a stock loop").

What is tested: which loops take which wake; that a wake reaches a loop
whose own wakes (``call_soon_threadsafe``) race it, however often; that the
port's drain is queued after the loop's reader of its self-pipe in a poll
they share, which is what keeps a wake from being read and lost; that a
closed loop's port releases its timers and its dup of the socket.
"""

from __future__ import annotations

import asyncio
import os
import random
import threading
import time
from typing import Any

import pytest

import bucketimer

if bucketimer.backend == "native":
    from bucketimer import _timers

# Ports and their wakes are the native backend's.
pytestmark = pytest.mark.native

#: Whether stock loops wake through their self-pipe here: not with
#: BUCKETIMER_PUBLIC_API, which turns that read off (then they have eventfds).
SELF_PIPE = bucketimer.backend == "native" and _timers._WAKE_SELF_PIPE and _timers._WRAP_SELECTOR
needs_self_pipe = pytest.mark.skipif(not SELF_PIPE, reason="BUCKETIMER_PUBLIC_API: eventfds only")


def _registered_fds(loop: Any) -> set[int]:
    return {key.fd for key in loop._selector.get_map().values()}


def _first_timer(loop: Any, tt: bucketimer.TimerThread) -> Any:
    """The port made by a first timer armed inside ``loop``, once it ran."""
    async def main() -> None:
        fut = loop.create_future()
        tt.call_later(0.001, fut.set_result, None)
        await fut

    loop.run_until_complete(main())
    return tt._ports[loop]


class _OwnEvents(asyncio.SelectorEventLoop):
    """A loop that reads a poll's events its own way."""

    def _process_events(self, event_list: Any) -> None:
        super()._process_events(list(event_list))


@needs_self_pipe
def test_a_stock_loops_timers_wake_it_through_its_self_pipe(tt: bucketimer.TimerThread) -> None:
    loop = asyncio.SelectorEventLoop()
    try:
        port = _first_timer(loop, tt)
        assert port.wakes_socket
        assert port.fileno() >= 0
        assert port.fileno() not in _registered_fds(loop)  # no reader of its own
        assert os.path.samestat(os.fstat(port.fileno()), os.fstat(loop._csock.fileno()))
    finally:
        loop.close()
    assert port.fileno() == -1


@pytest.mark.parametrize("make", [
    pytest.param(lambda: _OwnEvents(), id="_process_events overridden"),
    pytest.param(None, id="private reads off"),
])
def test_any_other_loop_gets_an_eventfd_and_a_reader(tt: bucketimer.TimerThread,
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     make: Any) -> None:
    if make is None:
        monkeypatch.setattr(_timers, "_WAKE_SELF_PIPE", False)
        make = asyncio.SelectorEventLoop
    loop = make()
    try:
        port = _first_timer(loop, tt)
        assert not port.wakes_socket
        assert port.fileno() in _registered_fds(loop)
    finally:
        loop.close()


def test_a_timer_armed_from_another_thread_gets_an_eventfd(tt: bucketimer.TimerThread) -> None:
    """The loop's poll is its own thread's to wrap: a port opened from
    outside wakes it through an eventfd the loop reads itself."""
    loop = asyncio.SelectorEventLoop()
    try:
        fut = loop.create_future()
        tt.call_later(0.001, fut.set_result, "ran", loop=loop)
        assert loop.run_until_complete(fut) == "ran"
        assert not tt._ports[loop].wakes_socket
    finally:
        loop.close()


@needs_self_pipe
def test_the_drop_in_loop_wakes_through_its_self_pipe_too(tt: bucketimer.TimerThread) -> None:
    loop = bucketimer.EventLoop(timer_thread=tt)
    try:
        port = tt._ports[loop]
        assert port.wakes_socket and port.fileno() not in _registered_fds(loop)
        assert loop.run_until_complete(asyncio.sleep(0.001, "ok")) == "ok"
    finally:
        loop.close()


@needs_self_pipe
def test_the_drain_is_queued_after_the_loops_own_reader_in_a_poll_they_share(
        tt: bucketimer.TimerThread) -> None:
    """A zero byte sent after the drain's ack must stay for the next poll:
    so in a poll that reports both, the self-pipe's reader (which empties
    it) runs first."""
    loop = asyncio.SelectorEventLoop()
    ssock = loop._ssock.fileno()
    polls: list[list[Any]] = []
    try:
        _first_timer(loop, tt)
        real = loop._process_events

        def spy(event_list: Any) -> None:
            polls.append([key.fileobj for key, _ in event_list])
            real(event_list)

        loop._process_events = spy  # type: ignore[method-assign]

        async def main() -> None:
            fut = loop.create_future()
            tt.call_later(0.001, fut.set_result, None)
            loop._write_to_self()  # the loop's own wake, in the same poll
            time.sleep(0.05)  # the timer thread posts meanwhile
            await fut

        loop.run_until_complete(main())
    finally:
        loop.close()
    port_polls = [p for p in polls if any(isinstance(f, bucketimer._core.Port) for f in p)]
    assert port_polls, polls
    shared = [p for p in port_polls if ssock in p]
    assert shared, port_polls
    for p in shared:
        assert isinstance(p[-1], bucketimer._core.Port), p


def test_no_wake_is_lost_to_the_loops_own_wakes(tt: bucketimer.TimerThread) -> None:
    """Timers fall due while another thread hammers the loop with
    call_soon_threadsafe (the same socket's bytes).  A wake lost on the way
    leaves the port signalled and never drained: the last batch, armed once
    the hammering stops, would then never run (the loop arms no timer of
    asyncio's, so nothing else would wake it)."""
    loop = asyncio.SelectorEventLoop()
    rounds, per_round = 40, 50
    done = threading.Event()
    stop_hammer = threading.Event()
    ran = [0]

    def fired() -> None:
        ran[0] += 1
        if ran[0] == (rounds + 1) * per_round:
            done.set()

    def arm(rng: random.Random) -> None:
        for _ in range(per_round):
            tt.call_later(rng.uniform(0, 0.004), fired)

    def hammer() -> None:
        while not stop_hammer.is_set():
            loop.call_soon_threadsafe(lambda: None)
            time.sleep(random.uniform(0, 0.0005))

    runner = threading.Thread(target=loop.run_forever)
    runner.start()
    hammers = [threading.Thread(target=hammer) for _ in range(2)]
    for h in hammers:
        h.start()
    try:
        rng = random.Random(37)
        for _ in range(rounds):
            loop.call_soon_threadsafe(arm, rng)
            time.sleep(0.005)
        stop_hammer.set()
        for h in hammers:
            h.join()
        time.sleep(0.05)  # the hammer's last bytes are read
        loop.call_soon_threadsafe(arm, rng)
        assert done.wait(10), f"{ran[0]} of {(rounds + 1) * per_round} timers ran"
        assert tt._ports[loop].wakes_socket == SELF_PIPE
    finally:
        stop_hammer.set()
        loop.call_soon_threadsafe(loop.stop)
        runner.join()
        loop.close()


def test_a_closed_loops_port_releases_its_timers_and_its_socket(tt: bucketimer.TimerThread) -> None:
    loop = asyncio.SelectorEventLoop()
    ran: list[int] = []

    async def main() -> Any:
        return [tt.call_later(0.02, ran.append, i) for i in range(5)]

    handles = loop.run_until_complete(main())
    port = tt._ports[loop]
    fd = port.fileno()
    assert port.wakes_socket == SELF_PIPE and fd >= 0
    loop.close()
    assert port.fileno() == -1
    time.sleep(0.05)  # past their deadlines: the timer thread has nowhere to post them
    assert ran == []
    assert [h.cancel() for h in handles] == [False] * 5  # dropped, never run
