"""The ``service`` group: a real service on 127.0.0.1 under load, per
contender -- stock asyncio, uvloop, the drop-in loop on each,
bucketimer's ``timeout()`` helper on the stock loop, and the stock code after
``patch_asyncio()`` on the drop-in loop -- at several numbers of
concurrent connections: requests/s, client-side latency p50/p99, the
server's worst loop stall, its RSS, and the CPU that the server and the
load generator each used (docs/performance.rst, "The service benchmark").

Each turn is a fresh server process (``_service_server``) and a fresh load
generator process (``_service_client``); the contenders take turns round by
round at each size, so that a drifting machine moves every column alike.
"""

from __future__ import annotations

import math
import selectors
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ._contenders import ASYNCIO, BUCKETIMER, DROPIN, DROPIN_UV, PATCHED, UVLOOP, uvloop
from ._records import count_label, make_record
from ._service_wire import parse_result
from ._suite import Suite, taking_turns

if TYPE_CHECKING:
    from ._runner import Runner

# The service's contenders, in column order.
SERVICE_CONTENDERS = (BUCKETIMER, ASYNCIO, UVLOOP, DROPIN, DROPIN_UV, PATCHED)
# Each bucketimer contender and what it is compared with: the loop it runs on
# ("its host loop"), or, for the patched stock code, stock asyncio.
HOSTS = {DROPIN: ASYNCIO, BUCKETIMER: ASYNCIO, DROPIN_UV: UVLOOP, PATCHED: ASYNCIO}
START_LIMIT = 30.0  # s for a server to start listening
STOP_LIMIT = 30.0  # s for a server to write its beats and exit
MAX_REQUESTS = 5_000_000  # per measured window: bounds the client's memory
MIB = 2.0**20
# Under N connections a saturated loop answers in waves of about N
# requests: warm-up and window grow with N so that the window holds several.
WARMUP_PER_CONN = 0.0002  # s
WINDOW_PER_CONN = 0.0005  # s
# % of a window a server's loop must be busy for it to be the bottleneck
BUSY = 90.0
# A turn that cannot be measured is taken once more with its window this
# many times longer (and at least RETRY_WINDOW s).
RETRY_STRETCH = 4.0
RETRY_WINDOW = 2.0


class Unmeasured(RuntimeError):
    """A turn whose service ran but whose figures cannot be read: the
    server's loop did not get to beat twice in the window, which on a
    loaded machine means it barely got a CPU.  Says why, and what the load
    generator saw: its ``requests`` answered and ``errors`` (wrong
    answers, which the caller must still treat as a failure)."""

    def __init__(self, reason: str, requests: int = 0, errors: int = 0) -> None:
        super().__init__(reason)
        self.reason = reason
        self.requests = requests
        self.errors = errors


def contenders(want: set[str]) -> list[str]:
    """The service contenders wanted and available here, in column order."""
    have = [c for c in SERVICE_CONTENDERS if c in want]
    if uvloop is None:
        have = [c for c in have if c not in (UVLOOP, DROPIN_UV)]
    return have


@dataclass
class Turn:
    """One contender serving one load: what the client and the server saw."""

    contender: str
    conns: int
    rps: float
    # requests per CPU-second of the server process (every thread): what a
    # request costs the server, whatever share of a CPU the machine gave it
    rps_per_cpu: float
    p50_ns: float
    p99_ns: float
    stall_ns: float
    rss_mib: float
    # Over the window, the share of time the loop thread ran or waited for
    # a CPU (``busy``), and ran (``cpu``): a server whose loop is busy all
    # the time is the bottleneck, whatever the load generator does.
    server_busy: float
    server_cpu: float
    client_busy: float
    client_cpu: float
    requests: int
    errors: int
    paced: float  # share of connections answered twice or more in the window


def _module(name: str) -> list[str]:
    return [sys.executable, "-m", f"bucketimer.bench.{name}"]


