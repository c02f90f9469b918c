"""The kit's workloads, for scripts and benchmarks of their own (the
repository's ``benchmarks/`` use these and nothing else of the kit).

Every timed loop here is the one a row of ``python -m bucketimer.bench``
times (docs/performance.rst, "What the rows measure"), so a figure from a
script and a row of the table measure the same thing.

Loops: :func:`new_loop` makes one of a loop contender (the names of
:data:`LOOP_CONTENDERS`; ``uvloop`` and ``drop-in uvloop`` only where
:data:`HAVE_UVLOOP`).

schedule + cancel pairs (the ``pairs`` rows): :func:`sync_pairs` times ``n``
``call_later(30, noop).cancel()`` pairs; :class:`PairsTarget` is a loop with
``pending`` other timers, inside which they run; :func:`fill` and
:func:`settle` make and retire such timers on any loop.

Helpers (the ``timeout`` rows): :func:`timeout_round` (``async with
timeout(30): pass``) and :func:`wait_for_round` (``await wait_for(coro(),
30)``), for any ``timeout``/``wait_for``.

Lateness: :func:`lateness_round` (what each of ``n`` timers spread over a
window was late by), :func:`via_call_later` (a ``call_later`` as a
``call_at`` of ``time.monotonic()`` instants).

Loop load: :func:`sequential_sleeps`, :func:`random_sleepers`,
:func:`cancel_churn` (loop stalls and RSS under call_later+cancel churn),
:func:`mass_cancel` (one iteration after a million cancellations).

Deadline resets (the ``reset`` rows): :class:`ResetTarget`,
:func:`reschedule_round` (``Timeout.reschedule``), :func:`rearm_round`
(``cancel`` + ``call_later``).

The service (the ``service`` rows): :func:`service_turn` (one turn of a
contender under N connections: a :class:`ServiceTurn`; taken once more with
a longer window if its figures cannot be read, then
:class:`ServiceUnmeasured`, which says why and what was answered),
:func:`service_contenders`, :func:`start_service_server` and
:func:`start_service_client` (the two processes of a turn, for tools that
watch one, e.g. a profiler).

gRPC (the ``grpc`` rows) is :mod:`bucketimer.bench.grpc_echo`, a module of
its own because it needs grpcio.
"""

from __future__ import annotations

import subprocess
import sys

from ._contenders import ASYNCIO, BUCKETIMER, DROPIN, DROPIN_UV, UVLOOP, new_loop, uvloop
from ._lateness import lateness_round, via_call_later
from ._loopload import cancel_churn, mass_cancel, random_sleepers, sequential_sleeps
from ._pairs import PAIR_DELAY, PairsTarget, fill, settle, sync_pairs
from ._resets import BLOCKS_COUNTED, Leftovers, rearm_round, reschedule_round
from ._resets import Target as ResetTarget
from ._service import SERVICE_CONTENDERS, _read_port
from ._service import Turn as ServiceTurn
from ._service import Unmeasured as ServiceUnmeasured
from ._service import contenders as _service_contenders
from ._service import measured_turn as service_turn
from ._timeouts import timeout_round, wait_for_round

__all__ = [
    "ASYNCIO",
    "BLOCKS_COUNTED",
    "BUCKETIMER",
    "DROPIN",
    "DROPIN_UV",
    "HAVE_UVLOOP",
    "LOOP_CONTENDERS",
    "PAIR_DELAY",
    "SERVICE_CONTENDERS",
    "UVLOOP",
    "Leftovers",
    "PairsTarget",
    "ResetTarget",
    "ServiceTurn",
    "ServiceUnmeasured",
    "cancel_churn",
    "fill",
    "lateness_round",
    "mass_cancel",
    "new_loop",
    "random_sleepers",
    "rearm_round",
    "reschedule_round",
    "sequential_sleeps",
    "service_contenders",
    "service_turn",
    "settle",
    "start_service_client",
    "start_service_server",
    "sync_pairs",
    "timeout_round",
    "via_call_later",
    "wait_for_round",
]

#: Whether uvloop is installed (its two loop contenders need it).
HAVE_UVLOOP = uvloop is not None
#: The loop contenders :func:`new_loop` knows, in the table's column order:
#: ``bucketimer`` runs on the stock loop, ``drop-in`` is
#: :class:`bucketimer.EventLoop`, ``drop-in uvloop`` uvloop with native timers.
LOOP_CONTENDERS = (BUCKETIMER, ASYNCIO, UVLOOP, DROPIN, DROPIN_UV)


def service_contenders() -> list[str]:
    """The service's contenders available here (uvloop's need it), in
    column order."""
    return _service_contenders(set(SERVICE_CONTENDERS))


def _module(name: str) -> list[str]:
    return [sys.executable, "-m", f"bucketimer.bench.{name}"]


def start_service_server(contender: str, conns: int, *args: str
                         ) -> tuple[subprocess.Popen[str], int]:
    """The service's server of ``contender``, sized for ``conns``
    connections, in a process of its own (stdout a pipe, ``args`` passed
    on), and its port once it listens.  Stop it with SIGTERM."""
    server = subprocess.Popen(
        [*_module("_service_server"), "--contender", contender, "--conns", str(conns), *args],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, text=True)
    try:
        return server, _read_port(server, conns)
    except BaseException:
        server.kill()
        server.communicate()
        raise


def start_service_client(port: int, conns: int, warmup: float, duration: float,
                         **popen: object) -> subprocess.Popen[str]:
    """The service's load generator: ``conns`` connections to ``port``,
    ``warmup`` s of load, then ``duration`` s measured; ``popen``: keyword
    arguments of :class:`subprocess.Popen`."""
    cmd = [*_module("_service_client"), "--port", str(port), "--conns", str(conns),
           "--warmup", str(warmup), "--duration", str(duration)]
    proc: subprocess.Popen[str] = subprocess.Popen(cmd, text=True, **popen)  # type: ignore[call-overload]
    return proc
