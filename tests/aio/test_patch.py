"""patch_asyncio(): asyncio's helpers become bucketimer's for every caller
that looks them up at call time, with asyncio's own tests passing through
them; unpatch_asyncio() puts asyncio's very objects back.

docs/asyncio.rst ("One line: patch_asyncio()") is what is pinned here.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
from asyncio import tasks, timeouts
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from _helpers import check_ok, run_python

import bucketimer
from bucketimer import _patch, aio

# What the patch installs is the native helpers; the pure backend's patch has
# its own test below (in a child process that selects that backend).
pytestmark = pytest.mark.native

HERE = Path(__file__).resolve().parent
# (module, name) pairs the patch owns, and asyncio's objects, as imported.
ASYNCIO_OWN = {(m, n): getattr(m, n) for m, n in _patch._TARGETS}


@pytest.fixture(autouse=True)
def unpatched() -> Iterator[None]:
    """Every test starts and ends with asyncio's own helpers."""
    bucketimer.unpatch_asyncio()
    yield
    bucketimer.unpatch_asyncio()
    for (module, name), original in ASYNCIO_OWN.items():
        assert getattr(module, name) is original, (module.__name__, name)


def _is_patched() -> bool:
    return all(getattr(m, n) is getattr(aio, n) for m, n in _patch._TARGETS)


def _native_scheduled(tt: bucketimer.TimerThread | None = None) -> int:
    return (tt or bucketimer.default_timer_thread()).stats()["scheduled"]


# ---- the switch ---------------------------------------------------------------------


def test_every_name_asyncio_calls_through_is_patched():
    assert bucketimer.patch_asyncio() is True
    assert asyncio.timeout is timeouts.timeout is bucketimer.timeout
    assert asyncio.timeout_at is timeouts.timeout_at is bucketimer.timeout_at
    assert asyncio.wait_for is tasks.wait_for is bucketimer.wait_for


def test_no_other_asyncio_module_binds_the_helpers():
    """The targets are every binding in Lib/asyncio of this Python: a new
    one in a later CPython fails here rather than staying stock."""
    import importlib
    import pkgutil

    found = set()
    for info in pkgutil.iter_modules(asyncio.__path__):
        if info.name.startswith("__"):
            continue
        try:
            module = importlib.import_module(f"asyncio.{info.name}")
        except ImportError:  # another platform's (windows_events)
            continue
        for name in ("timeout", "timeout_at", "wait_for"):
            if getattr(module, name, None) is ASYNCIO_OWN.get((asyncio, name)):
                found.add((module.__name__, name))
    found |= {("asyncio", n) for n in ("timeout", "timeout_at", "wait_for")}
    assert found == {(m.__name__, n) for m, n in _patch._TARGETS}


def test_unpatch_restores_the_very_objects():
    bucketimer.patch_asyncio()
    bucketimer.unpatch_asyncio()
    for (module, name), original in ASYNCIO_OWN.items():
        assert getattr(module, name) is original


def test_idempotent_both_ways():
    assert bucketimer.patch_asyncio() and bucketimer.patch_asyncio()
    assert _is_patched()
    bucketimer.unpatch_asyncio()  # one unpatch undoes any number of patches
    assert not any(getattr(m, n) is getattr(aio, n) for m, n in _patch._TARGETS)
    bucketimer.unpatch_asyncio()  # and a second is a no-op
    bucketimer.patch_asyncio()
    assert _is_patched()


def test_a_name_rebound_after_the_patch_is_left_alone():
    bucketimer.patch_asyncio()

    def someone_elses(*args: Any) -> None:
        raise AssertionError

    asyncio.wait_for = someone_elses  # type: ignore[assignment]
    try:
        bucketimer.unpatch_asyncio()
        assert asyncio.wait_for is someone_elses
        assert tasks.wait_for is ASYNCIO_OWN[(tasks, "wait_for")]
    finally:
        asyncio.wait_for = ASYNCIO_OWN[(asyncio, "wait_for")]


def test_the_timeout_class_stays_asyncios():
    """asyncio.Timeout is not replaced: subclasses and direct instances keep
    asyncio's class; bucketimer.Timeout is the type of what the patched
    helpers return."""
    own = asyncio.Timeout
    bucketimer.patch_asyncio()
    assert asyncio.Timeout is timeouts.Timeout is own

    async def made() -> Any:
        return asyncio.timeout(1)

    cm = asyncio.run(made())
    assert type(cm) is bucketimer.Timeout
    assert not isinstance(cm, asyncio.Timeout)


@pytest.mark.parametrize("rounds", [200])
def test_threads_racing_patch_and_unpatch(rounds: int):
    """Many threads patching and unpatching at once: the state is always
    one of the two whole states, and the saved originals are asyncio's."""
    barrier = threading.Barrier(4)
    errors: list[BaseException] = []

    def worker(patching: bool) -> None:
        try:
            barrier.wait()
            for _ in range(rounds):
                if patching:
                    bucketimer.patch_asyncio()
                else:
                    bucketimer.unpatch_asyncio()
        except BaseException as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i % 2 == 0,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    states = {getattr(m, n) is getattr(aio, n) for m, n in _patch._TARGETS}
    assert len(states) == 1, "a half-patched asyncio"
    bucketimer.patch_asyncio()
    assert _patch._originals == ASYNCIO_OWN


