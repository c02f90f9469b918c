"""``python -m bucketimer.bench``: run the suite, print the table, write files.

    python -m bucketimer.bench                 # every group in about a minute, ~0.2 GB
    python -m bucketimer.bench --full          # the standard suite: ten minutes, ~1.6 GB
    python -m bucketimer.bench --only service  # the loopback service benchmark alone
    python -m bucketimer.bench --only grpc     # the gRPC interceptors' cost alone
    python -m bucketimer.bench --json out.json --csv out.csv --plot out.png
    python -m bucketimer.bench --load out.json --only grpc   # a saved run's gRPC table

A run also draws its figure, into ./bucketimer-bench.png unless --plot names
another file or --no-plot says none.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from . import GROUPS, run
from ._contenders import CONTENDERS
from ._report import format_table, write_csv, write_json
from ._table import wrap

DEFAULT_PLOT = "bucketimer-bench.png"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bucketimer.bench",
        description="bucketimer's timers against asyncio, uvloop, threading.Timer, sched "
                    "and a single-lock heap, a loopback service under load and gRPC calls: one "
                    "table, every figure from the same run.")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", dest="suite", action="store_const", const="quick",
                      help="the default: every group, smaller sizes, fewer rounds: about a "
                           "minute")
    size.add_argument("--smoke", dest="suite", action="store_const", const="smoke",
                      help="tiny sizes: checks that everything runs (a few seconds)")
    size.add_argument("--full", dest="suite", action="store_const", const="full",
                      help="the standard suite: about ten minutes; it holds a million "
                           "pending timers per column at once (~1.6 GB)")
    p.set_defaults(suite="quick")
    p.add_argument("--rounds", type=int, help="override the suite's number of rounds")
    p.add_argument("--only", metavar="GROUPS",
                   help=f"comma-separated workload groups to run, of: {','.join(GROUPS)}")
    p.add_argument("--contenders", metavar="NAMES",
                   help=f"comma-separated columns to run, of: {','.join(CONTENDERS)}")
    p.add_argument("--json", metavar="FILE", help="write every record and machine info as JSON")
    p.add_argument("--csv", metavar="FILE", help="write every record as CSV")
    plot = p.add_mutually_exclusive_group()
    plot.add_argument("--plot", metavar="FILE.png",
                      help=f"where to draw the figure (needs matplotlib; a run's default: "
                           f"./{DEFAULT_PLOT})")
    plot.add_argument("--no-plot", action="store_true", help="draw no figure")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--load", metavar="FILE.json",
                   help="run nothing: print the tables (and write --csv/--plot) of a "
                        "file an earlier --json wrote, of its --only groups and "
                        "--contenders columns")
    return p


def _split(arg: str | None) -> list[str] | None:
    return [x.strip() for x in arg.split(",") if x.strip()] if arg else None


def _selection(args: argparse.Namespace) -> tuple[list[str], list[str] | None] | None:
    """(groups, contenders) the arguments name, or None after saying what is
    wrong."""
    if args.rounds is not None and args.rounds < 1:
        print("--rounds must be >= 1", file=sys.stderr)
        return None
    groups = _split(args.only) or list(GROUPS)
    contenders = _split(args.contenders)
    for bad in [g for g in groups if g not in GROUPS]:
        print(f"unknown workload group {bad!r}; known: {', '.join(GROUPS)}", file=sys.stderr)
        return None
    if contenders is not None:
        for bad in [c for c in contenders if c not in CONTENDERS]:
            print(f"unknown contender {bad!r}; known: {', '.join(CONTENDERS)}", file=sys.stderr)
            return None
        if "bucketimer" not in contenders:
            contenders.insert(0, "bucketimer")
    return groups, contenders


def _progress(args: argparse.Namespace) -> bool:
    """Whether to draw progress bars (a terminal, tqdm installed); says what it runs otherwise."""
    progress = not args.no_progress and sys.stderr.isatty() and not args.load
    if not args.no_progress and not progress and not args.load:
        print(f"bucketimer.bench: running the {args.suite} suite...", file=sys.stderr)
    if progress:
        try:
            import tqdm  # noqa: F401
        except ImportError:
            print("note: install tqdm for progress bars", file=sys.stderr)
    return progress


def _load(path: str, groups: list[str] | None, contenders: list[str] | None) -> Any:
    """The records of ``groups`` and ``contenders`` (None: all) an earlier
    --json wrote, printed as the tables; None if there are none."""
    from . import Records
    from ._report import read_json

    try:
        recs, meta = read_json(path)
    except (OSError, ValueError, KeyError) as e:
        print(f"cannot load {path}: {e}", file=sys.stderr)
        return None
    recs = [r for r in recs if (groups is None or r["group"] in groups)
            and (contenders is None or r["contender"] in contenders)]
    if not recs:
        print(f"{path} holds no records of the groups and columns asked for", file=sys.stderr)
        return None
    data = Records(recs, meta)
    print(format_table(data, sys.stdout))
    print("\n".join(wrap(f"(loaded from {path}; produced by: {meta.get('command')})")))
    return data


def _write_plot(data: Any, path: str) -> None:
    try:
        import matplotlib

        if "matplotlib.pyplot" not in sys.modules and not os.environ.get("MPLBACKEND"):
            matplotlib.use("Agg")
    except ImportError:
        print(f"note: matplotlib is not installed: {path} not written "
              "(pip install matplotlib)", file=sys.stderr)
        return
    from . import plot

    try:
        fig = plot(data)
    except ValueError:  # no panel draws these groups
        groups = ", ".join(sorted({r["group"] for r in data}))
        print(f"note: no figure: no panel draws the {groups} rows", file=sys.stderr)
        return
    fig.savefig(path, dpi=110)
    print(f"wrote the figure to {os.path.abspath(path)}")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    selection = _selection(args)
    if selection is None:
        return 2
    groups, contenders = selection
    progress = _progress(args)
    if args.load:
        data = _load(args.load, groups if args.only else None, contenders)
        if data is None:
            return 2
    else:
        t0 = time.perf_counter()
        data = run(args.suite, groups=groups, contenders=contenders, progress=progress,
                   rounds=args.rounds, as_frame=False)
        data.meta["command"] = " ".join(
            ["python -m bucketimer.bench", *(sys.argv[1:] if argv is None else argv)])
        elapsed = time.perf_counter() - t0
        print(format_table(data, sys.stdout))
        per_group = ", ".join(f"{g} {t:.1f}" for g, t in data.meta["group_seconds"].items())
        print("\n".join(wrap(f"({args.suite} suite: {elapsed:.1f} s; s per group: {per_group})")))
    if args.json:
        write_json(data, args.json)
        print(f"wrote {args.json}")
    if args.csv:
        write_csv(data, args.csv)
        print(f"wrote {args.csv}")
    plot = args.plot or (None if args.no_plot or args.load else DEFAULT_PLOT)
    if plot:
        _write_plot(data, plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
