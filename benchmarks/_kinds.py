"""The loop kinds of the pytest-benchmark wrappers' ids, as the kit's
contenders (``bucketimer.bench``): ``bucketimer-loop`` is the drop-in loop,
``bucketimer-uvloop`` the drop-in on uvloop."""

from __future__ import annotations

from bucketimer.bench import _contenders as c

LOOP_KINDS = {"asyncio": c.ASYNCIO, "bucketimer-loop": c.DROPIN}
if c.uvloop is not None:
    LOOP_KINDS.update({"uvloop": c.UVLOOP, "bucketimer-uvloop": c.DROPIN_UV})
HOST_LOOPS = ["asyncio"] + (["uvloop"] if c.uvloop is not None else [])
