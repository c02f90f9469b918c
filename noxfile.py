"""Developer and CI tasks.  ``python -m nox -l`` lists them.

Default (``python -m nox``): the Python test suite on every supported Python,
and the C tests under ctest.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import nox

ROOT = Path(__file__).resolve().parent
PYTHONS = ["3.11", "3.12", "3.13"]

nox.options.sessions = ["tests", "ctest"]


@nox.session(python=PYTHONS)
def tests(session: nox.Session) -> None:
    """Builds and installs the package, then runs the pytest suite.

    Tests marked slow (e.g. 10 million live timers, ~3 GB) run only with
    BUCKETIMER_SLOW_TESTS=1, which also selects the long hypothesis profile.
    """
    session.install(".[test]")
    slow = os.environ.get("BUCKETIMER_SLOW_TESTS", "") not in ("", "0")
    marks = [] if slow else ["-m", "not slow"]
    session.run("pytest", *marks, *session.posargs)


@nox.session
def lint(session: nox.Session) -> None:
    """ruff check."""
    session.install("ruff")
    session.run(
        "ruff", "check", "src", "tests", "benchmarks", "noxfile.py", *session.posargs
    )


def _gcc_runtime(name: str) -> str:
    """Absolute path of a gcc runtime library such as libasan.so."""
    gcc = shutil.which("gcc")
    if gcc is None:
        raise RuntimeError("gcc not found on PATH")
    path = subprocess.run(
        [gcc, f"-print-file-name={name}"], check=True, capture_output=True, text=True
    ).stdout.strip()
    # gcc echoes the bare name back when it does not find the file.
    if not os.path.isabs(path) or not os.path.exists(path):
        raise RuntimeError(
            f"gcc does not know where {name} is (is its package installed?)"
        )
    return path


@nox.session(python="3.11")
def sanitize(session: nox.Session) -> None:
    """Python tests against an ASan+UBSan build of the extensions (slow tests skipped)."""
    try:
        libasan = _gcc_runtime("libasan.so")
        # Preloaded too, so that ASan finds the real __cxa_throw at start-up:
        # otherwise the first C++ exception in an extension (matplotlib's
        # ft2font) aborts in ASan's interceptor.
        libstdcxx = _gcc_runtime("libstdc++.so")
    except RuntimeError as e:
        session.error(str(e))
    session.install(
        "-v",
        ".[test]",
        env={
            "BUCKETIMER_SANITIZE": "address",
            # Keep the core's assert()s in this Release build.
            "CMAKE_ARGS": "-DBUCKETIMER_ASSERTS=ON",
        },
    )
    session.run(
        "pytest",
        "-m",
        "not slow",
        # Capture sys.stdout/err only, so that a sanitizer report (written to
        # fd 2 just before the abort) reaches the terminal.
        "--capture=sys",
        *session.posargs,
        env={
            "PYTHONMALLOC": "malloc",
            # The ASan runtime must be the first library loaded into the
            # (uninstrumented) interpreter; libubsan is loaded as a dependency
            # of the extension modules.
            "LD_PRELOAD": f"{libasan} {libstdcxx}",
            # CPython itself "leaks" by design at exit.
            "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=1",
            "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1",
        },
    )


def _cmake_ctest(
    session: nox.Session, build_dir: str, *extra: str, env: dict | None = None
) -> None:
    if shutil.which("cmake") is None or shutil.which("ctest") is None:
        session.error("cmake/ctest not found on PATH (Debian: apt-get install cmake)")
    session.run(
        "cmake",
        "-S",
        ".",
        "-B",
        build_dir,
        "-DBUCKETIMER_BUILD_PYTHON=OFF",
        "-DBUCKETIMER_BUILD_TESTS=ON",
        "-DBUCKETIMER_ASSERTS=ON",
        "-DCMAKE_BUILD_TYPE=RelWithDebInfo",
        *extra,
        external=True,
    )
    session.run("cmake", "--build", build_dir, "--parallel", external=True)
    # (ctest --test-dir needs CMake >= 3.20; the project supports 3.18.)
    with session.chdir(build_dir):
        session.run(
            "ctest", "--output-on-failure", *session.posargs, env=env, external=True
        )


@nox.session(python=False)
def ctest(session: nox.Session) -> None:
    """The C tests (csrc/tests), built with cmake and run by ctest."""
    _cmake_ctest(session, "build-ctest")


@nox.session(python=False)
def tsan(session: nox.Session) -> None:
    """The C tests under ThreadSanitizer."""
    _cmake_ctest(
        session,
        "build-tsan",
        "-DBUCKETIMER_SANITIZE=thread",
        env={"TSAN_OPTIONS": "halt_on_error=1"},
    )


@nox.session(python=False)
def asan(session: nox.Session) -> None:
    """The C tests under ASan+UBSan (leak checks on): where a use-after-free
    on the timer thread shows (e.g. bt_destroy from a native callback)."""
    _cmake_ctest(
        session,
        "build-asan",
        "-DBUCKETIMER_SANITIZE=address",
        env={
            "ASAN_OPTIONS": "detect_leaks=1:abort_on_error=1",
            "UBSAN_OPTIONS": "halt_on_error=1:print_stacktrace=1",
        },
    )


@nox.session(python="3.11")
def soak(session: nox.Session) -> None:
    """tests/soak.py: the whole library under load for 150 s, then checks that
    counters balance, every slot is free and RSS and fds are flat.

    Longer: ``nox -s soak -- --minutes 30`` (or BUCKETIMER_SOAK_SECONDS).
    """
    session.install(".")
    session.run("python", "tests/soak.py", *session.posargs)


@nox.session(python="3.11")
def bench(session: nox.Session) -> None:
    """pytest-benchmark benchmarks (benchmarks/)."""
    session.install(".[bench,test]")
    session.run(
        "pytest",
        "benchmarks",
        "-o",
        "python_files=bench_*.py",
        "--benchmark-only",
        "--benchmark-disable-gc",
        *session.posargs,
    )


@nox.session(python="3.11")
def docs(session: nox.Session) -> None:
    """Builds the Sphinx docs into docs/_build/html (warnings are errors)."""
    session.install(".[docs]")
    session.run(
        "sphinx-build", "-W", "-b", "html", "docs", "docs/_build/html", *session.posargs
    )


NOTEBOOK = "docs/notebooks/explore.ipynb"

_EXECUTE_NOTEBOOK = """
import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient

path = Path(sys.argv[1])
nb = nbformat.read(path, as_version=4)
NotebookClient(
    nb, timeout=1800, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
).execute()
nbformat.write(nb, path)
print(f"executed {path} in place")
"""


@nox.session(python="3.11")
def notebook(session: nox.Session) -> None:
    """Executes docs/notebooks/explore.ipynb in place with nbclient."""
    if not (ROOT / NOTEBOOK).exists():
        session.skip(f"{NOTEBOOK} does not exist")
    session.install(".[bench,docs]")
    session.run("python", "-c", _EXECUTE_NOTEBOOK, NOTEBOOK)
