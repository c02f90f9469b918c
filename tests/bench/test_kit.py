"""The benchmark kit: `python -m bucketimer.bench` end to end (smoke sizes),
its files, the notebook helpers, and the C reference timer it compares with.

No timing is asserted here: performance targets live in the benchmarks.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import math
import os
import subprocess
import sys
import time

import pytest
from _helpers import wait_until

import bucketimer
from bucketimer import bench
from bucketimer.bench import _contenders, _records, _resets, _service

# grpc.aio, not grpc: without grpcio, tests/grpc/ on sys.path makes "grpc" a
# namespace package.
HAVE_GRPCIO = importlib.util.find_spec("grpc") is not None and (
    importlib.util.find_spec("grpc.aio") is not None)

try:
    import matplotlib  # noqa: F401

    HAVE_MPL = True
except ImportError:
    HAVE_MPL = False

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# Where the pure backend runs, the kit leaves out the C core's rows and the
# native-only columns (test_cli_runs_on_a_pure_only_install).
NATIVE = bucketimer.backend == "native"


def _headers(text):
    """The header lines of every table of the kit's output (those above a rule)."""
    lines = text.splitlines()
    return "\n".join(line for i, line in enumerate(lines[:-1])
                     for below in lines[i + 1:i + 3] if below.startswith("---"))


def _prose(text):
    """The output with its wrapped lines joined: for the verdicts and notes."""
    return " ".join(text.split())


