"""Which backend runs (bucketimer._backend): chosen once, at import."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

import bucketimer

FORCED = bool(os.environ.get("BUCKETIMER_NO_EXTENSIONS"))
# Where the native core is built (CMakeLists.txt's checks): a build that fell
# back to the pure package here is a broken build, not a platform without one.
NATIVE_BUILDS_HERE = (
    sys.platform == "linux"
    and platform.libc_ver()[0] == "glibc"
    and os.path.exists("/usr/include/linux/futex.h")
    and os.path.exists("/usr/include/sys/eventfd.h")
)


def _backend_with(value: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "BUCKETIMER_NO_EXTENSIONS"}
    if value is not None:
        env["BUCKETIMER_NO_EXTENSIONS"] = value
    return subprocess.run(
        [sys.executable, "-c", "import bucketimer; print(bucketimer.backend)"],
        env=env, capture_output=True, text=True, check=True, timeout=60,
    ).stdout.strip()


def test_backend_says_which_runs() -> None:
    pure = bucketimer.TimerThread.__module__.startswith("bucketimer._pure")
    assert bucketimer.backend == ("python" if pure else "native")


@pytest.mark.skipif(FORCED or not NATIVE_BUILDS_HERE,
                    reason="only where the native core is built and not forced off")
def test_the_native_backend_runs_where_it_is_built() -> None:
    assert bucketimer.backend == "native"


@pytest.mark.parametrize("value", ["1", "0", "yes", "anything"])
def test_any_non_empty_no_extensions_forces_the_pure_backend(value: str) -> None:
    # as aio-libs read MULTIDICT_NO_EXTENSIONS / YARL_NO_EXTENSIONS
    assert _backend_with(value) == "python"


def test_an_empty_no_extensions_forces_nothing() -> None:
    expected = _backend_with(None)
    assert _backend_with("") == expected


def test_the_pure_backend_serves_bucketimer_aio() -> None:
    script = ("import bucketimer, bucketimer.aio, asyncio; "
              "from bucketimer import aio; "
              "assert aio is bucketimer.aio is bucketimer._pure.aio, aio; "
              "assert bucketimer.timeout is aio.timeout; "
              "assert issubclass(aio.Timeout, asyncio.Timeout); "
              "assert bucketimer.wait_for is aio.wait_for; "
              "assert 'bucketimer._core' not in __import__('sys').modules")
    env = dict(os.environ, BUCKETIMER_NO_EXTENSIONS="1")
    subprocess.run([sys.executable, "-c", script], env=env, check=True, timeout=60)
