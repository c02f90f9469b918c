"""The native core's C API (``csrc/include/bucketimer.h``) through cffi:
``ffi`` and ``lib`` of the compiled ``bucketimer._cffi_lib``, whose calls
release the GIL (docs/design.rst).  It needs cffi's backend, the ``cffi``
extra, and a native install: where either is missing, importing it raises
an ``ImportError`` that says which."""

try:
    from ._cffi_lib import ffi, lib
except ModuleNotFoundError as _exc:
    if _exc.name == "_cffi_backend":
        raise ImportError(
            "bucketimer._cffi needs cffi, which is not installed; "
            "install it with: pip install 'bucketimer[cffi]'"
        ) from _exc
    if _exc.name == f"{__package__}._cffi_lib":
        raise ImportError(
            "bucketimer._cffi is the native core's C API, which this install does not have "
            "(bucketimer runs its pure-Python backend here: no native wheel for this system)"
        ) from _exc
    raise

__all__ = ["ffi", "lib"]
