"""What a type checker sees of bucketimer's API (``mypy --strict``, run by
``nox -s lint``; never imported by pytest).  ``assert_type`` pins each type;
an ``ignore`` comment pins an error that must stay one (strict mode reports
an ignore that is not needed)."""

from __future__ import annotations

import asyncio
import contextvars
from typing import assert_type

import bucketimer
from bucketimer import Handle, Timeout, TimerThread, aio


def takes(n: int, name: str) -> None: ...


def timers(tt: TimerThread) -> None:
    h = tt.call_later(1.5, takes, 1, "a")
    assert_type(h, Handle)
    assert_type(h.cancel(), bool)
    assert_type(h.when(), float)
    assert_type(tt.call_at(tt.time() + 1, takes, 2, "b", context=contextvars.copy_context()), Handle)
    assert_type(bucketimer.call_later(0.1, print), Handle)
    assert_type(tt.stats()["scheduled"], int)
    assert_type(tt.stats()["lateness_hist"], list[int])
    tt.call_later(1.5, takes, "a", 1)  # type: ignore[arg-type]
    tt.call_later(1.5, takes, 1)  # type: ignore[arg-type]
    tt.call_later("soon", takes, 1, "a")  # type: ignore[arg-type]
    assert_type(tt.slow_callback_duration, float | None)
    tt.slow_callback_duration = None
    TimerThread(slow_callback_duration=0.5)
    tt.slow_callback_duration = "slow"  # type: ignore[assignment]


async def helpers() -> str:
    async with bucketimer.timeout(2.5) as cm:
        assert_type(cm, Timeout)
        assert_type(cm.when(), float | None)
        cm.reschedule(None)
    async with aio.timeout_at(None) as cm2:
        assert_type(cm2.expired(), bool)
    result = await bucketimer.wait_for(asyncio.sleep(0, "done"), 1.0)
    assert_type(result, str)
    return result


def loops() -> None:
    assert_type(bucketimer.run(helpers()), str)
    assert_type(bucketimer.new_event_loop(), bucketimer.EventLoop)
    with asyncio.Runner(loop_factory=bucketimer.new_event_loop) as runner:
        assert_type(runner.run(helpers()), str)
    bucketimer.run(helpers(), loop_factory=lambda: bucketimer.EventLoop(timer_thread=TimerThread()))


def patching() -> None:
    assert_type(bucketimer.patch_asyncio(), bool)
    bucketimer.unpatch_asyncio()
    assert_type(bucketimer.run(helpers(), patch_asyncio=True), str)


def grpc_names() -> None:
    # the documented imports: each name re-exported as itself
    from bucketimer.grpc import (
        DeadlineEvent,
        ServerDeadlineInterceptor,
        SlowCall,
        current_deadline,
        remaining,
    )
    from bucketimer.grpc.aio import DeadlineEvent as AioDeadlineEvent
    from bucketimer.grpc.aio import remaining as aio_remaining

    assert_type(remaining(), float | None)
    assert_type(aio_remaining(), float | None)
    assert_type(current_deadline(), float | None)
    assert AioDeadlineEvent is DeadlineEvent
    ServerDeadlineInterceptor(0.5, on_deadline=lambda ev: assert_type(ev, DeadlineEvent))
    assert_type(SlowCall("/s/M", "server", 1.0, False).stack, str | None)


def introspection(tt: TimerThread) -> None:
    snap = tt.pending(limit=3)
    assert_type(snap, bucketimer.Pending)
    assert_type(snap.groups[0], bucketimer.PendingGroup)
    assert_type(snap.groups[0].timers[0].when, float)
    assert_type(snap.groups[0].timers[0].loop, asyncio.AbstractEventLoop | None)
    bucketimer.trace_timers(5)
    tt.pending(limit="3")  # type: ignore[arg-type]
    assert_type(tt.stats()["lateness_sum"], int)


def monitoring() -> None:
    import bucketimer.grpc
    import bucketimer.prometheus

    assert_type(bucketimer.grpc.patch_grpc(), list[str])
    bucketimer.grpc.unpatch_grpc()
    assert_type(bucketimer.prometheus.register({"default": None}),
                bucketimer.prometheus.LatenessCollector)
