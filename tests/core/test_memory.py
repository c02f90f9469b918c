"""Bounded memory.

* 1 000 000 schedule+cancel pairs of 60 s timers, nothing firing: RSS grows by
  at most 32 MB, and the core's garbage (bucket lists, heap, dead entries,
  slots) stays bounded by the drain threshold, sampled from ``stats()`` during
  the run: asyncio's heap of cancelled handles is what this is compared with
  (it keeps every cancelled TimerHandle until its deadline or a clean-up).
* 10 000 000 live timers (slow): bytes per timer, core only (cffi) and through
  the Python API (Handle objects included).
* A failed allocation raises MemoryError from ``call_later`` instead of
  crashing, and the process goes on (a subprocess under ``RLIMIT_AS``).
* A loop per request (``asyncio.run()`` of a handler that arms a timeout and
  a ``call_later``), 30 000 times: RSS stays flat, so a loop leaves nothing
  behind once closed and freed (the native core frees each loop's port).
"""

from __future__ import annotations

import json

import pytest
from _helpers import SANITIZED, check_ok, rss_bytes, run_python

import bucketimer
from bucketimer import _core

pytestmark = pytest.mark.timeout(300)

MB = 1 << 20
PAIRS = 1_000_000
SAMPLE_EVERY = 10_000
# The heap's sweep floor: the core's default (not settable from Python).
SWEEP_MIN = _core.DEFAULT_SWEEP_MIN


def noop() -> None:
    pass


def _bounds(drain_threshold: int, window: int) -> dict:
    """What docs/design.rst rule 5 promises for one calling thread (one bucket):
    the bucket list is pruned in place at 2 * max(drain_threshold, live); the
    heap is swept when dead entries pass half of it and it holds at least
    sweep_min; so memory is O(live + threshold), never O(pairs)."""
    list_max = 2 * max(drain_threshold, window) + 1
    heap_max = 2 * max(SWEEP_MIN, window) + list_max
    return {
        "list_size": list_max,
        "heap_size": heap_max,
        "dead": list_max + heap_max,
        # every slot is in a list, the heap, or a free list; blocks of 1024
        "slots": list_max + heap_max + window + 2 * 1024,
    }


