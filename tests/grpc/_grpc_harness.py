"""One harness for the sync and the aio gRPC interceptors: the tests of
tests/grpc/ are written once and run against both backends.

A backend starts real servers on 127.0.0.1 and calls them, in the four call
shapes, with generic handlers on bytes (no protobuf).  The test body is the
same for both: the aio backend runs its servers and clients on an event loop
in a thread of its own, so ``invoke()`` blocks in either case.

A handler's work is written once as ``async def work(request, context)``.
The aio backend awaits it in the handler; the sync backend runs it to the
end in one ``send()``: its waits (:func:`stuck_in_here`) block without
suspending the coroutine, so the work's frames stay on the handler thread's
stack (what the slow-call stack shows), and an asynchronous
``DeadlineInterrupt`` lands inside it.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Generator, Iterator
from concurrent import futures
from typing import Any

import grpc
import grpc.aio

import bucketimer.grpc as btg
import bucketimer.grpc.aio as bta

SERVICE = "bt.Test"
SHAPES = ("unary_unary", "unary_stream", "stream_unary", "stream_stream")
LOGGER = "bucketimer.grpc"

Work = Callable[[bytes, Any], Coroutine[Any, Any, bytes]]


# -- waiting inside a handler, on either backend ------------------------------------------


def busy_until(pred: Callable[[], bool], limit: float) -> float:
    """A Python-level wait (short sleeps, so an async exception can land)."""
    t0 = time.monotonic()
    while not pred() and time.monotonic() - t0 < limit:
        time.sleep(0.002)
    return time.monotonic() - t0


async def _until_async(pred: Callable[[], bool], limit: float) -> float:
    t0 = time.monotonic()
    while not pred() and time.monotonic() - t0 < limit:
        await asyncio.sleep(0.002)
    return time.monotonic() - t0


def _blocking(pred: Callable[[], bool], limit: float) -> Generator[Any, None, float]:
    return busy_until(pred, limit)
    yield  # a generator that never yields: the wait blocks inside the await


class _Wait:
    def __init__(self, pred: Callable[[], bool], limit: float) -> None:
        self.pred, self.limit = pred, limit

    def __await__(self) -> Generator[Any, None, float]:
        if asyncio._get_running_loop() is None:  # a sync handler's thread
            return _blocking(self.pred, self.limit)
        return _until_async(self.pred, self.limit).__await__()


async def stuck_in_here(pred: Callable[[], bool], limit: float) -> float:
    """Wait until ``pred()`` or ``limit`` seconds; the seconds waited.  A
    recognisable frame for the stack in slow-call records."""
    return await _Wait(pred, limit)


def is_active(ctx: Any) -> bool:
    """A sync context's ``is_active()``; an aio handler is cancelled instead."""
    probe = getattr(ctx, "is_active", None)
    return probe() if probe is not None else True


