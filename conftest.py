"""The documentation's examples, run as a reader would run them (Sybil).

pytest collects every ``*.rst`` under the ``testpaths`` of pyproject.toml
(``README.rst`` and ``docs/``), and runs each ``.. code-block:: python`` of
them as a program of its own: written to a file in an empty directory and
run by this interpreter in a new process, with the environment of the test
run (``BUCKETIMER_NO_EXTENSIONS=1`` selects the pure backend there too).
The program must exit with status 0, and what it writes (stdout and
stderr, in the order written) must be what the page shows after it:

* the literal block after it, when the paragraph between them says
  ``prints`` and ends in ``::`` (``prints::``, ``prints about::``),
  compared as doctest compares, ``...`` matching any text (a time that
  varies, an abridged stack); grpc's C core's own log lines are left out;
* no such block: the program must write nothing.

What a page shows but does not run is marked so, with a reason, as Sybil
marks it::

    .. skip: next "a fragment: the handler of a server"
    .. skip: next if(sys.version_info < (3, 12), reason="loop_factory is 3.12+")

and ``.. invisible-code-block: python`` before a block is run first, in the
same program (setup the page does not show).  A program that imports one of
the optional libraries (``OPTIONAL``) runs only where it is installed.
``docs/examples/*.py``, which the pages include, run in
``tests/test_examples.py``.  The same programs, as :func:`programs` lists
them, are type-checked together by ``tests/typing/test_docs.py``.
"""

from __future__ import annotations

import ast
import doctest
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any
from unittest import SkipTest

from sybil import Document, Example, Region, Sybil
from sybil.parsers.rest import CodeBlockParser, SkipParser

#: the extras' libraries: a program that imports one is skipped without it
OPTIONAL = frozenset({
    "grpc", "uvloop", "matplotlib", "pandas", "tqdm", "aiohttp", "anyio", "httpx",
    "opentelemetry", "prometheus_client",
})

#: bucketimer's modules that import an extra's library
_NEEDS = {"bucketimer.grpc": "grpc", "bucketimer.otel": "opentelemetry"}

#: how long one program may run
TIMEOUT = 120

#: the paragraph after a code block that introduces what it prints, and that
#: literal block (its lines indented, blank lines inside it kept)
_SHOWN = re.compile(
    r"[ \t]*\n(?:[ \t]*\n)*(?P<intro>(?:[ \t]*\S[^\n]*\n)+?)"
    r"[ \t]*\n(?P<block>(?:(?:[ \t]+[^\n]*)?\n)+)"
)

_SETUP = "bucketimer_docs_setup"

#: a line of grpc's C core's own log (``GRPC_VERBOSITY``), which depends on
#: grpcio's version, not on the program: not part of what a page shows
_GRPC_CORE_LOG = re.compile(r"^[DIWE]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ \S+:\d+\] [^\n]*\n", re.M)


def _shown_output(document: Document, end: int) -> str | None:
    """The output the page shows after the code block ending at ``end``."""
    m = _SHOWN.match(document.text, end)
    if m is None or not re.search(r"\bprints\b[^\n]*::[ \t]*\n\Z", m.group("intro")):
        return None
    return textwrap.dedent(m.group("block")).strip("\n") + "\n"


def _needs(source: str) -> list[str]:
    """The optional libraries ``source`` imports that are not installed."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name.partition(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.partition(".")[0])
    # bucketimer's own modules that need an extra's library
    names.update(lib for module, lib in _NEEDS.items() if module in source)
    missing = []
    for name in sorted(names & OPTIONAL):
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:  # absent, or a directory that shadows it
            missing.append(name)
    return missing


def _run(source: str) -> str:
    """Runs ``source`` as a program; returns what it wrote; raises on a failure."""
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "example.py"
        script.write_text(source, encoding="utf-8")
        # grpc's C core logs INFO lines (a GOAWAY at shutdown) to the same
        # stderr from its own threads, which can split a line of the program's.
        env = dict(os.environ, PYTHONUNBUFFERED="1", GRPC_VERBOSITY="ERROR")
        done = subprocess.run(
            [sys.executable, str(script)], cwd=tmp, env=env, timeout=TIMEOUT,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
    out = _GRPC_CORE_LOG.sub("", done.stdout)
    if done.returncode:
        raise AssertionError(f"the program exited with status {done.returncode}:\n{out}")
    return out


class ProgramParser(CodeBlockParser):
    """Python code blocks, each a program; invisible ones its setup.  A
    program is handed to ``check(source, expected)`` (default: run it and
    compare what it wrote with ``expected``)."""

    language = "python"

    def __init__(self, check: Callable[[str, str | None], None] | None = None) -> None:
        super().__init__()
        self._check = check or _check_output

    def __call__(self, document: Document) -> Iterable[Region]:
        for region in super().__call__(document):
            invisible = region.lexemes["directive"].startswith("invisible")
            expected = None if invisible else _shown_output(document, region.end)
            region.parsed = (str(region.parsed), invisible, expected)
            yield region

    def evaluate(self, example: Example) -> None:
        source, invisible, expected = example.parsed
        namespace = example.namespace
        if invisible:
            namespace[_SETUP] = namespace.get(_SETUP, "") + source
            return
        program = namespace.pop(_SETUP, "") + source
        missing = _needs(program)
        if missing:
            raise SkipTest(f"needs {', '.join(missing)}")
        self._check(program, expected)


def _check_output(program: str, expected: str | None) -> None:
    got = _run(program)
    want = expected or ""
    checker = doctest.OutputChecker()
    if not checker.check_output(want, got, doctest.ELLIPSIS):
        example_ = doctest.Example(source="", want=want)
        raise AssertionError(
            "the program's output is not what the page shows after it:\n"
            + checker.output_difference(example_, got, doctest.ELLIPSIS))


def _setup(namespace: dict[str, Any]) -> None:
    namespace["sys"] = sys  # for skip conditions


def _sybil(parser: ProgramParser) -> Sybil:
    return Sybil(parsers=[parser, SkipParser()], patterns=["*.rst"], setup=_setup)


pytest_collect_file = _sybil(ProgramParser()).pytest()


def programs(path: Path) -> list[tuple[int, str]]:
    """(line, program) of each program of the page ``path`` that the suite
    runs here, its invisible setup included: the pages' examples as they
    are run, without running them (what is skipped, or needs a library not
    installed, is left out)."""
    found: list[tuple[int, str]] = []
    line = 0

    def keep(program: str, expected: str | None) -> None:
        found.append((line, program))

    sybil = _sybil(ProgramParser(keep))
    document = sybil.parse(path)
    _setup(document.namespace)
    for example in document.examples():
        line = example.line
        try:
            example.evaluate()
        except SkipTest:
            pass
    return found
