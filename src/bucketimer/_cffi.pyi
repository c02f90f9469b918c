"""Types of ``bucketimer._cffi``, the cffi binding of ``csrc/include/bucketimer.h``
(the core's C API only; the benchmark kit's C is in ``bucketimer.bench._cbench``).

cffi builds ``ffi`` and ``lib`` from the header's declarations; their
attributes (the C API's functions, types and constants) are not visible to a
type checker, so both are ``Any``.
"""

from typing import Any

__all__ = ["ffi", "lib"]

ffi: Any
lib: Any
