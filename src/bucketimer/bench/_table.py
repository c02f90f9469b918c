"""The printed tables: one per workload group, each with only the columns
its records have, no wider than :data:`WIDTH`.

The reset and service groups measure every row at several sizes: they get
a table per size, whose title names it.  The gRPC rows all run bucketimer's
interceptors, on servers that differ in what they install: their columns
are the two APIs and their rows the servers, ``plain`` (no interceptor)
among them.  A table still too wide is printed in parts, each repeating
the row labels and the column every ratio is relative to."""

from __future__ import annotations

import textwrap
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ._contenders import BUCKETIMER, CONTENDERS
from ._format import format_ratio, format_value, isnan
from ._records import count_label

WIDTH = 120  # a terminal's columns
_GAP = "  "

TITLES = {
    "pairs": "schedule+cancel, in a running loop",
    "timeout": "timeout helpers, in a running loop",
    "lateness": "firing lateness, in a running loop",
    "noloop": "timers with no event loop",
    "core": "the C core alone, GIL released",
    "reset": "moving a pending deadline",
    "service": "service on 127.0.0.1",
    "grpc": "gRPC echo on 127.0.0.1, by server interceptors",
}
# Groups whose rows repeat at several sizes: the record field that holds the
# size, and the word that follows it at the end of each row's label.
_SIZED = {"reset": ("pending", "pending"), "service": ("conns", "conns")}
GRPC_APIS = {"sync": "grpc (sync)", "aio": "grpc.aio"}


@dataclass
class Table:
    title: str
    columns: list[str] = field(default_factory=list)  # column keys, in order
    rows: list[tuple[str, str, str]] = field(default_factory=list)  # (key, label, better)
    cells: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)  # (key, column)
    headers: dict[str, str] = field(default_factory=dict)  # column key -> header
    baseline: str | None = None  # the column the ratios are relative to
    group: str = ""  # the workload group of its rows

    def add(self, key: str, label: str, column: str, rec: dict[str, Any]) -> None:
        """``rec`` in ``column`` of the row ``key`` (made, labelled ``label``,
        if it is new)."""
        if not any(k == key for k, _, _ in self.rows):
            self.rows.append((key, label, rec["better"]))
        self.cells[(key, column)] = rec


def tables(recs: list[dict[str, Any]]) -> list[tuple[str, list[Table]]]:
    """Each group of ``recs`` (in first-seen order) with its tables."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in recs:
        groups.setdefault(r["group"], []).append(r)
    out = []
    for group, rows in groups.items():
        if group == "grpc" and all(r.get("api") for r in rows):
            out.append((group, [_grpc_table(rows)]))
        elif group in _SIZED and all(not isnan(r.get(_SIZED[group][0])) for r in rows):
            out.append((group, _sized_tables(group, rows)))
        else:
            out.append((group, [_contender_table(TITLES.get(group, group), rows, group)]))
    return out


def _contender_table(title: str, recs: Iterable[dict[str, Any]], group: str,
                     suffix: str = "") -> Table:
    """Workloads as rows (their labels without ``suffix``), contenders as columns."""
    recs = list(recs)
    present = {r["contender"] for r in recs}
    t = Table(title, [c for c in CONTENDERS if c in present], baseline=BUCKETIMER, group=group)
    t.columns += sorted(present - set(t.columns))  # a newer file's column: shown, last
    for r in recs:
        t.add(r["workload"], r["label"].removesuffix(suffix), r["contender"], r)
    return t


def _sized_tables(group: str, recs: list[dict[str, Any]]) -> list[Table]:
    key, word = _SIZED[group]
    out = []
    for size in sorted({r[key] for r in recs}):
        suffix = f", {count_label(size)} {word}"
        out.append(_contender_table(TITLES[group] + suffix,
                                    (r for r in recs if r[key] == size), group, suffix))
    return out


def _grpc_table(recs: list[dict[str, Any]]) -> Table:
    """The servers as rows, the APIs as columns."""
    apis = [a for a in GRPC_APIS if any(r["api"] == a for r in recs)]
    t = Table(TITLES["grpc"], apis, headers=dict(GRPC_APIS), group="grpc")
    for r in recs:
        label = r.get("server") or r["label"].removeprefix(f"gRPC {r['api']}: ")
        t.add(label, label, r["api"], r)
    return t


# ---- rendering ----------------------------------------------------------------------


def render(t: Table, sym: dict[str, str], rename: dict[str, str] | None = None,
           marks: dict[tuple[str, str], str] | None = None) -> list[str]:
    """The table's lines: the header (the title over the labels), a rule, and
    a line per row with a line of ratios under it where it has any; a
    cell's mark (``_verdict``) after its value."""
    heads = {c: (rename or {}).get(c, t.headers.get(c, c)) for c in t.columns}
    body: list[tuple[str, list[str]]] = []
    marks = marks or {}
    for key, label, better in t.rows:
        arrow = {"lower": sym["down"], "higher": sym["up"]}.get(better, " ")
        cells = [_cell(t.cells[(key, c)], sym, marks.get((key, c), ""))
                 if (key, c) in t.cells else ("", "") for c in t.columns]
        body.append((f"{arrow} {label}", [v for v, _ in cells]))
        if any(q for _, q in cells):
            body.append(("", [q for _, q in cells]))
    label_w = max([len(t.title), *(len(lab) for lab, _ in body)])
    cell_w = [max(len(row[i]) for _, row in body) for i in range(len(t.columns))]
    headers = [[heads[c]] for c in t.columns]
    if _width(label_w, [max(w, len(h[0])) for w, h in zip(cell_w, headers)]) > WIDTH:
        headers = [_wrap_header(heads[c], w) for c, w in zip(t.columns, cell_w)]
    widths = [max(w, *(len(x) for x in h)) for w, h in zip(cell_w, headers)]
    out: list[str] = []
    for part in _parts(t, label_w, widths):
        if out:
            out.append("")
        out.extend(_render_part(t.title, label_w, body, headers, widths, part))
    return out


