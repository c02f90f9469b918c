"""Run a project's own asyncio tests with bucketimer inside.

Load it by name and choose a mode::

    pytest -p bucketimer.pytest_plugin --bucketimer=loop    # every loop asyncio makes is bucketimer's
    pytest -p bucketimer.pytest_plugin --bucketimer=patch   # patch_asyncio(): the helpers are bucketimer's
    pytest -p bucketimer.pytest_plugin --bucketimer=both    # the two at once
    pytest -p bucketimer.pytest_plugin --bucketimer=off     # neither: the baseline to compare with

``loop`` makes every event loop that asyncio creates on its own
(``asyncio.run``, ``asyncio.Runner``, ``asyncio.new_event_loop`` and the
fixtures of pytest-asyncio, anyio and aiohttp, which all go through them) a
:class:`bucketimer.EventLoop`; ``patch`` calls
:func:`bucketimer.patch_asyncio` before any conftest is imported, so that a
library's ``from asyncio import wait_for`` binds bucketimer's.

One test in a mode of its own, whatever the session's::

    @pytest.mark.bucketimer("loop")     # or "patch", "both", "off"
    async def test_reconnect(): ...

The mode is on from the test's set-up (its fixtures make their loops in
it) to its teardown, then the session's is back.  ``patch`` there reaches
the helpers looked up at call time (``asyncio.wait_for(...)``), not the
names bound before the test; debug mode stays off, as in a session mode.
Without ``--bucketimer`` the plugin only serves the marker, and says so in
the summary.

In every mode, ``off`` included, asyncio's debug mode stays off:
``PYTHONASYNCIODEBUG`` is cleared and ``loop.set_debug(True)`` on any
asyncio loop (``asyncio.run(debug=True)``, a fixture that asks for it) leaves
it off, since a loop in debug mode keeps asyncio's own timers
(docs/asyncio.rst) and the run would test those.  ``off`` changes nothing
else: the same suite under ``off`` and under a mode, side by side, shows what
fails only with bucketimer.

At the end the plugin prints how many timers the native core armed during
the run, and fails the session if there were none: a run that quietly
tested stock asyncio (a suite that makes its loops itself, the pure-Python
backend) must not read as a pass.  Under pytest-xdist each worker counts
its own and the controller adds them up.

The plugin is not registered as an entry point: it does nothing unless
``-p bucketimer.pytest_plugin`` names it (or a ``conftest.py`` lists it in
``pytest_plugins``).
"""

from __future__ import annotations

import asyncio
import os
import sys
import warnings
from typing import Any

import pytest

import bucketimer

from . import _backend, loop

__all__ = ("MODES",)

MODES = ("loop", "patch", "both", "off")
MARKER = "bucketimer"

# What this process armed: the default TimerThread's `scheduled` counter at
# the start, the total reported by xdist workers (controller only), and
# what undo() must restore.
_state: dict[str, Any] = {"start": None, "workers": 0, "undo": [], "marked": 0}


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("bucketimer", "bucketimer: run the tests with native timers")
    group.addoption(
        "--bucketimer",
        choices=MODES,
        default=None,
        help="loop: every asyncio loop is bucketimer.EventLoop; patch: patch_asyncio() before "
        "any conftest; both: the two (the run fails if no native timer was armed); off: "
        "neither, the baseline.  asyncio's debug mode stays off in each.",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{MARKER}(mode): run this test with bucketimer in mode {'/'.join(MODES)} "
        "(bucketimer.pytest_plugin), whatever the session's")


def _mode(config: pytest.Config) -> str | None:
    return getattr(config.option, "bucketimer", None) or getattr(
        getattr(config, "known_args_namespace", None), "bucketimer", None
    )


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config, parser: pytest.Parser,
                                  args: list[str]) -> None:
    """Switch bucketimer on before the project's conftests import asyncio's
    users (a name bound by ``from asyncio import wait_for`` keeps the object
    it found)."""
    mode = _mode(early_config)
    if mode is None:
        return
    os.environ.pop("PYTHONASYNCIODEBUG", None)
    _state["undo"].append(_debug_stays_off())
    if mode in ("patch", "both"):
        bucketimer.patch_asyncio()
        _state["undo"].append(bucketimer.unpatch_asyncio)
    if mode in ("loop", "both"):
        _state["undo"].append(_make_loops_bucketimers())
    _state["start"] = _armed()


def _marked_mode(item: pytest.Item) -> str | None:
    marker = item.get_closest_marker(MARKER)
    if marker is None:
        return None
    mode = marker.args[0] if marker.args else marker.kwargs.get("mode")
    if mode not in MODES:
        raise pytest.UsageError(
            f"{item.nodeid}: @pytest.mark.{MARKER}({mode!r}): the mode is one of "
            f"{', '.join(MODES)}")
    return str(mode)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:  # a mark with no such mode stops the run before it starts
        _marked_mode(item)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    """A test marked ``@pytest.mark.bucketimer(mode)`` runs, set-up to
    teardown, in that mode; the session's is back after it."""
    mode = _marked_mode(item)
    if mode is None:
        yield
        return
    _state["marked"] += 1
    undo = _switch(loop_on=mode in ("loop", "both"), patch_on=mode in ("patch", "both"))
    try:
        yield
    finally:
        undo()


