"""Numbers as the tables print them: a value in its row's unit, a ratio,
and the symbols a stream can encode."""

from __future__ import annotations

import math
import sys
from typing import Any

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


def isnan(x: Any) -> bool:
    """None or a float NaN: a figure that was not measured."""
    return x is None or (isinstance(x, float) and math.isnan(x))


def plain_number(x: float) -> str:
    """Three significant digits (all of a whole number), never an exponent:
    2290.4 -> '2290', 12.34 -> '12.3', 0.5981 -> '0.598', 0.004 -> '0.004'."""
    a = abs(x)
    if a >= 99.95 or a == 0:  # .3g would write 999.6 as 1e+03
        return f"{x:.0f}"
    if a >= 1e-4:  # .3g writes no exponent down to here
        return f"{x:.3g}"
    return f"{x:.{2 - math.floor(math.log10(a))}f}"


def format_ratio(ratio: float, sym: dict[str, str] | None = None) -> str:
    """A cell's median over bucketimer's: '×9.39', '×2290', '×0.598'."""
    return f"{(sym or _FANCY)['x']}{plain_number(ratio)}"


def format_value(value: float, unit: str, sym: dict[str, str] | None = None) -> str:
    """2.5e-6 s written in the row's unit: '2.50 us', '31.2M/s', '1.73x'."""
    sym = sym or _FANCY
    if isnan(value):
        return "-"
    if unit == "ns":
        a = abs(value)
        if a < 1e3:
            return f"{value:.0f} ns"
        if a < 1e6:
            return f"{plain_number(value / 1e3)} {sym['mu']}s"
        if a < 1e9:
            return f"{plain_number(value / 1e6)} ms"
        return f"{plain_number(value / 1e9)} s"
    if unit in ("pairs/s", "req/s"):
        if value >= 1e6:
            return f"{plain_number(value / 1e6)}M/s"
        return f"{plain_number(value / 1e3)}k/s"
    if unit == "%":
        return f"{value:.0f}%"
    if unit == "x":
        return f"{value:.2f}{sym['x']}"
    if unit == "count":
        return f"{value:.0f}"
    return f"{plain_number(value)} {unit}"