def _cell(rec: dict[str, Any], sym: dict[str, str], mark: str = "") -> tuple[str, str]:
    """(value line, ratio line) of one table cell."""
    value, ratio = _cell_lines(rec, sym)
    return (f"{value} {mark}" if mark else value), ratio


def _cell_lines(rec: dict[str, Any], sym: dict[str, str]) -> tuple[str, str]:
    if rec["unit"] == "count":
        total, timers = rec.get("total"), rec.get("timers")
        if not isnan(total) and not isnan(timers):
            return f"{total:.0f} / {timers:.0f}", ""
        return format_value(rec["median"], "count", sym), ""
    value = format_value(rec["median"], rec["unit"], sym)
    med, p25, p75 = rec["median"], rec["p25"], rec["p75"]
    if not isnan(med) and med and not isnan(p25) and not isnan(p75):
        spread = (p75 - p25) / 2 / abs(med) * 100
        value += f" {sym['pm']}{spread:.0f}%"
    ratio = rec.get("ratio")
    if ratio is None or isnan(ratio) or rec["contender"] == BUCKETIMER:
        return value, ""
    return value, format_ratio(ratio, sym)


def _width(label_w: int, widths: Sequence[int]) -> int:
    return label_w + sum(len(_GAP) + w for w in widths)


def _wrap_header(text: str, width: int) -> list[str]:
    """A header on as many lines as it takes to be no wider than ``width``
    (or than its longest word)."""
    if len(text) <= width:
        return [text]
    return textwrap.wrap(text, max(width, *(len(w) for w in text.split())))


def _parts(t: Table, label_w: int, widths: list[int]) -> list[list[int]]:
    """Column indexes of each part of the table: all of them when they fit,
    else as many as fit each time, the baseline column in every part."""
    base = [i for i, c in enumerate(t.columns) if c == t.baseline][:1]
    rest = [i for i in range(len(t.columns)) if i not in base]
    parts: list[list[int]] = []
    part = list(base)
    for i in rest:
        if len(part) > len(base) and _width(label_w, [widths[j] for j in part + [i]]) > WIDTH:
            parts.append(part)
            part = list(base)
        part.append(i)
    parts.append(part)
    return parts


def _render_part(title: str, label_w: int, body: list[tuple[str, list[str]]],
                 headers: list[list[str]], widths: list[int], part: list[int]) -> list[str]:
    def line(label: str, cells: Sequence[str]) -> str:
        return (label.ljust(label_w) + "".join(
            _GAP + cells[k].rjust(widths[i]) for k, i in enumerate(part))).rstrip()

    depth = max(len(headers[i]) for i in part)
    head = []
    for k in range(depth):  # headers bottom-aligned, the title on the last line
        cells = [([""] * (depth - len(headers[i])) + headers[i])[k] for i in part]
        head.append(line(title if k == depth - 1 else "", cells))
    rule = "-" * _width(label_w, [widths[i] for i in part])
    return [*head, rule, *(line(lab, [row[i] for i in part]) for lab, row in body)]


def wrap(text: str) -> list[str]:
    """A line of prose under the tables, wrapped to :data:`WIDTH`."""
    return textwrap.wrap(text, WIDTH, subsequent_indent="  ", break_long_words=False,
                         break_on_hyphens=False) or [""]
