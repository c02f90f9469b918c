"""The supported CPython versions, read from the one place that lists them:
pyproject.toml's ``Programming Language :: Python :: 3.X`` classifiers.

noxfile.py imports :func:`supported`; ``python tools/pythons.py`` prints the
versions (space-separated) for shell scripts such as .ci/run.
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parent.parent / "pyproject.toml"
_PREFIX = "Programming Language :: Python :: "


def supported(pyproject: Path = PYPROJECT) -> list[str]:
    """["3.11", "3.12", ...]: each ``3.X`` classifier, in file order."""
    with open(pyproject, "rb") as f:
        classifiers = tomllib.load(f)["project"]["classifiers"]
    out = []
    for c in classifiers:
        version = c.removeprefix(_PREFIX)
        if c.startswith(_PREFIX) and version.count(".") == 1:
            out.append(version)
    if not out:
        raise ValueError(f"{pyproject}: no '{_PREFIX}3.X' classifier")
    return out


if __name__ == "__main__":
    print(" ".join(supported()))
    sys.exit(0)
