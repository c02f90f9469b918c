"""Deadline propagation: inside a handler served through
ServerDeadlineInterceptor, ``remaining()`` is the budget left, and calls
made through DefaultTimeoutInterceptor / DeadlinePropagationInterceptor get
at most that budget less the margin, as a downstream server sees it.

A server's ``time_remaining()`` can exceed the client's timeout by a few ms
(grpc's wire encoding and clock conversions): upper bounds allow 20 ms.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import pytest

grpc = pytest.importorskip("grpc")

from _grpc_harness import SERVICE, SHAPES, Backend, is_active, stuck_in_here, wait_for  # noqa: E402

import bucketimer.grpc as btg  # noqa: E402
import bucketimer.grpc.aio as bta  # noqa: E402


def _downstream(backend: Backend, seen: list[Any]) -> dict[str, Any]:
    async def work(req: bytes, ctx: Any) -> bytes:
        seen.append(ctx.time_remaining())
        return req
    return backend.all_shapes("Down", work)


@pytest.mark.parametrize("shape", SHAPES)
def test_max_time_budget_propagates_downstream(backend: Backend, shape: str) -> None:
    seen_down: list[Any] = []
    seen_up: list[Any] = []
    m = backend.mod
    with backend.serve(_downstream(backend, seen_down)) as down_addr, \
            backend.channel(down_addr, m.DefaultTimeoutInterceptor(30.0, margin=0.05)) as down:

        async def work(req: bytes, ctx: Any) -> bytes:
            seen_up.append(btg.remaining())
            # aio: from a task the handler created, which inherits its budget
            r = await backend.invoke_from_handler(down, shape, f"Down_{shape}", in_task=True)
            assert r.code == grpc.StatusCode.OK, r
            return r.responses[-1]

        with backend.serve(backend.all_shapes("Up", work), (m.ServerDeadlineInterceptor(0.3),)) as up_addr, \
                backend.channel(up_addr) as up:
            r = backend.invoke(up, "unary_unary", "Up_unary_unary", timeout=10.0)
    assert r.code == grpc.StatusCode.OK, r
    assert 0.0 < seen_up[0] <= 0.3
    # downstream got the upstream's remaining budget minus the margin, not 30 s
    assert seen_down[0] is not None and 0.0 < seen_down[0] <= 0.3 - 0.05 + 0.02  # the upper bound is the point


@pytest.mark.parametrize("shape", SHAPES)
def test_client_deadline_propagates_downstream(backend: Backend, shape: str) -> None:
    seen_down: list[Any] = []
    m = backend.mod
    with backend.serve(_downstream(backend, seen_down)) as down_addr, \
            backend.channel(down_addr, m.DeadlinePropagationInterceptor(margin=0.02)) as down:

        async def work(req: bytes, ctx: Any) -> bytes:
            r = await backend.invoke_from_handler(down, "unary_unary", "Down_unary_unary", timeout=20.0)
            return r.responses[-1]

        with backend.serve(backend.all_shapes("Up", work), (m.ServerDeadlineInterceptor(),)) as up_addr, \
                backend.channel(up_addr) as up:
            r = backend.invoke(up, shape, f"Up_{shape}", timeout=0.25)
    assert r.code == grpc.StatusCode.OK, r
    # an explicit downstream timeout (20 s) is capped by the budget (less
    # the margin) too; how much of the 0.25 s is left depends on how long
    # the upstream call took to reach its handler (~170 ms once under ASan)
    assert seen_down[0] is not None and 0.0 < seen_down[0] <= 0.25 - 0.02 + 0.02


def test_spent_budget_fails_downstream_call_at_once(backend: Backend, stop: threading.Event) -> None:
    seen_down: list[Any] = []
    outcome: list[Any] = []
    m = backend.mod
    with backend.serve(_downstream(backend, seen_down)) as down_addr, \
            backend.channel(down_addr, m.DefaultTimeoutInterceptor(30.0, margin=0.05)) as down:

        async def work(req: bytes, ctx: Any) -> bytes:
            await stuck_in_here(stop.is_set, 0.08)  # spend the budget but the margin
            outcome.append(await backend.invoke_from_handler(down, "unary_unary", "Down_unary_unary"))
            return b""

        with backend.serve(backend.all_shapes("Up", work), (m.ServerDeadlineInterceptor(0.1),)) as up_addr, \
                backend.channel(up_addr) as up:
            backend.invoke(up, "unary_unary", "Up_unary_unary")
            assert wait_for(lambda: bool(outcome))
    (down_result,) = outcome
    assert down_result.code == grpc.StatusCode.DEADLINE_EXCEEDED
    # The spent budget, not the downstream's own 30 s default, ended the
    # call: grpc failed it before sending (how fast is the machine's affair).
    assert down_result.elapsed < 30.0 / 2
    assert seen_down == []  # never reached the downstream handler


def test_outside_a_handler_propagation_changes_nothing(backend: Backend) -> None:
    seen_down: list[Any] = []
    m = backend.mod
    assert btg.remaining() is None
    with backend.serve(_downstream(backend, seen_down)) as addr:
        with backend.channel(addr, m.DefaultTimeoutInterceptor(0.5)) as ch:
            assert backend.invoke(ch, "unary_unary", "Down_unary_unary").code == grpc.StatusCode.OK
        with backend.channel(addr, m.DeadlinePropagationInterceptor()) as ch:
            assert backend.invoke(ch, "unary_unary", "Down_unary_unary").code == grpc.StatusCode.OK
    assert 0.25 < seen_down[0] <= 0.52  # the 0.5 s default, less the time in transit
    assert backend.no_deadline(seen_down[1]), seen_down


def test_propagation_can_be_turned_off(backend: Backend) -> None:
    seen_down: list[Any] = []
    m = backend.mod
    with backend.serve(_downstream(backend, seen_down)) as down_addr, \
            backend.channel(down_addr, m.DefaultTimeoutInterceptor(2.0, propagate=False)) as down:

        async def work(req: bytes, ctx: Any) -> bytes:
            return (await backend.invoke_from_handler(down, "unary_unary", "Down_unary_unary")).responses[-1]

        with backend.serve(backend.all_shapes("Up", work), (m.ServerDeadlineInterceptor(0.3),)) as up_addr, \
                backend.channel(up_addr) as up:
            assert backend.invoke(up, "unary_unary", "Up_unary_unary").code == grpc.StatusCode.OK
    assert 1.5 < seen_down[0] <= 2.02


def test_sync_and_aio_propagation_share_the_budget(backend: Backend) -> None:
    # one budget, read through either module's remaining() in either kind of handler
    seen: list[Any] = []

    async def work(req: bytes, ctx: Any) -> bytes:
        seen.append((btg.remaining(), bta.remaining(), btg.current_deadline()))
        return req

    with backend.serve(backend.all_shapes("Up", work), (backend.mod.ServerDeadlineInterceptor(0.5),)) as addr, \
            backend.channel(addr) as ch:
        assert backend.invoke(ch, "unary_unary", "Up_unary_unary").code == grpc.StatusCode.OK
    rem_sync, rem_aio, deadline = seen[0]
    assert 0.3 < rem_sync <= 0.5 and 0.3 < rem_aio <= 0.5
    assert deadline is not None and deadline > time.monotonic() - 1.0


# -- budget exhaustion through several hops -------------------------------------------------

#: the front end's budget; each hop gives the next its budget less MARGIN
FRONT = 0.3
MARGIN = 0.05


def _never_in_time(stop: threading.Event) -> Any:
    """A back end's work that answers only once its call has ended."""

    async def stuck(req: bytes, ctx: Any) -> bytes:
        await stuck_in_here(lambda: stop.is_set() or not is_active(ctx), 3.0)
        return b"never in time"

    return stuck


