"""Per-method settings in the form of grpc's service config
(``methodConfig``): DefaultTimeoutInterceptor's timeouts (and methods with
none), SlowCallInterceptor's thresholds (and methods not timed),
ServerDeadlineInterceptor's ``max_time``; what a back end sees of each, and
the checks of the form (docs/grpc.rst, "Per-method settings")."""

from __future__ import annotations

import asyncio
import json
import math
import threading
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

grpc = pytest.importorskip("grpc")

from _grpc_harness import SERVICE, Backend, Call, stuck_in_here, wait_for  # noqa: E402

import bucketimer  # noqa: E402
import bucketimer.grpc as btg  # noqa: E402
import bucketimer.grpc.aio as bta  # noqa: E402

OTHER = "bt.Other"

#: what the back end of the tests below is told, per method
TIMEOUTS = [
    {"name": [{"service": SERVICE, "method": "Watch"}], "timeout": None},  # no default: a watch
    {"name": [{"service": SERVICE, "method": "Fast"}, {"service": OTHER, "method": "Fast"}],
     "timeout": "0.5s", "waitForReady": False},  # as the JSON form writes it; grpc's keys left to grpc
    {"name": [{"service": SERVICE}], "timeout": 2.0},  # the rest of the service
    {"name": [{}], "timeout": 3.0},  # every other method
]


def _left(backend: Backend, ctx: Any) -> bytes:
    left = ctx.time_remaining()
    return b"none" if backend.no_deadline(left) else b"%.3f" % left


def _seen(r: Any) -> float | None:
    assert r.code == grpc.StatusCode.OK, r
    return None if r.responses[-1] == b"none" else float(r.responses[-1])


def test_default_timeouts_per_method(backend: Backend) -> None:
    async def left(req: bytes, ctx: Any) -> bytes:
        return _left(backend, ctx)

    handlers = {name: backend.handler("unary_unary", left) for name in ("Watch", "Fast", "Get")}
    ic = backend.mod.DefaultTimeoutInterceptor(5.0, method_config=TIMEOUTS)
    with backend.serve(handlers) as addr, backend.channel(addr, ic) as ch:
        seen = {m: _seen(backend.invoke(ch, "unary_unary", m)) for m in ("Watch", "Fast", "Get")}
        explicit = _seen(backend.invoke(ch, "unary_unary", "Watch", timeout=1.5))
    assert seen["Watch"] is None  # excluded: no deadline at all
    assert 0.3 < seen["Fast"] <= 0.52 and 1.7 < seen["Get"] <= 2.02  # type: ignore[operator]
    assert explicit is not None and 1.2 < explicit <= 1.52  # an explicit timeout is kept
    assert ic.timeout_for(f"/{SERVICE}/Watch") is None and ic.timeout_for(f"/{SERVICE}/Fast") == 0.5
    assert ic.timeout_for(f"/{OTHER}/Fast") == 0.5 and ic.timeout_for(f"/{OTHER}/Any") == 3.0
    assert ic.timeout_for(b"/bt.Test/Get") == 2.0


def test_a_watch_excluded_from_the_default_timeout_is_not_cut(backend: Backend) -> None:
    # a server stream that runs longer than the channel's default timeout:
    # cut by the default, whole when its method is excluded -- as plain grpc
    # without a timeout delivers it
    messages, gap = 9, 0.05

    if backend.name == "sync":
        def ticks(req: Any, ctx: Any) -> Iterator[bytes]:
            for _ in range(messages):
                time.sleep(gap)
                yield b"tick"
    else:
        async def ticks(req: Any, ctx: Any) -> AsyncIterator[bytes]:  # type: ignore[misc]
            for _ in range(messages):
                await asyncio.sleep(gap)
                yield b"tick"

    m = backend.mod
    excluded = [{"name": [{"service": SERVICE, "method": "Watch"}], "timeout": None}]
    with backend.serve({"Watch": grpc.unary_stream_rpc_method_handler(ticks)}) as addr, \
            backend.channel(addr) as plain, \
            backend.channel(addr, m.DefaultTimeoutInterceptor(0.2)) as cut, \
            backend.channel(addr, m.DefaultTimeoutInterceptor(0.2, method_config=excluded)) as whole:
        rs = backend.invoke_many([Call(ch, "unary_stream", "Watch") for ch in (plain, cut, whole)])
    assert [r.code for r in rs] == [grpc.StatusCode.OK, grpc.StatusCode.DEADLINE_EXCEEDED,
                                    grpc.StatusCode.OK], rs
    assert len(rs[0].responses) == len(rs[2].responses) == messages > len(rs[1].responses)


def test_an_excluded_method_is_still_capped_by_the_handlers_budget(backend: Backend) -> None:
    seen: list[Any] = []
    m = backend.mod

    async def down(req: bytes, ctx: Any) -> bytes:
        return _left(backend, ctx)

    with backend.serve({"Watch": backend.handler("unary_unary", down)}) as down_addr, \
            backend.channel(down_addr, m.DefaultTimeoutInterceptor(5.0, method_config=TIMEOUTS)) as to_down:

        async def up(req: bytes, ctx: Any) -> bytes:
            r = await backend.invoke_from_handler(to_down, "unary_unary", "Watch")
            seen.append(_seen(r))
            return b""

        with backend.serve({"Up": backend.handler("unary_unary", up)},
                           (m.ServerDeadlineInterceptor(0.4),)) as up_addr, backend.channel(up_addr) as ch:
            assert backend.invoke(ch, "unary_unary", "Up").code == grpc.StatusCode.OK
    assert seen[0] is not None and 0.0 < seen[0] <= 0.42  # the budget, not "none"