@pytest.mark.parametrize("drain_threshold", [_core.DEFAULT_DRAIN_THRESHOLD, 256])
@pytest.mark.parametrize("pattern", ["cancel-at-once", "cancel-1000-later"])
def test_a_million_schedule_cancel_pairs_stay_bounded(pattern, drain_threshold):
    """``cancel-at-once``: every timer is cancelled right after it is
    scheduled (the RPC that finished fast).  ``cancel-1000-later``: 1000 live
    timers at any time, each cancelled 1000 schedules later, so cancelled
    entries also reach the timer thread's heap (asyncio's tombstones)."""
    window = 0 if pattern == "cancel-at-once" else 1000
    tt = bucketimer.TimerThread(drain_threshold=drain_threshold)
    try:
        call_later = tt.call_later
        ring = [call_later(60, noop) for _ in range(window)]
        for _ in range(2 * SAMPLE_EVERY):  # warm up: pool, free lists, Handle free list
            call_later(60, noop).cancel()
        rss0 = rss_bytes()
        peak = {"list_size": 0, "heap_size": 0, "dead": 0, "slots": 0}
        i = 0
        for _ in range(PAIRS // SAMPLE_EVERY):
            if window:
                for _ in range(SAMPLE_EVERY):
                    h = call_later(60, noop)
                    ring[i].cancel()
                    ring[i] = h
                    i = (i + 1) % window
            else:
                for _ in range(SAMPLE_EVERY):
                    call_later(60, noop).cancel()
            s = tt.stats()
            for k, v in peak.items():
                peak[k] = max(v, s[k])
        growth = rss_bytes() - rss0
        s = tt.stats()
        print(f"\n{pattern} threshold={drain_threshold}: RSS +{growth / MB:.1f} MB, peaks {peak}, "
              f"drains={s['drains']} sweeps={s['sweeps']} reaped={s['reaped']}")
        if not SANITIZED:  # ASan's quarantine keeps freed memory resident
            assert growth <= 32 * MB, f"RSS grew by {growth / MB:.1f} MB"
        bounds = _bounds(drain_threshold, window)
        for k, limit in bounds.items():
            assert peak[k] <= limit, f"{k} reached {peak[k]} > {limit}: {peak}"
        assert s["scheduled"] - s["cancelled"] == window
        assert s["fired"] == 0 and s["early_fires"] == 0
        # All the garbage was reclaimed by somebody: bucket prunes, drains or
        # sweeps; never an O(pairs) pile.
        assert s["reaped"] >= s["cancelled"] - bounds["dead"]
    finally:
        tt.close()


TEN_MILLION = r"""
import gc, json, sys, time
from bucketimer._cffi import ffi, lib
import bucketimer
from _helpers import cffi_core, cffi_port, destroy_cffi_core, rss_bytes

N = int(sys.argv[1]) if len(sys.argv) > 1 else 10_000_000

out = {}
# 1. The core alone (cffi): a slot per timer, plus its heap entry once the
#    timer thread has collected the bucket lists.
tt = cffi_core()
port = cffi_port(tt)
id_p = ffi.new("uint64_t *")
far = lib.bt_now_ns() + 3600 * 10**9
schedule = lib.bt_schedule_port
gc.collect()
r0 = rss_bytes()
t0 = time.perf_counter()
for i in range(N):
    schedule(tt, far + i, port, ffi.NULL, id_p)
dt = time.perf_counter() - t0
time.sleep(0.5)  # let the thread collect the last lists into its heap
s = ffi.new("bt_stats *")
lib.bt_get_stats(tt, s)
out["core"] = {"bytes_per_timer": (rss_bytes() - r0) / N, "heap_size": s.heap_size, "list_size": s.list_size,
               "slots": s.slots, "ns_per_schedule": dt / N * 1e9}
destroy_cffi_core(tt)

# 2. The Python API: a Handle (and its context) per timer, kept in a list.
gc.collect()
r0 = rss_bytes()
btt = bucketimer.TimerThread()
def noop():
    pass
call_later = btt.call_later
t0 = time.perf_counter()
handles = [call_later(3600, noop) for _ in range(N)]
dt = time.perf_counter() - t0
time.sleep(0.5)
st = btt.stats()
out["python"] = {"bytes_per_timer": (rss_bytes() - r0) / N, "heap_size": st["heap_size"],
                 "list_size": st["list_size"], "slots": st["slots"], "ns_per_call_later": dt / N * 1e9,
                 "handle_getsizeof": sys.getsizeof(handles[0])}
t0 = time.perf_counter()
for h in handles:
    h.cancel()
out["python"]["ns_per_cancel"] = (time.perf_counter() - t0) / N * 1e9
btt.close()
print(json.dumps(out))
"""


@pytest.mark.slow
@pytest.mark.skipif(SANITIZED, reason="RSS means nothing under a sanitizer's allocator")
@pytest.mark.native
def test_ten_million_live_timers_bytes_per_timer():
    p = run_python(TEN_MILLION, timeout=900)
    out = json.loads(check_ok(p).strip().splitlines()[-1])
    core, py = out["core"], out["python"]
    print(f"\n10M live timers: core {core['bytes_per_timer']:.1f} B/timer "
          f"({core['ns_per_schedule']:.0f} ns per cffi schedule), "
          f"Python API {py['bytes_per_timer']:.1f} B/timer incl. Handle "
          f"({py['ns_per_call_later']:.0f} ns per call_later, {py['ns_per_cancel']:.0f} ns per cancel)\n"
          f"{json.dumps(out, indent=1)}")
    # A 64-byte slot plus a 24-byte heap entry (capacity doubles: up to 48).
    assert core["bytes_per_timer"] <= 128, core
    assert core["heap_size"] + core["list_size"] == 10_000_000, core
    assert py["bytes_per_timer"] <= 512, py


LOOP_PER_REQUEST = r"""
import asyncio, gc, json, sys, warnings
import bucketimer
from _helpers import rss_bytes

warnings.simplefilter("ignore", ResourceWarning)  # (the dropped loops')

def noop():
    pass

async def request():
    async with bucketimer.timeout(30):
        bucketimer.call_later(30, noop).cancel()
        await asyncio.sleep(0)

def run_dropped(main):
    # run, then dropped without close(): asyncio's __del__ closes it, in a
    # collection of the cycles it is in
    loop = asyncio.new_event_loop()
    loop.run_until_complete(main)

run = asyncio.run if sys.argv[1] == "closed" else run_dropped

def loops(n):
    for _ in range(n):
        run(request())
    gc.collect()

loops(3000)  # the allocator's pools and the interpreter's caches filled
before = rss_bytes()
loops(12000)
print(json.dumps({"grown": rss_bytes() - before,
                  "ports": bucketimer.default_timer_thread().stats()["ports"]}))
"""


@pytest.mark.skipif(SANITIZED, reason="RSS means nothing under a sanitizer's allocator")
@pytest.mark.parametrize("end", ["closed", "dropped"])
def test_a_loop_per_request_leaves_nothing_behind(end):
    """Each loop costs a port on the native backend (``stats()["ports"]``
    counts them), freed once the loop is done with it, whether the loop was
    closed or dropped without close() and collected.  A kept port grew RSS
    by about 530 bytes per loop."""
    code = f"import sys; sys.argv[1:] = [{end!r}]\n" + LOOP_PER_REQUEST
    out = json.loads(check_ok(run_python(code, timeout=300)).strip().splitlines()[-1])
    if bucketimer.backend == "native":
        assert out["ports"] >= 15_000, out
    assert out["grown"] < 2 * MB, out  # (the kept ports grew it by 6.4 MB)


OOM = r"""
import contextvars, errno, json, os, resource, sys, threading, time
import bucketimer

def vmsize():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024

# No bucket drains (so the timer thread allocates nothing): the one
# allocation growing with the timers is the core's slot pool (64 KiB blocks).
tt = bucketimer.TimerThread(drain_threshold=1 << 30)
ctx = contextvars.copy_context()  # context= given: no Context copy per call
def noop():
    pass
ev = threading.Event()
tt.call_later(0, ev.set)  # the dispatcher thread exists before the limit
assert ev.wait(5)
soft, hard = resource.getrlimit(resource.RLIMIT_AS)
# Is the limit enforced?  qemu-user accepts RLIMIT_AS but does not pass it
# to the host (it would limit the emulator itself); there, filling a million
# timers in vain would only take minutes.
resource.setrlimit(resource.RLIMIT_AS, (vmsize() + (1 << 20), hard))
try:
    probe = bytearray(64 << 20)
    enforced = False
    del probe
except MemoryError:
    enforced = True
resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
if not enforced:
    tt.close()
    print(json.dumps({"enforced": False}))
    sys.exit(0)
N = 1_000_000
handles = [None] * N
# Holes the size of a Handle, which can take Handles but no 64 KiB block:
# under the limit, the Python side keeps allocating, the pool cannot grow.
# (a bytes object of the Handle's pymalloc size class: 8 bytes short of it)
probe = tt.call_later(1e9, noop, context=ctx)
hole = sys.getsizeof(probe) - sys.getsizeof(b"") - 8
probe.cancel()  # (its slot is the next schedule's)
del probe
ballast = [bytes(hole) for _ in range(2 * N)]
del ballast[::2]
resource.setrlimit(resource.RLIMIT_AS, (vmsize() + (1 << 20), hard))
n = 0
err = None
try:
    while n < N:
        handles[n] = tt.call_later(1e9, noop, context=ctx)
        n += 1
except MemoryError as e:
    err = e
# A TimerThread cannot be made under the limit either: it says so.
try:
    bucketimer.TimerThread()
    create = "ok"
except MemoryError:
    create = "MemoryError"
except OSError as e:
    create = "OSError " + errno.errorcode.get(e.errno, "?")
resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
s = tt.stats()
report = {"enforced": True, "error": repr(err), "live": n, "slots": s["slots"], "slots_free": s["slots_free"], "create": create}
# The process and the TimerThread go on: more timers, and they fire.
more = [tt.call_later(1e9, noop, context=ctx) for _ in range(5000)]
ev2 = threading.Event()
tt.call_later(0.001, ev2.set)
assert ev2.wait(5), "a timer scheduled after the MemoryError did not fire"
assert all(h.cancel() for h in handles[:n] + more)
report["after"] = tt.stats()["slots"]
tt.close()
print(json.dumps(report))
"""


@pytest.mark.skipif(SANITIZED, reason="ASan reserves its heap up front: RLIMIT_AS cannot make it fail")
@pytest.mark.native
def test_failed_allocation_raises_memoryerror_and_the_process_survives():
    # pymalloc without a Py_DEBUG build's allocator hooks, whose padding
    # would keep a Handle out of the ballast's holes.
    p = run_python(OOM, timeout=120, env={"PYTHONMALLOC": "pymalloc"})
    r = json.loads(check_ok(p).strip().splitlines()[-1])
    print("\n", r)
    if not r["enforced"]:
        pytest.skip("RLIMIT_AS is not enforced here (qemu-user accepts it and ignores it)")
    assert r["error"] == "MemoryError()", r
    # It was the slot pool that could not grow: every slot in use.
    assert r["slots_free"] == 0 and r["slots"] == r["live"], r
    assert 0 < r["live"] < 1_000_000
    assert r["create"] in ("MemoryError", "OSError EAGAIN", "OSError ENOMEM"), r
    assert r["after"] > r["slots"]