def _expect(proc: subprocess.Popen[str], word: str, what: str) -> str:
    """The next line of ``proc``'s stdout, which must start with ``word``,
    within START_LIMIT."""
    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(START_LIMIT):
            raise RuntimeError(f"{what}: nothing within {START_LIMIT:.0f} s")
    line = proc.stdout.readline()
    if not line.startswith(word):
        err = proc.stderr.read()[-2000:] if proc.stderr is not None and proc.poll() else ""
        raise RuntimeError(f"{what}: {line!r} {err}")
    return line


def _read_port(server: subprocess.Popen[str], conns: int) -> int:
    """The port of a server just started (its first line), within START_LIMIT."""
    line = _expect(server, "PORT ", "service server: starting")
    fields = line.split()
    port, sockets = int(fields[1]), int(fields[3])
    if sockets < conns:
        raise RuntimeError(f"the server may open only {sockets} sockets (RLIMIT_NOFILE), "
                           f"fewer than {conns} connections")
    return port


def _window(beats: Sequence[float], fields: int, t0: float, t1: float
            ) -> tuple[float, float, float, float, float]:
    """(worst lateness in s, largest RSS in bytes, the loop thread's busy
    share and CPU share, the process's CPU share) of the heartbeats that woke
    within [t0, t1]."""
    rows = [beats[i:i + fields] for i in range(0, len(beats), fields)]
    inside = [r for r in rows if t0 <= r[0] <= t1]
    if len(inside) < 2:
        raise Unmeasured(f"service server: {len(inside)} heartbeats in the "
                         f"{t1 - t0:.1f} s window (its loop stalled for the whole window: "
                         "a machine too loaded to give it a CPU?)")
    stall = max(r[1] for r in inside)
    rss = max(r[2] for r in inside)
    first, last = inside[0], inside[-1]
    span_ns = (last[0] - first[0]) * 1e9
    cpu = (last[3] - first[3]) / span_ns
    busy = cpu + (last[4] - first[4]) / span_ns
    process_cpu = (last[5] - first[5]) / (last[0] - first[0])
    return stall, rss, busy, cpu, process_cpu


def measured_turn(contender: str, conns: int, warmup: float, window: float,
                  max_requests: int = MAX_REQUESTS) -> Turn:
    """:func:`run_turn`, taken once more with a longer window if its figures
    cannot be read; raises :class:`Unmeasured` (saying both tries) if they
    still cannot."""
    try:
        return run_turn(contender, conns, warmup, window, max_requests)
    except Unmeasured as first:
        longer = max(window * RETRY_STRETCH, RETRY_WINDOW)
        try:
            return run_turn(contender, conns, warmup, longer, max_requests)
        except Unmeasured as second:
            raise Unmeasured(f"{first.reason}; again with a {longer:.1f} s window: "
                             f"{second.reason}", second.requests, second.errors) from None