def _hop(backend: Backend, name: str, handle: str, down: Any, down_method: str) -> Any:
    """A handler calling ``down``'s ``down_method`` (no timeout of its own);
    ``handle``: what it does with the downstream's error -- lets it through
    ("through"), raises its own from it ("wrapped"), or works on until its
    own budget ends the call ("works_on")."""

    async def work(req: bytes, ctx: Any) -> bytes:
        r = await backend.invoke_from_handler(down, "unary_unary", down_method)
        if r.code == grpc.StatusCode.OK:
            return r.responses[-1]
        err = r.error
        if handle == "through":
            raise err
        if handle == "wrapped":
            raise RuntimeError(f"{name}: the backend failed") from err
        await stuck_in_here(lambda: not is_active(ctx), 3.0)
        return b"too late"

    return {name: backend.handler("unary_unary", work)}


@pytest.mark.parametrize("handle,margin", [("through", MARGIN), ("through", 0.0), ("wrapped", MARGIN),
                                           ("works_on", MARGIN)],
                         ids=["through", "through-no-margin", "wrapped", "works_on"])
def test_budget_exhaustion_through_three_hops(backend: Backend, handle: str, margin: float,
                                              stop: threading.Event,
                                              caplog: pytest.LogCaptureFixture) -> None:
    # front (max_time) -> middle -> back, whose handler never answers in time:
    # each hop gets its caller's budget less the margin, and every call of
    # the chain ends with DEADLINE_EXCEEDED and grpc's clean details.  A hop
    # reports the deadline when its own budget (less its margin) ran out:
    # the back end's and the middle's then; the front end's, 50 ms short of
    # its own, passes the status on -- unless it works on to its own end
    # (or there is no margin to keep it short)
    events: list[btg.DeadlineEvent] = []
    m = backend.mod
    stuck = _never_in_time(stop)
    deadline = m.ServerDeadlineInterceptor(on_deadline=events.append)
    front = m.ServerDeadlineInterceptor(FRONT, on_deadline=events.append)
    with backend.serve({"Back": backend.handler("unary_unary", stuck)}, (deadline,)) as back_addr, \
            backend.channel(back_addr, m.DefaultTimeoutInterceptor(5.0, margin=margin)) as to_back, \
            backend.serve(_hop(backend, "Middle", handle, to_back, "Back"), (deadline,)) as mid_addr, \
            backend.channel(mid_addr, m.DefaultTimeoutInterceptor(5.0, margin=margin)) as to_mid, \
            backend.serve(_hop(backend, "Front", handle, to_mid, "Middle"), (front,)) as front_addr, \
            backend.channel(front_addr) as ch:
        r = backend.invoke(ch, "unary_unary", "Front")
        front_reports = handle == "works_on" or margin == 0.0
        assert wait_for(lambda: len(events) >= 2 + front_reports), (r, events)
        assert btg.flush_reports(5.0)
        time.sleep(0.05)  # (nothing more comes)
    assert (r.code, r.details) == (grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"), r
    assert r.elapsed < FRONT + 1.0, r
    got = sorted((ev.method.rsplit("/", 1)[1], ev.source) for ev in events)
    front = [ev for ev in events if ev.method.endswith("/Front")]
    if not front_reports and front:
        # a loaded machine held the middle's status past the deadline the
        # front end gave it (its budget less the margin): then the front
        # end's budget is what ended the chain, and it is reported -- never
        # earlier than that deadline, less the 1 ms allowed for the two clocks
        assert front[0].elapsed >= FRONT - margin - 0.0011, front
        front_reports = True
    assert got == [("Back", "client"), *([("Front", "max_time")] if front_reports else []),
                   ("Middle", "client")], events
    # a downstream's DEADLINE_EXCEEDED let through is a status, not an error,
    # whichever came first, it or the hop's own budget; a handler's own
    # exception ("wrapped") is logged as grpc logs one, by both hops, always
    errors = sorted(rec.getMessage() for rec in caplog.records
                    if rec.name.startswith("grpc") and rec.levelno >= logging.ERROR)
    if handle != "wrapped":
        assert errors == [], errors
    elif backend.name == "sync":
        assert errors == [f"Exception calling application: {hop}: the backend failed"
                          for hop in ("Front", "Middle")], errors
    else:
        assert errors == [f"Unexpected [RuntimeError] raised by servicer method [/{SERVICE}/{hop}]"
                          for hop in ("Front", "Middle")], errors
    budgets = {ev.method.rsplit("/", 1)[1]: ev.budget for ev in events}
    # each hop's budget: its caller's, less the margin (less time in transit)
    assert budgets["Middle"] <= FRONT - margin + 0.02 and budgets["Back"] <= budgets["Middle"] - margin + 0.02


def test_a_downstream_deadline_the_budget_did_not_cause_is_passed_on(backend: Backend,
                                                                     stop: threading.Event) -> None:
    # the back end's own max_time (0.05 s) ends its call long before the
    # front end's budget (5 s): the front end passes the status on, as
    # grpc-go does a returned status, with the back end's details; no
    # deadline of the front end's is reported
    events: list[btg.DeadlineEvent] = []
    m = backend.mod
    stuck = _never_in_time(stop)
    back_ic = m.ServerDeadlineInterceptor(0.05, details="the back end's budget")
    with backend.serve({"Back": backend.handler("unary_unary", stuck)}, (back_ic,)) as back_addr, \
            backend.channel(back_addr, m.DefaultTimeoutInterceptor(5.0)) as to_back, \
            backend.serve(_hop(backend, "Front", "through", to_back, "Back"),
                          (m.ServerDeadlineInterceptor(5.0, on_deadline=events.append),)) as front_addr, \
            backend.channel(front_addr) as ch:
        r = backend.invoke(ch, "unary_unary", "Front", timeout=10.0)
        assert btg.flush_reports(5.0)
    assert (r.code, r.details) == (grpc.StatusCode.DEADLINE_EXCEEDED, "the back end's budget"), r
    assert events == []
