"""Plots of the suite's records and of a TimerThread's lateness histogram.

Figures are ``matplotlib.figure.Figure`` objects made without pyplot: nothing
is shown or kept by a global figure manager; in Jupyter they display as the
value of a cell, and ``fig.savefig(path)`` writes them anywhere.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from typing import Any

from ._contenders import BUCKETIMER, COLORS, CONTENDERS, REF_HEAP
from ._format import format_value
from ._records import count_label
from ._report import as_records, meta_of

PANELS = ("pairs", "timeout", "lateness", "cdf", "noloop", "core", "reset", "service",
          "service_tail", "service_stall")
# The group whose records each panel draws.
_PANEL_GROUP = {"pairs": "pairs", "timeout": "timeout", "lateness": "lateness",
                "cdf": "lateness", "noloop": "noloop", "core": "core", "reset": "reset",
                "service": "service", "service_tail": "service", "service_stall": "service"}


def _figure(nrows: int = 1, ncols: int = 1, size: tuple[float, float] = (6.4, 4.2)) -> Any:
    try:
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError("plotting needs matplotlib: pip install matplotlib") from e
    fig = Figure(figsize=(size[0] * ncols, size[1] * nrows), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False)
    return fig, axes


def _spans_decades(values: Sequence[float], factor: float = 20.0) -> bool:
    v = [x for x in values if x and x > 0 and not math.isnan(x)]
    return bool(v) and max(v) / min(v) >= factor


def _ns_axis(ax: Any, values: Sequence[float], label: str, log: bool | None = None) -> None:
    """A time axis in the unit that fits, log when the data spans decades
    (or when ``log`` says so)."""
    if log if log is not None else _spans_decades(values):
        ax.set_yscale("log")
    ax.set_ylabel(label)
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    # After set_yscale, which installs its own locators and formatters.
    if ax.get_yscale() == "log":
        v = [x for x in values if x and x > 0 and not math.isnan(x)]
        if v and max(v) / min(v) < 300:  # under ~2 decades: label 1, 2, 5 x 10^k
            ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        if v and ax.get_ylim()[0] > min(v) / 2:
            # a bar starts at the bottom of a log axis: leave room under the
            # smallest, or it shows as a sliver
            ax.set_ylim(bottom=min(v) / 2)
        ax.yaxis.set_minor_formatter(NullFormatter())
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: format_value(y, "ns")))


def _by(recs: list[dict[str, Any]], **match: Any) -> list[dict[str, Any]]:
    return [r for r in recs if all(r.get(k) == v for k, v in match.items())]


def _err(recs: Sequence[dict[str, Any]]) -> list[list[float]]:
    return [[max(0.0, r["median"] - r["p25"]) for r in recs],
            [max(0.0, r["p75"] - r["median"]) for r in recs]]


def _contenders(recs: list[dict[str, Any]]) -> list[str]:
    return [c for c in CONTENDERS if any(r["contender"] == c for r in recs)]


# ---- panels ---------------------------------------------------------------------------


def panel_pairs(ax: Any, recs: list[dict[str, Any]]) -> None:
    """ns per schedule+cancel pair against pending timers, one line per loop."""
    rows = _by(recs, group="pairs")
    levels = sorted({r["pending"] for r in rows})
    allv = []
    for c in _contenders(rows):
        pts = sorted(_by(rows, contender=c), key=lambda r: r["pending"])
        xs = [levels.index(r["pending"]) for r in pts]
        ys = [r["median"] for r in pts]
        allv += ys
        ax.errorbar(xs, ys, yerr=_err(pts), marker="o", capsize=3, label=c,
                    color=COLORS.get(c))
    ax.set_xticks(range(len(levels)), [count_label(p) for p in levels])
    ax.set_xlabel("pending timers in the loop")
    _ns_axis(ax, allv, "time per call_later + cancel (median)")
    ax.set_title("schedule + cancel, in a running loop")
    ax.grid(True, which="both", alpha=0.3)


def _bars(ax: Any, rows: list[dict[str, Any]], workloads: Sequence[str],
          labels: Sequence[str]) -> list[float]:
    conts = _contenders(rows)
    width = 0.8 / max(1, len(conts))
    allv = []
    for i, c in enumerate(conts):
        xs, ys, sel = [], [], []
        for j, w in enumerate(workloads):
            r = _by(rows, workload=w, contender=c)
            if r:
                xs.append(j + (i - (len(conts) - 1) / 2) * width)
                ys.append(r[0]["median"])
                sel.append(r[0])
        allv += ys
        if xs:
            ax.bar(xs, ys, width, yerr=_err(sel), capsize=2, label=c, color=COLORS.get(c))
    ax.set_xticks(range(len(workloads)), labels)
    ax.grid(True, axis="y", which="both", alpha=0.3)
    return allv


def panel_timeout(ax: Any, recs: list[dict[str, Any]]) -> None:
    rows = _by(recs, group="timeout")
    allv = _bars(ax, rows, ["timeout", "wait_for"],
                 ["async with timeout(30): pass", "await wait_for(coro(), 30)"])
    _ns_axis(ax, allv, "time per call (median)")
    ax.set_title("timeout helpers")


def panel_lateness(ax: Any, recs: list[dict[str, Any]]) -> None:
    rows = [r for r in _by(recs, group="lateness") if r["unit"] == "ns"]
    allv = _bars(ax, rows, ["lateness_p50", "lateness_p99", "lateness_max"],
                 ["p50", "p99", "max"])
    _ns_axis(ax, allv, "callback start - deadline", log=bool(allv))
    ax.set_title("firing lateness, in a loop")


def panel_noloop(ax: Any, recs: list[dict[str, Any]]) -> None:
    rows = _by(recs, group="noloop")
    pend = next((r["pending"] for r in rows if r["workload"] == "noloop_pairs@pending"), None)
    allv = _bars(ax, rows,
                 ["noloop_pairs@0", "noloop_pairs@pending", "noloop_lateness_p50",
                  "noloop_lateness_p99"],
                 ["pair, 0 pending", f"pair, {count_label(pend or 0)} pending",
                  "lateness p50", "lateness p99"])
    _ns_axis(ax, allv, "time per pair / lateness (median)", log=bool(allv))
    ax.set_title("timers with no event loop")


def panel_core(ax: Any, recs: list[dict[str, Any]]) -> None:
    rows = [r for r in _by(recs, group="core") if r["workload"].startswith("core@")]
    for c in _contenders(rows):
        pts = sorted(_by(rows, contender=c), key=lambda r: r["threads"])
        xs = [r["threads"] for r in pts]
        ys = [r["median"] / 1e6 for r in pts]
        err = [[e / 1e6 for e in side] for side in _err(pts)]
        ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=c, color=COLORS.get(c))
        if pts:
            # The scaling rows (per-round ratios) when present, as in the table.
            scaling = {r["threads"]: r["median"] for r in recs
                       if r["workload"].startswith("core_scaling@") and r["contender"] == c}
            base = pts[0]["median"]
            for x, r in zip(xs[1:], pts[1:]):
                f = scaling.get(r["threads"], r["median"] / base)
                ax.annotate(f"{f:.2f}x", (x, r["median"] / 1e6),
                            textcoords="offset points", xytext=(6, -4), fontsize="small",
                            color=COLORS.get(c))
    ax.set_xlabel("threads calling the core at once (GIL released);\n"
                  "labels: rate relative to the same design on 1 thread")
    ax.set_ylabel("schedule+cancel pairs per second (millions)")
    ax.set_ylim(bottom=0)
    threads = sorted({r["threads"] for r in rows})
    if threads:
        ax.set_xticks(threads)
        ax.margins(x=0.15)  # room for the labels right of the last points
    ax.set_title(f"native core: {BUCKETIMER}'s bucketed core vs one lock + one heap",
                 fontsize="medium")
    ax.grid(True, alpha=0.3)


def panel_reset(ax: Any, recs: list[dict[str, Any]]) -> None:
    """ns per deadline reset, the two kinds at each pending level."""
    rows = [r for r in _by(recs, group="reset") if r["unit"] == "ns"]
    workloads = sorted({r["workload"] for r in rows},
                       key=lambda w: (int(w.split("@")[1]), w))
    labels = [("reschedule()" if w.startswith("reset_timeout") else "cancel + re-arm")
              + f"\n{count_label(int(w.split('@')[1]))} pending" for w in workloads]
    allv = _bars(ax, rows, workloads, labels)
    _ns_axis(ax, allv, "time per reset (median)", log=bool(allv))
    ax.set_title("moving a pending deadline")


def _service_bars(ax: Any, recs: list[dict[str, Any]], key: str) -> list[float]:
    """Bars of the service row ``key`` at each number of connections."""
    rows = [r for r in _by(recs, group="service") if r["workload"].startswith(f"service_{key}@")]
    sizes = sorted({int(r["conns"]) for r in rows})  # floats in a DataFrame
    allv = _bars(ax, rows, [f"service_{key}@{n}" for n in sizes],
                 [f"{count_label(n)} connections" for n in sizes])
    return allv


def panel_service(ax: Any, recs: list[dict[str, Any]]) -> None:
    """Requests/s at each number of connections, a bar per contender."""
    from matplotlib.ticker import FuncFormatter

    _service_bars(ax, recs, "rps")
    ax.set_ylabel("requests/s (median)")
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: format_value(y, "req/s")))
    ax.set_title("service on 127.0.0.1: requests/s")


def panel_service_tail(ax: Any, recs: list[dict[str, Any]]) -> None:
    """The client-side p99 latency at each number of connections."""
    allv = _service_bars(ax, recs, "p99")
    _ns_axis(ax, allv, "p99 latency, at the client (median)", log=True)
    ax.set_title("service on 127.0.0.1: p99 latency")


def panel_service_stall(ax: Any, recs: list[dict[str, Any]]) -> None:
    """The server's worst loop stall at each number of connections."""
    allv = _service_bars(ax, recs, "stall")
    _ns_axis(ax, allv, "worst heartbeat lateness (median)", log=True)
    ax.set_title("service on 127.0.0.1: worst loop stall")


