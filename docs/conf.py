# Sphinx configuration for bucketimer's documentation.
#
# Kept plain on purpose (no autodoc): the docs build with `sphinx-build -W`
# without importing, or even installing, the package.  The version is read
# from the one file that holds it, src/bucketimer/_version.py.

import ast
from pathlib import Path

_VERSION_FILE = Path(__file__).resolve().parent.parent / "src" / "bucketimer" / "_version.py"


def _read_version() -> str:
    for node in ast.parse(_VERSION_FILE.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and [t.id for t in node.targets] == ["__version__"]:
            return ast.literal_eval(node.value)
    raise RuntimeError(f"no __version__ in {_VERSION_FILE}")


project = "bucketimer"
author = "bucketimer developers"
copyright = "bucketimer developers"
release = _read_version()
version = ".".join(release.split(".")[:2])

extensions = []

root_doc = "index"
source_suffix = {".rst": "restructuredtext"}
exclude_patterns = ["_build", "notebooks", "Thumbs.db", ".DS_Store"]

html_theme = "alabaster"