def run_to_end(coro: Coroutine[Any, Any, Any]) -> Any:
    """A work coroutine run in a sync handler: it never suspends."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    coro.close()
    raise AssertionError("a work coroutine suspended in a sync handler")


#: Seconds within which a call that its deadline ends has ended, however
#: loaded the machine: the tests' upper bounds, which tell "ended by the
#: deadline" from "held until the handler gave up" (STUCK s).
ENDED = 2.0
STUCK = 3.0


def stubborn(log: list[Any], stop: threading.Event, limit: float = STUCK,
             until: Callable[[], object] = lambda: True) -> Any:
    """A handler that keeps working past its budget: on the sync server it
    watches ``is_active()`` (and, once the call is inactive, goes on until
    ``until()``), on the aio server it is cancelled (and, once cancelled,
    goes on until ``until()`` before it lets the cancel through)."""

    async def work(req: bytes, ctx: Any) -> bytes:
        t0 = time.monotonic()
        log.append(("start", is_active(ctx), ctx.time_remaining(), btg.remaining()))
        try:
            waited = await stuck_in_here(
                lambda: stop.is_set() or (not is_active(ctx) and bool(until())), limit)
        except asyncio.CancelledError:
            cancelled_after = time.monotonic() - t0
            await stuck_in_here(lambda: stop.is_set() or bool(until()), limit)
            # logged last, with nothing awaited after it: a test that has
            # seen it stops no server under a handler that is still pending
            log.append(("cancelled", cancelled_after))
            raise
        log.append(("inactive", is_active(ctx), waited, time.monotonic() - t0))
        return b"late"

    return work


# -- results ---------------------------------------------------------------------------------


class Result:
    """What a call got: its messages, status and details, how long it took,
    and the RpcError it raised (``error``), if it did."""

    def __init__(self, responses: list[bytes], code: Any, details: str | None, elapsed: float,
                 error: BaseException | None = None) -> None:
        self.responses, self.code, self.details, self.elapsed = responses, code, details, elapsed
        self.error = error

    def __repr__(self) -> str:
        return f"Result({self.responses!r}, {self.code}, {self.details!r}, {self.elapsed:.3f}s)"


def wait_for(pred: Callable[[], Any], timeout: float = 3.0) -> bool:
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            return bool(pred())
        time.sleep(0.001)
    return True


class Call:
    """One call for :meth:`Backend.invoke_many`: ``/SERVICE/method`` in
    ``shape`` on ``channel``.  A streamed request is ``requests`` messages
    ``spacing`` s apart (the client uploading slowly); a streamed response
    is read ``read_delay`` s after each message (a slow reader); the client
    cancels the call ``cancel_at`` s after it started."""

    def __init__(self, channel: Any, shape: str, method: str, *, payload: bytes = b"x",
                 timeout: float | None = None, cancel_at: float | None = None,
                 requests: int = 1, spacing: float = 0.0, read_delay: float = 0.0) -> None:
        self.channel, self.shape, self.method, self.payload = channel, shape, method, payload
        self.timeout, self.cancel_at = timeout, cancel_at
        self.requests, self.spacing, self.read_delay = requests, spacing, read_delay
        #: when the client's cancel() was called (seconds after the start), if it was
        self.cancelled_at: float | None = None


def _start(c: Call, requests: Any, unary: Callable[[Any], Any] = lambda method: method) -> Any:
    """``c``'s call, started on its channel with ``requests`` as a streamed
    request (``unary``: how a unary-response method is started)."""
    method = getattr(c.channel, c.shape)(f"/{SERVICE}/{c.method}")
    if c.shape.endswith("_unary"):
        method = unary(method)
    return method(requests if c.shape.startswith("stream") else c.payload, timeout=c.timeout)


def _canceller(c: Call, call: Any, t0: float) -> Callable[[], None]:
    """What cancels ``call`` at ``c.cancel_at``, noting when it did."""
    def cancel() -> None:
        c.cancelled_at = time.monotonic() - t0
        call.cancel()
    return cancel


#: The code of a Result whose call grpc.aio ended with ``asyncio.CancelledError``
#: though the test did not cancel it.  grpc.aio does that to a call with
#: streamed requests whose deadline passes while it writes one: its request
#: consumer cancels the call on the write's error, and the call then reports
#: CANCELLED ("Locally cancelled by application!") instead of
#: DEADLINE_EXCEEDED.  Stock grpc.aio on a stock loop does it too (a timeout
#: of a millisecond shows it in one to three calls of a hundred).
LOCALLY_CANCELLED = "asyncio.CancelledError, no cancel of the test's"


def _cancelled_by_caller() -> bool:
    """In an ``except asyncio.CancelledError`` of a call the test did not
    cancel: whether the task itself is being cancelled (``run()``'s bound),
    which goes on; if not, the call is grpc.aio's LOCALLY_CANCELLED."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _cancelled_result(got: list[bytes], call: Call, t0: float) -> Result:
    # both APIs: what a client that cancelled its own call sees
    return Result(got, grpc.StatusCode.CANCELLED, "cancelled by the client", time.monotonic() - t0)


# -- the backends ---------------------------------------------------------------------------


class Backend:
    """What a test needs of one API: its module and servers, channels and calls."""

    name = ""
    mod: Any = None
    #: (shape, method suffix): the four shapes, plus other ways to serve them
    variants: list[tuple[str, str]] = [(s, s) for s in SHAPES]

    def handler(self, shape: str, work: Work, *, writer: bool = False) -> Any:
        raise NotImplementedError

    def no_deadline(self, time_remaining: float | None) -> bool:
        """Is this what a handler's ``time_remaining()`` says without a deadline?"""
        raise NotImplementedError

    async def invoke_from_handler(self, channel: Any, shape: str, method: str, payload: bytes = b"x",
                                  timeout: float | None = None, *, in_task: bool = False) -> Result:
        """:meth:`invoke` from a handler's work (aio: in a task of its own
        with ``in_task``, which copies the handler's context)."""
        raise NotImplementedError

    def all_shapes(self, name: str, work: Work) -> dict[str, Any]:
        """A handler for every variant, ``{name}_{suffix}``."""
        return {f"{name}_{suffix}": self.handler(shape, work, writer=suffix.endswith("_writer"))
                for shape, suffix in self.variants}

    def serve(self, handlers: dict[str, Any], interceptors: tuple[Any, ...] = ()) -> Any:
        raise NotImplementedError

    def channel(self, address: str, *interceptors: Any) -> Any:
        raise NotImplementedError

    def invoke(self, channel: Any, shape: str, method: str, payload: bytes = b"x",
               timeout: float | None = None) -> Result:
        """Calls ``/SERVICE/method`` in ``shape``; never raises RpcError."""
        raise NotImplementedError

    def invoke_many(self, calls: list[Call]) -> list[Result]:
        """Makes ``calls`` at once (threads on sync, tasks on aio); their
        results, in order."""
        raise NotImplementedError

    def deadline_codes(self, shape: str) -> tuple[Any, ...]:
        """The codes of a ``shape`` call that its deadline ended."""
        return (grpc.StatusCode.DEADLINE_EXCEEDED,)

    def __repr__(self) -> str:
        return self.name


def _stream_handler(shape: str, behavior: Any) -> Any:
    make = {"unary_unary": grpc.unary_unary_rpc_method_handler,
            "unary_stream": grpc.unary_stream_rpc_method_handler,
            "stream_unary": grpc.stream_unary_rpc_method_handler,
            "stream_stream": grpc.stream_stream_rpc_method_handler}[shape]
    return make(behavior)


class SyncBackend(Backend):
    name = "sync"
    mod = btg

    def no_deadline(self, time_remaining: float | None) -> bool:
        return time_remaining is not None and time_remaining > 1e6  # grpc's "no deadline"

    async def invoke_from_handler(self, channel: Any, shape: str, method: str, payload: bytes = b"x",
                                  timeout: float | None = None, *, in_task: bool = False) -> Result:
        return self.invoke(channel, shape, method, payload, timeout)

    def handler(self, shape: str, work: Work, *, writer: bool = False) -> Any:
        """Streaming responses first yield ``b"first"`` (so the client sees a
        partial stream before any status); streaming requests are joined first."""
        def call(req: bytes, ctx: Any) -> bytes:
            return run_to_end(work(req, ctx))

        if shape == "unary_unary":
            return _stream_handler(shape, call)
        if shape == "stream_unary":
            return _stream_handler(shape, lambda it, ctx: call(b"".join(it), ctx))

        def streamed(req: Any, ctx: Any) -> Iterator[bytes]:
            data = b"".join(req) if shape == "stream_stream" else req
            yield b"first"
            yield call(data, ctx)
        return _stream_handler(shape, streamed)

    @contextlib.contextmanager
    def serve(self, handlers: dict[str, Any], interceptors: tuple[Any, ...] = (),
              pool: futures.ThreadPoolExecutor | None = None) -> Iterator[str]:
        pool = pool or futures.ThreadPoolExecutor(max_workers=4)
        server = grpc.server(pool, interceptors=list(interceptors))
        server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, handlers)])
        port = server.add_insecure_port("127.0.0.1:0")
        assert port
        server.start()
        try:
            yield f"127.0.0.1:{port}"
        finally:
            # stop() waits forever when grpc's polling thread died: bound it.
            stopper = threading.Thread(target=server.stop, args=(None,), daemon=True)
            stopper.start()
            stopper.join(10.0)
            pool.shutdown(wait=False)
            assert not stopper.is_alive(), "the grpc server did not stop"

    @contextlib.contextmanager
    def channel(self, address: str, *interceptors: Any) -> Iterator[Any]:
        ch = grpc.insecure_channel(address)
        try:
            yield grpc.intercept_channel(ch, *interceptors) if interceptors else ch
        finally:
            ch.close()

    def invoke(self, channel: Any, shape: str, method: str, payload: bytes = b"x",
               timeout: float | None = None) -> Result:
        path = f"/{SERVICE}/{method}"
        got: list[bytes] = []
        t0 = time.monotonic()
        try:
            if shape == "unary_unary":
                got.append(channel.unary_unary(path)(payload, timeout=timeout))
            elif shape == "unary_stream":
                for r in channel.unary_stream(path)(payload, timeout=timeout):
                    got.append(r)
            elif shape == "stream_unary":
                got.append(channel.stream_unary(path)(iter([payload]), timeout=timeout))
            else:
                for r in channel.stream_stream(path)(iter([payload]), timeout=timeout):
                    got.append(r)
            code, details, error = grpc.StatusCode.OK, None, None
        except grpc.RpcError as e:
            code, details, error = e.code(), e.details(), e
        return Result(got, code, details, time.monotonic() - t0, error)

    def invoke_many(self, calls: list[Call]) -> list[Result]:
        with futures.ThreadPoolExecutor(max_workers=max(1, len(calls))) as pool:
            return list(pool.map(self._invoke_call, calls))

    def _invoke_call(self, c: Call) -> Result:
        def requests() -> Iterator[bytes]:
            for i in range(c.requests):
                if i:
                    time.sleep(c.spacing)
                yield c.payload

        got: list[bytes] = []
        t0 = time.monotonic()
        call = _start(c, requests(), lambda method: method.future)
        timer = None
        if c.cancel_at is not None:
            timer = threading.Timer(c.cancel_at, _canceller(c, call, t0))
            timer.start()
        try:
            if c.shape in ("unary_unary", "stream_unary"):
                got.append(call.result())
            else:
                for r in call:
                    got.append(r)
                    time.sleep(c.read_delay)
            code, details, error = grpc.StatusCode.OK, None, None
        except grpc.FutureCancelledError:
            return _cancelled_result(got, c, t0)
        except grpc.RpcError as e:
            code, details, error = e.code(), e.details(), e
            if code == grpc.StatusCode.CANCELLED and c.cancelled_at is not None:
                return _cancelled_result(got, c, t0)
        finally:
            if timer is not None:
                timer.cancel()
        return Result(got, code, details, time.monotonic() - t0, error)


