"""The package's namespace is its API: ``dir()`` lists what ``__all__``
names (and the public submodules), not what its code imports, and the
classes it makes on the fly are named as its own in their reprs.  A module
that needs an extra says which when its library is missing."""

from __future__ import annotations

import subprocess
import sys
import types
import warnings

import pytest

import bucketimer
from bucketimer import loop as bt_loop


@pytest.mark.parametrize("module", [bucketimer, bt_loop], ids=lambda m: m.__name__)
def test_dir_lists_the_api_and_no_import(module: types.ModuleType) -> None:
    names = dir(module)
    public = [n for n in names if not n.startswith("__")]
    assert set(module.__all__) <= set(names)
    extra = {n for n in public if n not in module.__all__}
    assert extra <= {"aio", "loop", "bench", "grpc", "otel", "prometheus", "pytest_plugin"}, extra
    for submodule in extra:
        assert isinstance(getattr(module, submodule), types.ModuleType)
    assert "__version__" in names or module is bt_loop
    assert not {"Any", "sys", "asyncio", "functools", "warnings"} & set(names)
    assert not [n for n in public if n.startswith("_")]


def test_a_fresh_import_lists_no_private_module() -> None:
    code = "import bucketimer; print(' '.join(dir(bucketimer)))"
    names = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                           text=True).stdout.split()
    assert "call_later" in names and "loop" in names and "aio" in names
    assert not [n for n in names if n.startswith("_") and not n.startswith("__")], names


@pytest.mark.skipif(not hasattr(__import__("asyncio"), "DefaultEventLoopPolicy"),
                    reason="asyncio's event loop policies are gone (3.16)")
def test_the_policy_classes_are_named_as_the_package_s() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        cls = bt_loop.EventLoopPolicy
    assert repr(cls) == "<class 'bucketimer.loop.EventLoopPolicy'>"
    assert cls.__qualname__ == "EventLoopPolicy"
    assert repr(cls()).startswith("<bucketimer.loop.EventLoopPolicy object at ")


@pytest.mark.parametrize(("module", "missing", "says"), [
    ("bucketimer._cffi", "_cffi_backend", "pip install 'bucketimer[cffi]'"),
    ("bucketimer._cffi", "bucketimer._cffi_lib", "this install does not have"),
])  # (bucketimer.grpc's and bucketimer.otel's: tests/grpc/, tests/otel/)
def test_a_module_whose_library_is_missing_says_what_to_install(module: str, missing: str,
                                                                 says: str) -> None:
    code = (f"import sys\nsys.modules[{missing!r}] = None  # as if it were not installed\n"
            f"try:\n    import {module}\nexcept ImportError as e:\n    print(e)\n"
            "else:\n    raise SystemExit('imported without it')\n")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                         text=True, timeout=60).stdout
    assert says in out, out
