"""The TimerThreads (native) or schedulers (pure) alive in this process.

Each backend keeps one :class:`Live`: what a drop-in loop's ``close()``
tells that the loop is going, what fork() and exit walk.  It holds them
weakly, as a ``weakref.WeakSet`` would, but a snapshot of it is a plain
copy of a dict's values: a WeakSet's iteration guard cost each short-lived
loop's close 3 µs (docs/performance.rst, "A short-lived loop").
"""

from __future__ import annotations

import weakref
from typing import Generic, TypeVar

_T = TypeVar("_T")


class Live(Generic[_T]):
    """Objects alive, held weakly, each once."""

    __slots__ = ("_refs",)

    def __init__(self) -> None:
        self._refs: dict[int, weakref.ref[_T]] = {}

    def add(self, obj: _T) -> None:
        key, refs = id(obj), self._refs

        def gone(ref: weakref.ref[_T]) -> None:  # (holds the dict, not self)
            if refs.get(key) is ref:
                del refs[key]

        refs[key] = weakref.ref(obj, gone)

    def snapshot(self) -> list[_T]:
        """Those alive now (a copy: safe to walk while others come and go)."""
        return [obj for ref in list(self._refs.values()) if (obj := ref()) is not None]

    def clear(self) -> None:
        self._refs.clear()