def test_the_pure_backend_patches_its_own_helpers():
    """On the pure-Python backend the patch installs that backend's helpers
    (asyncio's, with the native ones' order and NaN deadline), so a patched
    program behaves as on the native backend; unpatch puts asyncio's back."""
    out = check_ok(run_python(
        """
        import asyncio, math
        from asyncio import tasks, timeouts

        import bucketimer
        from bucketimer import aio

        targets = [(asyncio, "timeout"), (asyncio, "timeout_at"), (asyncio, "wait_for"),
                   (timeouts, "timeout"), (timeouts, "timeout_at"), (tasks, "wait_for")]
        own = [getattr(m, n) for m, n in targets]
        assert bucketimer.backend == "python", bucketimer.backend
        assert bucketimer.patch_asyncio() is True
        assert all(getattr(m, n) is getattr(aio, n) for m, n in targets)

        async def main():
            async with asyncio.timeout(5):
                ran = await asyncio.wait_for(asyncio.sleep(0, "ran"), 5)
            try:  # from 3.13 asyncio's own loop raises ValueError out of select()
                await asyncio.wait_for(asyncio.sleep(5), math.nan)
            except TimeoutError:
                return ran, "nan expired"

        print(*bucketimer.run(main(), patch_asyncio=True))
        bucketimer.unpatch_asyncio()
        assert [getattr(m, n) for m, n in targets] == own
        """,
        env={"BUCKETIMER_NO_EXTENSIONS": "1"},
    ))
    assert out.split() == ["ran", "nan", "expired"]


# ---- what callers get ---------------------------------------------------------------


def test_callers_arm_native_timers_with_asyncios_behaviour():
    """On the stock loop, asyncio.timeout/timeout_at/wait_for arm their
    timers in the core once patched, and expire as asyncio's do."""

    async def main() -> list[Any]:
        loop = asyncio.get_running_loop()
        out: list[Any] = []
        try:
            async with asyncio.timeout(0.01):
                await asyncio.sleep(3600)
        except TimeoutError:
            out.append("timeout expired")
        async with asyncio.timeout_at(loop.time() + 30) as cm:
            out.append(cm.expired())
        out.append(await asyncio.wait_for(asyncio.sleep(0, "done"), 30))
        try:
            await asyncio.wait_for(asyncio.sleep(3600), 0.01)
        except TimeoutError:
            out.append("wait_for expired")
        return out

    want = ["timeout expired", False, "done", "wait_for expired"]
    before = _native_scheduled()
    assert asyncio.run(main()) == want
    assert _native_scheduled() == before  # asyncio's own: nothing in the core
    bucketimer.patch_asyncio()
    assert asyncio.run(main()) == want
    assert _native_scheduled() - before >= 4


def test_asyncios_own_callers_reach_the_patch():
    """asyncio.staggered (via tasks.wait_for) arms its timer natively."""
    from asyncio import staggered

    bucketimer.patch_asyncio()

    async def fails() -> None:
        raise OSError

    async def succeeds() -> str:
        return "second"

    async def main() -> Any:
        return await staggered.staggered_race([fails, succeeds], 30)

    before = _native_scheduled()
    winner, index, _ = asyncio.run(main())
    assert (winner, index) == ("second", 1)
    assert _native_scheduled() > before


def test_run_with_patch_asyncio():
    seen: dict[str, Any] = {}

    async def main() -> str:
        seen["loop"] = type(asyncio.get_running_loop())
        seen["timeout"] = asyncio.timeout
        async with asyncio.timeout(30):
            return "ok"

    assert bucketimer.run(main()) == "ok"
    assert seen["timeout"] is ASYNCIO_OWN[(asyncio, "timeout")]
    assert bucketimer.run(main(), patch_asyncio=True) == "ok"
    assert seen == {"loop": bucketimer.EventLoop, "timeout": bucketimer.timeout}
    assert _is_patched()  # it stays on, as patch_asyncio() does


# ---- a library that binds the names at import -------------------------------------

BOTH_ORDERS = r"""
import asyncio, json, sys
import bucketimer
first = sys.argv[1]
if first == "patch":
    bucketimer.patch_asyncio()
import _binds_at_import as lib
if first == "import":
    bucketimer.patch_asyncio()

async def main():
    out = [await lib.query(asyncio.sleep(0, "a"), 30), await lib.guarded(asyncio.sleep(0, "b"), 30)]
    for call in (lib.query, lib.guarded):
        try:
            await call(asyncio.sleep(3600), 0.01)
        except TimeoutError:
            out.append("expired")
    return out

tt = bucketimer.default_timer_thread()
before = tt.stats()["scheduled"]
out = asyncio.run(main())
print(json.dumps({"out": out, "native": tt.stats()["scheduled"] - before,
                  "bucketimer's": lib.wait_for is bucketimer.wait_for
                                  and lib.timeout is bucketimer.timeout}))
"""


