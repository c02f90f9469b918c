"""Model checks of the core's lock-free protocols with CBMC (csrc/model/).

Each harness csrc/model/NAME.c includes the core's real C and checks one
property over every interleaving of its threads; its header comment says
what, with which bounds, and lists the lines this script reads:

    adapt FILE: OLD => NEW       applied to the model copy of csrc/ always
    unwind N                     the loop bound, instead of 4
    mutation NAME MODEL FILE: OLD => NEW
                                 applied to a copy for an extra run, which
                                 must FAIL (a counter-example) under MODEL:
                                 ``sc``; ``weak`` for an ordering that only
                                 a weak memory model can show; ``sc+weak``
                                 (one run under each) for a step dropped in
                                 a harness with no ordering to weaken, to
                                 show that its weak run can fail too

(OLD and NEW are one line each, ``\\n`` for a line break; OLD must occur
exactly once in FILE; mutation lines with one NAME make one mutation, applied
together; lines in the csrc/model/ headers a harness includes count as its
own.)  Every harness is checked under sequential consistency and under
CBMC's partial-store-order model (``cbmc --mm pso``: stores may overtake
stores and loads; fences restore the order), and each mutation under the
model it names.  The verdicts and times are printed as a
table; the exit status is 1 if a harness fails or a mutation is not
caught.

Run in the Debian root where CBMC is installed: ``nox -s model`` does that.
Arguments: harness names to run only those; ``quick`` for sequential
consistency only (the harnesses and their ``sc`` mutations); ``verify`` for
the harnesses without their mutations.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CSRC = ROOT / "csrc"
MODEL = CSRC / "model"
WEAK = "pso"
# A bound for every loop: each retry of a CAS loop needs another thread's
# step, and no harness has more than a few; --unwinding-assertions proves
# the bound is enough rather than assuming it.  A harness whose loops need
# fewer trips says so (``unwind N``): the run time grows fast with it.
CBMC = ["cbmc", "--no-standard-checks", "--unwinding-assertions"]
UNWIND = 4
# What every model copy gets (each edit replaces every occurrence in FILE):
# - a slot directory of 2 blocks instead of 65536, which CBMC would otherwise
#   carry in every state of the core struct;
# - one bucket, named as such: the harnesses' cores have one, where the real
#   expressions give 0 too, but CBMC reads a slot's `bucket` (or the caller's
#   thread index) as a shared variable any thread might have changed, and a
#   store through a pointer at an unknown offset into a struct that holds
#   pointers is what its concurrency support refuses.
GLOBAL_ADAPT = [
    ("internal.h", "#define BT_MAX_BLOCKS (1u << 16)", "#define BT_MAX_BLOCKS 2u"),
    ("bucket.c", "return k < tt->nbuckets ? k : k % tt->nbuckets;", "return 0 * k;"),
    ("bucket.c", "&tt->buckets[t->bucket]", "&tt->buckets[0]"),
    ("pass.c", "&tt->buckets[t->bucket]", "&tt->buckets[0]"),
    ("pass.c", "&tt->chains[t->bucket]", "&tt->chains[0]"),
]

EDIT = re.compile(r"^ \* adapt (\S+): (.*) => (.*)$")
BOUND = re.compile(r"^ \* unwind (\d+)$")
MUTATION = re.compile(r"^ \* mutation (\S+) (sc|weak|sc\+weak) (\S+): (.*) => (.*)$")


@dataclass
class Harness:
    name: str
    unwind: int
    adapt: list[tuple[str, str, str]]
    mutations: list[tuple[str, str, str, str, str]]


def unescape(text: str) -> str:
    return text.replace("\\n", "\n")


INCLUDE = re.compile(r'^#include "(\w+\.h)"$')


def harness_lines(path: Path) -> list[str]:
    """The harness's lines, and those of the csrc/model/ headers it includes."""
    lines = path.read_text().splitlines()
    headers = [MODEL / m[1] for line in lines if (m := INCLUDE.match(line))]
    return [line for h in headers if h.exists() for line in h.read_text().splitlines()] + lines


def read_harness(path: Path) -> Harness:
    adapt: list[tuple[str, str, str]] = []
    mutations: list[tuple[str, str, str, str, str]] = []
    unwind = UNWIND
    lines = harness_lines(path)
    for line in lines:
        if m := BOUND.match(line):
            unwind = int(m[1])
        elif m := EDIT.match(line):
            adapt.append((m[1], unescape(m[2]), unescape(m[3])))
        elif m := MUTATION.match(line):
            mutations.append((m[1], m[2], m[3], unescape(m[4]), unescape(m[5])))
    return Harness(path.stem, unwind, adapt, mutations)


