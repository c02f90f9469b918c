"""Smoke tests: does an installed bucketimer work at all?

A handful of quick checks of each way in (the C module, the cffi module, the
dispatcher thread, ``timeout()`` and the drop-in loop), on whichever backend
was loaded (the C and cffi modules only on the native one), written to run both in
the normal suite and alone against an installed wheel: they use no fixture
from ``conftest.py`` and no helper module, so ``nox -s dist`` (and
cibuildwheel's test command) copies this one file to an empty directory and
runs it there, where only the installed package can be imported.

With ``BUCKETIMER_SMOKE_INSTALLED=1`` they also check that what was imported
is the installed package, not a source tree; with
``BUCKETIMER_SMOKE_NO_COMPILER=1``, that no C compiler is on ``PATH`` (set by
``nox -s dist``; cibuildwheel tests inside its build image, which has one).
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import os
import shutil
import sys
import threading
import time
from pathlib import Path

import pytest

import bucketimer

NATIVE = bucketimer.backend == "native"
if NATIVE:
    from bucketimer import _cffi


def _flag(name: str) -> bool:
    return os.environ.get(name, "") not in ("", "0")


INSTALLED = _flag("BUCKETIMER_SMOKE_INSTALLED")
#: "native" or "python": the backend the installation must have loaded (the
#: suite's conftest.py checks it too, where the suite runs).
EXPECT_BACKEND = os.environ.get("BUCKETIMER_EXPECT_BACKEND", "")
native_only = pytest.mark.skipif(not NATIVE, reason="native backend only")
NO_COMPILER = _flag("BUCKETIMER_SMOKE_NO_COMPILER")

# Generous: these only check that timers fire, not how late (the suite
# proper does that); a loaded CI machine or an ASan build is slow.
WAIT = 30.0


def test_version_is_the_distributions() -> None:
    assert bucketimer.__version__ == importlib.metadata.version("bucketimer")


@pytest.mark.skipif(not EXPECT_BACKEND, reason="only where a backend is expected")
def test_the_expected_backend_is_loaded() -> None:
    assert bucketimer.backend == EXPECT_BACKEND


@pytest.mark.skipif(not INSTALLED, reason="only against an installed wheel")
def test_imported_from_the_installation() -> None:
    for mod in (bucketimer, bucketimer._core, _cffi) if NATIVE else (bucketimer,):
        path = Path(mod.__file__).resolve()
        assert path.is_relative_to(Path(sys.prefix).resolve()), path
    assert not (Path(bucketimer.__file__).parent / "_cffi_build.py").exists()


@pytest.mark.skipif(not NO_COMPILER, reason="only where no compiler must be found")
def test_no_compiler_on_path() -> None:
    for compiler in ("gcc", "cc", "clang", "zig", "c99"):
        assert shutil.which(compiler) is None, compiler
    assert "CC" not in os.environ


def test_call_later_fires_on_the_dispatcher_thread() -> None:
    done = threading.Event()
    seen: list[tuple[str, int]] = []

    def callback(value: int) -> None:
        seen.append((threading.current_thread().name, value))
        done.set()

    with bucketimer.TimerThread() as tt:
        handle = tt.call_later(0.01, callback, 42)
        assert done.wait(WAIT)
        assert seen == [("bucketimer-dispatcher", 42)]
        assert handle.cancel() is False  # it already ran
        assert handle.when() <= time.monotonic()


def test_cancelled_timer_never_runs_and_stats_count_it() -> None:
    with bucketimer.TimerThread() as tt:
        ran: list[int] = []
        handle = tt.call_later(3600, ran.append, 1)
        assert handle.cancel() is True
        stats = tt.stats()
        assert stats["scheduled"] == 1
        assert stats["cancelled"] == 1
        assert stats["early_fires"] == 0
        # docs/performance.rst documents 48 log2-ns buckets: pinned here, once.
        if NATIVE:
            assert bucketimer._core.HIST_BUCKETS == _cffi.lib.BT_HIST_BUCKETS == 48
        assert len(stats["lateness_hist"]) == 48
        assert ran == []


def test_timeout_in_asyncio_run() -> None:
    async def main() -> tuple[bool, bool]:
        async with bucketimer.timeout(WAIT) as kept:
            await asyncio.sleep(0)
        with pytest.raises(TimeoutError):
            async with bucketimer.timeout(0.01) as expired:
                await asyncio.sleep(WAIT)
        return kept.expired(), expired.expired()

    assert asyncio.run(main()) == (False, True)


def test_wait_for_in_asyncio_run() -> None:
    async def main() -> int:
        with pytest.raises(TimeoutError):
            await bucketimer.wait_for(asyncio.sleep(WAIT), 0.01)
        return await bucketimer.wait_for(asyncio.sleep(0, result=7), WAIT)

    assert asyncio.run(main()) == 7


async def _asyncio_wait_for_outcome() -> str:
    """asyncio's own wait_for, on the running loop, of a sleep longer than
    its timeout: "timed out" when the loop's timers work."""
    try:
        await asyncio.wait_for(asyncio.sleep(WAIT), 0.01)
    except TimeoutError:
        return "timed out"
    return "no timeout"


@native_only
def test_drop_in_loop_serves_asyncio_timers_natively() -> None:
    tt = bucketimer.TimerThread()
    try:
        with asyncio.Runner(loop_factory=lambda: bucketimer.EventLoop(timer_thread=tt)) as runner:
            loop = runner.get_loop()
            assert isinstance(loop, bucketimer.EventLoop)
            before = tt.stats()

            async def main() -> str:
                await asyncio.sleep(0.01)
                return await _asyncio_wait_for_outcome()

            assert runner.run(main()) == "timed out"
            assert loop._scheduled == []  # nothing went to asyncio's own heap
            after = tt.stats()
        assert after["scheduled"] - before["scheduled"] >= 2
        assert after["ran"] - before["ran"] >= 2
    finally:
        tt.close()


def test_drop_in_loop_serves_asyncio_timers() -> None:
    with asyncio.Runner(loop_factory=bucketimer.new_event_loop) as runner:
        assert runner.run(_asyncio_wait_for_outcome()) == "timed out"


def test_new_event_loop_factory() -> None:
    with asyncio.Runner(loop_factory=bucketimer.new_event_loop) as runner:
        assert isinstance(runner.get_loop(), bucketimer.EventLoop)
        assert runner.run(asyncio.sleep(0.01, result="slept")) == "slept"


@native_only
def test_cffi_module() -> None:
    ffi, lib = _cffi.ffi, _cffi.lib
    a = lib.bt_now_ns()
    b = lib.bt_now_ns()
    assert 0 < a <= b
    opt = ffi.new("bt_options *")
    lib.bt_options_init(opt)
    assert opt.num_buckets > 0
