"""The printed table, and the JSON and CSV files."""

from __future__ import annotations

import csv
import json
import math
from typing import Any

from . import _verdict
from ._contenders import BUCKETIMER, DROPIN, REF_HEAP
from ._format import isnan as _isnan
from ._format import symbols
from ._grpc import verdict as grpc_verdict
from ._resets import verdict as reset_verdict
from ._service import verdict as service_verdict
from ._table import render, tables, wrap

# The bucketimer columns' headers where the pure-Python backend ran.
PURE_HEADER = f"{BUCKETIMER} (pure)"
PURE_HEADERS = {BUCKETIMER: PURE_HEADER, DROPIN: f"{DROPIN} (pure)"}


# Fields only some records have: a DataFrame fills the others with NaN.
_OPTIONAL_FIELDS = ("pending", "threads", "hist", "total", "timers", "note", "conns", "pair",
                    "api", "server")


def as_records(data: Any) -> list[dict[str, Any]]:
    """Records from run(): a pandas DataFrame or a list of dicts."""
    if hasattr(data, "to_dict") and hasattr(data, "columns"):
        recs: list[dict[str, Any]] = data.to_dict("records")
        for r in recs:  # pandas turns None into NaN in numeric columns
            for k, v in list(r.items()):
                if isinstance(v, float) and math.isnan(v) and k in _OPTIONAL_FIELDS:
                    r[k] = None
        return recs
    return list(data)


def meta_of(data: Any) -> dict[str, Any]:
    """The suite/machine/notes metadata run() attached to its result."""
    attrs = getattr(data, "attrs", None)
    if isinstance(attrs, dict) and attrs:
        return attrs
    return getattr(data, "meta", {}) or {}


def format_table(data: Any, stream: Any = None) -> str:
    """The run's title and how to read a cell, then a table per workload
    group (:mod:`._table`), each followed by what its columns run and its
    verdict (:mod:`._verdict`), then what the group's rows mean and its
    verdicts, then the run's notes; every line fits ``_table.WIDTH`` columns."""
    sym = symbols(stream)
    recs = as_records(data)
    meta = meta_of(data)
    machine = meta.get("machine", {})
    pure_backend = machine.get("backend") == "python"
    rename = PURE_HEADERS if pure_backend else {}
    out = [*wrap(_title(recs, meta)), *_legend(sym)]
    for group, group_tables in tables(recs):
        for t in group_tables:
            out += ["", *render(t, sym, rename, _verdict.marks(t))]
            if t.baseline is not None:  # (the gRPC table: its verdicts are its group's)
                heads = {**t.headers, **rename}
                out += wrap(_verdict.legend(t, group, heads, pure_backend))
                out += wrap(_verdict.verdict(t, heads))
        for text in _group_text(group, recs, machine):
            out += wrap(text)
    notes = _notes(meta)
    if notes:
        out.append("")
        for text in notes:
            out += wrap(text)
    return "\n".join(out)


