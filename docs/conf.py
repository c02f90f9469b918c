# Sphinx configuration for bucketimer's documentation.
#
# Kept plain on purpose (no autodoc): the docs build with `sphinx-build -W`
# without importing, or even installing, the package.

project = "bucketimer"
author = "bucketimer developers"
copyright = "bucketimer developers"
release = "0.1.0"
version = "0.1"

extensions = []

root_doc = "index"
source_suffix = {".rst": "restructuredtext"}
exclude_patterns = ["_build", "notebooks", "Thumbs.db", ".DS_Store"]

html_theme = "alabaster"
