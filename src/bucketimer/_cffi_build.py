"""cffi out-of-line API-mode builder for ``bucketimer._cffi_lib`` and
``bucketimer.bench._cbench``.

The two modules, and what each is cdef'd from and linked with:

* ``bucketimer._cffi_lib``: the public header ``csrc/include/bucketimer.h``,
  the core's C API and nothing else (what tests and users call, as
  ``bucketimer._cffi``, which says what is missing when it cannot load);
* ``bucketimer.bench._cbench``: the same header and the benchmark kit's
  ``csrc/bench/bucketimer_bench.h`` (the reference single-lock heap timer and
  the GIL-free benchmark loops), for the kit alone.

Each extension links its own static copy of the core, so a core made through
one module must be used only through that module.

A cdef is the header itself, with its preprocessor lines and its
``#ifdef __cplusplus`` blocks removed.  The headers are written to be
parseable this way (fixed-width types, no macros in prototypes).  One kind
of macro is expanded here, because cffi cannot: a line that is only
``LIST(ITEM)``, where ``LIST`` is an X-macro (``#define LIST(X) X(a) X(b)``,
over continuation lines) and ``ITEM`` a one-line ``#define ITEM(name) ...``;
it becomes ITEM's body for each name.  That is how ``bt_stats`` lists its
counters once.

The build (CMakeLists.txt) runs this file as a script::

    python src/bucketimer/_cffi_build.py [--bench] OUT.c

which writes the generated C source of ``bucketimer._cffi_lib`` (with
``--bench``: of ``bucketimer.bench._cbench``) to ``OUT.c``; CMake then
compiles it against the static libraries.  This file is build-time only: it
is not part of the installed package.
"""

from __future__ import annotations

import os
import re
import sys

from cffi import FFI

HERE = os.path.dirname(os.path.abspath(__file__))
INCLUDE_DIR = os.path.normpath(os.path.join(HERE, "..", "..", "csrc", "include"))
HEADER = os.path.join(INCLUDE_DIR, "bucketimer.h")
# The benchmark kit's header; it includes bucketimer.h, so it is cdef'd second.
BENCH_DIR = os.path.normpath(os.path.join(HERE, "..", "..", "csrc", "bench"))
BENCH_HEADER = os.path.join(BENCH_DIR, "bucketimer_bench.h")

CORE_MODULE = "bucketimer._cffi_lib"
BENCH_MODULE = "bucketimer.bench._cbench"
# module -> the headers cdef'd and included, in that order
MODULES: dict[str, tuple[str, ...]] = {
    CORE_MODULE: (HEADER,),
    BENCH_MODULE: (HEADER, BENCH_HEADER),
}

_COMMENT_RE = re.compile(r"/\*.*?\*/|//[^\n]*", re.DOTALL)
_IF_RE = re.compile(r"#\s*(if|ifdef|ifndef)\b")
_ENDIF_RE = re.compile(r"#\s*endif\b")
_CPLUSPLUS_RE = re.compile(r"#\s*ifdef\s+__cplusplus\b")
_DEFINE_RE = re.compile(r"#\s*define\s+(\w+)\((\w+)\)\s*(.*)$", re.DOTALL)
_USE_RE = re.compile(r"^\s*(\w+)\((\w+)\)\s*$")


def _strip_comments(text: str) -> str:
    # Keep the newlines of block comments so that cffi's error messages point
    # at the right line of the header.
    return _COMMENT_RE.sub(lambda m: "\n" * m.group(0).count("\n") or " ", text)


def _join_continuations(lines: list[str]) -> list[str]:
    """Joins a line ending in a backslash with the next, leaving an empty
    line in its place (so line numbers still match the header's)."""
    out: list[str] = []
    pending = ""
    blanks = 0
    for line in lines:
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            blanks += 1
            continue
        out.append(pending + line)
        out.extend([""] * blanks)
        pending, blanks = "", 0
    return out


def _expand_x_macro(line: str, macros: dict[str, tuple[str, str]]) -> str | None:
    """``LIST(ITEM)`` expanded, or None if ``line`` is not one (module doc)."""
    use = _USE_RE.match(line)
    if not use or use[1] not in macros or use[2] not in macros:
        return None
    list_param, list_body = macros[use[1]]
    item_param, item_body = macros[use[2]]
    names = re.findall(rf"\b{list_param}\((\w+)\)", list_body)
    return " ".join(re.sub(rf"\b{item_param}\b", name, item_body) for name in names)


def header_to_cdef(text: str) -> str:
    """Returns the cdef text for the header source ``text``."""
    out: list[str] = []
    skip_depth = 0  # > 0 while inside an ``#ifdef __cplusplus`` block
    macros: dict[str, tuple[str, str]] = {}  # name -> (parameter, body)
    for line in _join_continuations(_strip_comments(text).splitlines()):
        stripped = line.strip()
        if skip_depth:
            if _IF_RE.match(stripped):
                skip_depth += 1
            elif _ENDIF_RE.match(stripped):
                skip_depth -= 1
            out.append("")
            continue
        if _CPLUSPLUS_RE.match(stripped):
            skip_depth = 1
            out.append("")
            continue
        if stripped.startswith("#"):
            define = _DEFINE_RE.match(stripped)
            if define:
                macros[define[1]] = (define[2], define[3])
            out.append("")
            continue
        expanded = _expand_x_macro(line, macros)
        out.append(line if expanded is None else expanded)
    if skip_depth:
        raise ValueError("unterminated '#ifdef __cplusplus' block in header")
    return "\n".join(out) + "\n"


def make_ffibuilder(module: str = CORE_MODULE) -> FFI:
    """The builder of ``module`` (a key of MODULES): its headers cdef'd and
    included in order."""
    headers = MODULES[module]
    builder = FFI()
    for path in headers:
        with open(path, encoding="utf-8") as f:
            builder.cdef(header_to_cdef(f.read()))
    builder.set_source(
        module,
        "\n".join(f'#include "{os.path.basename(path)}"' for path in headers),
        include_dirs=sorted({os.path.dirname(path) for path in headers}),
    )
    return builder


def main(argv: list[str]) -> int:
    args = argv[1:]
    module = CORE_MODULE
    if args[:1] == ["--bench"]:
        module, args = BENCH_MODULE, args[1:]
    if len(args) != 1 or args[0].startswith("-"):
        print(f"usage: {os.path.basename(argv[0])} [--bench] OUT.c", file=sys.stderr)
        return 2
    out = args[0]
    make_ffibuilder(module).emit_c_code(out)
    # cffi leaves an unchanged file untouched; bump its mtime anyway so that
    # the build tool sees the output as newer than its inputs.
    os.utime(out, None)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