def test_cli_smoke_writes_tables_json_csv_and_the_figure_by_default(tmp_path):
    out_json, out_csv = tmp_path / "out.json", tmp_path / "out.csv"
    env = dict(os.environ, MPLBACKEND="Agg")
    proc = subprocess.run(
        [sys.executable, "-m", "bucketimer.bench", "--smoke", "--json", str(out_json),
         "--csv", str(out_csv)],
        check=False, capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr

    # A table per group: headers with the contenders, a row per workload,
    # every line within a terminal's 120 columns.
    lines = proc.stdout.splitlines()
    assert max(len(line) for line in lines) <= 120, proc.stdout
    header = _headers(proc.stdout)
    for col in ("bucketimer", "asyncio", "sched", "threading.Timer", "1-lock heap",
                "pure Python", "pure drop-in"):
        assert (col in header) == (NATIVE or col not in _contenders.NATIVE_ONLY), col
    core_labels = ("core pairs/s, 2 threads", "core scaling, 2 threads / 1")
    for label in ("pairs in a loop, 0 pending", "pairs in a loop, 1k pending",
                  "lateness p99, in a loop", "early fires", "pairs, no loop, 0 pending",
                  *core_labels):
        assert any(label in line for line in lines) == (NATIVE or label not in core_labels)

    doc = json.loads(out_json.read_text(encoding="utf-8"))
    assert doc["format"] == "bucketimer.bench/1"
    assert doc["suite"]["name"] == "smoke"
    m = doc["machine"]
    for key in ("platform", "cpu_count", "python", "packages"):
        assert m[key], key
    assert m["packages"]["bucketimer"] == bucketimer.__version__
    recs = doc["records"]
    by = {(r["workload"], r["contender"]): r for r in recs}
    rounds = doc["suite"]["rounds"]
    rounds_of = {"service": doc["suite"]["service_rounds"], "grpc": doc["suite"]["grpc_sets"]}
    for r in recs:
        want = rounds_of.get(r["group"], rounds)
        if r["group"] == "service" and len(r["samples"]) < want:  # a loaded machine
            assert any("not measured" in n for n in doc["notes"]), r["workload"]
        else:
            assert len(r["samples"]) == r["rounds"] == want, r["workload"]
        if r["unit"] != "count":
            assert r["min"] <= r["p25"] <= r["median"] <= r["p75"] <= r["max"], r
    # bucketimer is on every row and its timings are real numbers.
    workloads = {r["workload"] for r in recs}
    expected = {"pairs@0", "pairs@1000", "timeout", "wait_for", "lateness_p50",
                "lateness_p99", "lateness_max", "early_fires", "noloop_pairs@0",
                "noloop_pairs@pending", "noloop_lateness_p50", "noloop_lateness_p99",
                "service_rps@20",
                "service_p50@20", "service_p99@20", "service_stall@20", "service_rss@20",
                "reset_timeout@0", "reset_rearm@1000", "reset_rearm_tombstones@1000",
                }
    if HAVE_GRPCIO:
        expected |= {"grpc_sync@plain", "grpc_sync@2 no-op", "grpc_sync@deadline+slow",
                     "grpc_sync@no timers", "grpc_aio@2 wrappers", "grpc_aio@deadline+slow",
                     "grpc_aio@slow + no-op", "grpc_sync_vs_noop", "grpc_aio_vs_noop"}
    # Heap-block rows exist only where pymalloc counts the blocks (not under
    # the sanitizer session's PYTHONMALLOC=malloc).
    assert ("reset_timeout_blocks@0" in workloads) == _resets.BLOCKS_COUNTED
    if _resets.BLOCKS_COUNTED:
        expected.add("reset_timeout_blocks@0")
    core = {"core@1", "core@2", "core_scaling@2", "core_pending"}
    assert core & workloads == (core if NATIVE else set())
    expected |= core if NATIVE else set()
    assert expected <= workloads
    for w in expected:
        b = by[(w, "bucketimer")]
        if b["unit"] in ("ns", "pairs/s", "req/s", "MiB"):
            assert b["median"] > 0, w
            assert b["ratio"] == 1.0  # the baseline of its row
        else:  # counts and scaling factors have no ratio (JSON null, not NaN)
            assert b["ratio"] is None, w
    # Each API's verdict: deadline+slow against the target, and the parts.
    for api in ("sync", "aio") if HAVE_GRPCIO else ():
        verdict = _prose(proc.stdout).split(f"gRPC {api}: deadline+slow")[1].split(". ")[0]
        assert "no-op + deadline" in verdict and "no timers" in verdict
    a = by[("pairs@0", "asyncio")]
    assert a["ratio"] == pytest.approx(a["median"] / by[("pairs@0", "bucketimer")]["median"])
    # Every timer of the lateness rounds fired exactly once: the histograms
    # count all of them, and the early-fire record knows the total.
    early = by[("early_fires", "bucketimer")]
    assert early["timers"] == rounds * doc["suite"]["late_timers"]
    assert early["total"] == 0  # docs/guarantees.rst, "Never early"
    assert sum(by[("lateness_p50", "bucketimer")]["hist"]) == early["timers"]

    with open(out_csv, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(recs)
    assert {"workload", "contender", "median", "p25", "p75", "samples", "python",
            "cpu_count"} <= set(rows[0])
    for row, rec in zip(rows, recs):
        assert row["workload"] == rec["workload"]
        assert len(row["samples"].split(";")) == rec["rounds"]
        assert float(row["median"]) == pytest.approx(rec["median"], rel=1e-5)

    # The figure, where the last line says.
    out_png = tmp_path / "bucketimer-bench.png"
    if HAVE_MPL:
        assert lines[-1] == f"wrote the figure to {out_png}"
        data = out_png.read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 20_000
        import matplotlib.image

        img = matplotlib.image.imread(str(out_png))
        assert img.shape[0] > 400 and img.shape[1] > 800
    else:
        assert not out_png.exists()
        assert "matplotlib is not installed" in proc.stderr


_WITHOUT_OPTIONAL = """
import runpy, sys
for name in ("matplotlib", "pandas", "tqdm", "uvloop"):
    sys.modules[name] = None  # makes `import name` raise ImportError
sys.argv = ["bucketimer.bench"] + sys.argv[1:]
runpy.run_module("bucketimer.bench", run_name="__main__")
"""


def test_cli_degrades_without_optional_packages(tmp_path):
    out_png, out_json = tmp_path / "x.png", tmp_path / "x.json"
    proc = subprocess.run(
        [sys.executable, "-c", _WITHOUT_OPTIONAL, "--smoke", "--only", "pairs,core",
         "--plot", str(out_png), "--json", str(out_json)],
        check=False, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "matplotlib is not installed" in proc.stderr
    assert not out_png.exists()
    doc = json.loads(out_json.read_text(encoding="utf-8"))
    assert "uvloop is not installed: no 'uvloop' column" in doc["notes"]
    assert {r["contender"] for r in doc["records"]} >= {"bucketimer", "asyncio"} | (
        {"1-lock heap"} if NATIVE else set())
    assert "uvloop" not in {r["contender"] for r in doc["records"]}


_WITHOUT_GRPC_AND_CFFI = _WITHOUT_OPTIONAL.replace('"uvloop"', '"uvloop", "grpc", "_cffi_backend"')


def test_cli_says_what_it_skips_without_grpc_and_cffi(tmp_path):
    """Without grpcio no grpc rows, without cffi's backend (bench._cbench
    cannot load) no core rows: each said in the notes, and the rest runs."""
    out_json = tmp_path / "x.json"
    proc = subprocess.run(
        [sys.executable, "-c", _WITHOUT_GRPC_AND_CFFI, "--smoke", "--only", "pairs,core,grpc",
         "--json", str(out_json)],
        check=False, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    notes = json.loads(out_json.read_text(encoding="utf-8"))["notes"]
    assert "grpcio is not installed: no grpc rows (pip install grpcio)" in notes
    if NATIVE:
        assert any(n.startswith("bucketimer.bench._cbench cannot load") and "no core rows" in n
                   for n in notes), notes
    else:  # no C core to measure, whether or not the kit's C loads
        assert _contenders.PURE_INSTALL_NOTE in notes
    groups = {r["group"] for r in json.loads(out_json.read_text(encoding="utf-8"))["records"]}
    assert groups == {"pairs"}
    assert "note: grpcio is not installed" in proc.stdout


_PURE_ONLY = """
import runpy, sys
# What a py3-none-any wheel lacks: the extension, the cffi bindings, the kit's C.
for name in ("bucketimer._core", "bucketimer._cffi", "bucketimer.bench._cbench"):
    sys.modules[name] = None  # makes `import name` raise ImportError
sys.argv = ["bucketimer.bench"] + sys.argv[1:]
runpy.run_module("bucketimer.bench", run_name="__main__")
"""


def test_cli_runs_on_a_pure_only_install(tmp_path):
    """With no native module (BUCKETIMER_NO_EXTENSIONS=1 and none importable)
    every group but the C core's runs; the bucketimer column is the pure
    backend, the native-only columns are left out, and a note says what a
    native install adds.  The same on either backend of this suite."""
    out_json = tmp_path / "pure.json"
    env = dict(os.environ, BUCKETIMER_NO_EXTENSIONS="1")
    proc = subprocess.run(
        [sys.executable, "-c", _PURE_ONLY, "--smoke", "--no-progress", "--json", str(out_json)],
        check=False, capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    header = _headers(proc.stdout)
    assert "bucketimer (pure)" in header and "drop-in (pure)" in header
    assert "asyncio" in header and "sched" in header
    assert "pure Python" not in header and "pure drop-in" not in header
    assert "1-lock heap" not in header
    assert "pairs, no loop, 0 pending" in proc.stdout
    assert " ".join(_contenders.PURE_INSTALL_NOTE.split()) in " ".join(proc.stdout.split())
    doc = json.loads(out_json.read_text(encoding="utf-8"))
    assert doc["machine"]["backend"] == "python"
    recs = doc["records"]
    groups = {r["group"] for r in recs}
    want = set(bench.GROUPS) - {"core"}
    if not HAVE_GRPCIO:
        want.discard("grpc")
    assert groups == want
    assert not {r["contender"] for r in recs} & set(_contenders.NATIVE_ONLY)
    by = {(r["workload"], r["contender"]): r for r in recs}
    assert by[("pairs@0", "bucketimer")]["median"] > 0
    assert by[("early_fires", "bucketimer")]["total"] == 0  # docs/guarantees.rst, "Never early"


def test_cli_default_is_the_minute_suite():
    from bucketimer.bench.__main__ import _parser

    assert _parser().parse_args([]).suite == "quick"
    assert _parser().parse_args(["--quick"]).suite == "quick"
    assert _parser().parse_args(["--full"]).suite == "full"
    # every group has a place in the default suite's sizes
    quick = bench.SUITES["quick"]
    assert quick.grpc_sets >= 1 and quick.service_conns and quick.core_threads


def test_public_workload_api_is_complete():
    from bucketimer.bench import workloads

    assert "workloads" in bench.__all__
    for name in workloads.__all__:
        assert getattr(workloads, name) is not None, name
    assert set(workloads.LOOP_CONTENDERS) <= set(bench.CONTENDERS)
    pytest.importorskip("grpc.aio")
    ge = pytest.importorskip("bucketimer.bench.grpc_echo", exc_type=ImportError)
    for name in ge.__all__:
        assert hasattr(ge, name), name
    names = [name for name, _ in ge.interceptor_sets("aio")]
    assert names == [*ge.SERVERS, *ge.PARTS]
    with pytest.raises(ValueError):
        ge.interceptor_sets("nope")


def test_cli_rejects_bad_arguments():
    proc = subprocess.run([sys.executable, "-m", "bucketimer.bench", "--only", "nope"],
                          check=False, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "unknown workload group 'nope'" in proc.stderr


def test_run_api_records_and_table():
    data = bench.run("smoke", groups=["noloop"], contenders=["bucketimer", "sched"],
                     progress=False, rounds=2, as_frame=False)
    assert isinstance(data, bench.Records)
    assert data.meta["suite"]["rounds"] == 2
    assert list(data.meta["group_seconds"]) == ["noloop"]
    assert 0 < data.meta["group_seconds"]["noloop"] <= data.meta["elapsed_s"]
    assert {r["contender"] for r in data} == {"bucketimer", "sched"}
    assert all(r["group"] == "noloop" for r in data)
    table = bench.format_table(data)
    assert "sched" in table and "threading.Timer" not in table
    with pytest.raises(ValueError):
        bench.run("smoke", groups=["pairs"], contenders=["asyncio"], progress=False)
    with pytest.raises(ValueError):
        bench.run("nope")


def test_statistics_helpers():
    assert _records.quantile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5
    assert _records.quantile([5.0], 0.99) == 5.0
    assert math.isnan(_records.quantile([], 0.5))
    s = _records.summarize([3, 1, 2])
    assert (s["min"], s["median"], s["max"], s["mean"]) == (1, 2, 3, 2)
    # The core's lateness histogram format: bucket i counts [2^(i-1), 2^i) ns.
    h = _records.log2_hist([-5, 0, 1, 2, 3, 4, 1023, 1024, 1 << 60])
    assert h[0] == 2 and h[1] == 1 and h[2] == 2 and h[3] == 1
    assert h[10] == 1 and h[11] == 1 and h[47] == 1 and sum(h) == 9
    assert _records.count_label(1_000_000) == "1M" and _records.count_label(10_000) == "10k"
    assert _records.count_label(1500) == "1500"


def test_monitor_samples_stats_while_timers_fire():
    with bucketimer.TimerThread() as tt, bench.monitor(tt, interval=0.005) as mon:
        for i in range(200):
            tt.call_later(0.001 + i * 1e-4, lambda: None)
        # the first sample, at least one of the thread's, and the last at exit
        assert wait_until(lambda: tt.stats()["fired"] == 200 and len(mon.samples) >= 2, timeout=10)
    assert len(mon.samples) >= 3
    ts = [s["t"] for s in mon.samples]
    assert ts == sorted(ts)
    assert mon.samples[0]["scheduled"] == 0
    assert mon.samples[-1]["scheduled"] == 200
    assert mon.samples[-1]["fired"] == 200
    with pytest.raises(ValueError):
        bench.monitor(None, interval=0)


@pytest.mark.skipif(not HAVE_MPL, reason="matplotlib is not installed")
def test_plot_lateness_from_a_timer_thread():
    with bucketimer.TimerThread() as tt:
        for i in range(50):
            tt.call_later(i * 1e-4, lambda: None)
        deadline = time.monotonic() + 5
        while tt.stats()["ran"] < 50 and time.monotonic() < deadline:
            time.sleep(0.005)
        st = tt.stats()
        assert sum(bench.hist_of(tt)) == st["ran"] == 50
        fig = bench.plot_lateness(tt)
    assert len(fig.axes) == 2
    assert fig.axes[0].get_xscale() == "log"
    assert fig.axes[1].get_ylabel()
    fig2 = bench.plot_lateness({"a": st, "b": st["lateness_hist"]}, cdf=False)
    assert len(fig2.axes) == 1


# ---- the C reference timer and the GIL-free loops (through bench._cbench) ----------


@pytest.mark.native
def test_bench_c_is_in_the_kits_module_only():
    """The public cffi module carries the core's API alone; the kit's module
    carries it too (its cores are made there) and the benchmark C."""
    from bucketimer import _cffi
    from bucketimer.bench import _cbench

    for name in ("bt_ref_create", "bt_bench_pairs", "bt_bench_pairs_gated", "bt_bench_fill"):
        assert not hasattr(_cffi.lib, name), name
        assert hasattr(_cbench.lib, name), name
    for name in ("bt_create", "bt_schedule_native", "bt_cancel", "bt_get_stats"):
        assert hasattr(_cbench.lib, name), name


@pytest.mark.native
def test_reference_heap_fires_what_was_not_cancelled():
    from bucketimer.bench._cbench import ffi, lib

    out = ffi.new("bt_ref_timer **")
    assert lib.bt_ref_create(out) == 0
    rt = out[0]
    try:
        n = 200
        ids = ffi.new("uint64_t[]", n)
        # Due in 0.5-0.6 s: every cancel below must reach its timer before it
        # fires, on a machine as loaded and slow as CI's ASan build (1-20 ms
        # was not always enough there).
        assert lib.bt_ref_bench_fill(rt, 500_000_000, 600_000_000, n, ids) == 0
        assert lib.bt_ref_pending(rt) == n
        assert len({ids[i] for i in range(n)}) == n and all(ids[i] for i in range(n))
        # Cancel every other timer: each cancel wins once, then the id is stale.
        won = sum(lib.bt_ref_cancel(rt, ids[i]) == lib.BT_CANCELLED for i in range(0, n, 2))
        assert won == n // 2
        assert lib.bt_ref_cancel(rt, ids[0]) == lib.BT_UNKNOWN
        assert lib.bt_ref_cancel(rt, 0) == lib.BT_UNKNOWN
        deadline = time.monotonic() + 10
        while lib.bt_ref_fired(rt) < n // 2 and time.monotonic() < deadline:
            time.sleep(0.005)
        assert lib.bt_ref_fired(rt) == n // 2
        assert lib.bt_ref_pending(rt) == 0
        assert lib.bt_ref_cancel(rt, ids[1]) == lib.BT_UNKNOWN  # it ran
        assert lib.bt_ref_bench_pairs(rt, 30_000_000_000, 1000) > 0
        assert lib.bt_ref_pending(rt) == 0
    finally:
        lib.bt_ref_destroy(rt)


@pytest.mark.native
def test_bench_loops_on_the_bucketed_core():
    from bucketimer.bench._cbench import ffi, lib
    from bucketimer.bench._contenders import BUCKETIMER
    from bucketimer.bench._native import NativeCore

    # Made through the kit's module, whose loops drive it (as the kit does).
    core = NativeCore(ffi, lib, BUCKETIMER)
    try:
        tt = core.ptr
        assert lib.bt_bench_pairs(tt, 30_000_000_000, 5000) > 0
        gate, start = ffi.new("uint32_t *"), ffi.new("int64_t *")
        assert lib.bt_bench_pairs_gated(tt, 30_000_000_000, 100, gate, 1, start) > 0
        assert gate[0] == 1 and start[0] > 0
        ids = ffi.new("uint64_t[]", 300)
        assert lib.bt_bench_fill(tt, 60_000_000_000, 120_000_000_000, 300, ids) == 0
        assert lib.bt_bench_cancel_all(tt, ids, 300) == 300
        assert lib.bt_bench_cancel_all(tt, ids, 300) == 0
        st = ffi.new("bt_stats *")
        lib.bt_get_stats(tt, st)
        assert st.scheduled == 5000 + 100 + 300
        assert st.cancelled == 5000 + 100 + 300
        assert lib.bt_bench_fill(tt, 2, 1, 1, ffi.NULL) < 0  # max < min: -EINVAL
    finally:
        core.close()


# ---- the service benchmark ---------------------------------------------------------


def test_service_smoke_serves_real_requests(tmp_path):
    """Every contender's server answers real requests over 127.0.0.1, in
    its own process, and the figures hang together."""
    out_json = tmp_path / "svc.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bucketimer.bench", "--smoke", "--only", "service",
         "--json", str(out_json)],
        check=False, capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "service on 127.0.0.1, 20 conns" in _headers(proc.stdout)
    assert "service requests/s" in proc.stdout
    assert "service, 20 conns: drop-in" in proc.stdout  # the verdict against asyncio
    # stock code + patch_asyncio() against asyncio, in the same (wrapped) verdict
    assert "; patched drop-in " in _prose(proc.stdout)
    doc = json.loads(out_json.read_text(encoding="utf-8"))
    recs = doc["records"]
    assert {r["group"] for r in recs} == {"service"}
    names = {"bucketimer", "asyncio", "drop-in", "patched drop-in"} | (
        {"uvloop", "drop-in uvloop"} if _service.uvloop is not None else set())
    assert {r["contender"] for r in recs} == names
    by = {(r["workload"], r["contender"]): r for r in recs}
    window = doc["suite"]["service_window"]
    for name in names:
        rps = by[("service_rps@20", name)]
        # Each turn answered requests; a closed loop of 20 connections on
        # loopback answers far more than 20 per window.
        assert rps["per_round"] > 20 and rps["min"] * window >= 20, name
        for s_p50, s_p99 in zip(by[("service_p50@20", name)]["samples"],
                                by[("service_p99@20", name)]["samples"]):
            assert 0 < s_p50 <= s_p99 < 5e9, name
        # Little's law: 20 connections, one request each in flight.
        assert by[("service_p50@20", name)]["median"] < 20 / rps["median"] * 1e9 * 3
        assert all(0 <= x < 5e9 for x in by[("service_stall@20", name)]["samples"])
        assert 5 < by[("service_rss@20", name)]["median"] < 2000  # MiB
        # Per CPU-second of the server it answers at least as many as per second.
        assert by[("service_rps_cpu@20", name)]["median"] >= rps["median"] * 0.9
        assert 0 < by[("service_server_busy@20", name)]["median"] <= 110
        assert 0 < by[("service_client_busy@20", name)]["median"] <= 110


def _fail_windows(monkeypatch, failures):
    """Makes the first ``failures`` turns see no heartbeat in their window
    (as a server whose loop got no CPU on a loaded machine does); returns
    the length of every window asked for."""
    real = _service._window
    seen: list[float] = []

    def window(beats, fields, t0, t1):
        seen.append(t1 - t0)
        return real([] if len(seen) <= failures else beats, fields, t0, t1)

    monkeypatch.setattr(_service, "_window", window)
    return seen


_ONE_SHORT_TURN = {"service_rounds": 1, "service_warmup": 0.05, "service_window": 0.2}


def test_service_turn_that_cannot_be_measured_is_noted_not_fatal(monkeypatch):
    """A turn with no heartbeat in its window is taken again with a longer
    window; if that fails too its cells print '-' with a note saying why,
    and the other groups of the run still print."""
    seen = _fail_windows(monkeypatch, failures=10**9)
    suite = bench.suite_by_name("smoke", **_ONE_SHORT_TURN)
    data = bench.run(suite, groups=["noloop", "service"], contenders=["bucketimer", "asyncio"],
                     progress=False, as_frame=False)
    assert len(seen) == 4  # two contenders, each turn tried twice
    assert seen[1] > 0.9 * _service.RETRY_WINDOW > seen[0]  # the window the client measured
    by = {(r["workload"], r["contender"]): r for r in data}
    for name in ("bucketimer", "asyncio"):
        rps = by[("service_rps@20", name)]
        assert rps["samples"] == [] and math.isnan(rps["median"])  # no made-up figure
    assert by[("noloop_pairs@0", "bucketimer")]["median"] > 0
    notes = [n for n in data.meta["notes"] if "not measured" in n]
    assert len(notes) == 2 and all("0 heartbeats" in n and "again with a" in n for n in notes)
    table = bench.format_table(data)
    assert "pairs, no loop, 0 pending" in table and "service requests/s" in table
    assert "a turn was not measured" in _prose(table)


def test_service_turn_measured_on_its_retry(monkeypatch):
    from bucketimer.bench.workloads import service_turn

    seen = _fail_windows(monkeypatch, failures=1)
    t = service_turn(_service.BUCKETIMER, 20, 0.05, 0.2)
    assert len(seen) == 2 and seen[1] > 0.9 * _service.RETRY_WINDOW
    assert t.requests > 0 and t.rps > 0 and not t.errors


def test_service_window_and_ratios():
    beats = [  # t, lateness, rss, run ns, wait ns, process CPU s
        1.0, 0.001, 10.0, 0.0, 0.0, 0.0,
        2.0, 0.004, 30.0, 0.5e9, 0.25e9, 0.6,
        3.0, 0.002, 20.0, 1.0e9, 0.5e9, 1.2,
        9.0, 5.000, 90.0, 1.0e9, 0.5e9, 1.2,
    ]
    stall, rss, busy, cpu, process_cpu = _service._window(beats, 6, 0.5, 3.5)
    assert (stall, rss) == (0.004, 30.0)
    assert cpu == pytest.approx(0.5) and busy == pytest.approx(0.75)
    assert process_cpu == pytest.approx(0.6)
    with pytest.raises(RuntimeError):
        _service._window(beats, 6, 3.5, 4.0)  # a window with no heartbeat
    assert _service.paired_ratio([2, 4, 9], [1, 1, 3]) == 3
    assert _service.paired_ratio([2, 4], [1, 1]) == 3
    # rounds that only one side measured are not paired
    assert _service.paired_ratio([2, 9], [1, 1], [0, 2], [0, 1]) == 2
    assert math.isnan(_service.paired_ratio([2], [1], [1], [0]))
    assert math.isnan(_service.paired_ratio([], []))


def test_fd_limit_is_raised_for_the_sockets():
    import resource

    from bucketimer.bench import _service_wire

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        got = _service_wire.raise_fd_limit(soft + 100)
        assert got == resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if hard == resource.RLIM_INFINITY or hard >= soft + 100 + _service_wire.SPARE_FDS:
            assert got >= soft + 100 + _service_wire.SPARE_FDS
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, resource.getrlimit(
            resource.RLIMIT_NOFILE)[1]))


# ---- deadline resets ------------------------------------------------------------------


@pytest.mark.native
def test_reset_rows_see_what_a_reset_leaves():
    """The probes see asyncio's tombstones and its Python objects, so they
    would see bucketimer's if it left any."""
    data = bench.run("smoke", groups=["reset"], contenders=["bucketimer", "asyncio", "drop-in"],
                     progress=False, as_frame=False)
    by = {(r["workload"], r["contender"]): r for r in data}
    counted = _resets.BLOCKS_COUNTED  # False under the sanitizer session's PYTHONMALLOC=malloc
    assert counted == (os.environ.get("PYTHONMALLOC") not in ("malloc", "malloc_debug"))
    for pending in (0, 1000):
        for kind in ("reset_timeout", "reset_rearm"):
            # The stock loop: the old TimerHandle stays in loop._scheduled
            # until an iteration, with its context and callback.
            assert by[(f"{kind}_tombstones@{pending}", "asyncio")]["samples"] == [1.0] * 3
            blocks = f"{kind}_blocks@{pending}"
            if not counted:
                assert not any(w == blocks for w, _ in by)
            else:
                assert by[(blocks, "asyncio")]["min"] >= 1.5
            for ours in ("bucketimer", "drop-in"):
                if counted:
                    assert by[(blocks, ours)]["max"] < 0.1, (kind, ours)
                assert 0 <= by[(f"{kind}_tombstones@{pending}", ours)]["min"] <= 1
                r = by[(f"{kind}@{pending}", ours)]
                assert r["median"] > 0 and len(r["pair"]) == 3
    table = bench.format_table(data)
    assert "reset, bucketimer Timeout.reschedule(): 0 pending:" in table
    assert "moving a pending deadline, 1k pending" in table
    assert ("Python heap blocks left per reset" in table) == counted


# ---- output that reads at a glance ------------------------------------------------------

# A smoke run of every group and column, recorded with --json; and the full
# service runs the package ships (the notebook reads them).
RECORDED = os.path.join(os.path.dirname(__file__), "data", "smoke_run.json")
SHIPPED = [os.path.join(os.path.dirname(bench.__file__), "data", f"perf_service_{v}.json")
           for v in ("311", "314")]


class _Ascii:
    encoding = "ascii"  # a stream that cannot print the Unicode symbols


@pytest.mark.parametrize("path", [RECORDED, *SHIPPED], ids=os.path.basename)
@pytest.mark.parametrize("stream", [None, _Ascii()], ids=["unicode", "ascii"])
def test_recorded_runs_print_within_120_columns(path, stream):
    table = bench.format_table(bench.load(path), stream)
    wide = [line for line in table.splitlines() if len(line) > 120]
    assert not wide, "\n".join(wide)


def _tables(text):
    """(header lines, body lines) of each table of the output: the lines above
    its rule that start blank (wrapped column names) and the one with its
    title; the rows below it, up to a blank line or the prose under it."""
    lines = text.splitlines()
    out = []
    for i, line in enumerate(lines):
        if line.startswith("---"):
            top = i - 1
            while lines[top - 1].startswith(" ") and lines[top - 1].strip():
                top -= 1
            end = i + 1
            while end < len(lines) and lines[end][:1] in (" ", "\u2193", "\u2191") \
                    and lines[end].strip():
                end += 1
            out.append((lines[top:i], lines[i + 1:end]))
    return out


def _cells(line):
    """(start, end) of each run of text in ``line`` with 2+ spaces around it."""
    import re

    return [m.span() for m in re.finditer(r"\S+(?: \S+)*", line)]


def test_every_cell_stands_under_a_labelled_column():
    """Each table's cells end where a column header of that table ends, and
    the gRPC rows (plain: no bucketimer at all) stand under their APIs, not
    under a bucketimer column."""
    text = bench.format_table(bench.load(RECORDED))
    tables = _tables(text)
    assert len(tables) >= len(bench.GROUPS)
    for head, body in tables:
        first_column = _cells(head[-1])[1][0]  # after the title
        edges = {end for h in head for start, end in _cells(h) if start >= first_column}
        assert body
        for row in body:
            ends = {end for _, end in _cells(row) if end > first_column}
            assert ends and ends <= edges, (head, row)
    grpc_head, grpc_body = next((h, b) for h, b in tables if any(" plain" in r for r in b))
    assert "grpc (sync)" in grpc_head[-1] and "grpc.aio" in grpc_head[-1]
    assert "bucketimer" not in " ".join(grpc_head)
    plain = next(r for r in grpc_body if " plain " in r)
    assert len(_cells(plain)) == 3  # its label, and a cell under each API


def test_ratios_print_as_plain_numbers():
    from bucketimer.bench._records import add_ratios, make_record

    recs = [make_record("noloop", "w", "pairs, no loop", c, "ns", "lower", [v])
            for c, v in (("bucketimer", 100.0), ("threading.Timer", 229_040.0),
                         ("sched", 1234.0))]
    recs += [make_record("noloop", "v", "lateness", c, "ns", "lower", [v])
             for c, v in (("bucketimer", 1000.0), ("threading.Timer", 12.3),
                          ("sched", 598.0))]
    add_ratios(recs)
    table = bench.format_table(bench.Records(recs))
    assert "\u00d72290" in table and "\u00d712.3" in table
    assert "\u00d70.0123" in table and "\u00d70.598" in table
    assert "e+" not in table and "e-" not in table


def _under_each_table(text):
    """Each contender table's header line and the prose lines between its
    rows and the next table (wrapped lines joined)."""
    lines = text.splitlines()
    out = []
    for i, line in enumerate(lines):
        if not line.startswith("---"):
            continue
        end = i + 1
        while end < len(lines) and lines[end][:1] in (" ", "\u2193", "\u2191") \
                and lines[end].strip():
            end += 1
        prose = []
        while end < len(lines) and lines[end].strip():
            if lines[end].startswith("  ") and prose:
                prose[-1] += " " + lines[end].strip()
            else:
                prose.append(lines[end])
            end += 1
        out.append((lines[i - 1], prose))
    return out


def test_every_table_names_its_columns_and_gives_a_verdict():
    """Under every table of bucketimer's columns: a legend naming what each
    of its columns runs (its header included), then a verdict line."""
    text = bench.format_table(bench.load(RECORDED))
    assert "! after a cell of bucketimer's" in _prose(text)
    judged = 0
    tables = _under_each_table(text)
    for (header, prose), after in zip(tables, [*tables[1:], ("", [])]):
        if "grpc.aio" in header:  # the APIs are its columns; its verdicts are the group's
            continue
        title = header.split("  ")[0]
        if not prose and after[0].startswith(title):  # a part of a wide table: the next
            continue
        legend = next(p for p in prose if p.startswith("columns: "))
        verdict = prose[prose.index(legend) + 1]
        assert verdict.startswith("verdict: "), prose
        columns = [c for c in bench.CONTENDERS if f" {c}" in header]
        assert columns and all(f"{c} = " in legend for c in columns), (header, legend)
        judged += "against the column each stands in for" in verdict or "ahead" in verdict
    assert judged >= 5


def _race(ours, theirs, better="lower"):
    """A table of one row: bucketimer's samples against asyncio's."""
    from bucketimer.bench._records import add_ratios, make_record

    recs = [make_record("pairs", "w", "a row", c, "ns", better, v)
            for c, v in (("bucketimer", ours), ("asyncio", theirs))]
    add_ratios(recs)
    return bench.format_table(bench.Records(recs))


def test_a_cell_behind_or_within_the_spread_is_marked_and_named():
    """The mark after bucketimer's cell and the verdict: behind (!) when its
    median is worse than the column it stands in for, within the spread (~)
    when better, or even to the digits printed, but the interquartile ranges
    overlap, none when clearly ahead; for a rate, higher is better."""
    behind = _race([110, 120, 130], [90, 100, 105])
    within = _race([95, 100, 103], [98, 105, 110])
    ahead = _race([10, 11, 12], [90, 100, 105])
    rate_behind = _race([10, 11, 12], [90, 100, 105], better="higher")
    row = next(line for line in behind.splitlines() if "a row" in line)
    assert row.split()[6] == "!", row  # after bucketimer's cell (its value, its spread)
    assert "behind (!) on 1: bucketimer vs asyncio, a row: 0.833x" in _prose(behind)
    assert "within the spread (~) on 1: bucketimer vs asyncio, a row: 1.05x" in _prose(within)
    assert "~" in next(line for line in within.splitlines() if "a row" in line)
    assert "each of bucketimer's columns is ahead" in _prose(ahead)
    assert not {"!", "~"} & set(next(x for x in ahead.splitlines() if "a row" in x).split())
    assert "behind (!) on 1" in _prose(rate_behind)
    # even to the three digits printed, the spreads overlapping: not behind
    even = _race([28.3594, 28.3516, 28.3945], [28.3555, 28.2734, 28.3867])
    assert "within the spread (~) on 1: bucketimer vs asyncio, a row: 1x" in _prose(even)
    # even to three digits, the spreads apart: behind
    apart = _race([1000.4, 1000.4, 1000.4], [1000.0, 1000.0, 1000.0])
    assert "behind (!) on 1: bucketimer vs asyncio, a row: 1x" in _prose(apart)


def _cli(*args, cwd):
    return subprocess.run([sys.executable, "-m", "bucketimer.bench", *args], check=False,
                          capture_output=True, text=True, timeout=120, cwd=cwd,
                          env=dict(os.environ, MPLBACKEND="Agg"))


def test_load_honours_only_and_contenders(tmp_path):
    proc = _cli("--load", RECORDED, "--only", "grpc", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    heads = _headers(proc.stdout)
    assert "gRPC echo on 127.0.0.1" in heads and "grpc.aio" in heads
    for other in ("schedule+cancel", "timers with no event loop", "service on 127.0.0.1",
                  "moving a pending deadline"):
        assert other not in proc.stdout
    assert "gRPC sync: deadline+slow" in proc.stdout  # its verdicts come along
    assert not list(tmp_path.iterdir())  # --load draws no figure unless asked
    proc = _cli("--load", RECORDED, "--only", "pairs,noloop", "--contenders", "sched",
                cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    heads = _headers(proc.stdout)
    assert "bucketimer" in heads and "sched" in heads and "asyncio" not in heads
    assert "schedule+cancel" in heads and "no event loop" in heads and "gRPC" not in heads
    proc = _cli("--load", SHIPPED[0], "--only", "pairs", cwd=tmp_path)  # service rows only
    assert proc.returncode == 2 and "holds no records" in proc.stderr


@pytest.mark.skipif(not HAVE_MPL, reason="matplotlib is not installed")
def test_figure_default_path_explicit_path_and_no_plot(tmp_path):
    proc = _cli("--load", RECORDED, "--only", "pairs", "--plot", "here.png", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == f"wrote the figure to {tmp_path / 'here.png'}"
    assert (tmp_path / "here.png").read_bytes().startswith(PNG_MAGIC)
    proc = _cli("--load", RECORDED, "--only", "grpc", "--plot", "grpc.png", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "note: no figure: no panel draws the grpc rows" in proc.stderr
    proc = _cli("--smoke", "--only", "timeout", "--rounds", "1", "--no-plot", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "wrote the figure" not in proc.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["here.png"]


def _figure_of(path, panels=None):
    import matplotlib

    matplotlib.use("Agg")
    fig = bench.plot(bench.load(path), panels)
    fig.canvas.draw()
    return fig


@pytest.mark.skipif(not HAVE_MPL, reason="matplotlib is not installed")
def test_figure_one_colour_per_column_and_legends_off_the_data():
    from matplotlib.colors import to_hex

    from bucketimer.bench._plot import COLORS

    assert len(set(COLORS.values())) == len(COLORS) and set(COLORS) == set(bench.CONTENDERS)
    fig = _figure_of(RECORDED)
    seen: dict[str, set[str]] = {}
    for ax in fig.axes:
        assert ax.get_legend() is None, ax.get_title()  # no legend inside a panel
        for container in ax.containers:
            label = container.get_label()
            if label in COLORS:
                artist = container.patches[0] if hasattr(container, "patches") else (
                    container.lines[0])
                color = (artist.get_facecolor() if hasattr(container, "patches")
                         else artist.get_color())
                seen.setdefault(label, set()).add(to_hex(color))
        for line in ax.lines:
            if line.get_label() in COLORS:
                seen.setdefault(line.get_label(), set()).add(to_hex(line.get_color()))
    assert set(seen) == {r["contender"] for r in _recorded_dicts(RECORDED)
                         if r["group"] != "grpc"}
    for label, colors in seen.items():
        assert colors == {COLORS[label]}, label
    # One legend, for the whole figure, overlapping no panel.
    (legend,) = fig.legends
    box = legend.get_window_extent()
    for ax in fig.axes:
        if ax.get_visible():
            assert not box.overlaps(ax.get_window_extent()), ax.get_title()
    assert set(t.get_text() for t in legend.get_texts()) == set(seen)


def _recorded_dicts(path):
    """A JSON file's records as dicts, whether or not pandas is installed
    (``bench.load`` gives a DataFrame with it, ``Records`` without)."""
    recs = bench.load(path)
    return recs.to_dict("records") if hasattr(recs, "to_dict") else list(recs)


@pytest.mark.skipif(not HAVE_MPL, reason="matplotlib is not installed")
@pytest.mark.parametrize("path", SHIPPED, ids=os.path.basename)
def test_service_panels_draw_what_their_titles_say(path):
    """A bar per contender at each number of connections, of the one row the
    title names."""
    recs = _recorded_dicts(path)
    names = {r["contender"] for r in recs if r["group"] == "service"}
    sizes = sorted({int(r["conns"]) for r in recs if r["group"] == "service"})
    for panel, key, words in (("service", "rps", "requests/s"),
                              ("service_tail", "p99", "p99 latency"),
                              ("service_stall", "stall", "worst loop stall")):
        (ax,) = [ax for ax in _figure_of(path, [panel]).axes if ax.get_visible()]
        assert words in ax.get_title()
        bars = [c for c in ax.containers if c.get_label() in names]
        assert {c.get_label() for c in bars} == names and len(bars) == len(names)
        for c in bars:
            want = {r["median"] for r in recs if r["contender"] == c.get_label()
                    and r["workload"] in {f"service_{key}@{n}" for n in sizes}}
            assert {p.get_height() for p in c.patches} == want, (key, c.get_label())


def test_the_first_timer_script_measures_every_column():
    """benchmarks/first_timer.py (docs/performance.rst, "A short-lived
    loop"), at smoke size, on this backend: every column of both tables,
    each a median of what it took."""
    script = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "first_timer.py")
    proc = subprocess.run([sys.executable, script, "--loops", "3"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert out.startswith(f"{bucketimer.backend} backend"), out
    rows = [line for line in out.splitlines() if line.endswith("x")]
    assert [r.split("  ")[0].strip() for r in rows] == [
        "asyncio loop.call_later", "drop-in loop.call_later",
        "bucketimer.call_later (stock loop)", "TimerThread.call_later (stock loop)",
        "asyncio.run, asyncio.timeout", "asyncio.run, bucketimer.timeout",
        "bucketimer.run, bucketimer.timeout"], out
    for row in rows:
        median = float(row.split()[-3])
        assert median > 0, row
