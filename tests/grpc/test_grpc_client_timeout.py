"""DefaultTimeoutInterceptor and DeadlinePropagationInterceptor outside a
handler: the timeout a call gets, seen by a real server's handler."""

from __future__ import annotations

import threading
from typing import Any

import pytest

grpc = pytest.importorskip("grpc")

from _grpc_harness import ENDED, SHAPES, Backend, is_active, stuck_in_here  # noqa: E402


def _seen(seen: list[Any]) -> Any:
    async def work(req: bytes, ctx: Any) -> bytes:
        seen.append(ctx.time_remaining())
        return req
    return work


@pytest.mark.parametrize("shape", SHAPES)
def test_default_timeout_applies_to_calls_without_one(backend: Backend, shape: str) -> None:
    seen: list[Any] = []
    with backend.serve(backend.all_shapes("Seen", _seen(seen))) as addr, \
            backend.channel(addr, backend.mod.DefaultTimeoutInterceptor(0.25)) as ch:
        r = backend.invoke(ch, shape, f"Seen_{shape}")
    assert r.code == grpc.StatusCode.OK, r
    assert len(seen) == 1 and 0.0 < seen[0] <= (0.3 if backend.name == "sync" else 0.27)


@pytest.mark.parametrize("shape", SHAPES)
def test_explicit_timeout_is_kept(backend: Backend, shape: str) -> None:
    seen: list[Any] = []
    with backend.serve(backend.all_shapes("Seen", _seen(seen))) as addr, \
            backend.channel(addr, backend.mod.DefaultTimeoutInterceptor(0.2)) as ch:
        r = backend.invoke(ch, shape, f"Seen_{shape}", timeout=30.0)
    assert r.code == grpc.StatusCode.OK, r
    assert 25.0 < seen[0] <= (30.5 if backend.name == "sync" else 30.1)


@pytest.mark.parametrize("shape", SHAPES)
def test_default_timeout_expires_a_hanging_call(backend: Backend, shape: str, stop: threading.Event) -> None:
    async def work(req: bytes, ctx: Any) -> bytes:
        await stuck_in_here(lambda: stop.is_set() or not is_active(ctx), 3.0)
        return req

    with backend.serve(backend.all_shapes("Hang", work)) as addr, \
            backend.channel(addr, backend.mod.DefaultTimeoutInterceptor(0.15)) as ch:
        r = backend.invoke(ch, shape, f"Hang_{shape}")
    assert r.code in backend.deadline_codes(shape), r
    assert 0.14 <= r.elapsed < ENDED, r


def test_no_default_and_no_propagation_leaves_calls_alone(backend: Backend) -> None:
    seen: list[Any] = []
    with backend.serve(backend.all_shapes("Seen", _seen(seen))) as addr, \
            backend.channel(addr, backend.mod.DeadlinePropagationInterceptor(margin=0.01)) as ch:
        r = backend.invoke(ch, "unary_unary", "Seen_unary_unary")
    assert r.code == grpc.StatusCode.OK
    assert backend.no_deadline(seen[0]), seen
