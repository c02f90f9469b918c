"""How a timed loop is timed: with the cyclic GC off (a collection inside a
round would be charged to whichever contender triggered it) and
``time.perf_counter_ns`` read just inside the block."""

from __future__ import annotations

import gc
import time
from types import TracebackType

perf_counter_ns = time.perf_counter_ns


class Stopwatch:
    """``with Stopwatch() as sw: <loop>`` then ``sw.ns``: the block's time
    in ns, measured with the cyclic GC disabled (and enabled again after)."""

    __slots__ = ("ns", "_t0")

    def __init__(self) -> None:
        self.ns = 0
        self._t0 = 0

    def __enter__(self) -> Stopwatch:
        gc.disable()
        self._t0 = perf_counter_ns()
        return self

    def __exit__(self, typ: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.ns = perf_counter_ns() - self._t0
        gc.enable()
