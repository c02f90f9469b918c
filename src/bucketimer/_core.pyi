"""Types of bucketimer._core, the CPython module over the native core (ext/)."""

import asyncio
import contextvars
import sys
from collections.abc import Awaitable, Callable, Coroutine, Generator
from types import FrameType, TracebackType
from typing import Any, Final, Generic, Self, TypeVar, TypeVarTuple, Unpack, final

from typing_extensions import disjoint_base

from ._stats import Stats

_T = TypeVar("_T")
_Ts = TypeVarTuple("_Ts")

CANCELLED: Final[int]
TOO_LATE: Final[int]
UNKNOWN: Final[int]
DEFAULT_BUCKETS: Final[int]
MAX_BUCKETS: Final[int]
DEFAULT_DRAIN_THRESHOLD: Final[int]
MIN_DRAIN_THRESHOLD: Final[int]
DEFAULT_SWEEP_MIN: Final[int]
HIST_BUCKETS: Final[int]
SECONDS_RANGE: Final[float]

def monotonic_ns() -> int: ...
def timeout(delay: float | None, /) -> Timeout: ...
def timeout_at(when: float | None, /) -> Timeout: ...
def _compat_status() -> dict[str, str]: ...
def default_timer_thread() -> TimerThread: ...
def _set_default_class(cls: type[TimerThread], /) -> None: ...

if sys.version_info >= (3, 12):
    def wait_for(fut: Awaitable[_T], timeout: float | None) -> WaitFor[_T]: ...
    def _set_wait_for_nonpositive(
        fn: Callable[[Awaitable[Any], asyncio.AbstractEventLoop], Coroutine[Any, Any, Any]], /
    ) -> None: ...

@final
class Handle:
    @property
    def id(self) -> int: ...
    @property
    def loop(self) -> asyncio.AbstractEventLoop | None: ...
    @property
    def callback(self) -> Callable[..., object] | None: ...
    @property
    def args(self) -> tuple[Any, ...] | None: ...
    @property
    def _when(self) -> float: ...
    def cancel(self) -> bool: ...
    def cancelled(self) -> bool: ...
    def when(self) -> float: ...
    def get_context(self) -> contextvars.Context | None: ...

@final
class Port:
    @property
    def loop(self) -> asyncio.AbstractEventLoop | None: ...
    on_error: Callable[[Handle, BaseException], object] | None
    on_slow: Callable[[Any, tuple[Any, ...] | None, float, float], object] | None
    slow_after: float
    def drain(self) -> int: ...
    def fileno(self) -> int: ...
    def detach(self) -> None: ...
    def cancel_pending(self) -> int: ...

@final
class Scheduler:
    def __call__(
        self,
        time: float,
        callback: Callable[..., object],
        /,
        *args: Any,
        context: contextvars.Context | None = None,
    ) -> Handle: ...

@disjoint_base
class GrpcCall:
    """One call of a GrpcUnary (bucketimer.grpc subclasses it per method)."""
    _ctx: Any
    _deadline: float | None
    _source: str
    _task: Any
    _handle: Any
    _handle2: Any
    _start: float
    _ident: int
    _expired: bool
    _done: bool
    _slow: bool
    _first_slow: bool
    _where: Any

@final
class GrpcUnary:
    def __new__(
        cls,
        call_type: type[GrpcCall],
        behavior: Callable[[Any, Any], Any],
        var: contextvars.ContextVar[float | None],
        timers: Callable[[], Any],
        threshold: float,
        max_time: float | None,
    ) -> Self: ...
    def __call__(self, request: Any, context: Any, /) -> Any: ...
    @property
    def behavior(self) -> Callable[[Any, Any], Any]: ...
    @property
    def call_type(self) -> type[GrpcCall]: ...
    @property
    def free_calls(self) -> int: ...

if sys.version_info >= (3, 12):
    @final
    class GrpcAioUnary:
        def __new__(
            cls,
            call_type: type[GrpcCall],
            behavior: Callable[[Any, Any], Any],
            var: contextvars.ContextVar[float | None],
            timers: Callable[[], Any],
            threshold: float,
            max_time: float | None,
            current_task: Callable[[], Any],
        ) -> Self: ...
        def __call__(self, request: Any, context: Any, /) -> Coroutine[Any, Any, Any]: ...
        @property
        def behavior(self) -> Callable[[Any, Any], Any]: ...
        @property
        def call_type(self) -> type[GrpcCall]: ...
        @property
        def free_calls(self) -> int: ...

@disjoint_base
class TimerThread:
    def __init__(self, buckets: int = ..., *, drain_threshold: int = ...) -> None: ...
    @property
    def closed(self) -> bool: ...
    def call_later(
        self,
        delay: float,
        callback: Callable[[Unpack[_Ts]], object],
        /,
        *args: *_Ts,
        loop: asyncio.AbstractEventLoop | None = None,
        context: contextvars.Context | None = None,
    ) -> Handle: ...
    def call_at(
        self,
        when: float,
        callback: Callable[[Unpack[_Ts]], object],
        /,
        *args: *_Ts,
        loop: asyncio.AbstractEventLoop | None = None,
        context: contextvars.Context | None = None,
    ) -> Handle: ...
    def stats(self) -> Stats: ...
    def time(self) -> float: ...
    @property
    def _ports(self) -> dict[asyncio.AbstractEventLoop, Port]: ...
    @property
    def _dispatcher(self) -> Port | None: ...
    def _port(self, loop: asyncio.AbstractEventLoop | None, /) -> Port: ...
    def _forget(self, loop: asyncio.AbstractEventLoop, /) -> Port | None: ...
    def _attach(self, loop: asyncio.AbstractEventLoop | None, port: Port, /) -> None: ...
    def _orphans(self) -> Port: ...
    def _close_core(self) -> int | None: ...
    def _scheduler(self, loop: asyncio.AbstractEventLoop, absolute: bool, /) -> Scheduler: ...

@final
class Timeout:
    def __new__(cls, when: float | None) -> Self: ...
    def when(self) -> float | None: ...
    def reschedule(self, when: float | None, /) -> None: ...
    def expired(self) -> bool: ...
    def __aenter__(self) -> Coroutine[Any, Any, Timeout]: ...
    def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc_val: BaseException | None,
        exc_tb: TracebackType | None,
        /,
    ) -> Coroutine[Any, Any, None]: ...

if sys.version_info >= (3, 12):
    @final
    class WaitFor(Coroutine[Any, Any, _T], Generic[_T]):
        @property
        def cr_await(self) -> Any: ...
        @property
        def cr_running(self) -> bool: ...
        @property
        def cr_suspended(self) -> bool: ...
        @property
        def cr_frame(self) -> FrameType | None: ...
        @property
        def cr_code(self) -> None: ...
        if sys.version_info >= (3, 15):
            @property
            def cr_state(self) -> str: ...
        __name__: str
        __qualname__: str
        def __await__(self) -> Generator[Any, None, _T]: ...
        def send(self, value: Any, /) -> Any: ...
        def throw(self, typ: Any, val: Any = ..., tb: Any = ..., /) -> Any: ...
        def close(self) -> None: ...