def hist_of(obj: Any) -> list[int]:
    """The log2-ns lateness buckets (``_core.HIST_BUCKETS``) from a TimerThread, a stats() dict, or a
    sequence of counts."""
    if hasattr(obj, "stats") and callable(obj.stats):
        obj = obj.stats()
    if isinstance(obj, Mapping):
        obj = obj.get("lateness_hist") if "lateness_hist" in obj else obj.get("hist")
    if obj is None:
        raise ValueError("no lateness histogram found")
    return [int(x) for x in obj]


def _cdf_line(ax: Any, hist: Sequence[int], label: str, color: Any = None) -> None:
    total = sum(hist)
    if not total:
        return
    xs: list[float] = []
    ys: list[float] = []
    acc = 0
    for i, n in enumerate(hist):
        acc += n
        if n or xs:
            xs.append(2.0 ** i)  # upper edge of bucket i
            ys.append(acc / total)
        if acc == total:
            break
    ax.step(xs, ys, where="post", label=label, color=color)


def panel_cdf(ax: Any, recs: list[dict[str, Any]]) -> None:
    rows = [r for r in _by(recs, group="lateness") if r.get("hist")]
    for r in rows:
        _cdf_line(ax, r["hist"], r["contender"], COLORS.get(r["contender"]))
    _cdf_axes(ax)
    ax.set_title("firing lateness CDF, in a loop")