@pytest.mark.parametrize("first", ["patch", "import"])
def test_a_library_binding_at_import_is_reached_only_if_patched_first(first: str):
    code = f"import sys; sys.argv[1:] = [{first!r}]; sys.path.insert(0, {str(HERE)!r})\n"
    got = json.loads(check_ok(run_python(code + BOTH_ORDERS)).strip().splitlines()[-1])
    assert got["out"] == ["a", "b", "expired", "expired"]
    if first == "patch":
        assert got["bucketimer's"] and got["native"] == 4
    else:
        # Bound before the patch: asyncio's objects.  From 3.12 asyncio's
        # wait_for enters asyncio.timeouts.timeout, which is patched: its two
        # timers still reach the core; the early-bound timeout's do not.
        assert not got["bucketimer's"]
        assert got["native"] == (2 if sys.version_info >= (3, 12) else 0)


# ---- CPython's own asyncio tests --------------------------------------------------

CPYTHON_MODULES = ("test_timeouts", "test_waitfor", "test_taskgroups", "test_tasks")
# The modules whose tests arm timers through the helpers.  test_taskgroups'
# only timeout is already expired (asyncio.timeout(-1): loop.call_soon, as in
# asyncio), so the core has nothing to count there.
ARM_NATIVE = {"test_timeouts", "test_waitfor", "test_tasks"}


def _have_cpython_tests() -> bool:
    try:
        import test.test_asyncio  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(not _have_cpython_tests(), reason="this Python ships no test package")
@pytest.mark.parametrize("module", CPYTHON_MODULES)
def test_cpythons_own_asyncio_tests_pass_patched(module: str):
    """test.test_asyncio.<module> of this interpreter, with the patch on and
    the drop-in loop as asyncio's default (tests that name their own loop,
    such as 3.14's test_taskgroups, keep it): every test passes, and the
    modules that use the helpers armed native timers through them.
    (IsolatedAsyncioTestCase runs its loop in debug mode, where the drop-in
    loop's own timers are asyncio's: what the core counts there is the
    patched helpers'.)"""
    proc = subprocess.run([sys.executable, str(HERE / "_cpython_suite.py"), module],
                          capture_output=True, text=True, timeout=1800, check=False)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["failures"] == got["errors"] == 0, proc.stderr[-8000:]
    assert got["run"] > 10 and got["skipped"] < got["run"] // 10, got
    assert got["loop"] == "EventLoop" and got["patched"], got
    if module in ARM_NATIVE:
        assert got["native_scheduled"] > 0, got


# ---- aiohttp: a real server and client on 127.0.0.1 --------------------------------

aiohttp = pytest.importorskip("aiohttp")
from aiohttp import web  # noqa: E402


def _stock() -> asyncio.AbstractEventLoop:
    return asyncio.SelectorEventLoop()


@pytest.fixture(params=["stock", "drop-in"])
def loop_factory(request: pytest.FixtureRequest) -> Iterator[Callable[[], Any]]:
    """The client and server's loop; the drop-in loop takes its own timers
    from a TimerThread of its own, so that the process-wide one counts only
    the patched helpers."""
    if request.param == "stock":
        yield _stock
        return
    tt = bucketimer.TimerThread()
    try:
        yield lambda: bucketimer.EventLoop(timer_thread=tt)
    finally:
        tt.close()


def _serve_and_call(loop_factory: Callable[[], Any]) -> list[Any]:
    """A handler with its own asyncio.timeout (one in time, one expiring),
    called by a client whose ClientTimeout arms connect timeouts (aiohttp's
    ceil_timeout: asyncio.timeout_at)."""

    async def handler(request: web.Request) -> web.Response:
        delay = float(request.query["sleep"])
        try:
            async with asyncio.timeout(0.2):
                await asyncio.sleep(delay)
        except TimeoutError:
            return web.Response(status=504, text="handler timed out")
        return web.Response(text="in time")

    async def main() -> list[Any]:
        app = web.Application()
        app.router.add_get("/", handler)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        host, port = runner.addresses[0][:2]
        timeout = aiohttp.ClientTimeout(total=60, connect=30, sock_connect=20, sock_read=40)
        out: list[Any] = []
        try:
            async with aiohttp.ClientSession(timeout=timeout) as session:
                for sleep in (0, 3600):
                    async with session.get(f"http://{host}:{port}/?sleep={sleep}") as resp:
                        out.append((resp.status, await resp.text()))
        finally:
            await runner.cleanup()
        return out

    with asyncio.Runner(loop_factory=loop_factory) as runner:
        return runner.run(main())


def test_aiohttp_client_and_server_timeouts_go_native(loop_factory: Callable[[], Any]):
    want = [(200, "in time"), (504, "handler timed out")]
    before = _native_scheduled()
    assert _serve_and_call(loop_factory) == want
    stock = _native_scheduled() - before
    bucketimer.patch_asyncio()
    before = _native_scheduled()
    assert _serve_and_call(loop_factory) == want
    patched = _native_scheduled() - before
    assert stock == 0
    # Two handler timeouts, and the client's connect timeouts (ceil_timeout).
    assert patched >= 3, patched
