"""The package's version: the one place it is written.

The build backend reads it from this file (scikit-build-core's regex
provider, see ``pyproject.toml``), the package re-exports it as
``bucketimer.__version__``, and the Sphinx configuration reads it from this
file without importing the package.
"""

__version__ = "0.4.0"
