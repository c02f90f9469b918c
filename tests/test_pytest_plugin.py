"""bucketimer.pytest_plugin: a project's own tests, run with bucketimer inside.

Each test runs an inner pytest session in a subprocess (pytester), as a
user's ``pytest -p bucketimer.pytest_plugin --bucketimer=MODE`` would.
"""

from __future__ import annotations

import re

import pytest

import bucketimer

pytest_plugins = ["pytester"]

# The tests a project might have: each asserts what its mode must make true,
# from inside a loop that asyncio made on its own.
PROJECT_TESTS = """
import asyncio
import os

import bucketimer


def test_asyncio_run_with_a_timeout():
    async def main():
        async with asyncio.timeout(5):
            await asyncio.sleep(0.01)
        return type(asyncio.get_running_loop()), asyncio.timeout
    loop_type, helper = asyncio.run(main())
    mode = os.environ["EXPECT_MODE"]
    assert (loop_type is bucketimer.EventLoop) == (mode in ("loop", "both"))
    assert (helper is bucketimer.aio.timeout) == (mode in ("patch", "both"))


def test_debug_asked_for_stays_off():
    async def main():
        return asyncio.get_running_loop().get_debug()
    assert asyncio.run(main(), debug=True) is False


def test_a_fresh_loop_from_new_event_loop():
    loop = asyncio.new_event_loop()
    try:
        assert loop.get_debug() is False
        fired = []
        loop.call_later(0.01, fired.append, 1)
        loop.run_until_complete(asyncio.sleep(0.05))
        assert fired == [1]
    finally:
        loop.close()
"""

native = pytest.mark.skipif(bucketimer.backend != "native", reason="counts native timers")


def _armed(result: pytest.RunResult) -> int:
    text = result.stdout.str()
    match = re.search(r"(\d+) native timers armed", text)
    assert match, text
    return int(match.group(1))


@native
@pytest.mark.parametrize("mode", ["loop", "patch", "both"])
def test_each_mode_runs_the_tests_natively(pytester: pytest.Pytester, mode: str,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EXPECT_MODE", mode)
    monkeypatch.setenv("PYTHONASYNCIODEBUG", "1")  # the plugin turns it off
    pytester.makepyfile(test_project=PROJECT_TESTS)
    result = pytester.runpytest_subprocess("-p", "bucketimer.pytest_plugin",
                                           f"--bucketimer={mode}")
    result.assert_outcomes(passed=3)
    assert _armed(result) > 0
    result.stdout.fnmatch_lines([f"mode {mode}, backend native, Python *"])


def test_a_run_that_arms_no_native_timer_fails(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_nothing="def test_no_timers():\n    assert True\n")
    result = pytester.runpytest_subprocess("-p", "bucketimer.pytest_plugin", "--bucketimer=loop")
    result.assert_outcomes(passed=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    assert _armed(result) == 0
    result.stdout.fnmatch_lines(["bucketimer: FAILED: no native timer was armed: *"])


@native
def test_off_is_the_baseline(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EXPECT_MODE", "off")
    pytester.makepyfile(test_project=PROJECT_TESTS)
    result = pytester.runpytest_subprocess("-p", "bucketimer.pytest_plugin", "--bucketimer=off")
    result.assert_outcomes(passed=3)
    assert result.ret == pytest.ExitCode.OK


@native
def test_the_patch_comes_before_the_projects_conftest(pytester: pytest.Pytester) -> None:
    # A conftest that binds asyncio's helper by name at import, as libraries do.
    pytester.makeconftest("from asyncio import wait_for as bound_at_import\n")
    pytester.makepyfile(test_bound="""
import asyncio
import bucketimer
from conftest import bound_at_import

def test_bound():
    assert bound_at_import is bucketimer.aio.wait_for
    asyncio.run(bound_at_import(asyncio.sleep(0), 5))
""")
    result = pytester.runpytest_subprocess("-p", "bucketimer.pytest_plugin", "--bucketimer=patch")
    result.assert_outcomes(passed=1)
    assert result.ret == pytest.ExitCode.OK


def test_without_the_option_it_does_nothing(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_plain="""
import asyncio
import bucketimer

def test_stock():
    async def main():
        return type(asyncio.get_running_loop()), asyncio.timeout
    loop_type, helper = asyncio.run(main())
    assert loop_type is not bucketimer.EventLoop
    # (on the pure backend bucketimer's helpers are asyncio's own objects)
    assert helper is not bucketimer.aio.timeout or bucketimer.backend == "python"
""")
    result = pytester.runpytest_subprocess("-p", "bucketimer.pytest_plugin")
    result.assert_outcomes(passed=1)
    assert result.ret == pytest.ExitCode.OK
    assert "native timers armed" not in result.stdout.str()


# Tests marked one by one, checking from inside the loop asyncio made which
# mode they run in; the unmarked one runs in the session's.
MARKED_TESTS = """
import asyncio
import os

import pytest

import bucketimer


def seen():
    async def main():
        await asyncio.sleep(0.001)  # a timer of the loop's
        return (type(asyncio.get_running_loop()) is bucketimer.EventLoop,
                asyncio.timeout is bucketimer.aio.timeout)
    return asyncio.run(main(), debug=True)


@pytest.mark.bucketimer("loop")
def test_loop():
    assert seen() == (True, False)


@pytest.mark.bucketimer("patch")
def test_patch():
    assert seen() == (False, True)


@pytest.mark.bucketimer(mode="both")
def test_both():
    assert seen() == (True, True)


@pytest.mark.bucketimer("off")
def test_off():
    assert seen() == (False, False)


@pytest.fixture
def fixture_loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.mark.bucketimer("loop")
def test_a_fixture_makes_its_loop_in_the_mode(fixture_loop):
    assert type(fixture_loop) is bucketimer.EventLoop


def test_unmarked():
    session = os.environ["SESSION_MODE"]
    assert seen() == (session in ("loop", "both"), session in ("patch", "both"))
"""


@pytest.mark.parametrize("session", ["", "both"])
def test_a_marked_test_runs_in_its_own_mode(pytester: pytest.Pytester,
                                            monkeypatch: pytest.MonkeyPatch,
                                            session: str) -> None:
    """@pytest.mark.bucketimer(mode) puts one test in a mode, fixtures
    included, whatever the session's, which the next test gets back; with
    no session mode the summary says what ran."""
    monkeypatch.setenv("SESSION_MODE", session)
    pytester.makepyfile(test_marked=MARKED_TESTS)
    args = ["-p", "bucketimer.pytest_plugin"]
    if session:
        args.append(f"--bucketimer={session}")
    result = pytester.runpytest_subprocess(*args)
    result.assert_outcomes(passed=6)
    # (a session mode on the pure backend arms no native timer: it fails)
    assert result.ret == (pytest.ExitCode.OK if bucketimer.backend == "native" or not session
                          else pytest.ExitCode.TESTS_FAILED)
    summary = ("no --bucketimer mode: the session ran on stock asyncio, 5 test(s) marked "
               "@pytest.mark.bucketimer(mode) in their own (backend *")
    if session:
        result.stdout.no_fnmatch_line(summary)
    else:
        result.stdout.fnmatch_lines([summary])


def test_a_mark_with_no_such_mode_stops_the_run(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_bad="""
import pytest

@pytest.mark.bucketimer("fast")
def test_bad():
    pass
""")
    result = pytester.runpytest_subprocess("-p", "bucketimer.pytest_plugin")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*@pytest.mark.bucketimer('fast'): the mode is one of loop, "
                                 "patch, both, off*"])
