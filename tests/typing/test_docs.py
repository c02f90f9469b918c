"""The documentation's examples type-check: every program of README.rst and
docs/ that the suite runs (conftest.py, :func:`programs`) passes
``mypy --strict``, in one run over all of them (a run per program would
start mypy and read grpc's and asyncio's stubs each time)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

pytest.importorskip("mypy", reason="mypy is in the test extra")

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.rst", *sorted((ROOT / "docs").glob("*.rst"))]


def _conftest() -> ModuleType:
    """The repository's conftest.py, which finds the pages' programs."""
    spec = importlib.util.spec_from_file_location("bucketimer_docs_programs", ROOT / "conftest.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_example_type_checks(tmp_path: Path, pytestconfig: pytest.Config) -> None:
    programs = _conftest().programs
    names = {}
    for page in PAGES:
        for line, program in programs(page):
            name = re.sub(r"\W", "_", f"{page.relative_to(ROOT)}_{line}")
            (tmp_path / f"{name}.py").write_text(program, encoding="utf-8")
            names[name] = f"{page.relative_to(ROOT)}, the block at line {line}"
    assert len(names) >= 10, names  # the pages' programs were found
    # mypy's cache in pytest's, where there is one: the stubs are read once
    cache = getattr(pytestconfig, "cache", None)
    cache_dir = cache.mkdir("mypy-docs") if cache is not None else tmp_path / ".mypy_cache"
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-error-summary", "--cache-dir", str(cache_dir),
         *sorted(f"{n}.py" for n in names)],
        cwd=tmp_path, capture_output=True, text=True, timeout=600)
    # name each error by its page and block
    report = re.sub(r"^(\w+)\.py:", lambda m: f"{names.get(m[1], m[1])}, line ", done.stdout, flags=re.M)
    assert done.returncode == 0, report + done.stderr