class AioBackend(Backend):
    """Servers and clients on an event loop in a thread of its own."""

    name = "aio"
    mod = bta
    variants = [(s, s) for s in SHAPES] + [("unary_stream", "unary_stream_writer"),
                                           ("stream_stream", "stream_stream_writer")]

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="grpc-aio-test", daemon=True)
        self.thread.start()

    def no_deadline(self, time_remaining: float | None) -> bool:
        return time_remaining is None

    def deadline_codes(self, shape: str) -> tuple[Any, ...]:
        # streamed requests: grpc.aio's mid-write race too (LOCALLY_CANCELLED)
        if shape.startswith("stream"):
            return grpc.StatusCode.DEADLINE_EXCEEDED, LOCALLY_CANCELLED
        return super().deadline_codes(shape)

    async def invoke_from_handler(self, channel: Any, shape: str, method: str, payload: bytes = b"x",
                                  timeout: float | None = None, *, in_task: bool = False) -> Result:
        call = self.invoke_async(channel, shape, method, payload, timeout)
        return await (asyncio.create_task(call) if in_task else call)

    def run(self, coro: Awaitable[Any], timeout: float = 20.0) -> Any:
        async def bounded() -> Any:
            return await asyncio.wait_for(coro, timeout)
        return asyncio.run_coroutine_threadsafe(bounded(), self.loop).result(timeout + 5.0)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5.0)
        self.loop.close()

    def handler(self, shape: str, work: Work, *, writer: bool = False) -> Any:
        """As the sync backend's; with ``writer=True`` streaming responses
        use ``context.write()`` instead of an async generator."""
        if shape == "unary_unary":
            return _stream_handler(shape, work)
        if shape == "stream_unary":
            async def su(it: Any, ctx: Any) -> bytes:
                return await work(b"".join([r async for r in it]), ctx)
            return _stream_handler(shape, su)

        async def request_of(req: Any) -> bytes:
            return b"".join([r async for r in req]) if shape == "stream_stream" else req

        if writer:
            async def write_api(req: Any, ctx: Any) -> None:
                data = await request_of(req)
                await ctx.write(b"first")
                await ctx.write(await work(data, ctx))
            return _stream_handler(shape, write_api)

        async def gen_api(req: Any, ctx: Any) -> AsyncIterator[bytes]:
            data = await request_of(req)
            yield b"first"
            yield await work(data, ctx)
        return _stream_handler(shape, gen_api)

    @contextlib.contextmanager
    def serve(self, handlers: dict[str, Any], interceptors: tuple[Any, ...] = ()) -> Iterator[str]:
        async def start() -> tuple[Any, int]:
            server = grpc.aio.server(interceptors=list(interceptors))
            server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, handlers)])
            port = server.add_insecure_port("127.0.0.1:0")
            await server.start()
            return server, port

        server, port = self.run(start())
        assert port
        try:
            yield f"127.0.0.1:{port}"
        finally:
            self.run(server.stop(None))

    @contextlib.contextmanager
    def channel(self, address: str, *interceptors: Any) -> Iterator[Any]:
        ics = bta.client_interceptors(*interceptors) if interceptors else None

        async def open_channel() -> Any:
            return grpc.aio.insecure_channel(address, interceptors=ics)

        ch = self.run(open_channel())
        try:
            yield ch
        finally:
            self.run(ch.close())

    def invoke(self, channel: Any, shape: str, method: str, payload: bytes = b"x",
               timeout: float | None = None) -> Result:
        return self.run(self.invoke_async(channel, shape, method, payload, timeout))

    async def invoke_async(self, channel: Any, shape: str, method: str, payload: bytes = b"x",
                           timeout: float | None = None) -> Result:
        """:meth:`invoke` from inside the loop (a handler calling downstream)."""
        path = f"/{SERVICE}/{method}"
        got: list[bytes] = []

        async def requests() -> AsyncIterator[bytes]:
            yield payload

        t0 = time.monotonic()
        try:
            if shape == "unary_unary":
                got.append(await channel.unary_unary(path)(payload, timeout=timeout))
            elif shape == "unary_stream":
                async for r in channel.unary_stream(path)(payload, timeout=timeout):
                    got.append(r)
            elif shape == "stream_unary":
                got.append(await channel.stream_unary(path)(requests(), timeout=timeout))
            else:
                async for r in channel.stream_stream(path)(requests(), timeout=timeout):
                    got.append(r)
            code, details, error = grpc.StatusCode.OK, None, None
        except asyncio.CancelledError:
            if _cancelled_by_caller():
                raise
            return Result(got, LOCALLY_CANCELLED, None, time.monotonic() - t0)
        except grpc.RpcError as e:
            code, details, error = e.code(), e.details(), e
        return Result(got, code, details, time.monotonic() - t0, error)

    def invoke_many(self, calls: list[Call]) -> list[Result]:
        async def all_calls() -> list[Result]:
            return list(await asyncio.gather(*(self._invoke_call(c) for c in calls)))
        return self.run(all_calls())  # type: ignore[no-any-return]

    async def _invoke_call(self, c: Call) -> Result:
        async def requests() -> AsyncIterator[bytes]:
            for i in range(c.requests):
                if i:
                    await asyncio.sleep(c.spacing)
                yield c.payload

        got: list[bytes] = []
        t0 = time.monotonic()
        call = _start(c, requests())
        timer = None
        if c.cancel_at is not None:
            timer = asyncio.get_running_loop().call_later(c.cancel_at, _canceller(c, call, t0))
        try:
            if c.shape in ("unary_unary", "stream_unary"):
                got.append(await call)
            else:
                async for r in call:
                    got.append(r)
                    await asyncio.sleep(c.read_delay)
            code, details, error = grpc.StatusCode.OK, None, None
        except asyncio.CancelledError:
            if c.cancelled_at is not None:
                return _cancelled_result(got, c, t0)
            if _cancelled_by_caller():
                raise
            # what this call got, for its row to weigh against the others'
            # (and to name), rather than an end of the row
            return Result(got, LOCALLY_CANCELLED, None, time.monotonic() - t0)
        except grpc.RpcError as e:
            code, details, error = e.code(), e.details(), e
        finally:
            if timer is not None:
                timer.cancel()
        return Result(got, code, details, time.monotonic() - t0, error)


BACKENDS = ("sync", "aio")


def variant_params() -> list[Any]:
    """(backend, shape, method suffix) for every variant of each backend."""
    import pytest

    return [pytest.param(b, shape, suffix, id=f"{b}-{suffix}")
            for b, cls in (("sync", SyncBackend), ("aio", AioBackend))
            for shape, suffix in cls.variants]
