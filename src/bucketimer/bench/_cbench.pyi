"""Types of ``bucketimer.bench._cbench``, the benchmark kit's cffi binding of
``csrc/include/bucketimer.h`` and ``csrc/bench/bucketimer_bench.h`` (the
reference single-lock heap timer and the GIL-free benchmark loops).

It links its own copy of the core: a core made through ``bucketimer._cffi``
must not be passed to it, nor one made here to ``bucketimer._cffi``.

cffi builds ``ffi`` and ``lib`` from the headers' declarations; their
attributes are not visible to a type checker, so both are ``Any``.
"""

from typing import Any

ffi: Any
lib: Any
