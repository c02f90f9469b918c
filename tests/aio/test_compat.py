"""The reads of CPython's private state (ext/compat.c): in use exactly where
they were checked, off under BUCKETIMER_PUBLIC_API=1, and off by themselves
when they disagree with the public API, with the helpers right every time.

docs/design.rst ("Reads of CPython internals") describes each read.
"""

from __future__ import annotations

import os
import sys
import sysconfig

import pytest
from _helpers import check_ok, run_python

import bucketimer
from bucketimer import _core

# The C helpers' reads of CPython's private state: the native backend's alone.
pytestmark = pytest.mark.native

READS = ("running_loop", "current_task", "stop_iteration", "cr_await", "loop_time")
FORCED = os.environ.get("BUCKETIMER_PUBLIC_API", "") not in ("", "0")
FREE_THREADED = bool(sysconfig.get_config_var("Py_GIL_DISABLED"))


def _checked_reads() -> set[str]:
    """The reads this CPython was checked with and that pay on it
    (compat.c's gates)."""
    if FREE_THREADED or sys.version_info >= (3, 16):
        return set()
    by_version = {
        (3, 11): {"running_loop", "current_task", "loop_time"},
        (3, 12): {"current_task", "stop_iteration", "cr_await", "loop_time"},
        (3, 13): set(READS),
        (3, 14): set(READS),
        (3, 15): {"running_loop", "current_task", "cr_await", "loop_time"},
    }
    return by_version[sys.version_info[:2]]


# What every run below does with the helpers, checked against asyncio.
BEHAVIOUR = r"""
import asyncio, json, sys
import bucketimer
from bucketimer import _core

async def main():
    out = []
    loop = asyncio.get_running_loop()
    try:
        async with bucketimer.timeout(0.01):
            await asyncio.sleep(1)
    except TimeoutError:
        out.append("expired")
    async with bucketimer.timeout(30) as cm:
        out.append(cm.when() > loop.time())
    out.append(await bucketimer.wait_for(asyncio.sleep(0, "result"), 30))
    fut = loop.create_future()
    def outside():
        try:
            bucketimer.timeout(30).__aenter__().send(None)
        except RuntimeError as e:
            fut.set_result(str(e))
    loop.call_soon(outside)
    out.append(await fut)
    return out

print(json.dumps({"out": asyncio.run(main()), "status": _core._compat_status(),
                  "loop": bucketimer.run(main())}))
"""
EXPECTED = ["expired", True, "result", "Timeout should be used inside a task"]


def _run(env: dict | None = None, prelude: str = "") -> dict:
    import json

    out = check_ok(run_python(prelude + BEHAVIOUR, env=env))
    return json.loads(out.strip().splitlines()[-1])


def test_status_names_every_read():
    assert set(_core._compat_status()) == set(READS)


def test_reads_in_use_where_checked():
    """On the CPython versions the reads were checked on, each one is in
    use once the helpers have run; elsewhere the public API answers."""
    got = _run(env={"BUCKETIMER_PUBLIC_API": ""})
    assert got["out"] == got["loop"] == EXPECTED
    for name in READS:
        want = "private" if name in _checked_reads() else "public: not available"
        assert got["status"][name].startswith(want), (name, got["status"])


def test_public_api_forced_by_the_environment():
    got = _run(env={"BUCKETIMER_PUBLIC_API": "1"})
    assert got["out"] == got["loop"] == EXPECTED
    for name in READS:
        want = "public: BUCKETIMER_PUBLIC_API" if name in _checked_reads() else "public: not"
        assert got["status"][name].startswith(want), (name, got["status"])


@pytest.mark.skipif(not _checked_reads(), reason="no private reads on this CPython")
def test_public_api_forced_for_named_reads():
    """A comma-separated list turns off just the reads it names (to measure
    what each saves)."""
    named = sorted(_checked_reads())[:2]
    got = _run(env={"BUCKETIMER_PUBLIC_API": ",".join(named)})
    assert got["out"] == got["loop"] == EXPECTED
    for name in _checked_reads():
        forced = got["status"][name] == "public: BUCKETIMER_PUBLIC_API"
        assert forced == (name in named), (name, got["status"])


@pytest.mark.skipif(not _checked_reads(), reason="no private reads on this CPython")
def test_a_read_that_disagrees_turns_itself_off():
    """With asyncio's C accelerator blocked, asyncio keeps the running loop
    and the current task in pure-Python state that the reads do not see:
    the self-check catches the disagreement, the read is off for good, and
    the helpers still behave as asyncio's."""
    prelude = "import sys; sys.modules['_asyncio'] = None\n"
    got = _run(env={"BUCKETIMER_PUBLIC_API": ""}, prelude=prelude)
    assert got["out"] == got["loop"] == EXPECTED
    if "running_loop" in _checked_reads():
        assert got["status"]["running_loop"] == "public: disagreed with the public API"
    # the current task: a dict that is not there, or a thread-state word
    # nobody writes (it cannot tell, so it is never proven)
    assert not got["status"]["current_task"].startswith("private")


def test_this_process_matches_its_environment():
    """The suite also runs whole under BUCKETIMER_PUBLIC_API=1 (CI does):
    then no read is in use in this very process."""
    import asyncio

    async def main():
        async with bucketimer.timeout(30):
            await bucketimer.wait_for(asyncio.sleep(0), 30)

    asyncio.run(main())
    status = _core._compat_status()
    if FORCED:
        assert not any(v == "private" for v in status.values()), status
    else:
        assert {k for k, v in status.items() if v == "private"} == _checked_reads(), status