def _switch(loop_on: bool, patch_on: bool) -> Any:
    """Makes asyncio's loops bucketimer's or not, and its helpers, and keeps
    debug mode off; returns what puts back what was."""
    undo = [_debug_stays_off()]
    ours: Any = bucketimer.aio.timeout
    if (asyncio.timeout is ours) != patch_on:  # patch_asyncio() is on, or off
        if patch_on:
            bucketimer.patch_asyncio()
            undo.append(bucketimer.unpatch_asyncio)
        else:
            bucketimer.unpatch_asyncio()
            undo.append(bucketimer.patch_asyncio)
    undo.append(_loops_made_by(loop.EventLoop if loop_on else asyncio.SelectorEventLoop))

    def undo_all() -> None:
        while undo:
            undo.pop()()

    return undo_all


def _debug_stays_off() -> Any:
    """``set_debug()`` on every asyncio loop class leaves debug off; returns
    what undoes it.  (uvloop's ``Loop`` is a compiled type whose methods
    cannot be replaced: its debug mode is the suite's own.)"""
    base = asyncio.BaseEventLoop
    stock = base.set_debug

    def set_debug(self: asyncio.BaseEventLoop, enabled: bool) -> None:
        stock(self, False)

    base.set_debug = set_debug  # type: ignore[method-assign]

    def undo() -> None:
        base.set_debug = stock  # type: ignore[method-assign]

    return undo


def _default_policy_class() -> type | None:
    """The class of asyncio's default event loop policy, while asyncio has
    policies (they go in 3.16)."""
    events = asyncio.events
    for name in ("_DefaultEventLoopPolicy", "DefaultEventLoopPolicy"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            cls = getattr(asyncio, name, None) or getattr(events, name, None)
        if isinstance(cls, type):
            return cls
    return None


def _make_loops_bucketimers() -> Any:
    """Every loop the default policy makes becomes a bucketimer.EventLoop;
    returns what undoes it."""
    return _loops_made_by(loop.EventLoop)


def _loops_made_by(factory: type) -> Any:
    """Every loop the default policy makes is a ``factory()`` (asyncio's
    selector loop or bucketimer's); returns what undoes it.

    The default policy makes its loops through its class's
    ``_loop_factory`` (3.11 to 3.15; checked here before it is replaced), so
    replacing that one attribute reaches ``asyncio.run``, ``Runner`` and
    ``new_event_loop``, and also a policy that a suite sets or resets
    (``set_event_loop_policy(None)``) on its own.  Where that attribute is
    neither loop class, the public way: our policy, set once."""
    cls = _default_policy_class()
    stock = getattr(cls, "_loop_factory", None) if cls is not None else None
    if cls is not None and stock in (asyncio.SelectorEventLoop, loop.EventLoop):
        cls._loop_factory = factory  # type: ignore[attr-defined]

        def undo() -> None:
            cls._loop_factory = stock  # type: ignore[attr-defined]

        return undo
    if factory is asyncio.SelectorEventLoop:  # nothing of ours was set
        return lambda: None
    if hasattr(asyncio, "set_event_loop_policy"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            previous = asyncio.get_event_loop_policy()
            asyncio.set_event_loop_policy(loop._policy_class("EventLoopPolicy")())

        def undo_policy() -> None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)
                asyncio.set_event_loop_policy(previous)

        return undo_policy
    raise pytest.UsageError(
        "--bucketimer=loop: this Python's asyncio has no event loop policy to make its "
        "loops bucketimer's; use --bucketimer=patch"
    )


def _armed() -> int:
    """Timers the default TimerThread (the drop-in loops' and the helpers')
    has armed since it started; 0 on the pure backend, whose helpers and
    loops are asyncio's own."""
    if not _backend.NATIVE:
        return 0
    return int(bucketimer.default_timer_thread().stats()["scheduled"])


def _armed_here() -> int:
    start = _state["start"]
    return 0 if start is None else _armed() - start


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    config = session.config
    mode = _mode(config)
    if mode is None:
        return
    if hasattr(config, "workeroutput"):  # an xdist worker: the controller judges
        config.workeroutput["bucketimer_armed"] = _armed_here()
        return
    armed = _armed_here() + _state["workers"]
    if mode != "off" and armed == 0 and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    while _state["undo"]:
        _state["undo"].pop()()


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: Any) -> None:
    """xdist's controller: add up what each worker armed."""
    _state["workers"] += int(getattr(node, "workeroutput", {}).get("bucketimer_armed", 0))


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int,
                            config: pytest.Config) -> None:
    mode = _mode(config)
    if hasattr(config, "workeroutput"):
        return
    tr = terminalreporter
    if mode is None:
        tr.write_sep("-", "bucketimer")
        tr.write_line(
            f"no --bucketimer mode: the session ran on stock asyncio, "
            f"{_state['marked']} test(s) marked @pytest.mark.{MARKER}(mode) in their own "
            f"(backend {bucketimer.backend}, Python {sys.version.split()[0]}); "
            f"--bucketimer={'|'.join(MODES)} runs the session in one")
        return
    armed = _armed_here() + _state["workers"]
    tr.write_sep("-", "bucketimer")
    tr.write_line(
        f"mode {mode}, backend {bucketimer.backend}, Python {sys.version.split()[0]}: "
        f"{armed} native timers armed"
    )
    if mode != "off" and armed == 0:
        why = (
            "the pure-Python backend is loaded: its helpers and loops are asyncio's own"
            if not _backend.NATIVE
            else "no test armed a timer through bucketimer (do the tests make their loops "
            "themselves, or run them in debug mode?)"
        )
        tr.write_line(f"bucketimer: FAILED: no native timer was armed: {why}", red=True)
