"""The examples of docs/grpc.rst, run as written: each starts its own
servers on 127.0.0.1 and must print what the page says it prints."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("grpc")

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs" / "grpc.rst"

#: what each example of docs/grpc.rst must print (stdout + stderr), in order
DOC_EXPECTS = [
    ["StatusCode.DEADLINE_EXCEEDED after 0.2", "b'hi'"],
    ["StatusCode.DEADLINE_EXCEEDED Deadline Exceeded after 0.1", "handler: budget 0.",
     "handler: no longer active, stopping", "/demo.Svc/Work max_time 0.1"],
    ["StatusCode.DEADLINE_EXCEEDED", "b'next'", "handler interrupted"],
    ["frontend budget 0.", "backend saw 0."],
    ["slow gRPC server call /demo.Svc/Work still running", "in query_database",
     "slow gRPC client call /demo.Svc/Work still running",
     "slow gRPC server call /demo.Svc/Work finished", "(OK)"],
    ["handler cancelled at the deadline", "StatusCode.DEADLINE_EXCEEDED after 0.1"],
]


def _doc_examples() -> list[str]:
    lines = DOCS.read_text(encoding="utf-8").splitlines()
    blocks, i = [], 0
    while i < len(lines):
        if lines[i].strip() == ".. code-block:: python":
            i += 1
            body = []
            while i < len(lines) and (not lines[i].strip() or lines[i].startswith("    ")):
                body.append(lines[i])
                i += 1
            blocks.append(textwrap.dedent("\n".join(body)))
        else:
            i += 1
    return blocks


@pytest.mark.skipif(not DOCS.exists(), reason="docs/ not present (installed tests)")
@pytest.mark.parametrize("index", range(len(DOC_EXPECTS)))
def test_docs_example_runs(index: int, tmp_path: pathlib.Path) -> None:
    examples = _doc_examples()
    assert len(examples) == len(DOC_EXPECTS), "docs/grpc.rst examples changed: update DOC_EXPECTS"
    script = tmp_path / "example.py"
    script.write_text(examples[index], encoding="utf-8")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "Traceback" not in out, out
    pos = 0
    for expected in DOC_EXPECTS[index]:
        found = out.find(expected, pos) if index != 4 else out.find(expected)
        assert found >= 0, f"{expected!r} missing from:\n{out}"
        pos = found
    saw = re.search(r"backend saw (\d+\.\d+) s", out)
    if saw:  # the client's 0.5 s less the 0.05 s margin, and the time to get there
        assert 0.0 < float(saw.group(1)) <= 0.45, out