def _log_ns_xaxis(ax: Any) -> None:
    ax.set_xscale("log")
    from matplotlib.ticker import FuncFormatter, NullFormatter

    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: format_value(x, "ns")))
    ax.xaxis.set_minor_formatter(NullFormatter())


def _cdf_axes(ax: Any) -> None:
    _log_ns_xaxis(ax)
    ax.set_xlabel("lateness (callback start - deadline), at log2-ns bucket edges\n"
                  "(a step at 1 ns: timers on time or early)")
    ax.set_ylabel("fraction of timers at most this late")
    ax.set_ylim(0, 1.02)
    ax.grid(True, which="both", alpha=0.3)


def _shared_legend(fig: Any, axes: Sequence[Any]) -> None:
    """One legend for every panel, under them (outside every axes, so it
    covers no data): each label once, the contenders in column order."""
    seen: dict[str, Any] = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(label, handle)
    if not seen:
        return
    order = {c: i for i, c in enumerate(CONTENDERS)}
    labels = sorted(seen, key=lambda lab: order.get(lab, len(order)))
    fig.legend([seen[lab] for lab in labels], labels, loc="outside lower center",
               ncols=min(len(labels), 6), fontsize="small")


_PANEL_FUNCS = {
    "pairs": panel_pairs,
    "timeout": panel_timeout,
    "lateness": panel_lateness,
    "cdf": panel_cdf,
    "noloop": panel_noloop,
    "core": panel_core,
    "reset": panel_reset,
    "service": panel_service,
    "service_tail": panel_service_tail,
    "service_stall": panel_service_stall,
}


