"""Each interceptor registered each way grpc offers, for every call kind,
against a real server on 127.0.0.1, sync and aio; and the clear TypeError for
an interceptor of the other API.

The handlers answer with what they saw (``context.time_remaining()``), so
whether an interceptor served a call shows in the reply, not in timing; the
slow-call interceptors report to ``on_slow``.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
import types
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent import futures
from typing import Any

import pytest

grpc = pytest.importorskip("grpc")

from _grpc_harness import SHAPES, wait_for  # noqa: E402

import bucketimer.grpc as btg  # noqa: E402
import bucketimer.grpc.aio as bta  # noqa: E402
from bucketimer.grpc import _common  # noqa: E402

SERVICE = "bt.Reg"
HOLD = 0.3  # how long a handler holds a call that a slow-call interceptor should see
THRESHOLD = 0.05

_MAKE = {"unary_unary": grpc.unary_unary_rpc_method_handler,
         "unary_stream": grpc.unary_stream_rpc_method_handler,
         "stream_unary": grpc.stream_unary_rpc_method_handler,
         "stream_stream": grpc.stream_stream_rpc_method_handler}


def _seen(ctx: Any) -> bytes:
    """The handler's ``time_remaining()``: b"none" without a deadline."""
    left = ctx.time_remaining()
    return b"none" if left is None or left > 1e6 else f"{left:.3f}".encode()


def _sync_handlers() -> Any:
    def unary(req: bytes, ctx: Any) -> bytes:
        time.sleep(float(req))
        return _seen(ctx)

    def joined(it: Iterator[bytes]) -> bytes:
        return b"".join(it)

    behaviors = {"unary_unary": unary,
                 "unary_stream": lambda req, ctx: iter([unary(req, ctx)]),
                 "stream_unary": lambda it, ctx: unary(joined(it), ctx),
                 "stream_stream": lambda it, ctx: iter([unary(joined(it), ctx)])}
    return grpc.method_handlers_generic_handler(
        SERVICE, {k: _MAKE[k](v) for k, v in behaviors.items()})


def _aio_handlers() -> Any:
    async def unary(req: bytes, ctx: Any) -> bytes:
        await asyncio.sleep(float(req))
        return _seen(ctx)

    async def joined(it: Any) -> bytes:
        return b"".join([r async for r in it])

    async def unary_stream(req: bytes, ctx: Any) -> AsyncIterator[bytes]:
        yield await unary(req, ctx)

    async def stream_unary(it: Any, ctx: Any) -> bytes:
        return await unary(await joined(it), ctx)

    async def stream_stream(it: Any, ctx: Any) -> AsyncIterator[bytes]:
        yield await unary(await joined(it), ctx)

    behaviors = {"unary_unary": unary, "unary_stream": unary_stream,
                 "stream_unary": stream_unary, "stream_stream": stream_stream}
    return grpc.method_handlers_generic_handler(
        SERVICE, {k: _MAKE[k](v) for k, v in behaviors.items()})


def _local(server: Any) -> tuple[str, str]:
    """(insecure address, secure address) of ``server`` on 127.0.0.1."""
    plain = server.add_insecure_port("127.0.0.1:0")
    secure = server.add_secure_port("127.0.0.1:0", grpc.local_server_credentials())
    assert plain and secure
    return f"127.0.0.1:{plain}", f"127.0.0.1:{secure}"


# -- sync --------------------------------------------------------------------------------------


@contextlib.contextmanager
def sync_server(*interceptors: Any) -> Iterator[tuple[str, str]]:
    pool = futures.ThreadPoolExecutor(max_workers=4)
    server = grpc.server(pool, interceptors=list(interceptors))
    server.add_generic_rpc_handlers([_sync_handlers()])
    addresses = _local(server)
    server.start()
    try:
        yield addresses
    finally:
        server.stop(None).wait(10.0)
        pool.shutdown(wait=False)


def sync_call(channel: Any, shape: str, hold: float = 0.0) -> bytes:
    path, req = f"/{SERVICE}/{shape}", str(hold).encode()
    if shape == "unary_unary":
        return channel.unary_unary(path)(req)  # type: ignore[no-any-return]
    if shape == "unary_stream":
        return b"".join(channel.unary_stream(path)(req))
    if shape == "stream_unary":
        return channel.stream_unary(path)(iter([req]))  # type: ignore[no-any-return]
    return b"".join(channel.stream_stream(path)(iter([req])))