@pytest.mark.parametrize("form", ["entries", "service_config", "json"])
def test_the_forms_a_method_config_takes(form: str) -> None:
    config: Any = TIMEOUTS
    if form != "entries":
        config = {"methodConfig": TIMEOUTS, "loadBalancingConfig": [{"round_robin": {}}]}
    if form == "json":
        config = json.dumps(config)
    for mod in (btg, bta):
        ic = mod.DefaultTimeoutInterceptor(1.0, method_config=config)
        assert ic.timeout_for(f"/{SERVICE}/Watch") is None and ic.timeout_for("/x.Y/Z") == 3.0


@pytest.mark.parametrize("config,error", [
    ([{"name": [{"service": "a.B"}], "timeout": 1.0}, {"name": [{"service": "a.B"}], "timeout": 2.0}],
     "names service 'a.B' twice"),
    ([{"name": [{"method": "M"}], "timeout": 1.0}], "names its service too"),
    ([{"name": [{"service": "a.B", "methd": "M"}], "timeout": 1.0}], "is {'service'"),
    ([{"name": [{"service": "a.B"}], "timout": 1.0}], "unknown key"),
    ([{"timeout": 1.0}], "needs 'name'"),
    ([{"name": [{}], "timeout": "1.5 s"}], "a duration is seconds"),
    ([{"name": [{}], "timeout": -1}], "must be > 0"),
    ({"methodConfigs": []}, "under 'methodConfig'"),
    ("{not json", "not valid JSON"),
    (42, "must be a list"),
])
def test_a_wrong_method_config_is_refused(config: Any, error: str) -> None:
    with pytest.raises((ValueError, TypeError), match=error):
        btg.DefaultTimeoutInterceptor(1.0, method_config=config)


def test_slow_call_thresholds_per_method(backend: Backend, tt: bucketimer.TimerThread) -> None:
    # a long-lived method not timed at all (no timer armed), one with a
    # threshold of its own, the rest with the interceptor's
    reports: list[btg.SlowCall] = []
    config = [{"name": [{"service": SERVICE, "method": "Watch"}], "threshold": None},
              {"name": [{"service": SERVICE, "method": "Quick"}], "threshold": 0.02}]

    async def work(req: bytes, ctx: Any) -> bytes:
        await stuck_in_here(lambda: False, 0.1)
        return req

    handlers = {name: backend.handler("unary_unary", work) for name in ("Watch", "Quick", "Other")}
    m = backend.mod
    server_ic = m.SlowCallInterceptor(5.0, on_slow=reports.append, stack=False, method_config=config,
                                      timer_thread=tt)
    client_ic = m.SlowCallInterceptor(5.0, on_slow=reports.append, method_config=config, timer_thread=tt)
    with backend.serve(handlers, (server_ic,)) as addr, backend.channel(addr, client_ic) as ch:
        for name in ("Watch", "Quick", "Other"):
            assert backend.invoke(ch, "unary_unary", name).code == grpc.StatusCode.OK
        assert wait_for(lambda: len(reports) == 4)
        assert btg.flush_reports(5.0)
    got = sorted((r.method.rsplit("/", 1)[1], r.side, r.finished) for r in reports)
    assert got == [("Quick", "client", False), ("Quick", "client", True),
                   ("Quick", "server", False), ("Quick", "server", True)]
    # Watch: no timer on either side; Quick and Other: one each side
    assert tt.stats()["scheduled"] == 4
    assert server_ic.threshold_for(f"/{SERVICE}/Watch") is None
    assert server_ic.threshold_for(f"/{SERVICE}/Other") == 5.0


def test_max_time_per_method(backend: Backend, stop: threading.Event) -> None:
    events: list[btg.DeadlineEvent] = []
    config = [{"name": [{"service": SERVICE, "method": "Watch"}], "max_time": None},
              {"name": [{"service": SERVICE, "method": "Short"}], "max_time": 0.05}]

    async def left(req: bytes, ctx: Any) -> bytes:
        return _left(backend, ctx)

    handlers = {name: backend.handler("unary_unary", left) for name in ("Watch", "Short", "Other")}
    ic = backend.mod.ServerDeadlineInterceptor(3.0, on_deadline=events.append, method_config=config)
    with backend.serve(handlers, (ic,)) as addr, backend.channel(addr) as ch:
        seen = {n: _seen(backend.invoke(ch, "unary_unary", n)) for n in ("Watch", "Short", "Other")}
    assert seen["Watch"] is None  # no budget of the server's
    assert 0.0 < seen["Short"] <= 0.05 and 2.5 < seen["Other"] <= 3.0  # type: ignore[operator]
    assert ic.max_time_for(f"/{SERVICE}/Short") == 0.05 and events == []


def test_the_combined_interceptor_takes_both_keys(backend: Backend) -> None:
    config = [{"name": [{"service": SERVICE, "method": "Watch"}], "threshold": None, "max_time": None},
              {"name": [{}], "threshold": 0.5}]
    ic = backend.mod.ServerDeadlineSlowCallInterceptor(1.0, 2.0, method_config=config)
    slow, deadline = ic.slow_call_interceptor, ic.deadline_interceptor
    assert slow.threshold_for(f"/{SERVICE}/Watch") is None and slow.threshold_for("/a.B/C") == 0.5
    assert deadline.max_time_for(f"/{SERVICE}/Watch") is None and deadline.max_time_for("/a.B/C") == 2.0
    assert math.isfinite(slow.threshold)
