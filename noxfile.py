"""Developer and CI tasks.  ``python -m nox -l`` lists them.

Default (``python -m nox``): the Python test suite on every supported Python,
and the C tests under ctest.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
import zipfile
from pathlib import Path
from types import ModuleType

import nox

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "tools"))
from pythons import supported  # noqa: E402

# The supported CPythons: pyproject.toml's classifiers (tools/pythons.py).
PYTHONS = supported()
# CPython's Py_DEBUG builds (refcount and assertion checks in the
# interpreter).  grpcio, uvloop and matplotlib publish no wheels for their
# ABI, so those libraries' tests skip there.
DEBUG_PYTHONS = ["python3.14d", "python3.15d"]

nox.options.sessions = ["tests", "ctest"]


# The sdist falls back to the pure-Python package when the native build
# fails (pyproject.toml); a session that tests the native backend must not
# quietly test the pure one, so its install refuses that fallback, and its
# pytest run checks which backend loaded (tests/conftest.py).
NATIVE_BUILD = {"BUCKETIMER_NATIVE_REQUIRED": "1"}


def _install(session: nox.Session, extras: str) -> None:
    """The package with EXTRAS, its native core built or the install fails."""
    session.install(f".[{extras}]", env=NATIVE_BUILD)


def _pytest(session: nox.Session, env: dict[str, str] | None = None,
            paths: tuple[str, ...] = ()) -> None:
    """pytest over tests/ (or the posargs, or ``paths``); slow tests (e.g. 10 million live timers, ~3 GB)
    only with BUCKETIMER_SLOW_TESTS=1, which also selects the long
    hypothesis profile.  The backend pytest must find loaded is the pure one
    under BUCKETIMER_NO_EXTENSIONS, else the native one."""
    slow = os.environ.get("BUCKETIMER_SLOW_TESTS", "") not in ("", "0")
    marks = [] if slow else ["-m", "not slow"]
    env = dict(env or {})
    env["BUCKETIMER_EXPECT_BACKEND"] = "python" if env.get("BUCKETIMER_NO_EXTENSIONS") else "native"
    session.run("pytest", *marks, *(session.posargs or paths), env=env)


@nox.session(python=PYTHONS)
def tests(session: nox.Session) -> None:
    """Builds and installs the package, then runs the pytest suite."""
    _install(session, "test")
    _pytest(session)


@nox.session(name="tests-public", python=PYTHONS)
def tests_public(session: nox.Session) -> None:
    """The suite with BUCKETIMER_PUBLIC_API=1: no read of CPython's private
    state is used, so every public-API fallback is what runs."""
    _install(session, "test")
    _pytest(session, env={"BUCKETIMER_PUBLIC_API": "1"})


@nox.session(name="tests-pure", python=PYTHONS)
def tests_pure(session: nox.Session) -> None:
    """The suite on the pure-Python backend (BUCKETIMER_NO_EXTENSIONS=1, set
    as aio-libs' packages set theirs); tests of native-only things (marked
    ``native``) skip, saying so."""
    session.install(".[test]")
    _pytest(session, env={"BUCKETIMER_NO_EXTENSIONS": "1"})


#: the benchmark kit's tests that run it whole, or its service rows
DEBUG_SKIPS_KIT = [
    "cli_smoke_writes_tables_json_csv_and_the_figure_by_default",
    "cli_runs_on_a_pure_only_install",
    "service_smoke_serves_real_requests",
    "service_turn_that_cannot_be_measured_is_noted_not_fatal",
    "service_turn_measured_on_its_retry",
]


@nox.session(name="tests-debug", python=DEBUG_PYTHONS)
def tests_debug(session: nox.Session) -> None:
    """The suite under a Py_DEBUG interpreter (cffi builds from source),
    which checks what the extensions do to the interpreter (refcounts, its
    assertions).  But for the benchmark kit's whole runs and the pytest
    plugin's, in subprocesses, which make the calls tests/core and tests/aio
    make and run on every release build."""
    _install(session, "test-core")
    kit = "tests/bench/test_kit.py::test_"
    _pytest(session, paths=(
        "--ignore=tests/test_pytest_plugin.py",
        *(f"--deselect={kit}{name}" for name in DEBUG_SKIPS_KIT)))


LINT_PATHS = ["src", "tests", "benchmarks", "tools", "docs/examples", "noxfile.py", "conftest.py"]


@nox.session(python="3.11")
def lint(session: nox.Session) -> None:
    """ruff; mypy --strict over the package, tests/typing/ and docs/examples/
    (as 3.11 and as 3.14 read them); stubtest of the extension modules' stubs
    (_core.pyi, _cffi.pyi, bench/_cbench.pyi) against the built modules."""
    # The checkers are pinned: a new release's rules must not fail CI on
    # unchanged code.  Raise the pins on purpose, with the fixes they ask for.
    # (mypy and grpc's stubs: the test extra's, which type-checks the docs' examples)
    session.install("ruff==0.17.6", "types-tqdm", "pandas-stubs", ".[test,bench]")
    session.run("ruff", "check", *LINT_PATHS, *session.posargs)
    for version in ("3.11", "3.14"):
        session.run("mypy", "--python-version", version)  # files: pyproject.toml
    session.run("python", "-m", "mypy.stubtest", "bucketimer._core", "bucketimer._cffi",
                "bucketimer.bench._cbench")
    _check_wheel_builds(session)


#: the oldest grpcio supported (the first with wheels for CPython 3.14:
#: pyproject.toml's grpc extra) and the newest tested
GRPCIO_BOUNDS = ["1.75.1", "1.85.3"]


@nox.session(name="grpc-bounds", python=["3.11", "3.14"])
@nox.parametrize("grpcio", GRPCIO_BOUNDS)
def grpc_bounds(session: nox.Session, grpcio: str) -> None:
    """The gRPC interceptors on the oldest and the newest grpcio supported:
    the grpc functions importing bucketimer.grpc wraps, found and wrapped,
    and every interceptor registered every way (posargs: other tests)."""
    _install(session, "test")
    session.install(f"grpcio=={grpcio}")
    _pytest(session, paths=("tests/otel/test_grpc_patching.py",
                            "tests/grpc/test_grpc_registration.py"))


def _check_wheel_builds(session: nox.Session) -> None:
    """cibuildwheel's ``build`` list (which TOML cannot derive) names the
    supported CPythons, no more, no fewer."""
    with open(ROOT / "pyproject.toml", "rb") as f:
        build = tomllib.load(f)["tool"]["cibuildwheel"]["build"]
    expected = [f"cp{v.replace('.', '')}-*" for v in PYTHONS]
    if build != expected:
        session.error(f"[tool.cibuildwheel] build = {build}, but the classifiers say {expected}")


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
            **NATIVE_BUILD,
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
        # mypy over the docs' examples runs none of the extensions' code
        "--ignore=tests/typing",
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
            "BUCKETIMER_EXPECT_BACKEND": "native",
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


# CBMC (Debian's package) in the x86 root of DEBIAN_PYTHON, installed on first
# use; the root's package lists may be older than the mirror's Valid-Until.
CBMC_INSTALL = (
    "command -v cbmc >/dev/null || { apt-get -o Acquire::Check-Valid-Until=false update -qq"
    " && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq cbmc >/dev/null; }"
)


@nox.session(python=False)
def model(session: nox.Session) -> None:
    """Model checks of the core's lock-free protocols (csrc/model/, run by
    tools/model_check.py): CBMC over every interleaving of each harness's
    threads, under sequential consistency and partial store order, and each
    recorded mutation must give a counter-example (about 19 minutes).  In
    DEBIAN_PYTHON's root, which gets CBMC on first use.
    Posargs: harness names, ``quick`` for sequential consistency only,
    ``verify`` to skip the mutations."""
    deb = str(DEBIAN_PYTHON)
    session.run(deb, "run", str(ROOT), "--", "bash", "-c", CBMC_INSTALL, external=True)
    session.run(deb, "run", str(ROOT), "--", "python3.14", "tools/model_check.py",
                *session.posargs, external=True)


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
    _install(session, "cffi")  # the soak drives a core through bucketimer._cffi
    session.run("python", "tests/soak.py", *session.posargs)


@nox.session(python="3.11")
def bench(session: nox.Session) -> None:
    """pytest-benchmark benchmarks (benchmarks/).  ``-- --check`` runs each
    benchmark's body once, untimed, with the long workloads shrunk: that the
    benchmarks still work (CI runs it)."""
    _install(session, "bench,test")
    args = list(session.posargs)
    env = {}
    if "--check" in args:
        args.remove("--check")
        mode = ["--benchmark-disable"]
        env["BUCKETIMER_BENCH_QUICK"] = "1"
    else:
        mode = ["--benchmark-only", "--benchmark-disable-gc"]
    session.run("pytest", "benchmarks", "-o", "python_files=bench_*.py", *mode, *args, env=env)


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
    """Executes docs/notebooks/explore.ipynb in place with nbclient (the
    quick suite: a minute or two), keeping its outputs in the notebook; it
    writes no other file (BUCKETIMER_NOTEBOOK_FIGURES=DIR: its figures as
    PNGs into DIR).  ``-- --check`` executes a copy in a directory outside
    the checkout instead, on the smoke suite: that every cell still runs
    from anywhere (CI does this), in seconds, leaving the notebook as it is."""
    if not (ROOT / NOTEBOOK).exists():
        session.skip(f"{NOTEBOOK} does not exist")
    _install(session, "bench,docs")
    if "--check" not in session.posargs:
        session.run("python", "-c", _EXECUTE_NOTEBOOK, NOTEBOOK)
        return
    with tempfile.TemporaryDirectory(prefix="bucketimer-notebook-") as work:
        copy = Path(work) / Path(NOTEBOOK).name
        shutil.copyfile(ROOT / NOTEBOOK, copy)
        session.run("python", "-c", _EXECUTE_NOTEBOOK, str(copy),
                    env={"BUCKETIMER_NOTEBOOK_SUITE": "smoke"})
        written = sorted(p.name for p in Path(work).iterdir() if p != copy)
        if written:
            session.error(f"the notebook wrote files beside itself: {written}")


# -- release artefacts -------------------------------------------------------------

# aarch64 wheels only for the CPythons the emulated arm64 root runs, where each
# is installed and smoke-tested before it ships (pyproject.toml's cibuildwheel
# skip list says the same); on aarch64 the others (3.11, 3.12) install the
# pure wheel.
DIST_AARCH64_PYTHONS = ["3.13", "3.14", "3.15"]
DIST_ARCHS = ["x86_64", "aarch64"]
DIST_DIR = ROOT / "dist"
DIST_WORK = ROOT / "build-dist"
# Where the machine provides it: runs a command in a Debian root that has the
# CPythons pyenv does not (3.14, 3.15), with this directory mounted in place.
# With DEBIAN_PYTHON_ARCH=arm64, an arm64 root (3.13-3.15) whose programs run
# under qemu-user; static x86_64 programs, such as PyPI's zig, run there natively.
DEBIAN_PYTHON = ROOT.parent / "shared" / "tools" / "debian-python"
ARM64 = {"DEBIAN_PYTHON_ARCH": "arm64"}
# Top-level files of the sdist besides csrc/, ext/, src/ and tests/.
SDIST_ROOT_FILES = {"pyproject.toml", "CMakeLists.txt", "README.rst", "CHANGELOG.rst"}


def _python_on_path(version: str) -> str | None:
    """``pythonX.Y`` if it is on PATH and really is X.Y (a pyenv shim for a
    version not selected is on PATH but fails)."""
    exe = shutil.which(f"python{version}")
    if exe is None:
        return None
    probe = subprocess.run(
        [exe, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
        capture_output=True,
        text=True,
    )
    return exe if probe.returncode == 0 and probe.stdout.strip() == version else None


def _check_sdist(session: nox.Session, sdist: Path) -> None:
    """The sdist holds exactly the tracked files a build and its tests need."""
    import tarfile

    with tarfile.open(sdist) as tf:
        prefix = sdist.name[: -len(".tar.gz")] + "/"
        members = {m.name[len(prefix) :] for m in tf.getmembers() if m.isfile()}
        pkg_info = tf.extractfile(prefix + "PKG-INFO").read().decode()
    ns: dict[str, str] = {}
    exec((ROOT / "src" / "bucketimer" / "_version.py").read_text(), ns)
    version = ns["__version__"]
    if f"\nVersion: {version}\n" not in pkg_info:
        session.error(f"sdist metadata does not say Version: {version}")
    changelog = (ROOT / "CHANGELOG.rst").read_text()
    if f"\n{version}\n{'-' * len(version)}\n" not in changelog:
        session.error(f"CHANGELOG.rst has no section for {version}")
    try:
        tracked = subprocess.run(
            ["git", "ls-files", "csrc", "ext", "src", "tests", "docs/examples",
             *sorted(SDIST_ROOT_FILES)],
            cwd=ROOT, check=True, capture_output=True, text=True,
        ).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        session.warn("not a git checkout: sdist contents not compared with the tracked files")
        return
    expected = set(tracked) | {"PKG-INFO"}
    missing, extra = sorted(expected - members), sorted(members - expected)
    if missing or extra:
        session.error(f"sdist contents: missing {missing}, unexpected {extra}")
    session.log(f"{sdist.name}: {len(members)} files, the tracked ones of csrc/ ext/ src/ tests/ docs/examples/")


def _host_zig(session: nox.Session) -> str:
    """The zig binary of PyPI's ``ziglang``, installed in the session's venv:
    a static x86_64 executable, which the emulated arm64 root runs natively
    (it is under ROOT, which the root mounts in place)."""
    session.install("ziglang")
    out = session.run(
        "python", "-c",
        "import os, ziglang; print(os.path.join(os.path.dirname(ziglang.__file__), 'zig'))",
        silent=True,
    )
    return str(out).strip().splitlines()[-1]


def _build_wheel_cmd(
    session: nox.Session, version: str, arch: str, args: list[str], zig: str
) -> tuple[list[str], dict[str, str]] | None:
    """How to run tools/build_wheel.py ARGS under CPython VERSION on ARCH:
    the command and its extra environment, or None (said why) if there is no
    such interpreter here."""
    if arch == "aarch64":
        if not DEBIAN_PYTHON.exists():
            session.warn(f"{DEBIAN_PYTHON} does not exist: no arm64 CPython to build with")
            return None
        session.log(f"aarch64 python{version}: building in the emulated arm64 root")
        return [str(DEBIAN_PYTHON), "run", str(ROOT), "--", f"python{version}", *args,
                "--zig", zig], ARM64
    exe = _python_on_path(version)
    if exe is not None:
        return [exe, *args], {}
    if DEBIAN_PYTHON.exists():
        session.log(f"python{version} is not on PATH: building in {DEBIAN_PYTHON.name}")
        return [str(DEBIAN_PYTHON), "run", str(ROOT), "--", f"python{version}", *args], {}
    session.warn(f"python{version} is not on PATH and {DEBIAN_PYTHON} does not exist")
    return None


def _dist_targets(session: nox.Session) -> list[tuple[str, str]]:
    """(arch, version) pairs from the posargs: CPython versions and/or
    architectures, each list defaulting to all."""
    args = list(session.posargs)
    archs = [a for a in args if a in DIST_ARCHS] or DIST_ARCHS
    versions = [v for v in args if v not in DIST_ARCHS] or PYTHONS
    unknown = sorted(set(versions) - set(PYTHONS))
    if unknown:
        session.error(f"not a supported CPython or architecture: {unknown} "
                      f"(supported: {PYTHONS}, {DIST_ARCHS})")
    targets = [(arch, v) for arch in archs for v in versions
               if arch == "x86_64" or v in DIST_AARCH64_PYTHONS]
    if not targets:
        session.error(f"nothing to build: aarch64 wheels are for {DIST_AARCH64_PYTHONS} only")
    return targets


def _build_sdist(session: nox.Session, outdir: Path) -> Path:
    """The sdist, built into OUTDIR (emptied first), checked."""
    session.install("build")
    shutil.rmtree(outdir, ignore_errors=True)
    session.run("python", "-m", "build", "--sdist", "--outdir", str(outdir))
    (sdist,) = outdir.glob("*.tar.gz")
    _check_sdist(session, sdist)
    return sdist


@nox.session(python="3.11")
def dist(session: nox.Session) -> None:
    """The sdist, one audited manylinux wheel per supported CPython and
    architecture, and the pure-Python py3-none-any wheel, in dist/.

    Each wheel is built from the sdist by tools/build_wheel.py under its own
    interpreter: with zig cc targeting glibc 2.28, repaired and checked by
    auditwheel, then installed where no compiler is on PATH and smoke-tested.
    A CPython not on PATH (3.14, 3.15 here) is run from the Debian root of
    DEBIAN_PYTHON; the aarch64 wheels (DIST_AARCH64_PYTHONS) are built,
    installed and smoke-tested in its emulated arm64 root, compiled by this
    machine's zig.  ``nox -s dist -- 3.12 3.14`` builds a subset,
    ``nox -s dist -- aarch64`` one architecture.  dist/ is emptied first.
    """
    targets = _dist_targets(session)
    zig = _host_zig(session) if any(arch == "aarch64" for arch, _ in targets) else ""
    sdist = _build_sdist(session, DIST_DIR)

    # Every target is tried; the session fails at the end if any failed.
    summaries, failed = [], []
    for arch, version in targets:
        work = DIST_WORK / (version if arch == "x86_64" else f"{arch}-{version}")
        args = ["tools/build_wheel.py", "--sdist", str(sdist), "--out", str(DIST_DIR),
                "--work", str(work)]
        how = _build_wheel_cmd(session, version, arch, args, zig)
        if how is None:
            failed.append(f"{version} ({arch})")
            continue
        cmd, env = how
        shutil.rmtree(work, ignore_errors=True)
        session.run(*cmd, env=env, external=True, success_codes=range(256))
        summary = work / "summary.json"
        s = json.loads(summary.read_text()) if summary.exists() else None
        if s is None or s["smoke"] != "passed":
            failed.append(f"{version} ({arch})")
        if s is not None:
            summaries.append(s)

    pure = _pure_wheel(session, sdist)
    if pure is None:
        failed.append("py3-none-any")
    _sdist_fallback(session, sdist)

    session.log(f"sdist: {sdist.name} ({sdist.stat().st_size} bytes)")
    if pure is not None:
        session.log(f"{pure.name}: {pure.stat().st_size} bytes; pure Python; smoke tests passed")
    for s in summaries:
        session.log(
            f"{s['wheel']}: {s['size']} bytes; newest glibc symbol {s['newest_glibc']}; "
            f"auditwheel: {' '.join(s['auditwheel_show'].split()[1:9])}; "
            f"smoke tests {s['smoke']}; {s['seconds']} s"
        )
    if failed:
        session.error(f"no wheel for {', '.join(failed)} (see above)")


@nox.session(name="dist-pure", python="3.11")
def dist_pure(session: nox.Session) -> None:
    """What ``dist`` builds for systems with no native wheel, alone: the sdist,
    the py3-none-any wheel (in dist/) and the sdist's fallback build, each
    installed in a fresh venv and smoke-tested."""
    session.install("build")
    DIST_DIR.mkdir(exist_ok=True)
    for old in DIST_DIR.glob("*.tar.gz"):
        old.unlink()
    session.run("python", "-m", "build", "--sdist", "--outdir", str(DIST_DIR))
    (sdist,) = DIST_DIR.glob("*.tar.gz")
    _check_sdist(session, sdist)
    pure = _pure_wheel(session, sdist)
    if pure is None:
        session.error("no py3-none-any wheel")
    _sdist_fallback(session, sdist)
    session.log(f"{pure.name}: {pure.stat().st_size} bytes; pure Python; smoke tests passed")


def _smoke_in_fresh_venv(session: nox.Session, wheel: Path, work: Path) -> None:
    """Installs ``wheel`` into a new venv under ``work`` and runs the smoke
    tests there from an empty directory, expecting the pure backend."""
    venv = work / "venv"
    session.run("python", "-m", "venv", str(venv))
    py = str(venv / "bin" / "python")
    session.run(py, "-m", "pip", "install", "-q", str(wheel), "pytest", external=True)
    smoke = work / "smoke"
    smoke.mkdir()
    shutil.copy(ROOT / "tests" / "test_smoke.py", smoke)
    with session.chdir(smoke):
        session.run(py, "-m", "pytest", "-p", "no:cacheprovider", "-v", "test_smoke.py",
                    env={"BUCKETIMER_SMOKE_INSTALLED": "1", "BUCKETIMER_EXPECT_BACKEND": "python"},
                    external=True)


def _sdist_fallback(session: nox.Session, sdist: Path) -> None:
    """The sdist on a system where the native core cannot be built
    (simulated: BUCKETIMER_PRETEND_UNSUPPORTED=1) builds the pure package,
    saying why, and that package passes the smoke tests."""
    work = DIST_WORK / "fallback"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    log = session.run("python", "-m", "pip", "wheel", "-v", "--no-deps", "-w", str(work),
                      str(sdist), env={"BUCKETIMER_PRETEND_UNSUPPORTED": "1"}, silent=True)
    if not isinstance(log, str) or "installed the pure-Python package instead" not in log:
        session.error("the sdist's fallback build did not say it built the pure package")
    (wheel,) = work.glob("*-py3-none-any.whl")
    _smoke_in_fresh_venv(session, wheel, work)
    session.log(f"sdist fallback: {wheel.name}, smoke tests passed")


def _pure_wheel(session: nox.Session, sdist: Path) -> Path | None:
    """The py3-none-any wheel: the pure-Python backend alone, for every system
    with no native wheel (pyproject.toml's overrides: no CMake run), built
    from the sdist, installed in a fresh venv and smoke-tested there against
    an empty directory; None if the build made any other wheel."""
    work = DIST_WORK / "pure"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    env = {"BUCKETIMER_NO_EXTENSIONS": "1"}
    session.run("python", "-m", "pip", "wheel", "--no-deps", "-w", str(work), str(sdist),
                env=env)
    (wheel,) = work.glob("*.whl")
    with zipfile.ZipFile(wheel) as zf:
        compiled = [n for n in zf.namelist() if n.endswith((".so", ".pyd", ".dylib"))]
    if not wheel.name.endswith("-py3-none-any.whl") or compiled:
        session.warn(f"{wheel.name}: not a pure py3-none-any wheel ({compiled})")
        return None
    _smoke_in_fresh_venv(session, wheel, work)
    target = DIST_DIR / wheel.name
    shutil.copy(wheel, target)
    return target



# -- aarch64 under emulation -------------------------------------------------------

EMULATED_DIR = ROOT / "build-emulated"
EMULATED_PARTS = ["ctest", "wheel", "suite"]
EMULATED_PYTHON = "3.14"
# How much slower than native the suite may run emulated (tests/conftest.py).
EMULATED_TIME_SCALE = 10


def _arm64_run(session: nox.Session, *cmd: str) -> None:
    """Runs CMD in the emulated arm64 root, in this directory."""
    if not DEBIAN_PYTHON.exists():
        session.error(f"{DEBIAN_PYTHON} does not exist: no arm64 root to run in")
    session.run(str(DEBIAN_PYTHON), "run", str(ROOT), "--", *cmd, env=ARM64, external=True)


def _build_wheel_module() -> ModuleType:
    """tools/build_wheel.py, for its zig wrappers."""
    spec = importlib.util.spec_from_file_location("build_wheel", ROOT / "tools" / "build_wheel.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _emulated_ctest(session: nox.Session, zig: str) -> None:
    """The C tests, compiled for aarch64 (glibc 2.28) by this machine's zig,
    as the wheels are, and run by ctest in the arm64 root."""
    build = EMULATED_DIR / "ctest"
    shutil.rmtree(build, ignore_errors=True)
    build.mkdir(parents=True)
    bw = _build_wheel_module()
    tools = bw.zig_wrappers(Path(zig), build, bw.zig_target("aarch64"), [])
    configure = [
        "cmake", "-S", ".", "-B", str(build), "-G", "Ninja",
        f"-DCMAKE_C_COMPILER={tools['cc']}",
        f"-DCMAKE_C_COMPILER_AR={tools['ar']}",
        f"-DCMAKE_C_COMPILER_RANLIB={tools['ranlib']}",
        "-DBUCKETIMER_BUILD_PYTHON=OFF", "-DBUCKETIMER_BUILD_TESTS=ON",
        "-DBUCKETIMER_ASSERTS=ON", "-DCMAKE_BUILD_TYPE=RelWithDebInfo",
    ]
    script = (f"set -e; {' '.join(configure)}; cmake --build {build}; "
              f"cd {build}; ctest --output-on-failure")
    _arm64_run(session, "bash", "-c", script)


def _emulated_wheel(session: nox.Session, zig: str, version: str) -> Path:
    """An aarch64 wheel for CPython VERSION, built by tools/build_wheel.py in
    the arm64 root from a fresh sdist, audited, installed with no compiler on
    PATH and smoke-tested (tests/test_smoke.py, BUCKETIMER_SMOKE_INSTALLED=1)."""
    sdist = _build_sdist(session, EMULATED_DIR / "sdist")
    out, work = EMULATED_DIR / f"wheel-{version}", EMULATED_DIR / f"work-{version}"
    shutil.rmtree(out, ignore_errors=True)
    _arm64_run(session, f"python{version}", "tools/build_wheel.py", "--sdist", str(sdist),
               "--out", str(out), "--work", str(work), "--zig", zig)
    (wheel,) = out.glob("*.whl")
    return wheel


def _emulated_suite(session: nox.Session, wheel: Path, version: str, whole: bool) -> None:
    """The pytest suite in the arm64 root against WHEEL, installed in a venv
    of its own: tests/core and tests/aio (with their test-core dependencies),
    or (whole) all of it, with the libraries the suite integrates."""
    venv = EMULATED_DIR / f"venv-{version}"
    extra, paths = ("test", ["tests"]) if whole else ("test-core", ["tests/core", "tests/aio"])
    # pytest-timeout's hang guards, made for a native machine, scaled for
    # qemu-user (tests/conftest.py): the first hypothesis test that draws
    # text builds hypothesis' Unicode tables, well over a 60 s guard emulated.
    script = (
        f"set -e; rm -rf {venv}; python{version} -m venv {venv}; "
        f"{venv}/bin/python -m pip install -q '{wheel}[{extra}]'; "
        f"BUCKETIMER_TEST_TIME_SCALE={EMULATED_TIME_SCALE} "
        f"{venv}/bin/python -m pytest -p no:cacheprovider -m 'not slow' -q {' '.join(paths)}"
    )
    _arm64_run(session, "bash", "-c", script)


@nox.session(name="emulated-arm64", python="3.11")
def emulated_arm64(session: nox.Session) -> None:
    """The aarch64 build under qemu-user, in the arm64 root of DEBIAN_PYTHON
    (built on first use, about 15 minutes): the C tests (ctest), an aarch64
    wheel built, installed and smoke-tested, and the pytest suite against that
    wheel (tests/core and tests/aio; all of it with ``full``).  Posargs pick
    parts and the CPython: ``nox -s emulated-arm64 -- ctest wheel`` (what CI
    runs), ``-- suite full 3.13``.  Emulation runs arm64 code with the host's
    stronger memory ordering: docs/design.rst ("Memory orderings") argues the
    orderings instead.  Each part's time is logged at the end."""
    args = list(session.posargs)
    parts = [a for a in args if a in EMULATED_PARTS] or EMULATED_PARTS
    versions = [a for a in args if a in DIST_AARCH64_PYTHONS] or [EMULATED_PYTHON]
    unknown = sorted(set(args) - set(EMULATED_PARTS) - set(DIST_AARCH64_PYTHONS) - {"full"})
    if unknown or len(versions) > 1:
        session.error(f"posargs: parts {EMULATED_PARTS}, 'full', and one of {DIST_AARCH64_PYTHONS}")
    (version,) = versions
    zig = _host_zig(session)
    took: list[tuple[str, float]] = []
    wheel = None
    for part in EMULATED_PARTS:
        if part not in parts:
            continue
        start = time.monotonic()
        if part == "ctest":
            _emulated_ctest(session, zig)
        elif part == "wheel":
            wheel = _emulated_wheel(session, zig, version)
        else:
            if wheel is None:  # an earlier wheel part's, or `nox -s dist`'s
                tag = "cp" + version.replace(".", "")
                found = [*(EMULATED_DIR / f"wheel-{version}").glob("*.whl"),
                         *DIST_DIR.glob(f"bucketimer-*-{tag}-{tag}-*aarch64*.whl")]
                if not found:
                    session.error(f"no aarch64 wheel for {version}: run the wheel part first")
                wheel = found[0]
            _emulated_suite(session, wheel, version, "full" in args)
        took.append((part, time.monotonic() - start))
    for part, seconds in took:
        session.log(f"emulated-arm64 {part} (CPython {version}): {seconds:.0f} s")
