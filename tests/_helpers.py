"""Helpers shared by the race, fault, bad-input, memory and fork tests and
the soak.

Not a conftest: these are plain functions and classes, imported explicitly
(``from _helpers import ...``): pytest puts ``tests/`` on ``sys.path``, so
does ``python tests/soak.py``, and :func:`run_python` puts it on the
``PYTHONPATH`` of the interpreters it starts, so their scripts import these
helpers too.  Nothing here needs more than bucketimer and the standard
library at import time (the soak runs with just the package installed):
hypothesis is imported only by :func:`examples`.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from hypothesis import settings

#: this directory (``tests/``), which holds this module
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))

#: ``BUCKETIMER_SLOW_TESTS=1`` selects the long profiles of these tests.
SLOW = os.environ.get("BUCKETIMER_SLOW_TESTS") == "1"

#: How many times slower than a native machine this run may be: ``nox -s
#: emulated-arm64`` sets ``BUCKETIMER_TEST_TIME_SCALE`` to 10 (qemu-user runs
#: Python code 5-30x slower), ``.ci/run`` to 2 (two test sessions share the
#: CPUs).  It scales pytest-timeout's hang guards (conftest.py)
#: and the delays a test needs to outlast its own setup, nothing a test
#: asserts about time.
TIME_SCALE = max(1.0, float(os.environ.get("BUCKETIMER_TEST_TIME_SCALE") or 1))


def examples(default: int, slow: int) -> settings:
    """Hypothesis settings: ``default`` examples, or ``slow`` ones when
    ``BUCKETIMER_SLOW_TESTS=1``.  No deadline: these tests run real threads on
    a shared machine."""
    from hypothesis import HealthCheck, settings

    return settings(
        max_examples=slow if SLOW else default,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
        print_blob=True,
    )


def under_sanitizer() -> bool:
    """True when a sanitizer runtime (ASan, TSan) is loaded into this process
    (``nox -s sanitize``).  Its allocator quarantines freed memory and reserves
    terabytes of shadow address space, so RSS and RLIMIT_AS measurements mean
    nothing there."""
    try:
        with open("/proc/self/maps", encoding="ascii", errors="replace") as f:
            maps = f.read()
    except OSError:  # pragma: no cover
        return False
    return any(lib in maps for lib in ("libasan", "libtsan", "libhwasan"))


#: Computed once: sanitizer runtimes are loaded at start-up or not at all.
SANITIZED = under_sanitizer()


def wait_until(pred: Callable[[], Any], timeout: float = 5.0, interval: float = 0.001) -> bool:
    """Polls ``pred`` until it is true or ``timeout`` passes; returns its last value."""
    end = time.monotonic() + timeout
    while True:
        if pred():
            return True
        if time.monotonic() > end:
            return bool(pred())
        time.sleep(interval)


@contextlib.contextmanager
def dispatcher_held(tt: Any) -> Iterator[None]:
    """Hold ``tt``'s dispatcher thread inside a callback until the block
    ends.  It runs its callbacks one at a time, in order, so none of the
    timers armed in the block without a loop can run before it ends (a
    machine stalled past their deadlines would otherwise run some while the
    test is still arming or cancelling the rest); they stay cancellable."""
    entered, release = threading.Event(), threading.Event()

    def hold() -> None:
        entered.set()
        release.wait(30)

    tt.call_later(0, hold)
    assert entered.wait(30), "the dispatcher never ran"
    try:
        yield
    finally:
        release.set()


def open_fds() -> set[int]:
    """The file descriptors this process has open now."""
    return {int(name) for name in os.listdir("/proc/self/fd")}


def fd_count() -> int:
    # listdir itself opens one fd while it runs; it is the same every time.
    return len(os.listdir("/proc/self/fd"))


def rss_bytes() -> int:
    """Resident set size of this process (VmRSS of /proc/self/status)."""
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def run_python(code: str, timeout: float = 30.0, env: dict | None = None) -> subprocess.CompletedProcess:
    """Runs ``code`` (dedented) in a fresh interpreter (``sys.executable -c``),
    with a timeout: a hang fails the test instead of hanging it.  ``tests/``
    comes first on its ``PYTHONPATH``, so the script can ``from _helpers
    import ...`` like a test.  Returns the CompletedProcess (text
    stdout/stderr)."""
    full_env = dict(os.environ)
    full_env.setdefault("PYTHONFAULTHANDLER", "1")
    if env:
        full_env.update(env)
    full_env["PYTHONPATH"] = os.pathsep.join(
        p for p in (TESTS_DIR, full_env.get("PYTHONPATH")) if p
    )
    try:
        return subprocess.run(
            [sys.executable, "-X", "faulthandler", "-c", textwrap.dedent(code)],
            check=False,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=full_env,
        )
    except subprocess.TimeoutExpired as e:  # pragma: no cover - the failure path
        raise AssertionError(
            f"subprocess hung for {timeout}s\nstdout:\n{e.stdout}\nstderr:\n{e.stderr}"
        ) from None


def check_ok(p: subprocess.CompletedProcess) -> str:
    """Asserts the subprocess exited 0 and returns its stdout."""
    assert p.returncode == 0, (
        f"exit status {p.returncode}\nstdout:\n{p.stdout}\nstderr:\n{p.stderr}"
    )
    return p.stdout


#: the context variable a :class:`Recorder` reads where it runs
var: contextvars.ContextVar[str] = contextvars.ContextVar("var", default="unset")


class Recorder:
    """A callback that records where, when and in which context it ran."""

    def __init__(self, name: str = "cb") -> None:
        self.name = name
        self.calls: list[dict] = []
        self.done = threading.Event()

    def __call__(self, *args):
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        self.calls.append(
            {
                "args": args,
                "thread": threading.current_thread(),
                "at": time.monotonic(),
                "var": var.get(),
                "loop": loop,
            }
        )
        self.done.set()

    def wait(self, timeout: float = 5.0) -> dict:
        assert self.done.wait(timeout), f"{self.name} did not run within {timeout}s"
        return self.calls[0]


def posted_at_least(tt: Any, n: int) -> Callable[[], bool]:
    """For :func:`wait_until`: the TimerThread posted ``n`` timers to ports."""
    return lambda: tt.stats()["posted"] >= n


def cffi_core(**options: int) -> Any:
    """A ``bt_timer_thread *`` made through ``bucketimer._cffi``: bt_create
    with bt_options_init's defaults and ``options`` set on top (e.g.
    ``manual_clock=1, manual_start_ns=0, drain_threshold=64``).  The caller
    stops and destroys it (:func:`destroy_cffi_core`)."""
    from bucketimer._cffi import ffi, lib

    opt = ffi.new("bt_options *")
    lib.bt_options_init(opt)
    for name, value in options.items():
        setattr(opt, name, value)
    out = ffi.new("bt_timer_thread **")
    rc = lib.bt_create(opt, out)
    assert rc == 0, rc
    return out[0]


def destroy_cffi_core(tt: Any) -> None:
    from bucketimer._cffi import lib

    assert lib.bt_stop(tt) == 0
    lib.bt_destroy(tt)


def cffi_port(tt: Any, with_fd: bool = True) -> Any:
    """A ``bt_port *`` of the cffi core ``tt`` (``bt_port_open``), with an
    eventfd or, ``with_fd=False``, without one.  The core owns it."""
    from bucketimer._cffi import ffi, lib

    out = ffi.new("bt_port **")
    rc = lib.bt_port_open(tt, 1 if with_fd else 0, out)
    assert rc == 0, rc
    return out[0]


def fork_children(child: Callable[[], int], count: int, results: list[int], *,
                  first_pause: float, pause: float) -> None:
    """Forks ``count`` children one after the other, ``pause`` s apart (the
    first after ``first_pause`` s); each runs ``child()`` and exits with the
    code it returns (``os._exit``, its output flushed first).  Appends each
    child's exit code (``os.waitstatus_to_exitcode``: minus the signal that
    killed it) to ``results`` as it ends, so a caller that gave up waiting
    sees how far it got."""
    time.sleep(first_pause)
    for _ in range(count):
        pid = os.fork()
        if pid == 0:  # pragma: no cover - in the child
            code = 1
            try:
                code = child()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        results.append(os.waitstatus_to_exitcode(status))
        time.sleep(pause)
