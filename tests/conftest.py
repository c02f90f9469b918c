"""Shared fixtures and hypothesis profiles.

Hypothesis profiles (as python-zstandard does):

* ``default``: quick, for a developer's run;
* ``ci``: more examples, no deadline (CI machines are noisy), printed blob;
* ``expensive``: long fuzzing, opt-in.

Choose one with ``HYPOTHESIS_PROFILE=ci``; ``BUCKETIMER_SLOW_TESTS=1`` selects
``expensive`` (unless ``HYPOTHESIS_PROFILE`` names another).
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import sys
import threading
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import pytest
from _helpers import TIME_SCALE, destroy_cffi_core, wait_until
from _helpers import cffi_core as _new_cffi_core
from hypothesis import HealthCheck, settings

import bucketimer

# tests/ is on sys.path (pytest's rootdir-based import mode), and tests/grpc
# is a directory of it: where grpcio is not installed (the Py_DEBUG
# sessions), ``import grpc`` would find that directory as a namespace
# package.  Made to fail as it should, so that importorskip("grpc") skips.
if (_spec := importlib.util.find_spec("grpc")) is not None and _spec.origin in (None, "namespace"):
    sys.modules["grpc"] = None  # type: ignore[assignment]

T = TypeVar("T")

settings.register_profile(
    "default",
    max_examples=100,
    stateful_step_count=40,
    deadline=None,
)
settings.register_profile(
    "ci",
    max_examples=200,
    stateful_step_count=50,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "expensive",
    max_examples=2000,
    stateful_step_count=200,
    deadline=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def _profile_name() -> str:
    name = os.environ.get("HYPOTHESIS_PROFILE")
    if name:
        return name
    if os.environ.get("BUCKETIMER_SLOW_TESTS") == "1":
        return "expensive"
    if os.environ.get("CI"):
        return "ci"
    return "default"


settings.load_profile(_profile_name())


def pytest_report_header(config: pytest.Config) -> str:
    scale = f"; time scale {TIME_SCALE:g}" if TIME_SCALE != 1.0 else ""
    return f"hypothesis profile: {_profile_name()}; bucketimer backend: {bucketimer.backend}{scale}"


def pytest_configure(config: pytest.Config) -> None:
    """BUCKETIMER_EXPECT_BACKEND (set by noxfile.py): the backend this run
    must test.  A native build that failed falls back to the pure package
    (pyproject.toml), and the native suite must not then pass on it."""
    expected = os.environ.get("BUCKETIMER_EXPECT_BACKEND")
    if expected and bucketimer.backend != expected:
        raise pytest.UsageError(
            f"bucketimer.backend is {bucketimer.backend!r}, this run expects {expected!r}"
        )


# TIME_SCALE (_helpers.py) scales the hang guards: the ini's ``timeout`` and
# each ``timeout`` mark.
def _scale_hang_guard(config: pytest.Config, item: pytest.Item) -> None:
    mark = item.get_closest_marker("timeout")
    if mark is not None:
        base = mark.args[0] if mark.args else mark.kwargs.get("timeout")
        args, kwargs = mark.args[1:], {k: v for k, v in mark.kwargs.items() if k != "timeout"}
    else:
        base, args, kwargs = config.getini("timeout"), (), {}
    if base:
        # Prepended: the item's own marks come before its module's and
        # class's, so this one is the closest.
        item.add_marker(pytest.mark.timeout(float(base) * TIME_SCALE, *args, **kwargs),
                        append=False)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """One suite, both backends: tests marked ``native`` test what only the
    native backend has (the C core through ``_cffi``, its counters, compat
    reads of CPython's state) and skip on the pure one, saying so.  Under
    ``BUCKETIMER_TEST_TIME_SCALE`` each test's hang guard is scaled."""
    if TIME_SCALE != 1.0:
        for item in items:
            _scale_hang_guard(config, item)
    if bucketimer.backend == "native":
        return
    skip = pytest.mark.skip(reason="native backend only (bucketimer.backend is 'python')")
    for item in items:
        if item.get_closest_marker("native") is not None:
            item.add_marker(skip)


# -- fixtures ---------------------------------------------------------------------


@pytest.fixture
def tt() -> Iterator[bucketimer.TimerThread]:
    """A fresh TimerThread, closed after the test."""
    timer_thread = bucketimer.TimerThread()
    try:
        yield timer_thread
    finally:
        timer_thread.close()


@pytest.fixture
def cffi_core() -> Iterator[Callable[..., Any]]:
    """``cffi_core(**options)``: a ``bt_timer_thread *`` made through
    ``bucketimer._cffi`` (bt_options_init's defaults, ``options`` on top),
    stopped and destroyed after the test."""
    made: list[Any] = []

    def make(**options: int) -> Any:
        made.append(_new_cffi_core(**options))
        return made[-1]

    yield make
    for tt in made:
        destroy_cffi_core(tt)


@pytest.fixture
def run() -> Callable[..., Any]:
    """``run(coro_fn, *args, timeout=10)``: runs ``coro_fn(*args)`` in a fresh
    event loop (closed afterwards, like ``asyncio.run``) and returns its
    result; fails the test if it takes longer than ``timeout`` seconds."""

    def _run(coro_fn: Callable[..., Awaitable[T]], *args: Any, timeout: float = 10.0) -> T:
        async def main() -> T:
            return await asyncio.wait_for(coro_fn(*args), timeout)

        return asyncio.run(main())

    return _run


class LoopThread:
    """An event loop running ``run_forever`` in a thread of its own."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self.thread = threading.Thread(target=self._main, name="test-loop-thread", daemon=True)
        self.thread.start()
        if not self._ready.wait(5):
            raise RuntimeError("loop thread did not start")

    def _main(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._ready.set)
        self.loop.run_forever()

    def call(self, fn: Callable[..., T], *args: Any, timeout: float = 5.0) -> T:
        """Runs ``fn(*args)`` in the loop's thread and returns its result."""

        async def coro() -> T:
            return fn(*args)

        return asyncio.run_coroutine_threadsafe(coro(), self.loop).result(timeout)

    def close(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        assert not self.thread.is_alive(), "loop thread did not stop"
        self.loop.close()


@pytest.fixture
def loop_thread() -> Iterator[LoopThread]:
    """An event loop running in another thread; stopped and closed afterwards."""
    lt = LoopThread()
    try:
        yield lt
    finally:
        lt.close()


@pytest.fixture(name="wait_until")
def wait_until_fixture() -> Callable[..., bool]:
    """The :func:`wait_until` helper, as a fixture."""
    return wait_until
