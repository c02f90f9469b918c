"""The printed table, and the JSON and CSV files."""

from __future__ import annotations

import csv
import json
import math
import sys
from collections.abc import Sequence
from typing import Any

from ._contenders import BUCKETIMER, CONTENDERS, REF_HEAP
from ._grpc import verdict as grpc_verdict
from ._resets import verdict as reset_verdict
from ._service import verdict as service_verdict

# The bucketimer column's header where the pure-Python backend ran.
PURE_HEADER = f"{BUCKETIMER} (pure)"
_FANCY = {"mu": "\u00b5", "x": "\u00d7", "pm": "\u00b1", "down": "\u2193", "up": "\u2191"}
_PLAIN = {"mu": "u", "x": "x", "pm": "+-", "down": "v", "up": "^"}


def symbols(stream: Any = None) -> dict[str, str]:
    """Unicode symbols when ``stream`` can encode them, ASCII otherwise."""
    enc = getattr(stream if stream is not None else sys.stdout, "encoding", None) or "ascii"
    try:
        "".join(_FANCY.values()).encode(enc)
    except (UnicodeEncodeError, LookupError):
        return _PLAIN
    return _FANCY


def _isnan(x: Any) -> bool:
    return x is None or (isinstance(x, float) and math.isnan(x))


def format_value(value: float, unit: str, sym: dict[str, str] | None = None) -> str:
    """2.5e-6 s written in the row's unit: '2.50 us', '31.2M/s', '1.73x'."""
    sym = sym or _FANCY
    if _isnan(value):
        return "-"
    if unit == "ns":
        a = abs(value)
        if a < 1e3:
            return f"{value:.0f} ns"
        if a < 1e6:
            return f"{value / 1e3:.3g} {sym['mu']}s"
        if a < 1e9:
            return f"{value / 1e6:.3g} ms"
        return f"{value / 1e9:.3g} s"
    if unit in ("pairs/s", "req/s"):
        if value >= 1e6:
            return f"{value / 1e6:.3g}M/s"
        return f"{value / 1e3:.3g}k/s"
    if unit == "%":
        return f"{value:.0f}%"
    if unit == "x":
        return f"{value:.2f}{sym['x']}"
    if unit == "count":
        return f"{value:.0f}"
    return f"{value:.3g} {unit}"


def _cell(rec: dict[str, Any], sym: dict[str, str]) -> tuple[str, str]:
    """(value line, ratio line) of one table cell."""
    if rec["unit"] == "count":
        total, timers = rec.get("total"), rec.get("timers")
        if not _isnan(total) and not _isnan(timers):
            return f"{total:.0f} / {timers:.0f}", ""
        return format_value(rec["median"], "count", sym), ""
    value = format_value(rec["median"], rec["unit"], sym)
    med, p25, p75 = rec["median"], rec["p25"], rec["p75"]
    if not _isnan(med) and med and not _isnan(p25) and not _isnan(p75):
        spread = (p75 - p25) / 2 / abs(med) * 100
        value += f" {sym['pm']}{spread:.0f}%"
    ratio = rec.get("ratio")
    line2 = "" if _isnan(ratio) or rec["contender"] == BUCKETIMER else f"{sym['x']}{ratio:.3g}"
    return value, line2


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
    """The one table: workloads as rows, contenders as columns; under it the
    legend, the verdicts and the run's notes."""
    sym = symbols(stream)
    recs = as_records(data)
    meta = meta_of(data)
    machine = meta.get("machine", {})
    pure = machine.get("backend") == "python"
    out = [_title(recs, meta), *_grid(recs, sym, {BUCKETIMER: PURE_HEADER} if pure else {}), ""]
    out.extend(_legend(recs, sym))
    out.extend(core_verdict(recs, machine))
    out.extend(reset_verdict(recs))
    out.extend(service_verdict(recs))
    out.extend(grpc_verdict(recs))
    out.extend(_notes(meta))
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


def _grid(recs: list[dict[str, Any]], sym: dict[str, str], headers: dict[str, str]
          ) -> list[str]:
    """The header (``headers`` renames columns), a rule, and a row per
    workload (with its ratios below it), a blank line between groups."""
    cols = [c for c in CONTENDERS if any(r["contender"] == c for r in recs)]
    rows: list[tuple[str, str, str]] = []  # (workload, label, better), in first-seen order
    for r in recs:
        key = (r["workload"], r["label"], r["better"])
        if key not in rows:
            rows.append(key)
    by = {(r["workload"], r["contender"]): r for r in recs}
    group_of = {r["workload"]: r["group"] for r in recs}
    header = ["workload"] + [headers.get(c, c) for c in cols]
    body: list[tuple[list[str], str]] = []  # (cells, group)
    for workload, label, better in rows:
        arrow = {"lower": sym["down"], "higher": sym["up"]}.get(better, " ")
        cells = [_cell(by[(workload, c)], sym) if (workload, c) in by else ("", "") for c in cols]
        body.append(([f"{arrow} {label}", *(v for v, _ in cells)], group_of[workload]))
        if any(q for _, q in cells):
            body.append((["", *(q for _, q in cells)], group_of[workload]))
    widths = [max(len(row[i]) for row in [header] + [b for b, _ in body])
              for i in range(len(header))]

    def fmt(row: Sequence[str]) -> str:
        first = row[0].ljust(widths[0])
        rest = "  ".join(cell.rjust(w) for cell, w in zip(row[1:], widths[1:]))
        return (first + "  " + rest).rstrip()

    out = [fmt(header), "-" * len(fmt(header))]
    prev = None
    for row, group in body:
        if prev is not None and group != prev:
            out.append("")
        out.append(fmt(row))
        prev = group
    return out


def _legend(recs: list[dict[str, Any]], sym: dict[str, str]) -> list[str]:
    """How to read the cells, and the rows of the groups present."""
    out = [f"Each cell: the median over rounds {sym['pm']} half the interquartile range; "
           f"{sym['x']}N below it = that median / bucketimer's.",
           f"{sym['down']} lower is better, {sym['up']} higher is better.  Lateness = "
           "callback start - deadline (early fires: negative)."]
    if any(r["group"] == "service" for r in recs):
        out.append("Service rows: a streams server on 127.0.0.1, one process per turn, "
                   "under N connections of a load generator in another process; latency "
                   "from the client, stall = the server's heartbeat lateness, busy = share "
                   "of the window a process's loop thread ran or waited for a CPU.")
    if any(r["group"] == "grpc" for r in recs):
        out.append("gRPC rows: a unary echo over 127.0.0.1 to servers whose interceptors are "
                   "none (plain), 2 pass-throughs (2 no-op), 2 that wrap the handler, "
                   "bucketimer.grpc's SlowCallInterceptor + ServerDeadlineInterceptor "
                   "(deadline+slow) and its parts; the servers' calls take turns; a round = "
                   "one fresh set of servers, its median per call.")
    if any(r["group"] == "core" for r in recs):
        out.append(f"Core rows: the C core alone, schedule+cancel loops in C on 1..N Python "
                   f"threads (GIL released); bucketimer = bucketed core, {REF_HEAP} = one "
                   "mutex around one binary heap.")
    return out


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
        nt = r.get("threads") or 1
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
