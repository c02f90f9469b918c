"""cffi out-of-line API-mode builder for ``bucketimer._cffi``.

The cdef is the public header ``csrc/include/bucketimer.h`` itself, with its
preprocessor lines and its ``#ifdef __cplusplus`` blocks removed.  The header
is written to be parseable this way (fixed-width types, no macros in
prototypes, every preprocessor line stands alone).

The build (CMakeLists.txt) runs this file as a script::

    python src/bucketimer/_cffi_build.py OUT.c

which writes the generated C source of the extension to ``OUT.c``; CMake then
compiles it against the static core library.  This file is build-time only: it
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
# The benchmark kit's header (the reference single-lock heap timer and the
# GIL-free benchmark loops); it includes bucketimer.h, so it is cdef'd second.
BENCH_DIR = os.path.normpath(os.path.join(HERE, "..", "..", "csrc", "bench"))
BENCH_HEADER = os.path.join(BENCH_DIR, "bucketimer_bench.h")

_COMMENT_RE = re.compile(r"/\*.*?\*/|//[^\n]*", re.DOTALL)
_IF_RE = re.compile(r"#\s*(if|ifdef|ifndef)\b")
_ENDIF_RE = re.compile(r"#\s*endif\b")
_CPLUSPLUS_RE = re.compile(r"#\s*ifdef\s+__cplusplus\b")


def _strip_comments(text: str) -> str:
    # Keep the newlines of block comments so that cffi's error messages point
    # at the right line of the header.
    return _COMMENT_RE.sub(lambda m: "\n" * m.group(0).count("\n") or " ", text)


def header_to_cdef(text: str) -> str:
    """Returns the cdef text for the header source ``text``."""
    out: list[str] = []
    skip_depth = 0  # > 0 while inside an ``#ifdef __cplusplus`` block
    for line in _strip_comments(text).splitlines():
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
            out.append("")
            continue
        out.append(line)
    if skip_depth:
        raise ValueError("unterminated '#ifdef __cplusplus' block in header")
    return "\n".join(out) + "\n"


def make_ffibuilder(header: str = HEADER, extra_headers: tuple[str, ...] | None = None) -> FFI:
    """The builder for ``header`` plus ``extra_headers`` (default: the bench
    header when it exists), cdef'd and included in that order."""
    if extra_headers is None:
        extra_headers = (BENCH_HEADER,) if header == HEADER and os.path.exists(BENCH_HEADER) else ()
    builder = FFI()
    includes = []
    for path in (header, *extra_headers):
        with open(path, encoding="utf-8") as f:
            builder.cdef(header_to_cdef(f.read()))
        includes.append(f'#include "{os.path.basename(path)}"')
    builder.set_source(
        "bucketimer._cffi",
        "\n".join(includes),
        include_dirs=[INCLUDE_DIR, BENCH_DIR],
    )
    return builder


ffibuilder = make_ffibuilder()


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(f"usage: {os.path.basename(argv[0])} OUT.c", file=sys.stderr)
        return 2
    out = argv[1]
    ffibuilder.emit_c_code(out)
    # cffi leaves an unchanged file untouched; bump its mtime anyway so that
    # the build tool sees the output as newer than its inputs.
    os.utime(out, None)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