def plot(data: Any, panels: Sequence[str] | str | None = None, ncols: int = 3) -> Any:
    """One matplotlib Figure of the records from :func:`run`.

    ``panels``: any of ``"pairs"`` (time per pair against pending timers),
    ``"timeout"``, ``"lateness"`` (p50/p99/max), ``"cdf"`` (lateness CDF),
    ``"noloop"``, ``"core"`` (native pairs/s against threads), ``"reset"``
    (time per deadline reset), ``"service"`` (requests/s),
    ``"service_tail"`` (the client's p99 latency) and ``"service_stall"``
    (the server's worst loop stall), each at every number of connections;
    default: every panel the records have data for.  Each contender has one
    colour (``COLORS``) in every panel, named once in the legend under them.
    """
    recs = as_records(data)
    if isinstance(panels, str):
        panels = [panels]
    if panels is None:
        groups = {r["group"] for r in recs}
        panels = [p for p in PANELS if _PANEL_GROUP[p] in groups]
    unknown = [p for p in panels if p not in _PANEL_FUNCS]
    if unknown:
        raise ValueError(f"unknown panels {unknown}; known: {list(PANELS)}")
    if not panels:
        raise ValueError("nothing to plot")
    ncols = max(1, min(ncols, len(panels)))
    nrows = math.ceil(len(panels) / ncols)
    fig, axes = _figure(nrows, ncols)
    flat = [ax for row in axes for ax in row]
    for ax, p in zip(flat, panels):
        _PANEL_FUNCS[p](ax, recs)
    for ax in flat[len(panels):]:
        ax.set_visible(False)
    _shared_legend(fig, flat[:len(panels)])
    meta = meta_of(data)
    m, s = meta.get("machine") or {}, meta.get("suite") or {}
    if m or s:
        fig.suptitle(f"bucketimer.bench {s.get('name', '')}: Python {m.get('python', '?')}, "
                     f"{m.get('cpus_usable', '?')} CPUs, {m.get('cpu_model') or ''}",
                     fontsize="medium")
    return fig


def plot_lateness(stats_or_tt: Any, cdf: bool = True, label: str = "bucketimer") -> Any:
    """Histogram (and CDF) of firing lateness from a TimerThread's ``stats()``.

    Accepts a TimerThread, its ``stats()`` dict, a sequence of the log2-ns
    counts, or a mapping of names to any of those (overlaid).  Bucket i counts
    lateness in [2^(i-1), 2^i) ns.
    """
    if isinstance(stats_or_tt, Mapping) and "lateness_hist" not in stats_or_tt \
            and "hist" not in stats_or_tt:
        series = {k: hist_of(v) for k, v in stats_or_tt.items()}
    else:
        series = {label: hist_of(stats_or_tt)}
    fig, axes = _figure(1, 2 if cdf else 1)
    ax = axes[0][0]
    for k, (name, h) in enumerate(series.items()):
        color = COLORS.get(name, f"C{k}")
        # Bucket i spans [2^(i-1), 2^i) ns; bucket 0 (on time or early) is
        # drawn over [0.5, 1).
        lefts = [2.0 ** (i - 1) for i, n in enumerate(h) if n]
        ys = [n for n in h if n]
        ax.bar(lefts, ys, width=[x * 0.9 for x in lefts], align="edge", alpha=0.6,
               label=f"{name} (n={sum(h)})", color=color)
    _log_ns_xaxis(ax)
    ax.set_xlabel("lateness (callback start - deadline), log2-ns buckets")
    ax.set_ylabel("timers")
    if _spans_decades([n for h in series.values() for n in h if n], 100):
        ax.set_yscale("log")
    ax.set_title("firing lateness histogram")
    ax.grid(True, which="both", alpha=0.3)
    if cdf:
        ax2 = axes[0][1]
        for k, (name, h) in enumerate(series.items()):
            _cdf_line(ax2, h, f"{name} (n={sum(h)})", COLORS.get(name, f"C{k}"))
        _cdf_axes(ax2)
        ax2.set_title("firing lateness CDF")
    _shared_legend(fig, [ax for row in axes for ax in row])
    return fig


def plot_stats_timeline(samples: Any, keys: Sequence[str] = ("heap_size", "list_size", "dead"),
                        rates: Sequence[str] = ("scheduled", "cancelled", "fired")) -> Any:
    """Counters sampled by :func:`monitor` over time: sizes on the left,
    per-second rates on the right."""
    rows = as_records(samples)
    if not rows:
        raise ValueError("no samples")
    fig, axes = _figure(1, 2)
    t = [r["t"] for r in rows]
    ax = axes[0][0]
    for k in keys:
        ax.plot(t, [r[k] for r in rows], label=k)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("entries")
    ax.set_title("core sizes while the workload runs")
    ax.grid(True, alpha=0.3)
    _legend_below(ax)
    ax = axes[0][1]
    allv = []
    for k in rates:
        ys = [(b[k] - a[k]) / max(1e-9, b["t"] - a["t"]) for a, b in itertools.pairwise(rows)]
        allv += [y for y in ys if y > 0]
        ax.plot(t[1:], [y if y > 0 else math.nan for y in ys], label=f"{k}/s", marker=".")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("per second, between samples")
    if _spans_decades(allv, 100):
        ax.set_yscale("log")
    ax.set_title("core counters, rates")
    ax.grid(True, alpha=0.3)
    _legend_below(ax)
    return fig


def _legend_below(ax: Any) -> None:
    """The axes' legend under it, outside the data."""
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncols=3, fontsize="small")


__all__ = ["PANELS", "REF_HEAP", "hist_of", "plot", "plot_lateness", "plot_stats_timeline"]
