"""Instructions per operation, bucketimer against asyncio, counted by valgrind.

Wall-clock figures on a shared VM drift (this project's machine changes speed
by up to 1.5x within a minute); instruction counts do not: callgrind gives the
same total for the same binary, input and environment whatever else the
machine does.  They are not time -- a cache miss costs more than an add --
but their ratios tell whether a change made an operation do less work.

    python benchmarks/instructions.py            # needs valgrind on PATH
    python benchmarks/instructions.py --pure     # the pure-Python backend's
    python benchmarks/instructions.py idle       # only the rows whose op names it

Each operation runs N and 2N times in a fresh interpreter under
``valgrind --tool=callgrind``; the difference over N is its cost, start-up and
the loop's set-up cancelling out.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import tempfile

N = 5000

# Each operation is the kit's timed loop of that workload (bucketimer.bench).
SNIPPET = r"""
import asyncio, sys
import bucketimer
from bucketimer.bench.workloads import fill, sync_pairs, timeout_round, wait_for_round
op, n = sys.argv[1], int(sys.argv[2])
# ".../patched": bucketimer's helper on the drop-in loop, as patch_asyncio() there
ours = op.endswith(("bucketimer", "patched"))
# "pair@10000/...": the pairs with that many timers pending on the same call_later
pending = int(op.split("/")[0].partition("@")[2] or 0)
async def main():
    if op.startswith("timeout_none"):  # the same loop with no timer armed
        cm = bucketimer.timeout if ours else asyncio.timeout
        for _ in range(n):
            async with cm(None):
                pass
    elif op.startswith("timeout_at"):
        loop = asyncio.get_running_loop()
        cm = bucketimer.timeout_at if ours else asyncio.timeout_at
        for _ in range(n):
            async with cm(loop.time() + 30):
                pass
    elif op.startswith("timeout"):
        await timeout_round(bucketimer.timeout if ours else asyncio.timeout, n)
    elif op.startswith("wait_for"):
        await wait_for_round(bucketimer.wait_for if ours else asyncio.wait_for, n)
    elif op.startswith("reschedule"):
        loop = asyncio.get_running_loop()
        async with (bucketimer.timeout if ours else asyncio.timeout)(30) as cm:
            for _ in range(n):
                cm.reschedule(loop.time() + 30)
    elif op.startswith("idle"):  # loop iterations: a call_soon chain
        if op == "idle/timer-thread":  # after one TimerThread timer on this loop
            bucketimer.call_later(3600, print).cancel()
        elif op != "idle/asyncio":  # after one bucketimer timeout on this loop
            async with bucketimer.timeout(3600):
                await asyncio.sleep(0)
        loop = asyncio.get_running_loop()
        done, left = loop.create_future(), [n]
        def step():
            left[0] -= 1
            if left[0]:
                loop.call_soon(step)
            else:
                done.set_result(None)
        loop.call_soon(step)
        await done
    elif op.startswith("at_pair"):  # call_at(now + 30, cb).cancel()
        loop = asyncio.get_running_loop()
        call_at, cb = loop.call_at, print
        for _ in range(n):
            call_at(loop.time() + 30, cb).cancel()
    else:
        loop = asyncio.get_running_loop()
        tt = bucketimer.default_timer_thread()
        call_later = tt.call_later if op.endswith("timer-thread") else loop.call_later
        keep = await fill(call_later, pending, None)
        sync_pairs(call_later, n)
        for h in keep:
            h.cancel()
factory = (bucketimer.new_event_loop if op.endswith(("drop-in", "patched"))
           else asyncio.SelectorEventLoop)
with asyncio.Runner(loop_factory=factory) as r:
    r.run(main())