def sync_client(address: str, ic: Any, shape: str, hold: float = 0.0) -> bytes:
    """One call through ``grpc.intercept_channel(channel, ic)``."""
    with grpc.insecure_channel(address) as ch:
        return sync_call(grpc.intercept_channel(ch, ic) if ic is not None else ch, shape, hold)


# -- aio ----------------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def aio_server(*interceptors: Any) -> AsyncIterator[tuple[str, str]]:
    server = grpc.aio.server(interceptors=list(interceptors))
    server.add_generic_rpc_handlers([_aio_handlers()])
    addresses = _local(server)
    await server.start()
    try:
        yield addresses
    finally:
        await server.stop(None)


async def aio_call(channel: Any, shape: str, hold: float = 0.0) -> bytes:
    path, req = f"/{SERVICE}/{shape}", str(hold).encode()

    async def requests() -> AsyncIterator[bytes]:
        yield req

    if shape == "unary_unary":
        return await channel.unary_unary(path)(req)  # type: ignore[no-any-return]
    if shape == "unary_stream":
        return b"".join([r async for r in channel.unary_stream(path)(req)])
    if shape == "stream_unary":
        return await channel.stream_unary(path)(requests())  # type: ignore[no-any-return]
    return b"".join([r async for r in channel.stream_stream(path)(requests())])


#: the ways to give grpc.aio client interceptors: (addresses, interceptors) -> channel
AIO_WAYS: dict[str, Callable[[tuple[str, str], list[Any]], Any]] = {
    "insecure_channel": lambda a, ics: grpc.aio.insecure_channel(a[0], interceptors=ics),
    "secure_channel": lambda a, ics: grpc.aio.secure_channel(
        a[1], grpc.local_channel_credentials(), interceptors=ics),
    "client_interceptors": lambda a, ics: grpc.aio.insecure_channel(
        a[0], interceptors=bta.client_interceptors(*ics)),
}


async def aio_client(addresses: tuple[str, str], way: str, ic: Any, shape: str, hold: float = 0.0) -> bytes:
    async with AIO_WAYS[way](addresses, [ic]) as ch:
        return await aio_call(ch, shape, hold)


def run(coro: Any) -> Any:
    return asyncio.run(asyncio.wait_for(coro, 30.0))


# -- what each interceptor does to a call, seen from its reply ------------------------------------


def budget_of(reply: bytes) -> float | None:
    return None if reply == b"none" else float(reply)


def has_budget(reply: bytes, at_most: float) -> bool:
    """A budget of about ``at_most`` s or less (grpc's clock on the server
    may count a few ms more than the timeout the client gave)."""
    b = budget_of(reply)
    return b is not None and 0.0 < b <= at_most + 0.05


def slow_ends(events: list[Any], side: str, shape: str) -> bool:
    """Did ``on_slow`` hear the end of a slow ``shape`` call on ``side``?"""
    method = f"/{SERVICE}/{shape}"
    return wait_for(lambda: any(e.finished and e.side == side and e.method == method for e in events))


CLIENT_KINDS = ["default_timeout", "propagation", "slow_call"]
SERVER_KINDS = ["server_deadline", "slow_call", "deadline_slow_call"]


def client_interceptor(mod: Any, kind: str, events: list[Any]) -> Any:
    if kind == "default_timeout":
        return mod.DefaultTimeoutInterceptor(5.0)
    if kind == "propagation":
        return mod.DeadlinePropagationInterceptor()
    return mod.SlowCallInterceptor(THRESHOLD, on_slow=events.append)


def server_interceptor(mod: Any, kind: str, events: list[Any]) -> Any:
    if kind == "server_deadline":
        return mod.ServerDeadlineInterceptor(2.0)
    if kind == "slow_call":
        return mod.SlowCallInterceptor(THRESHOLD, on_slow=events.append)
    return mod.ServerDeadlineSlowCallInterceptor(THRESHOLD, 2.0, on_slow=events.append)