def _title(recs: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    """The suite, its rounds and the machine, in one line."""
    suite = meta.get("suite", {})
    machine = meta.get("machine", {})
    title = "bucketimer.bench"
    if suite:
        service = (f", {suite.get('service_rounds')} of the service"
                   if any(r["group"] == "service" for r in recs) else "")
        title += f" ({suite.get('name')} suite, {suite.get('rounds')} rounds{service})"
    if machine:
        title += (f" -- Python {machine.get('python')}, {machine.get('cpus_usable')} CPUs, "
                  f"{machine.get('cpu_model') or machine.get('machine')}")
    return title


def _legend(sym: dict[str, str]) -> list[str]:
    """How to read a cell."""
    return [*wrap(f"Each cell: the median over rounds {sym['pm']} half the interquartile "
                  f"range; {sym['x']}N below it = that median / bucketimer's."),
            f"{sym['down']} lower is better, {sym['up']} higher is better.",
            *wrap(_verdict.LEGEND_MARKS)]


def _group_text(group: str, recs: list[dict[str, Any]], machine: dict[str, Any]
                ) -> list[str]:
    """What a group's rows mean, and its verdicts."""
    if group == "lateness":
        return ["Lateness = callback start - deadline (early fires: negative)."]
    if group == "core":
        return [f"Core rows: the C core alone, schedule+cancel loops in C on 1..N Python "
                f"threads (GIL released); bucketimer = bucketed core, {REF_HEAP} = one "
                "mutex around one binary heap.", *core_verdict(recs, machine)]
    if group == "reset":
        return reset_verdict(recs)
    if group == "service":
        return ["Service rows: a streams server on 127.0.0.1, one process per turn, under N "
                "connections of a load generator in another process; latency from the "
                "client, stall = the server's heartbeat lateness, busy = share of the window "
                "a process's loop thread ran or waited for a CPU.", *service_verdict(recs)]
    if group == "grpc":
        return ["gRPC rows: time per unary echo call over 127.0.0.1 to servers whose "
                "interceptors are none (plain: no bucketimer), 2 pass-throughs (2 no-op), 2 "
                "that wrap the handler (2 wrappers), bucketimer.grpc's SlowCallInterceptor + "
                "ServerDeadlineInterceptor (deadline+slow), the two as one (combined) and its "
                "parts; the servers' calls take turns; a round = one fresh set of servers, its "
                "median per call.", *grpc_verdict(recs)]
    return []


def _notes(meta: dict[str, Any]) -> list[str]:
    """A busy machine at the start, and the notes run() attached."""
    machine = meta.get("machine", {})
    out = []
    load = machine.get("loadavg_before") or machine.get("loadavg")
    usable = machine.get("cpus_usable")
    if load and usable and load[0] > 0.5 * usable:
        out.append(f"note: the 1-minute load average was {load[0]:.2f} on {usable} CPUs when "
                   "the run started: other processes competed for the CPUs, so spreads are "
                   "wide and the thread rows understate what the cores can do.")
    out.extend(f"note: {note}" for note in meta.get("notes", []))
    return out


def core_verdict(recs: list[dict[str, Any]], machine: dict[str, Any]) -> list[str]:
    """One line on the core rows: ahead of the single-lock heap or not."""
    by = {(r["workload"], r["contender"]): r for r in recs}
    lines = []
    for r in recs:
        if r["contender"] != BUCKETIMER or not r["workload"].startswith("core@"):
            continue
        nt = int(r.get("threads") or 1)  # a DataFrame's column of counts holds floats
        ref = by.get((r["workload"], REF_HEAP))
        if ref is None or nt == 1 or _isnan(ref["median"]) or not ref["median"]:
            continue
        ratio = r["median"] / ref["median"]
        verdict = "ahead of" if ratio > 1.05 else ("behind" if ratio < 0.95 else "level with")
        line = (f"core, {nt} threads: the bucketed core is {verdict} the single-lock heap "
                f"({ratio:.2f}x its rate)")
        usable = machine.get("cpus_usable")
        if usable and nt > usable:
            line += f"; {nt} threads share {usable} CPUs here (time-sliced, not parallel)"
        lines.append(line + ".")
    return lines


def _clean(x: Any) -> Any:
    """JSON-safe: NaN -> None, recursively."""
    if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if hasattr(x, "item") and not isinstance(x, (str, bytes)):  # numpy scalars
        try:
            return _clean(x.item())
        except (TypeError, ValueError):
            return x
    return x


def write_json(data: Any, path: str) -> None:
    meta = meta_of(data)
    doc = {
        "format": "bucketimer.bench/1",
        "suite": meta.get("suite"),
        "machine": meta.get("machine"),
        "command": meta.get("command"),
        "notes": meta.get("notes", []),
        "records": as_records(data),
    }
    with open(path, "w", encoding="utf-8") as f:
        json.dump(_clean(doc), f, indent=1, allow_nan=False)
        f.write("\n")


CSV_FIELDS = ["group", "workload", "label", "contender", "unit", "better", "rounds",
              "per_round", "pending", "threads", "conns", "median", "p10", "p25", "p75", "p90",
              "min", "max", "mean", "ratio", "total", "timers", "note", "samples"]
MACHINE_FIELDS = ["suite", "platform", "cpu_model", "cpu_count", "cpus_usable", "python",
                  "bucketimer_version", "uvloop_version"]


def write_csv(data: Any, path: str) -> None:
    meta = meta_of(data)
    machine = meta.get("machine") or {}
    pk = machine.get("packages") or {}
    mrow = {
        "suite": (meta.get("suite") or {}).get("name"),
        "platform": machine.get("platform"),
        "cpu_model": machine.get("cpu_model"),
        "cpu_count": machine.get("cpu_count"),
        "cpus_usable": machine.get("cpus_usable"),
        "python": machine.get("python"),
        "bucketimer_version": machine.get("bucketimer"),
        "uvloop_version": pk.get("uvloop"),
    }
    with open(path, "w", encoding="utf-8", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS + MACHINE_FIELDS)
        w.writeheader()
        for r in as_records(data):
            row = {k: _csv_value(r.get(k)) for k in CSV_FIELDS}
            row["samples"] = ";".join(f"{x:.6g}" for x in (r.get("samples") or []))
            row.update(mrow)
            w.writerow(row)


def _csv_value(v: Any) -> Any:
    v = _clean(v)
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.6g}"
    return v



def read_json(path: str) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Records and metadata of a file write_json wrote."""
    with open(path, encoding="utf-8") as f:
        doc = json.load(f)
    if doc.get("format") != "bucketimer.bench/1":
        raise ValueError(f"{path}: not a bucketimer.bench JSON file")
    recs = doc["records"]
    for r in recs:  # JSON null back to NaN where the table expects numbers
        for k in ("median", "p10", "p25", "p75", "p90", "min", "max", "mean", "ratio"):
            if r.get(k) is None:
                r[k] = math.nan
    meta = {k: doc.get(k) for k in ("suite", "machine", "command", "notes")}
    meta["notes"] = meta["notes"] or []
    return recs, meta
