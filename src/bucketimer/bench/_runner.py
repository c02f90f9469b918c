"""The runner: runs the workload groups of one suite for the chosen
contenders, with a progress bar, and collects their records (one per table
cell).  Each group's module owns its workloads and the way its contenders
take turns; the runner only drives them in the table's order."""

from __future__ import annotations

import gc
import random
import time
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

from . import _grpc, _lateness, _native, _noloop, _pairs, _resets, _service, _timeouts
from ._contenders import (
    BUCKETIMER,
    CONTENDERS,
    NATIVE_ONLY,
    PURE_INSTALL_NOTE,
    UVLOOP,
    LoopFactory,
    loop_factories,
    native_backend,
)
from ._records import add_ratios
from ._suite import Suite

# The workload groups, in the table's order, and the module that runs each.
_GROUP_MODULES: dict[str, ModuleType] = {
    "pairs": _pairs,
    "timeout": _timeouts,
    "lateness": _lateness,
    "noloop": _noloop,
    "core": _native,
    "reset": _resets,
    "service": _service,
    "grpc": _grpc,
}
GROUPS = tuple(_GROUP_MODULES)


class Progress:
    """A tqdm.auto bar when tqdm is installed and wanted; else silent."""

    def __init__(self, total: int, enabled: bool, desc: str) -> None:
        self.bar: Any = None
        if enabled:
            try:
                from tqdm.auto import tqdm
            except ImportError:
                return
            self.bar = tqdm(total=total, desc=desc, unit="step", leave=False)

    def step(self, what: str, n: int = 1) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(what, refresh=False)
            self.bar.update(n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class Runner:
    """Runs the workloads of one suite and collects their records."""

    def __init__(self, suite: Suite, groups: Sequence[str] = GROUPS,
                 contenders: Sequence[str] | None = None, progress: bool = True,
                 seed: int = 1234) -> None:
        self.suite = suite
        unknown = set(groups) - set(GROUPS)
        if unknown:
            raise ValueError(f"unknown workload groups: {sorted(unknown)}; known: {GROUPS}")
        self.groups = tuple(g for g in GROUPS if g in groups)
        self.records: list[dict[str, Any]] = []
        self.notes: list[str] = []
        # s each group took, set-up included, in the order they ran
        self.group_seconds: dict[str, float] = {}
        self.rng = random.Random(seed)
        self.want = set(contenders) if contenders is not None else set(CONTENDERS)
        unknown = self.want - set(CONTENDERS)
        if unknown:
            raise ValueError(f"unknown contenders: {sorted(unknown)}; known: {CONTENDERS}")
        if BUCKETIMER not in self.want:
            raise ValueError("the bucketimer contender is the baseline of every ratio")
        if not native_backend():
            self.want -= set(NATIVE_ONLY)
            self.notes.append(PURE_INSTALL_NOTE)
        factories = loop_factories()
        if UVLOOP in self.want and UVLOOP not in factories:
            self.notes.append(f"uvloop is not installed: no '{UVLOOP}' column")
        # The loop contenders of the micro-benchmark groups, in column order.
        self.loops: dict[str, LoopFactory] = {
            name: f for name, f in factories.items() if name in self.want}
        self._progress_enabled = progress
        self.progress: Progress | None = None

    def step(self, what: str) -> None:
        """One step of the progress bar done."""
        if self.progress is not None:
            self.progress.step(what)

    def add(self, rec: dict[str, Any]) -> None:
        self.records.append(rec)

    def run(self) -> list[dict[str, Any]]:
        steps: Callable[[Runner], int]
        total = 0
        for g in self.groups:
            steps = _GROUP_MODULES[g].steps
            total += steps(self)
        self.progress = Progress(total, self._progress_enabled,
                                 f"bucketimer.bench ({self.suite.name})")
        gc_was_enabled = gc.isenabled()
        try:
            for g in self.groups:
                t0 = time.perf_counter()
                _GROUP_MODULES[g].run(self)
                self.group_seconds[g] = time.perf_counter() - t0
        finally:
            if gc_was_enabled:
                gc.enable()
            self.progress.close()
        add_ratios(self.records)
        return self.records
