"""How each of bucketimer's columns did against the column it stands in for
(``_contenders.stands_in_for``): the mark on its cell, the legend and the
verdict line under each table.

A cell is *behind* (``!``) when its median is worse than the other's, in
the row's direction; *within the spread* (``~``) when it is better, or even
to the three digits the tables print (a server's RSS one page apart), but
the two interquartile ranges overlap, so that this run cannot tell them
apart; *ahead* (no mark) otherwise.  Only rows of times and rates are judged
(counts, percentages and scaling factors are not raced).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ._contenders import describe, stands_in_for
from ._format import isnan, plain_number
from ._records import NO_RATIO_UNITS

if TYPE_CHECKING:
    from ._table import Table

BEHIND = "!"
WITHIN = "~"
AHEAD = ""

LEGEND_MARKS = (f"{BEHIND} after a cell of bucketimer's: slower than the column it stands in "
                f"for (named under each table); {WITHIN}: faster, or even to three digits (1x), "
                "but the two cells' interquartile ranges overlap, so this run cannot tell "
                "them apart.")


@dataclass(frozen=True)
class Judgement:
    row: str  # the row's key
    label: str
    column: str
    other: str  # the column it is measured against
    mark: str  # BEHIND, WITHIN or AHEAD
    factor: float  # how many times better than the other (< 1: worse)


def _judge(ours: dict[str, Any], theirs: dict[str, Any]) -> tuple[str, float] | None:
    if ours["unit"] in NO_RATIO_UNITS or ours["better"] not in ("lower", "higher"):
        return None
    a, b = ours["median"], theirs["median"]
    if isnan(a) or isnan(b) or not a or not b:
        return None
    factor = b / a if ours["better"] == "lower" else a / b
    spreads: list[Any] = [r.get(q) for r in (ours, theirs) for q in ("p25", "p75")]
    overlap = False
    if not any(isnan(x) for x in spreads):
        lo, hi, olo, ohi = spreads
        overlap = lo <= ohi and olo <= hi
    if factor < 1 and not (overlap and plain_number(factor) == "1"):
        return BEHIND, factor
    if factor <= 1 or overlap:
        return WITHIN, factor
    return AHEAD, factor


def judgements(t: Table) -> list[Judgement]:
    """Each cell of one of bucketimer's columns of ``t`` against the best
    cell of the row's columns it stands in for."""
    out = []
    for key, label, _ in t.rows:
        for column in t.columns:
            ours = t.cells.get((key, column))
            if ours is None:
                continue
            best: tuple[str, float, str] | None = None
            for other in stands_in_for(ours["group"], column):
                theirs = t.cells.get((key, other))
                judged = None if theirs is None else _judge(ours, theirs)
                if judged is not None and (best is None or judged[1] < best[1]):
                    best = (*judged, other)
            if best is not None:
                out.append(Judgement(key, label, column, best[2], best[0], best[1]))
    return out


def marks(t: Table) -> dict[tuple[str, str], str]:
    """(row, column) -> the mark of its cell, for the judged cells."""
    return {(j.row, j.column): j.mark for j in judgements(t) if j.mark}


def legend(t: Table, group: str, headers: dict[str, str], pure_backend: bool) -> str:
    """The line naming what each column of ``t`` runs, and the marks."""
    names = "; ".join(f"{headers.get(c, c)} = {describe(group, c, pure_backend)}"
                      for c in t.columns)
    return f"columns: {names}."


def verdict(t: Table, headers: dict[str, str]) -> str:
    """The line under ``t``: how bucketimer's columns did against the ones
    they stand in for, naming every row that is not clearly ahead."""
    judged = judgements(t)
    if not judged:
        return ("verdict: none of this table's columns stands in for another one here "
                "(--contenders may have left it out).")

    def cells(mark: str) -> list[str]:
        return [f"{headers.get(j.column, j.column)} vs {headers.get(j.other, j.other)}, "
                f"{j.label}: {plain_number(j.factor)}x" for j in judged if j.mark == mark]

    behind, within = cells(BEHIND), cells(WITHIN)
    ahead = _span([j.factor for j in judged if j.mark == AHEAD])
    if not behind and not within:
        return (f"verdict: each of bucketimer's columns is ahead of the one it stands in for, "
                f"on every row ({ahead} as fast).")
    parts = []
    if behind:
        parts.append(f"behind ({BEHIND}) on {len(behind)}: " + "; ".join(behind))
    if within:
        parts.append(f"within the spread ({WITHIN}) on {len(within)}: " + "; ".join(within))
    if ahead:
        parts.append(f"ahead on the rest ({ahead} as fast)")
    return f"verdict: of {len(judged)} cells against the column each stands in for, " + (
        "; ".join(parts) + ".")


def _span(factors: list[float]) -> str:
    """'1.2x-9.8x', '1.2x' or ''."""
    if not factors:
        return ""
    lo, hi = plain_number(min(factors)), plain_number(max(factors))
    return f"{lo}x" if lo == hi else f"{lo}x-{hi}x"