def apply(tree: Path, file: str, old: str, new: str, every: bool = False) -> None:
    path = tree / file
    text = path.read_text()
    n = text.count(old)
    if n != 1 and not (every and n):
        raise SystemExit(f"model_check: {file}: {old!r} occurs {n} times")
    path.write_text(text.replace(old, new))


def build(h: Harness, work: Path, mutation: list[tuple[str, str, str]]) -> Path:
    """A copy of csrc/ with the edits applied, and the harness compiled."""
    tree = work / "csrc"
    if tree.exists():
        shutil.rmtree(tree)
    shutil.copytree(CSRC, tree, ignore=shutil.ignore_patterns("bench", "tests"))
    for edit in GLOBAL_ADAPT:
        apply(tree, *edit, every=True)
    for edit in h.adapt + mutation:
        apply(tree, *edit)
    binary = work / f"{h.name}.gb"
    subprocess.run(["goto-cc", "-I", "shim", "-I", "../include", "-I", "..", f"{h.name}.c",
                    "-o", str(binary)], cwd=tree / "model", check=True)
    return binary


def check(binary: Path, model: str, unwind: int) -> tuple[str, float]:
    """'ok' (verified), 'FAILED' (a counter-example) or 'ERROR', and seconds."""
    cmd = CBMC + ["--unwind", str(unwind)] + ([] if model == "sc" else ["--mm", WEAK]) + [str(binary)]
    start = time.monotonic()
    run = subprocess.run(cmd, capture_output=True, text=True)
    took = time.monotonic() - start
    verdict = {0: "ok", 10: "FAILED"}.get(run.returncode, "ERROR")
    if verdict != "ok":
        failed = [line for line in run.stdout.splitlines() if line.endswith(": FAILURE")]
        detail = failed or (run.stdout + run.stderr).strip().splitlines()[-5:]
        print("\n".join("    " + line for line in detail), flush=True)
    return verdict, took


def main(argv: list[str]) -> int:
    quick = "quick" in argv
    verify = "verify" in argv
    names = [a for a in argv if a not in ("quick", "verify")]
    paths = sorted(MODEL.glob("*.c"))
    if names:
        paths = [p for p in paths if p.stem in names]
    version = subprocess.run(["cbmc", "--version"], capture_output=True, text=True).stdout.strip()
    models = ["sc"] if quick else ["sc", "weak"]
    shown = "sc" if quick else f"sc, --mm {WEAK}"
    print(f"model_check: CBMC {version}; {len(paths)} harnesses; models: {shown}", flush=True)
    rows: list[tuple[str, str, str, str, float]] = []
    bad = 0
    with tempfile.TemporaryDirectory(prefix="bt-model-") as tmp:
        work = Path(tmp)
        for path in paths:
            h = read_harness(path)
            binary = build(h, work, [])
            for model in models:
                print(f"-- {h.name}: {model}", flush=True)
                verdict, took = check(binary, model, h.unwind)
                bad += verdict != "ok"
                rows.append((h.name, "-", model, verdict, took))
            for name, named in dict.fromkeys((m[0], m[1]) for m in h.mutations):
                runs = [m for m in named.split("+") if not verify and (m == "sc" or not quick)]
                if not runs:
                    continue
                edits = [(f, old, new) for n, _, f, old, new in h.mutations if n == name]
                mutant = build(h, work, edits)
                for model in runs:
                    print(f"-- {h.name}: mutation {name} ({model})", flush=True)
                    verdict, took = check(mutant, model, h.unwind)
                    caught = verdict == "FAILED"
                    bad += not caught
                    rows.append((h.name, name, model,
                                 "caught" if caught else f"NOT caught ({verdict})", took))
    print(f"\n{'harness':<8} {'mutation':<28} {'model':<6} {'verdict':<22} seconds")
    for name, mutation, model, verdict, took in rows:
        shown = WEAK if model == "weak" else model
        print(f"{name:<8} {mutation:<28} {shown:<6} {verdict:<22} {took:7.1f}")
    ok = "all verified" + (", mutations not run" if verify else ", every mutation caught")
    print(f"model_check: {'FAILED' if bad else ok}"
          f" ({sum(r[4] for r in rows):.0f} s)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