@contextlib.contextmanager
def handler_budget(kind: str) -> Iterator[None]:
    """For ``propagation``: calls made here are as if made inside a handler
    with 1.5 s left (what ServerDeadlineInterceptor sets around a handler)."""
    if kind != "propagation":
        yield
        return
    budget = types.SimpleNamespace(_deadline=time.monotonic() + 1.5, _bound=math.inf)
    token = _common._deadline_var.set(budget)
    try:
        yield
    finally:
        _common._deadline_var.reset(token)


def check_client(kind: str, reply: bytes, events: list[Any], shape: str) -> None:
    if kind == "default_timeout":
        assert has_budget(reply, 5.0), reply
    elif kind == "propagation":
        assert has_budget(reply, 1.5), reply
    else:
        assert slow_ends(events, "client", shape), events


def check_server(kind: str, reply: bytes, events: list[Any], shape: str) -> None:
    if kind != "slow_call":
        assert has_budget(reply, 2.0), reply
    if kind != "server_deadline":
        assert slow_ends(events, "server", shape), events


HOLDS = {"default_timeout": 0.0, "propagation": 0.0, "slow_call": HOLD,
         "server_deadline": 0.0, "deadline_slow_call": HOLD}


# -- the matrix -------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind", CLIENT_KINDS)
def test_sync_client_interceptor_on_intercept_channel(kind: str, shape: str) -> None:
    events: list[Any] = []
    ic = client_interceptor(btg, kind, events)
    with sync_server() as addresses, handler_budget(kind):
        assert sync_client(addresses[0], None, shape) == b"none"  # nothing set a deadline
        reply = sync_client(addresses[0], ic, shape, HOLDS[kind])
    check_client(kind, reply, events, shape)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("way", list(AIO_WAYS))
@pytest.mark.parametrize("kind", CLIENT_KINDS)
def test_aio_client_interceptor_each_way(kind: str, way: str, shape: str) -> None:
    events: list[Any] = []

    async def main() -> bytes:
        ic = client_interceptor(bta, kind, events)
        async with aio_server() as addresses:
            async with grpc.aio.insecure_channel(addresses[0]) as plain:
                assert await aio_call(plain, shape) == b"none"
            with handler_budget(kind):
                return await aio_client(addresses, way, ic, shape, HOLDS[kind])

    check_client(kind, run(main()), events, shape)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind", SERVER_KINDS)
def test_sync_server_interceptor_on_grpc_server(kind: str, shape: str) -> None:
    events: list[Any] = []
    with sync_server(server_interceptor(btg, kind, events)) as addresses:
        reply = sync_client(addresses[0], None, shape, HOLDS.get(kind, HOLD))
    check_server(kind, reply, events, shape)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("kind", SERVER_KINDS)
def test_aio_server_interceptor_on_aio_server(kind: str, shape: str) -> None:
    events: list[Any] = []

    async def main() -> bytes:
        async with aio_server(server_interceptor(bta, kind, events)) as addresses:
            async with grpc.aio.insecure_channel(addresses[0]) as ch:
                return await aio_call(ch, shape, HOLDS.get(kind, HOLD))

    check_server(kind, run(main()), events, shape)


def test_aio_default_timeout_ends_a_streaming_call() -> None:
    """The trap as a user meets it: DefaultTimeoutInterceptor(0.2) given to
    the channel directly, a unary-stream call to a handler that takes 1 s."""
    async def main() -> Any:
        async with aio_server() as addresses:
            async with grpc.aio.insecure_channel(
                    addresses[0], interceptors=[bta.DefaultTimeoutInterceptor(0.2)]) as ch:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await aio_call(ch, "unary_stream", 1.0)
                return err.value.code()

    assert run(main()) is grpc.StatusCode.DEADLINE_EXCEEDED


def test_aio_channel_keeps_the_order_given() -> None:
    """Interceptors see a call in the order they were listed, bucketimer's
    split per kind among others (which grpc gets as they were given)."""
    seen: list[str] = []

    class Tag(grpc.aio.UnaryStreamClientInterceptor):
        def __init__(self, name: str) -> None:
            self.name = name

        async def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
            seen.append(self.name)
            return await continuation(details, request)

    class Slow(bta.SlowCallInterceptor):
        async def _client(self, continuation: Any, details: Any, request: Any) -> Any:
            seen.append("bucketimer")
            return await super()._client(continuation, details, request)

        intercept_unary_stream = _client

    async def main() -> None:
        async with aio_server() as addresses:
            async with grpc.aio.insecure_channel(
                    addresses[0], interceptors=[Tag("a"), Slow(10.0), Tag("b")]) as ch:
                await aio_call(ch, "unary_stream")

    run(main())
    assert seen == ["a", "bucketimer", "b"]


