"""An installation whose compiled modules are deleted still works: it imports,
says ``bucketimer.backend == "python"`` and passes the smoke tests
(docs/design.rst, "The pure-Python backend")."""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import bucketimer

TESTS_DIR = Path(__file__).resolve().parent
COMPILED = ("*.so", "*.pyd", "*.dylib")


def _copy_without_compiled_modules(site: Path) -> list[str]:
    """The installed package and its metadata, copied to ``site`` minus every
    compiled module; returns the names of those left out."""
    pkg = Path(bucketimer.__file__).resolve().parent
    left_out = sorted(p.name for pattern in COMPILED for p in pkg.rglob(pattern))
    shutil.copytree(pkg, site / "bucketimer",
                    ignore=shutil.ignore_patterns(*COMPILED, "__pycache__"))
    dist = importlib.metadata.distribution("bucketimer")
    info = Path(str(dist.locate_file(""))) / f"bucketimer-{dist.version}.dist-info"
    if info.is_dir():
        shutil.copytree(info, site / info.name)
    return left_out


def _compiled_outside_the_package() -> bool:
    """An editable install: the package is the source tree and its compiled
    modules are elsewhere, found through the install's own import hook
    (which a copy's child process would still find)."""
    direct_url = importlib.metadata.distribution("bucketimer").read_text("direct_url.json")
    if direct_url and json.loads(direct_url).get("dir_info", {}).get("editable"):
        return True
    if bucketimer.backend != "native":
        return False
    core = importlib.import_module("bucketimer._core")
    pkg = Path(bucketimer.__file__).resolve().parent
    return Path(str(core.__file__)).resolve().parent != pkg


@pytest.mark.skipif(_compiled_outside_the_package(),
                    reason="an editable install: no installed package to copy "
                           "(nox sessions and CI install the wheel)")
def test_an_install_without_its_compiled_modules_runs_the_pure_backend(tmp_path: Path) -> None:
    site, smoke = tmp_path / "site", tmp_path / "smoke"
    left_out = _copy_without_compiled_modules(site)
    if bucketimer.backend == "native":
        assert any(name.startswith("_core.") for name in left_out), left_out
    smoke.mkdir()
    shutil.copy(TESTS_DIR / "test_smoke.py", smoke)
    env = {k: v for k, v in os.environ.items() if k != "BUCKETIMER_NO_EXTENSIONS"}
    env.update(PYTHONPATH=str(site), BUCKETIMER_EXPECT_BACKEND="python")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "-rs", "test_smoke.py"],
        cwd=smoke, env=env, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "passed" in proc.stdout and "failed" not in proc.stdout, proc.stdout
    assert "only where a backend is expected" not in proc.stdout  # the check ran
