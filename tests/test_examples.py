"""The example programs of ``docs/examples/``: each runs and prints what its
comments say, and the copies of them in README.rst and the docs are the
programs themselves.

README.rst cannot include a file (PyPI renders it as it is), so its Python
blocks are copies: each must be a whole example or a run of consecutive
lines of one.  The Sphinx pages include the files (``literalinclude``).
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import bucketimer

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "docs" / "examples"

# What each program prints, line by line.
OUTPUT = {
    "asyncio_timeouts.py": ["in time"],
    "grpc_deadlines.py": ["b'0.1'", "StatusCode.DEADLINE_EXCEEDED"],
    "idle_timeout.py": [str([f"message {i}" for i in range(5)])],
    "loop_delivery.py": ["set in MainThread"],
    # a Prometheus scrape of the process itself: two timers, one cancelled
    "monitoring.py": ["bucketimer_timer_scheduled_total 2.0", "bucketimer_timer_fired_total 1.0",
                      "bucketimer_timer_cancelled_total 1.0",
                      "# TYPE bucketimer_timer_lateness_seconds histogram",
                      "bucketimer_timer_lateness_seconds_count 1.0"],
    # two helpers' timers and two sleeps', all four in the core
    "patch_asyncio.py": ["timed out", "native timers: 4"],
    "timers.py": ["True", "fired on the dispatcher thread"],
}


def test_every_example_has_its_expected_output() -> None:
    assert sorted(p.name for p in EXAMPLES.glob("*.py")) == sorted(OUTPUT)


@pytest.mark.parametrize("name", sorted(OUTPUT))
def test_example_runs(name: str) -> None:
    if name.startswith("grpc"):
        # grpc.aio, not grpc: without grpcio, tests/grpc/ on sys.path makes
        # "grpc" a namespace package.
        pytest.importorskip("grpc.aio")
    if name == "monitoring.py":  # the SDK and exporter of the test extra
        pytest.importorskip("opentelemetry.exporter.prometheus")
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / name)],
        capture_output=True, text=True, timeout=120, cwd=EXAMPLES,
    )
    assert done.returncode == 0, done.stderr
    expected = OUTPUT[name]
    if name == "patch_asyncio.py" and bucketimer.backend == "python":
        # the pure helpers arm their timers on the loop's heap
        expected = ["timed out", "native timers: 0"]
    assert done.stdout.splitlines() == expected
    assert "Traceback" not in done.stderr, done.stderr


def _python_blocks(rst: str) -> list[str]:
    """The bodies of the ``.. code-block:: python`` directives of ``rst``."""
    blocks = []
    for m in re.finditer(r"^\.\. code-block:: python\n\n((?:(?:[ \t]+.*)?\n)+)", rst, re.M):
        blocks.append(textwrap.dedent(m.group(1)).strip("\n") + "\n")
    return blocks


def _is_run_of_lines(block: str, program: str) -> bool:
    want = block.splitlines()
    have = program.splitlines()
    return any(
        textwrap.dedent("\n".join(have[i:i + len(want)])).splitlines() == want
        for i in range(len(have) - len(want) + 1)
    )


def _readme_copies() -> set[str]:
    """The examples README.rst copies from; fails on a block that copies none."""
    blocks = _python_blocks((ROOT / "README.rst").read_text())
    assert blocks, "README.rst has no Python example"
    programs = {p.name: p.read_text() for p in EXAMPLES.glob("*.py")}
    copied = set()
    for block in blocks:
        found = {name for name, text in programs.items() if _is_run_of_lines(block, text)}
        assert found, f"README.rst block is in no docs/examples/ program:\n{block}"
        copied |= found
    return copied


def test_readme_python_blocks_are_copies_of_the_examples() -> None:
    _readme_copies()


def test_every_example_is_shown_and_every_include_exists() -> None:
    included = set()
    for page in (ROOT / "docs").glob("*.rst"):
        for m in re.finditer(r"^\.\. literalinclude:: (\S+)", page.read_text(), re.M):
            target = (page.parent / m.group(1)).resolve()
            assert target.is_file(), f"{page.name} includes missing {m.group(1)}"
            included.add(target.name)
    unshown = set(OUTPUT) - included - _readme_copies()
    assert not unshown, f"examples neither README.rst nor the docs show: {unshown}"