def run_turn(contender: str, conns: int, warmup: float, window: float,
             max_requests: int = MAX_REQUESTS) -> Turn:
    """A fresh server of ``contender`` under ``conns`` connections of a fresh
    load generator: ``warmup`` s of load, then ``window`` s measured.  Raises
    :class:`Unmeasured` when the service worked but its figures cannot be
    read (see :func:`measured_turn`)."""
    budget = 2 * START_LIMIT + warmup + window
    server = subprocess.Popen(
        [*_module("_service_server"), "--contender", contender, "--conns", str(conns),
         "--lifetime", str(budget + STOP_LIMIT)],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    client: subprocess.Popen[str] | None = None
    try:
        port = _read_port(server, conns)
        client = subprocess.Popen(
            [*_module("_service_client"), "--port", str(port), "--conns", str(conns),
             "--warmup", str(warmup), "--duration", str(window),
             "--max-requests", str(max_requests), "--wait-go"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        _expect(client, "CONNECTED", "service client: connecting")
        _expect(server, "READY", "service server: accepting the connections")
        out, err = client.communicate("GO\n", timeout=budget)
        if client.returncode:
            raise RuntimeError(f"service client failed: {err[-2000:]}")
        c = parse_result(out)
        server.send_signal(signal.SIGTERM)
        out, err = server.communicate(timeout=STOP_LIMIT)
        if server.returncode:
            raise RuntimeError(f"service server failed: {err[-2000:]}")
    finally:
        for proc in (client, server):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.communicate()
    s = parse_result(out)
    if c["conns"] != conns or c["lost"]:
        raise RuntimeError(f"service client: {c['conns']} of {conns} connections, "
                           f"{c['lost']} lost during the run")
    try:
        stall, rss, busy, cpu, process_cpu = _window(s["beats"], s["beat_fields"], c["t0"],
                                                     c["t1"])
    except Unmeasured as e:
        raise Unmeasured(e.reason, c["requests"], c["errors"]) from None
    return Turn(contender, conns, c["rps"], c["rps"] / process_cpu, c["p50_ns"], c["p99_ns"], stall * 1e9,
                rss / MIB, busy, cpu, c["busy"], c["cpu"], c["requests"], c["errors"],
                c["paced"] / conns)


# (workload key, label, unit, better, the Turn field, scale)
ROWS = (
    ("rps", "service requests/s", "req/s", "higher", "rps", 1.0),
    ("rps_cpu", "  per server CPU-second", "req/s", "higher", "rps_per_cpu", 1.0),
    ("p50", "service latency p50", "ns", "lower", "p50_ns", 1.0),
    ("p99", "service latency p99", "ns", "lower", "p99_ns", 1.0),
    ("stall", "service worst loop stall", "ns", "lower", "stall_ns", 1.0),
    ("rss", "service server RSS", "MiB", "lower", "rss_mib", 1.0),
    ("server_busy", "service server busy", "%", "info", "server_busy", 100.0),
    ("client_busy", "service client busy", "%", "info", "client_busy", 100.0),
)


def steps(runner: Runner) -> int:
    s = runner.suite
    return len(s.service_conns) * s.service_rounds * len(contenders(runner.want))


def measure(suite: Suite, names: Sequence[str], step: Any = None, notes: list[str] | None = None
            ) -> dict[tuple[str, int], list[Turn | None]]:
    """Every contender of ``names`` at every size of ``suite``, taking turns
    round by round; the turns of each (contender, size) in round order,
    None for a turn that could not be measured (:func:`measured_turn`; the
    reason goes to ``notes``)."""
    turns: dict[tuple[str, int], list[Turn | None]] = {}
    for conns in suite.service_conns:
        warmup = max(suite.service_warmup, conns * WARMUP_PER_CONN)
        window = max(suite.service_window, conns * WINDOW_PER_CONN)
        for name in taking_turns(list(names), suite.service_rounds):
            t = _turn_or_none(name, conns, warmup, window, notes)
            if t is not None and t.paced < 0.9 and notes is not None:
                notes.append(f"service {name}, {count_label(conns)} conns: only "
                             f"{t.paced:.0%} of the connections were answered twice in the "
                             f"{window:.1f} s window; its requests/s is extrapolated from them")
            turns.setdefault((name, conns), []).append(t)
            if step is not None:
                step(f"service {count_label(conns)} {name}")
    return turns


def _turn_or_none(name: str, conns: int, warmup: float, window: float,
                  notes: list[str] | None) -> Turn | None:
    """One measured turn, or None after noting why it could not be measured.
    Wrong responses are never a measurement problem: they raise."""
    try:
        t = measured_turn(name, conns, warmup, window)
    except Unmeasured as e:
        if e.errors:
            raise RuntimeError(f"service {name}: {e.errors} wrong responses") from None
        if notes is not None:
            notes.append(f"service {name}, {count_label(conns)} conns: a turn was not "
                         f"measured ({e.requests} requests answered, no figures): {e.reason}")
        return None
    if t.errors:
        raise RuntimeError(f"service {name}: {t.errors} wrong responses")
    return t


def run(runner: Runner) -> None:
    names = contenders(runner.want)
    if BUCKETIMER not in names:  # the runner insists on it; keep it first
        return
    turns = measure(runner.suite, names, runner.step, runner.notes)
    for conns in runner.suite.service_conns:
        for key, label, unit, better, field, scale in ROWS:
            for name in names:
                ts = turns[(name, conns)]
                runner.add(_record(name, conns, (key, label, unit, better, field, scale),
                                   [(i, t) for i, t in enumerate(ts) if t is not None]))


def _record(name: str, conns: int, row: tuple[str, str, str, str, str, float],
            measured: list[tuple[int, Turn]]) -> dict[str, Any]:
    """One service cell of a row of ROWS from the turns that were measured
    (``turn_rounds`` holds their round numbers, so that ratios pair turns of
    the same round); a cell with none has no samples and prints as '-'."""
    key, label, unit, better, field, scale = row
    busy = key.endswith("busy")
    return make_record(
        "service", f"service_{key}@{conns}", f"{label}, {count_label(conns)} conns", name,
        unit, better, [getattr(t, field) * scale for _, t in measured],
        per_round=sum(t.requests for _, t in measured) // max(1, len(measured)),
        pending=None, conns=conns, turn_rounds=[i for i, _ in measured],
        cpu=[t.client_cpu if "client" in key else t.server_cpu for _, t in measured]
        if busy else None)


def paired_ratio(a: Sequence[float], b: Sequence[float],
                 a_rounds: Sequence[int] | None = None, b_rounds: Sequence[int] | None = None
                 ) -> float:
    """The median over rounds of a[i] / b[i] (the turns of one round were
    taken moments apart); with ``a_rounds``/``b_rounds``, the round of each
    sample, only rounds both measured are paired."""
    if a_rounds is not None and b_rounds is not None:
        by_round = dict(zip(b_rounds, b))
        pairs = [(x, by_round[i]) for i, x in zip(a_rounds, a) if i in by_round]
    else:
        pairs = list(zip(a, b))
    r = sorted(x / y for x, y in pairs if y and not math.isnan(x) and not math.isnan(y))
    if not r:
        return math.nan
    mid = len(r) // 2
    return r[mid] if len(r) % 2 else (r[mid - 1] + r[mid]) / 2


def _record_ratio(a: dict[str, Any], b: dict[str, Any]) -> float:
    """:func:`paired_ratio` of two service cells, over the rounds both measured."""
    return paired_ratio(a["samples"], b["samples"], a.get("turn_rounds"), b.get("turn_rounds"))


def verdict(recs: list[dict[str, Any]]) -> list[str]:
    """Lines under the table: each bucketimer contender against its host
    loop at each size (medians of per-round ratios), and whether the server
    or the load generator was the bottleneck."""
    by = {(r["workload"], r["contender"]): r for r in recs if r["group"] == "service"}
    sizes = sorted({int(r["conns"]) for r in recs if r["group"] == "service"})
    lines = []
    for conns in sizes:
        parts = []
        for ours, host in HOSTS.items():
            pair = {k: (by.get((f"service_{k}@{conns}", ours)),
                        by.get((f"service_{k}@{conns}", host)))
                    for k in ("rps", "rps_cpu", "p99", "stall")}
            if any(a is None or b is None for a, b in pair.values()):
                continue
            ratio = {k: _record_ratio(a, b) for k, (a, b) in pair.items()}  # type: ignore[arg-type]
            if any(math.isnan(x) for x in ratio.values()):
                continue  # no round in which both were measured
            what = "timeout()" if ours == BUCKETIMER else ours
            parts.append(f"{what} {ratio['rps'] - 1:+.0%} req/s ({ratio['rps_cpu'] - 1:+.0%} "
                         f"per server CPU-s) vs {host}, p99 {ratio['p99']:.2f}x, "
                         f"stall {ratio['stall']:.2f}x")
        if parts:
            lines.append(f"service, {count_label(conns)} conns: " + "; ".join(parts) + ".")
    server = [x for r in recs if r["workload"].startswith("service_server_busy@")
              for x in r["samples"]]
    client = [x for r in recs if r["workload"].startswith("service_client_busy@")
              for x in r["samples"]]
    if server and client:
        lines.append(
            f"service: in the measured windows the server's loop thread ran or waited for "
            f"a CPU {min(server):.0f}-{max(server):.0f}% of the time, the load generator's "
            f"{min(client):.0f}-{max(client):.0f}%: "
            + ("the server was the bottleneck of every turn." if min(server) >= BUSY
               else "in some turns the server waited for the load generator: those "
                    "figures understate what the server can do."))
    return lines