"""

OPS = [
    ("loop.call_later(30, cb).cancel()", "pair/asyncio", "pair/drop-in"),
    ("async with timeout(30): pass", "timeout/asyncio", "timeout/bucketimer"),
    ("async with timeout(None): pass", "timeout_none/asyncio", "timeout_none/bucketimer"),
    ("await wait_for(coro(), 30)", "wait_for/asyncio", "wait_for/bucketimer"),
    # What must stay asyncio's: an idle iteration of a loop (ratio ~1.0x)
    ("loop iteration, the helpers used", "idle/asyncio", "idle/bucketimer"),
    ("loop iteration, drop-in loop", "idle/asyncio", "idle/drop-in"),
]
# The pure-Python backend (BUCKETIMER_NO_EXTENSIONS=1): the drop-in loop's
# pairs (asyncio's heap behind its call_at/call_later) and a TimerThread's
# (on the running loop's heap) against the stock loop's, its helpers
# (asyncio's, with the native ones' order of due timers and NaN deadline)
# against asyncio's, and what must stay asyncio's: an idle iteration.
OPS_PURE = [
    ("loop.call_later(30, cb).cancel()", "pair/asyncio", "pair/drop-in"),
    ("(the drop-in loop) 10k pending", "pair@10000/asyncio", "pair@10000/drop-in"),
    ("100k pending", "pair@100000/asyncio", "pair@100000/drop-in"),
    ("loop.call_at(now + 30, cb).cancel()", "at_pair/asyncio", "at_pair/drop-in"),
    ("tt.call_later(30, cb).cancel()", "pair/asyncio", "pair/timer-thread"),
    ("(a TimerThread's) 10k pending", "pair@10000/asyncio", "pair@10000/timer-thread"),
    ("100k pending", "pair@100000/asyncio", "pair@100000/timer-thread"),
    ("async with timeout(30): pass", "timeout/asyncio", "timeout/bucketimer"),
    ("async with timeout_at(now + 30): pass", "timeout_at/asyncio", "timeout_at/bucketimer"),
    ("cm.reschedule(loop.time() + 30)", "reschedule/asyncio", "reschedule/bucketimer"),
    ("await wait_for(coro(), 30)", "wait_for/asyncio", "wait_for/bucketimer"),
    # The kit's drop-in column: asyncio's helpers on the drop-in loop; and its
    # patched one: the pure helpers there.  Against asyncio's on its own loop.
    ("timeout(30), drop-in loop", "timeout/asyncio", "timeout/drop-in"),
    ("  patched", "timeout/asyncio", "timeout/patched"),
    ("reschedule, drop-in loop", "reschedule/asyncio", "reschedule/drop-in"),
    ("  patched", "reschedule/asyncio", "reschedule/patched"),
    ("wait_for(coro(), 30), drop-in loop", "wait_for/asyncio", "wait_for/drop-in"),
    ("  patched", "wait_for/asyncio", "wait_for/patched"),
    ("loop iteration, a TimerThread's used", "idle/asyncio", "idle/timer-thread"),
    ("loop iteration, drop-in loop", "idle/asyncio", "idle/drop-in"),
]


def instructions(script: str, op: str, n: int) -> int:
    with tempfile.NamedTemporaryFile(suffix=".out") as out:
        # A fixed hash seed: string hashes change dict layouts, and with them
        # a few hundred instructions per operation from run to run.
        subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out.name}",
                        sys.executable, script, op, str(n)],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       env={**os.environ, "PYTHONHASHSEED": "0", **EXTRA_ENV})
        with open(out.name) as f:
            for line in f:
                if line.startswith("summary:"):
                    return int(line.split()[1])
    raise RuntimeError(f"no summary line from callgrind for {op}")


@functools.cache  # (a reference row serves several rows)
def per_op(script: str, op: str) -> float:
    return (instructions(script, op, 2 * N) - instructions(script, op, N)) / N


EXTRA_ENV: dict[str, str] = {}


def main() -> int:
    pure = "--pure" in sys.argv[1:]
    if pure:
        EXTRA_ENV["BUCKETIMER_NO_EXTENSIONS"] = "1"
    if shutil.which("valgrind") is None:
        print("valgrind is not on PATH (Debian: apt-get install valgrind)", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as d:
        script = os.path.join(d, "ops.py")
        with open(script, "w") as f:
            f.write(SNIPPET)
        print(f"instructions per operation, Python {sys.version.split()[0]} "
              f"{'(pure-Python backend) ' if pure else ''}"
              f"(valgrind callgrind, {N} vs {2 * N} runs)")
        print(f"{'operation':36} {'asyncio':>10} {'bucketimer':>11} {'ratio':>7}")
        prec = 2 if pure else 1  # (the pure backend's ratios are near 1)
        only = [a for a in sys.argv[1:] if not a.startswith("--")]
        for label, ref, ours in OPS_PURE if pure else OPS:
            if only and not any(o in ours for o in only):
                continue
            a, b = per_op(script, ref), per_op(script, ours)
            digits = 2 if ours.startswith("idle") else prec  # (these should be 1.00x)
            print(f"{label:36} {a:10,.0f} {b:11,.0f} {a / b:6.{digits}f}x", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
