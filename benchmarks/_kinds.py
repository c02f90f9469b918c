"""The loop kinds of the pytest-benchmark wrappers' ids, as the kit's
contenders (``bucketimer.bench``): ``bucketimer-loop`` is the drop-in loop,
``bucketimer-uvloop`` the drop-in on uvloop."""

from __future__ import annotations

from bucketimer.bench import workloads as w

LOOP_KINDS = {"asyncio": w.ASYNCIO, "bucketimer-loop": w.DROPIN}
if w.HAVE_UVLOOP:
    LOOP_KINDS.update({"uvloop": w.UVLOOP, "bucketimer-uvloop": w.DROPIN_UV})
HOST_LOOPS = ["asyncio"] + (["uvloop"] if w.HAVE_UVLOOP else [])
