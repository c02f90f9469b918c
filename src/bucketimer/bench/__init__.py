"""bucketimer.bench: what timers cost, against what Python uses today.

From a terminal: ``python -m bucketimer.bench [--full] [--only GROUPS]
[--json F] [--csv F] [--plot F.png]`` prints one table (workloads as rows,
contenders as columns): every group in about a minute, or with ``--full``
the standard suite in about ten.

From a notebook::

    from bucketimer import bench
    df = bench.run("quick")          # pandas DataFrame (a list of dicts without pandas)
    print(bench.format_table(df))
    bench.plot(df)                   # matplotlib Figure, every panel
    bench.plot(df, "pairs")          # one panel
    df = bench.load("out.json")      # the records a --json file holds
    bench.plot_lateness(tt)          # lateness histogram + CDF of a TimerThread
    with bench.monitor(tt) as mon:   # stats() sampled while a workload runs
        ...
    bench.plot_stats_timeline(mon.frame())

Every figure of one ``run`` comes from the same process and the same run;
the result carries the suite sizes, the machine and package versions
(``df.attrs`` or ``records.meta``).

Scripts of your own: :mod:`bucketimer.bench.workloads` has the timed loops
the rows run (and :mod:`bucketimer.bench.grpc_echo` the gRPC ones).
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any, Self

from . import workloads
from ._contenders import CONTENDERS
from ._machine import machine_info
from ._plot import PANELS, hist_of, plot, plot_lateness, plot_stats_timeline
from ._report import format_table, write_csv, write_json
from ._runner import GROUPS, Runner
from ._suite import SUITES, Suite, suite_by_name, suite_dict

__all__ = [
    "CONTENDERS",
    "GROUPS",
    "PANELS",
    "SUITES",
    "Records",
    "Suite",
    "format_table",
    "hist_of",
    "load",
    "machine_info",
    "monitor",
    "plot",
    "plot_lateness",
    "plot_stats_timeline",
    "run",
    "write_csv",
    "workloads",
    "write_json",
]


class Records(list[dict[str, Any]]):
    """The result of :func:`run` when pandas is not installed: a list of
    dicts (one per table cell) with the run's metadata in ``.meta``."""

    meta: dict[str, Any]

    def __init__(self, records: Sequence[dict[str, Any]] = (), meta: dict[str, Any] | None = None) -> None:
        super().__init__(records)
        self.meta = meta or {}


def run(suite: str | Suite = "quick", *, groups: Sequence[str] | None = None,
        contenders: Sequence[str] | None = None, progress: bool = True,
        rounds: int | None = None, as_frame: bool | None = None) -> Any:
    """Runs the benchmark suite and returns its records.

    ``suite``: ``"smoke"`` (seconds), ``"quick"`` (< 1 min), ``"full"`` (about
    ten minutes) or a :class:`Suite`.  ``groups``: a subset of
    ``("pairs", "timeout", "lateness", "noloop", "core", "reset", "service",
    "grpc")``.  ``contenders``:
    a subset of :data:`CONTENDERS` (``"bucketimer"`` must stay: it is every
    ratio's baseline).  ``progress``: a ``tqdm.auto`` bar when tqdm is
    installed.  ``rounds`` overrides the suite's number of rounds (of the
    service rows too).

    Returns a pandas DataFrame (one row per workload x contender, with the
    round values in ``samples`` and metadata in ``.attrs``) when pandas is
    installed and ``as_frame`` is not False; else :class:`Records`.
    """
    s = suite if isinstance(suite, Suite) else suite_by_name(suite)
    if rounds is not None:
        if rounds < 1:
            raise ValueError("rounds must be >= 1")
        s = (suite_by_name(s.name, rounds=rounds, service_rounds=rounds)
             if s.name in SUITES else s)
    runner = Runner(s, groups=tuple(groups) if groups is not None else GROUPS,
                    contenders=contenders, progress=progress)
    t0 = time.perf_counter()
    load_before = machine_info().get("loadavg")
    records = _run_outside_loop(runner.run)
    machine = machine_info()
    machine["loadavg_before"] = load_before
    meta = {
        "suite": suite_dict(s),
        "machine": machine,
        "notes": list(runner.notes),
        "elapsed_s": time.perf_counter() - t0,
        "group_seconds": dict(runner.group_seconds),
        "command": " ".join(sys.argv) if sys.argv and sys.argv[0] else None,
    }
    if as_frame is not False:
        try:
            import pandas as pd
        except ImportError:
            if as_frame:
                raise
        else:
            df = pd.DataFrame.from_records(records)
            df.attrs.update(meta)
            return df
    return Records(records, meta)


def _run_outside_loop(fn: Any) -> Any:
    """fn() here, or on a helper thread when this thread runs an event loop
    (Jupyter's kernel does): the suite runs loops of its own."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return fn()
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:
            box["error"] = e

    t = threading.Thread(target=target, name="bucketimer-bench")
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def load(path: str) -> Any:
    """The records a ``--json`` file holds, as :func:`run` returns them
    (a DataFrame when pandas is installed, else :class:`Records`)."""
    from ._report import read_json

    recs, meta = read_json(path)
    try:
        import pandas as pd
    except ImportError:
        return Records(recs, meta)
    df = pd.DataFrame.from_records(recs)
    df.attrs.update(meta)
    return df


class monitor:
    """Samples ``tt.stats()`` every ``interval`` seconds on a background
    thread while the ``with`` block runs::

        with bench.monitor(tt, interval=0.02) as mon:
            workload()
        mon.samples        # list of dicts: t (s since start) + every counter
        mon.frame()        # the same as a pandas DataFrame (if installed)
    """

    def __init__(self, tt: Any, interval: float = 0.05) -> None:
        if interval <= 0:
            raise ValueError("interval must be > 0")
        self.tt = tt
        self.interval = interval
        self.samples: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0

    def _sample(self) -> None:
        st = self.tt.stats()
        row = {"t": time.perf_counter() - self._t0}
        row.update({k: v for k, v in st.items() if k != "lateness_hist"})
        self.samples.append(row)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            self._sample()

    def __enter__(self) -> Self:
        self._t0 = time.perf_counter()
        self._sample()
        self._thread = threading.Thread(target=self._loop, name="bench-monitor", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._sample()

    def frame(self) -> Any:
        import pandas as pd

        return pd.DataFrame(self.samples)