# -- the wrong API -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["DefaultTimeoutInterceptor", "DeadlinePropagationInterceptor",
                                  "SlowCallInterceptor"])
def test_sync_client_interceptor_on_aio_channel(name: str) -> None:
    ic = getattr(btg, name)(1.0) if name != "DeadlinePropagationInterceptor" else btg.DeadlinePropagationInterceptor()

    async def main() -> None:
        for way in AIO_WAYS:
            if way == "client_interceptors":
                continue  # client_interceptors() itself says what is wrong first
            with pytest.raises(TypeError) as err:
                AIO_WAYS[way](("127.0.0.1:1", "127.0.0.1:1"), [ic])
            assert str(err.value) == (f"bucketimer.grpc.{name} is an interceptor for the sync grpc API; "
                                      f"a grpc.aio channel takes bucketimer.grpc.aio.{name}")

    run(main())


@pytest.mark.parametrize("name", ["ServerDeadlineInterceptor", "SlowCallInterceptor",
                                  "ServerDeadlineSlowCallInterceptor"])
def test_sync_server_interceptor_on_aio_server(name: str) -> None:
    ic = getattr(btg, name)(1.0)

    async def main() -> None:
        with pytest.raises(TypeError) as err:
            grpc.aio.server(interceptors=[ic])
        assert str(err.value) == (f"bucketimer.grpc.{name} is an interceptor for the sync grpc API; "
                                  f"grpc.aio.server() takes bucketimer.grpc.aio.{name}")

    run(main())


@pytest.mark.parametrize("name", ["DefaultTimeoutInterceptor", "SlowCallInterceptor"])
def test_aio_client_interceptor_on_intercept_channel(name: str) -> None:
    ic = getattr(bta, name)(1.0)
    with grpc.insecure_channel("127.0.0.1:1") as ch, pytest.raises(TypeError) as err:
        grpc.intercept_channel(ch, ic)
    assert str(err.value) == (f"bucketimer.grpc.aio.{name} is an interceptor for grpc.aio; "
                              f"grpc.intercept_channel() takes bucketimer.grpc.{name}")


@pytest.mark.parametrize("name", ["ServerDeadlineInterceptor", "SlowCallInterceptor",
                                  "ServerDeadlineSlowCallInterceptor"])
def test_aio_server_interceptor_on_sync_server(name: str) -> None:
    ic = getattr(bta, name)(1.0)
    pool = futures.ThreadPoolExecutor(max_workers=1)
    try:
        with pytest.raises(TypeError) as err:
            grpc.server(pool, interceptors=[ic])
    finally:
        pool.shutdown()
    assert str(err.value) == (f"bucketimer.grpc.aio.{name} is an interceptor for grpc.aio; "
                              f"grpc.server() takes bucketimer.grpc.{name}")


def test_a_subclass_is_named_by_the_class_it_derives_from() -> None:
    class Mine(btg.SlowCallInterceptor):
        pass

    async def main() -> None:
        with pytest.raises(TypeError, match=r"takes bucketimer\.grpc\.aio\.SlowCallInterceptor$"):
            grpc.aio.server(interceptors=[Mine(1.0)])

    run(main())


def test_other_objects_get_grpcs_own_checks() -> None:
    """Only bucketimer's interceptors are looked at: grpc treats anything
    else as it would without bucketimer."""
    async def main() -> None:
        with pytest.raises(ValueError):
            grpc.aio.server(interceptors=[object()])
        with pytest.raises(ValueError):
            grpc.aio.insecure_channel("127.0.0.1:1", interceptors=[object()])
        with pytest.raises(ValueError):  # a server interceptor is no client one
            grpc.aio.insecure_channel("127.0.0.1:1", interceptors=[bta.ServerDeadlineInterceptor(1.0)])

    run(main())
    with grpc.insecure_channel("127.0.0.1:1") as ch, pytest.raises(TypeError, match="^interceptor must be"):
        grpc.intercept_channel(ch, object())
