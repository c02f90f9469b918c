"""The differential status matrix: the same calls, against real servers on
127.0.0.1, with and without each configuration of the interceptors -- sync
and aio, every call kind, each handler behaviour -- compared with plain
grpcio: what the client receives (status, details, messages), what the
handler sees, what grpc logs, and what the interceptors report (log
records, ``on_deadline``/``on_slow``, the metrics observers).

The one difference allowed is the interceptors' purpose: a budget of
theirs (``max_time``, or the client's deadline) ends the call with
``DEADLINE_EXCEEDED`` as a client deadline of that length would, and that
call, and only that one, is reported as a deadline (docs/grpc.rst, "What
the caller sees").  So the reference for every configuration is plain
grpcio with a client timeout of the budget, ``B``.

One server per configuration, on every backend, serves every row: its
methods are ``{config}__{behaviour}__{variant}``, and every record, report
and handler step is told apart by that name.  A row makes all its calls at
once (the plain ones and every configuration's), so it takes about one
budget.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import logging
import math
import re
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any

import pytest

grpc = pytest.importorskip("grpc")

import _grpc_harness  # noqa: E402
from _grpc_harness import (  # noqa: E402
    LOCALLY_CANCELLED,
    SERVICE,
    AioBackend,
    Backend,
    Call,
    Result,
    SyncBackend,
    is_active,
    wait_for,
)
from _helpers import TIME_SCALE, under_sanitizer  # noqa: E402

from bucketimer import _observers  # noqa: E402
from bucketimer.grpc import flush_reports  # noqa: E402

SC = grpc.StatusCode

#: the times below, stretched where everything runs slower: a sanitizer's
#: build (ASan), an emulated CPU (BUCKETIMER_TEST_TIME_SCALE)
SCALE = TIME_SCALE * (3 if under_sanitizer() else 1)
#: the budget every configuration gives a call, and the reference's client timeout
B = 0.2 * SCALE
#: the slow-call threshold (under the budget: a call stuck until its budget is slow)
TH = 0.1 * SCALE
#: a client timeout that is never the budget
LONG = 10.0
#: how long a handler waits for its call to stop before it gives up
LIMIT = 2.0
#: the "cancel" row: when the client cancels (within the last 50 ms before
#: the budget) and how long its handler goes on (past the budget)
CANCEL_AT = B - 0.045 * SCALE
GOES_ON = B + 0.06 * SCALE


@dataclasses.dataclass(frozen=True)
class Config:
    """One way of using the interceptors: the server's and the client's,
    the client's timeout, and what of the interceptors' acts on the call."""

    name: str
    server: Callable[[Any, Hooks], tuple[Any, ...]]
    client: Callable[[Any, Hooks], tuple[Any, ...]] = lambda m, h: ()
    timeout: float | None = B
    #: the interceptors' budget: "max_time", "client" or None (grpc's deadline only)
    budget: str | None = None
    #: where a SlowCallInterceptor times the call: "server", "client" or None
    slow: str | None = None
    interrupt: bool = False
    sync_only: bool = False


class Hooks:
    """What every interceptor of the module hands its hooks, and what the
    metrics observers see; each by method name."""

    def __init__(self) -> None:
        self.deadlines: list[Any] = []
        self.slow: list[Any] = []
        self.observed: list[tuple[str, Any]] = []

    def on_deadline(self, ev: Any) -> None:
        self.deadlines.append(ev)

    def on_slow(self, info: Any) -> None:
        self.slow.append(info)


class _Observer:
    """A metrics observer (``bucketimer._observers.GrpcObserver``)."""

    def __init__(self, hooks: Hooks) -> None:
        self.hooks = hooks

    def deadline(self, ev: Any, /) -> None:
        self.hooks.observed.append(("deadline", ev))

    def slow(self, info: Any, /) -> None:
        self.hooks.observed.append(("slow", info))


def _deadline(m: Any, h: Hooks, max_time: float | None, **kw: Any) -> Any:
    return m.ServerDeadlineInterceptor(max_time, on_deadline=h.on_deadline, **kw)


def _slow(m: Any, h: Hooks) -> Any:
    return m.SlowCallInterceptor(TH, on_slow=h.on_slow, stack=False)


CONFIGS = [
    Config("deadline", lambda m, h: (_deadline(m, h, B),), timeout=LONG, budget="max_time"),
    Config("deadline-client", lambda m, h: (_deadline(m, h, None),), budget="client"),
    Config("slow+deadline", lambda m, h: (_slow(m, h), _deadline(m, h, B)), timeout=LONG,
           budget="max_time", slow="server"),
    Config("slow+deadline-client", lambda m, h: (_slow(m, h), _deadline(m, h, None)),
           budget="client", slow="server"),
    Config("combined", lambda m, h: (m.ServerDeadlineSlowCallInterceptor(
        TH, B, on_deadline=h.on_deadline, on_slow=h.on_slow, stack=False),), timeout=LONG,
        budget="max_time", slow="server"),
    Config("deadline+slow", lambda m, h: (_deadline(m, h, B), _slow(m, h)), timeout=LONG,
           budget="max_time", slow="server"),
    Config("slow", lambda m, h: (_slow(m, h),), slow="server"),
    Config("interrupt", lambda m, h: (_deadline(m, h, B, interrupt=True),), timeout=LONG,
           budget="max_time", interrupt=True, sync_only=True),
    Config("client-timeout", lambda m, h: (), lambda m, h: (m.DefaultTimeoutInterceptor(B),),
           timeout=None),
    Config("client-slow", lambda m, h: (), lambda m, h: (_slow(m, h),), slow="client"),
]

PLAIN = Config("plain", lambda m, h: ())

#: the handler's behaviours: what it does, and when (``late_*``: once its
#: call stopped -- ``is_active()`` false on sync, a cancellation on aio)
BEHAVIOURS = ["ok", "raise", "abort", "set_code", "late_return", "late_raise", "late_abort",
              "late_set_code", "unwind", "cancel"]
#: aio only: the cancellation propagates (a sync handler has none)
AIO_ONLY = {"unwind"}
#: the behaviours that end at once, long before the budget
AT_ONCE = {"ok", "raise", "abort", "set_code"}


async def _maybe(x: Any) -> None:
    if inspect.isawaitable(x):
        await x


async def _until_stopped(ctx: Any, limit: float) -> None:
    """Wait ``limit`` seconds, or until the call stops (``ctx`` given):
    ``is_active()`` turns false on sync (a poll), a cancellation on aio (one
    sleep: many handlers polling at once would hold up the one loop that
    runs every server of the row)."""
    if asyncio._get_running_loop() is None:
        end = time.monotonic() + limit
        while (ctx is None or is_active(ctx)) and time.monotonic() < end:
            time.sleep(0.005)  # Python code between the sleeps: an interrupt lands there
    else:
        await asyncio.sleep(max(limit, 0.0))


def _work(behaviour: str, method: str, trace: dict[str, list[Any]]) -> Any:
    """The handler's work for ``behaviour``; what it sees goes to
    ``trace[method#request]`` (the request: the row's attempt)."""

    async def work(req: bytes, ctx: Any) -> bytes:
        steps = trace.setdefault(f"{method}#{req.decode()}", [])
        t0 = time.monotonic()
        how = "returned"
        try:
            if behaviour == "ok":
                return req
            if behaviour == "raise":
                raise KeyError(method)
            if behaviour == "abort":
                await _maybe(ctx.abort(SC.NOT_FOUND, "nope"))
            if behaviour == "set_code":
                ctx.set_code(SC.FAILED_PRECONDITION)
                ctx.set_details("precondition")
                return b"set"
            try:
                await _until_stopped(ctx, LIMIT)
                steps.append("inactive" if not is_active(ctx) else "waited to the limit")
            except asyncio.CancelledError:
                steps.append("cancelled")
                if behaviour == "unwind":
                    raise
            if behaviour == "cancel":  # goes on past the budget
                try:
                    await _until_stopped(None, GOES_ON - (time.monotonic() - t0))
                except asyncio.CancelledError:
                    steps.append("cancelled again")
            if behaviour == "late_raise":
                raise KeyError(method)
            if behaviour == "late_abort":
                await _maybe(ctx.abort(SC.INTERNAL, "mine"))
            if behaviour == "late_set_code":
                ctx.set_code(SC.INTERNAL)
                ctx.set_details("set late")
            return b"after-deadline"
        except BaseException as e:
            how = type(e).__name__
            raise
        finally:
            steps.append(("end", how))

    return work


# -- the servers ----------------------------------------------------------------------


class Matrix:
    """One backend's servers, one per configuration and the plain one, each
    serving every behaviour in every variant; with what was logged."""

    def __init__(self, backend: Backend, stack: contextlib.ExitStack) -> None:
        #: the clients' backend; on aio the servers' loop is another one's
        self.backend = backend
        servers = backend
        if isinstance(backend, AioBackend):
            servers = AioBackend()
            stack.callback(servers.close)
        self.hooks = Hooks()
        self.trace: dict[str, list[Any]] = {}
        #: how many steps each handler had traced when the last row was judged
        self.judged: dict[str, int] = {}
        self.configs = [c for c in CONFIGS if not (c.sync_only and backend.name != "sync")]
        self.behaviours = [b for b in BEHAVIOURS if b not in AIO_ONLY or backend.name == "aio"]
        self.channels: dict[str, Any] = {}
        m = backend.mod
        for cfg in [PLAIN, *self.configs]:
            handlers = {}
            for beh in self.behaviours:
                for shape, suffix in backend.variants:
                    name = f"{cfg.name}__{beh}__{suffix}"
                    handlers[name] = backend.handler(shape, _work(beh, name, self.trace),
                                                     writer=suffix.endswith("_writer"))
            if isinstance(servers, SyncBackend):
                # one thread per call of a row, and spares for handlers still ending
                serving = servers.serve(handlers, cfg.server(m, self.hooks),
                                        pool=futures.ThreadPoolExecutor(max_workers=12))
            else:
                serving = servers.serve(handlers, cfg.server(m, self.hooks))
            address = stack.enter_context(serving)
            self.channels[cfg.name] = stack.enter_context(
                backend.channel(address, *cfg.client(m, self.hooks)))


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture(scope="module")
def records() -> Iterator[_Records]:
    """Every record of grpc's loggers (INFO and up) and of bucketimer.grpc."""
    handler = _Records()
    loggers = [logging.getLogger("grpc"), logging.getLogger("bucketimer.grpc")]
    levels = [lg.level for lg in loggers]
    loggers[0].setLevel(logging.INFO)
    loggers[1].setLevel(logging.DEBUG)
    for lg in loggers:
        lg.addHandler(handler)
    try:
        yield handler
    finally:
        for lg, level in zip(loggers, levels):
            lg.removeHandler(handler)
            lg.setLevel(level)


@pytest.fixture(scope="module", params=["sync", "aio"])
def matrix(request: pytest.FixtureRequest) -> Iterator[Matrix]:
    backend: Backend = SyncBackend() if request.param == "sync" else AioBackend()
    with contextlib.ExitStack() as stack:
        if isinstance(backend, AioBackend):
            stack.callback(backend.close)
        mx = Matrix(backend, stack)
        observer = _Observer(mx.hooks)
        _observers.add_grpc(observer)
        stack.callback(_observers.remove_grpc, observer)
        yield mx


def _settle(records: _Records) -> None:
    """Let what the calls that ended report reach the log, hooks and
    observers: until no record has come for 100 ms (grpc writes its own
    once a server task has finished), and the reports' thread is done."""
    end = time.monotonic() + 2.0
    while True:
        seen = len(records.records)
        time.sleep(0.1)
        assert flush_reports(5.0)
        if len(records.records) == seen or time.monotonic() > end:
            return


def shape_streams_responses(shape: str) -> bool:
    return shape.endswith("_stream")


# -- one row -----------------------------------------------------------------------------


def _named(method: str) -> re.Pattern[str]:
    """``method``'s name as a word of a text (not the tail of another's)."""
    return re.compile(rf"(?<![\w+-]){re.escape(method)}(?!\w)")


#: what grpc's own client says of a streaming call its deadline ended, one
#: time or the other (which of its parts saw the deadline first): one text
_DEADLINE_DETAILS = {"Stream removed (Deadline Exceeded)": "Deadline Exceeded"}


def _outcome(r: Result, method: str) -> tuple[Any, ...]:
    details = _named(method).sub("METHOD", r.details) if r.details else r.details
    if r.code == SC.DEADLINE_EXCEEDED:
        details = _DEADLINE_DETAILS.get(details, details)  # type: ignore[arg-type]
    return (r.code, details, r.responses)


def _grpc_records(recs: list[logging.LogRecord], method: str) -> list[tuple[Any, ...]]:
    """grpc's own records about ``method`` (its name in the message, or in
    the exception's), the name taken out."""
    out = []
    name = _named(method)
    for rec in recs:
        if not rec.name.startswith("grpc") or rec.levelno < logging.INFO:
            continue
        msg = rec.getMessage()
        if not name.search(msg):
            continue
        exc = rec.exc_info[0].__name__ if rec.exc_info and rec.exc_info[0] else None
        out.append((rec.name, rec.levelname, name.sub("METHOD", msg), exc))
    return out


def _ours(recs: list[logging.LogRecord], method: str) -> list[tuple[Any, ...]]:
    full = f"/{SERVICE}/{method}"
    return [(rec.grpc_event, rec.levelname, rec.grpc_code)  # type: ignore[attr-defined]
            for rec in recs if rec.name == "bucketimer.grpc" and getattr(rec, "grpc_method", None) == full]


def _ended(trace: dict[str, list[Any]], key: str) -> bool:
    return any(isinstance(s, tuple) and s[0] == "end" for s in trace.get(key, []))


#: the "cancel" row says what the reports must be only of a cancel this long
#: before the deadline: later, it comes within the look before the deadline
#: (``_common._EARLY``, 20 ms) that a busy loop or dispatcher may run late
CLEAR_CANCEL = B - 0.03 * SCALE


def run_row(mx: Matrix, records: _Records, behaviour: str, attempt: int) -> tuple[list[str], list[str]]:
    """Every variant of ``behaviour`` on the plain server and on every
    configuration's, all at once: (the differences found, the variants a
    stalled machine left undecided: a handler that never ran)."""
    backend = mx.backend
    payload = b"%d" % attempt
    calls: list[tuple[Config, str, str, Call]] = []
    for cfg in [PLAIN, *mx.configs]:
        for shape, suffix in backend.variants:
            method = f"{cfg.name}__{behaviour}__{suffix}"
            timeout = B if cfg is PLAIN else cfg.timeout
            cancel_at = CANCEL_AT if behaviour == "cancel" else None
            calls.append((cfg, suffix, method, Call(mx.channels[cfg.name], shape, method,
                                                    payload=payload, timeout=timeout,
                                                    cancel_at=cancel_at)))
    start = len(records.records)
    hooks = mx.hooks
    marks = (len(hooks.deadlines), len(hooks.slow), len(hooks.observed))
    results = backend.invoke_many([c for *_, c in calls])
    keys = [f"{m}#{attempt}" for _, _, m, _ in calls]
    # every handler that ran has ended, and what was reported has arrived
    assert wait_for(lambda: all(_ended(mx.trace, k) for k in keys if k in mx.trace), LIMIT + 1.0), \
        [(k, mx.trace[k], r) for k, r in zip(keys, results) if k in mx.trace and not _ended(mx.trace, k)]
    _settle(records)
    recs = records.records[start:]
    # A handler of an earlier attempt that ran after that attempt was judged
    # (it had not begun: a stalled machine) reports under the same method as
    # this attempt's: those variants are left undecided.
    counts = {k: len(v) for k, v in list(mx.trace.items())}
    late = {k.partition("#")[0] for k, n in counts.items()
            if k not in keys and n != mx.judged.get(k, 0)}
    mx.judged = counts
    deadlines, slows, observed_all = (hooks.deadlines[marks[0]:], hooks.slow[marks[1]:],
                                      hooks.observed[marks[2]:])

    problems: list[str] = []
    undecided: list[str] = []
    plain = {suffix: (r, m, k) for (cfg, suffix, m, _), r, k in zip(calls, results, keys)
             if cfg is PLAIN}
    for (cfg, suffix, method, call), r, key in zip(calls, results, keys):
        if cfg is PLAIN:
            continue
        ref, ref_method, ref_key = plain[suffix]
        where = f"{backend.name} {cfg.name} {behaviour} {suffix}"
        full = f"/{SERVICE}/{method}"
        if method in late or ref_method in late:
            undecided.append(f"{where}: a handler of an earlier attempt ran during this one")
            continue
        ours = _ours(recs, method)
        events = [ev for ev in deadlines if ev.method == full]
        if key not in mx.trace or ref_key not in mx.trace or behaviour in AT_ONCE and (
                SC.DEADLINE_EXCEEDED in (r.code, ref.code) or events
                or [x for x in ours if x[0] == "deadline"]):
            # a handler that never ran, or one that ends at once but ran out of
            # the budget: the machine stalled for longer than the budget
            undecided.append(f"{where}: {r!r}, plain grpc: {ref!r}")
            continue
        # A request that reached its handler with the client's deadline
        # mostly spent (the machine stalled before the handler began) is
        # judged as any other if it ends as the plain one does; a difference
        # it shows leaves the row undecided instead.
        late_start = bool([ev for ev in events if ev.source == "client"
                           and ev.budget < (cfg.timeout or B) - 0.05 * SCALE])
        found = len(problems)
        try:
            if shape_streams_responses(call.shape) and ref.code == SC.DEADLINE_EXCEEDED \
                    and b"first" not in ref.responses:
                # the plain handler yields its first message at once: a plain client
                # whose deadline came before it read it was stalled past the budget
                undecided.append(f"{where}: {r!r}, plain grpc: {ref!r}")
                continue

            def differs(what: str, got: Any, want: Any, where: str = where) -> None:
                if got != want:
                    problems.append(f"{where}: {what}: {got!r}, plain grpc: {want!r}")

            raced = behaviour == "cancel" and (
                (r.code, ref.code) != (SC.CANCELLED, SC.CANCELLED)
                or call.cancelled_at is None or call.cancelled_at > CLEAR_CANCEL)
            if not raced:  # a cancel that came late (a loaded machine) races the deadline
                differs("the client received", _outcome(r, method), _outcome(ref, ref_method))
                if not cfg.interrupt:  # interrupt mode stops the handler: its own difference
                    differs("the handler saw", mx.trace[key], mx.trace[ref_key])
                    differs("grpc logged", _grpc_records(recs, method), _grpc_records(recs, ref_method))

            # what the interceptors report: a deadline exactly when their budget
            # ended the call, and what the client got
            slow = [info for info in slows if info.method == full]
            observed = [x for x in observed_all if x[1].method == full]
            if behaviour == "cancel" and r.code == SC.CANCELLED and (
                    events or [x for x in ours if x[0] == "deadline"]
                    or slow and slow[-1].code == SC.DEADLINE_EXCEEDED):
                # the client's cancel, sent before the budget (or before the
                # client's own deadline, which is all a slow-call report can go
                # by), reached the server after it: a stalled machine; a row that
                # shows it twice fails
                undecided.append(f"{where}: {r!r}: the cancel reached the server after its deadline")
                continue
            if cfg.slow == "server" and r.code == SC.DEADLINE_EXCEEDED and slow \
                    and slow[-1].code == SC.CANCELLED:
                # the slow-call timer's look just before the client's deadline
                # ran only after grpc had ended the call (docs/grpc.rst, "What
                # the caller sees"): a stalled machine; a row that shows it twice
                # fails
                undecided.append(f"{where}: {r!r}: the slow call's look came after its end")
                continue
            by_budget = cfg.budget is not None and r.code == SC.DEADLINE_EXCEEDED
            if by_budget and cfg.budget == "client" and not events \
                    and not [x for x in ours if x[0] == "deadline"]:
                # grpc's own deadline, the same instant, ended the call before the
                # interceptor's timer ran: a stalled machine; a row that shows it
                # twice fails as undecided
                undecided.append(f"{where}: {r!r}: grpc's own deadline came before the interceptor's")
                continue  # (what the slow-call timer saw of that end is as stalled)
            if not raced:
                differs("deadline records", [x for x in ours if x[0] == "deadline"],
                        [("deadline", "WARNING", SC.DEADLINE_EXCEEDED.name)] if by_budget else [])
                differs("on_deadline sources", [ev.source for ev in events],
                        [cfg.budget] if by_budget else [])
            slow_recs = [x for x in ours if x[0] in ("slow", "slow_end")]
            if slow:  # a call that turned slow: both reports, the end with the client's status
                end_code = slow[-1].code if raced else r.code
                differs("slow reports", [(x.finished, x.code) for x in slow], [(False, None), (True, end_code)])
                differs("slow records", slow_recs,
                        [("slow", "WARNING", None),
                         ("slow_end", "INFO", None if end_code is None else end_code.name)])
            else:
                differs("slow records", slow_recs, [])
            if cfg.slow is None:
                differs("slow reports", slow, [])
            differs("other records", [x for x in ours if x[0] not in ("deadline", "slow", "slow_end")], [])
            # the observers get what the hooks get
            differs("metrics observers", sorted((kind, id(x)) for kind, x in observed),
                    sorted([("deadline", id(ev)) for ev in events] + [("slow", id(x)) for x in slow]))
        finally:
            if late_start and len(problems) > found:
                del problems[found:]
                undecided.append(f"{where}: {r!r}: the handler began with its deadline spent")
    return problems, undecided


#: a pause of the test process this long (a thread's 5 ms sleep that ended
#: this much late) is as long as the interceptors' early look before a
#: deadline (``_common._EARLY``): the order of a row's events may then be
#: the machine's, not the interceptors'
STALL = 0.02 * SCALE


@contextlib.contextmanager
def _stall_watch() -> Iterator[list[float]]:
    """The longest pause the process saw while the block ran (a thread that
    sleeps 5 ms at a time and notes how late it woke)."""
    worst = [0.0]
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            t = time.monotonic()
            time.sleep(0.005)
            worst[0] = max(worst[0], time.monotonic() - t - 0.005)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    try:
        yield worst
    finally:
        done.set()
        t.join()


@pytest.mark.parametrize("behaviour", BEHAVIOURS)
def test_status_matrix(matrix: Matrix, records: _Records, behaviour: str) -> None:
    """A row that shows a difference fails, unless the process was paused
    for longer than the interceptors' margins meanwhile: that row runs
    again, up to three times in all, and the last one fails on any
    difference.  A row left undecided (a stalled machine: a handler that
    began with its deadline spent and then ended otherwise than the plain
    one, say) runs again too, and fails if it is undecided four times (on a
    2-vCPU machine building an emulated root beside the tests, the rows
    whose late-starting handlers had ended as the plain ones were left
    undecided four times in a row)."""
    if behaviour not in matrix.behaviours:
        pytest.skip(f"{behaviour}: {', '.join(sorted(AIO_ONLY))} is the aio handler's own")
    undecided_runs = stalled_runs = 0
    for attempt in range(6):
        with _stall_watch() as worst:
            problems, undecided = run_row(matrix, records, behaviour, attempt)
        if problems and worst[0] >= STALL and stalled_runs < 2:
            stalled_runs += 1
            continue
        assert not problems, "\n".join(problems) + f"\n(the longest pause: {worst[0]:.3f} s)"
        if not undecided:
            return
        undecided_runs += 1
        if undecided_runs == 4:
            break
    pytest.fail("handlers that never ran (the machine stalled past the budget):\n"
                + "\n".join(undecided))



# -- a slow peer -------------------------------------------------------------------------------

#: a streamed request: this many messages, this far apart (the client's pace)
UPLOAD, UPLOAD_GAP = 5, 0.04 * SCALE
#: a streamed response to a slow reader: messages the size of a flow-control
#: window, read this far apart
DOWNLOAD, CHUNK, READ_GAP = 8, 64 * 1024, 0.03 * SCALE
#: the threshold: under the calls' time (the peer's), far over the handlers' own
PEER_TH = 0.08 * SCALE


def _peer_handlers(backend: Backend, busy: float) -> dict[str, Any]:
    """Upload (stream-unary, stream-stream) and download (unary-stream)
    handlers whose own work per message takes ``busy`` seconds."""
    if isinstance(backend, SyncBackend):
        def upload(it: Any, ctx: Any) -> bytes:
            n = 0
            for _ in it:
                time.sleep(busy)
                n += 1
            return b"%d" % n

        def upload_stream(it: Any, ctx: Any) -> Iterator[bytes]:
            for r in it:
                time.sleep(busy)
                yield r

        def download(req: bytes, ctx: Any) -> Iterator[bytes]:
            for _ in range(DOWNLOAD):
                time.sleep(busy)
                yield b"x" * CHUNK
    else:
        async def upload(it: Any, ctx: Any) -> bytes:  # type: ignore[misc]
            n = 0
            async for _ in it:
                await asyncio.sleep(busy)
                n += 1
            return b"%d" % n

        async def upload_stream(it: Any, ctx: Any) -> Any:  # type: ignore[misc]
            async for r in it:
                await asyncio.sleep(busy)
                yield r

        async def download(req: bytes, ctx: Any) -> Any:  # type: ignore[misc]
            for _ in range(DOWNLOAD):
                await asyncio.sleep(busy)
                yield b"x" * CHUNK

    return {"Upload": grpc.stream_unary_rpc_method_handler(upload),
            "UploadStream": grpc.stream_stream_rpc_method_handler(upload_stream),
            "Download": grpc.unary_stream_rpc_method_handler(download)}


@pytest.mark.parametrize("busy", [0.0, PEER_TH / 2], ids=["waits-for-the-peer", "busy-itself"])
def test_the_peers_pace_is_not_the_handlers_time(backend: Backend, busy: float) -> None:
    # A slow client's upload and a slow reader's download take longer than
    # the threshold; the handler's own time does not, unless it is busy
    # itself: only then is the call slow.  Each call as plain grpc gets it.
    hooks = Hooks()
    m = backend.mod
    configs = {"plain": (), "slow": (m.SlowCallInterceptor(PEER_TH, on_slow=hooks.on_slow),),
               "slow+deadline": (m.SlowCallInterceptor(PEER_TH, on_slow=hooks.on_slow),
                                 m.ServerDeadlineInterceptor(5.0))}
    with contextlib.ExitStack() as stack:
        channels = {}
        for name, ics in configs.items():
            addr = stack.enter_context(backend.serve(_peer_handlers(backend, busy), ics))
            channels[name] = stack.enter_context(backend.channel(addr))
        calls = [(name, Call(ch, shape, method, timeout=LONG, **kw))
                 for name, ch in channels.items()
                 for shape, method, kw in (
                     ("stream_unary", "Upload", {"requests": UPLOAD, "spacing": UPLOAD_GAP}),
                     ("stream_stream", "UploadStream", {"requests": UPLOAD, "spacing": UPLOAD_GAP}),
                     ("unary_stream", "Download", {"read_delay": READ_GAP}))]
        results = backend.invoke_many([c for _, c in calls])
        assert flush_reports(5.0)
    plain = {c.method: r for (name, c), r in zip(calls, results) if name == "plain"}
    for (name, c), r in zip(calls, results):
        want = plain[c.method]
        assert (r.code, r.responses) == (want.code, want.responses) == (SC.OK, want.responses), (name, c.method)
        assert r.elapsed > PEER_TH, (name, c.method, r)  # the peer's pace: longer than the threshold
    slow_methods = sorted({info.method for info in hooks.slow})
    if busy:  # the handler's own time passed the threshold: each such call reported, twice
        assert len(hooks.slow) == 12 and {info.code for info in hooks.slow if info.finished} == {SC.OK}
        assert all(info.peer_wait >= 0.0 for info in hooks.slow)
    else:
        assert slow_methods == [], hooks.slow


# -- the server's stop ----------------------------------------------------------------------------


def _servers_stop_row(backend_name: str) -> tuple[list[str], float, float]:
    """One run of the servers' stop: its differences from plain grpc, how
    long after the calls began the last server had stopped, and how long
    the last call the stop ended had run on its server."""
    backend: Backend = SyncBackend() if backend_name == "sync" else AioBackend()
    hooks = Hooks()
    m = backend.mod
    configs = [c for c in CONFIGS if c.client(m, hooks) == () and not (c.sync_only and backend_name != "sync")]
    trace: dict[str, list[Any]] = {}
    servers: list[Any] = []
    stopped: list[float] = []

    def handlers(name: str) -> dict[str, Any]:
        return {"Stop": backend.handler("unary_unary", _work("cancel", name, trace))}

    def stop_all() -> None:
        for s in servers:
            s.__exit__(None, None, None)
        stopped.append(time.monotonic())

    try:
        with contextlib.ExitStack() as stack:
            calls = []
            for cfg in [PLAIN, *configs]:
                serving = backend.serve(handlers(cfg.name), cfg.server(m, hooks))
                addr = serving.__enter__()
                servers.append(serving)
                ch = stack.enter_context(backend.channel(addr))
                calls.append((cfg, Call(ch, "unary_unary", "Stop", payload=b"0",
                                        timeout=B if cfg is PLAIN else cfg.timeout)))
            stopper = threading.Timer(B / 2, stop_all)
            began = time.monotonic()
            stopper.start()
            results = backend.invoke_many([c for _, c in calls])
            stopper.join(10.0)
            assert wait_for(lambda: all(_ended(trace, f"{cfg.name}#0") for cfg, _ in calls), LIMIT + 1.0)
            assert flush_reports(5.0)
    finally:
        if isinstance(backend, AioBackend):
            backend.close()
    problems = []
    ref = results[0]
    if ref.code != SC.UNAVAILABLE:  # grpc's "Cancelling all calls"
        problems.append(f"plain grpc got {ref}")
    for (cfg, _), r in zip(calls, results):
        if (r.code, r.details, r.responses) != (ref.code, ref.details, ref.responses):
            problems.append(f"{cfg.name}: {r}, plain grpc {ref}")
    if hooks.deadlines:
        problems.append(f"deadlines reported: {hooks.deadlines}")
    # the server cannot tell its stop from the client's cancel: both cancel
    # the call, and a slow call's end says CANCELLED (docs/grpc.rst)
    ends = [info.code for info in hooks.slow if info.finished]
    if not ends or set(ends) != {SC.CANCELLED}:
        problems.append(f"slow calls' ends: {hooks.slow}")
    last_end = max((info.elapsed for info in hooks.slow if info.finished), default=0.0)
    return problems, (stopped[0] - began if stopped else math.inf), last_end


@pytest.mark.parametrize("backend_name", ["sync", "aio"])
def test_a_call_the_servers_stop_ends_is_no_deadline(backend_name: str) -> None:
    """server.stop() ends calls whose handlers go on past their budget: the
    client gets what plain grpc gives it, and nothing is reported as a
    deadline.  The servers stop at half the calls' budget.  A run is void
    and runs again, up to three times, on a loaded machine: its last server
    had not stopped halfway from then to the shortest deadline (the stops
    are sequential), a call the stop ended had still run on its server past
    the shortest deadline (grpc's cancel reached it late: it did run out of
    its budget), or the process paused past the interceptors' margin.  The
    last run fails on any difference."""
    shortest = min([B, *(c.timeout for c in CONFIGS if c.timeout is not None)])
    late = (B / 2 + shortest) / 2
    for attempt in range(3):
        with _stall_watch() as worst:
            problems, took, last_end = _servers_stop_row(backend_name)
        loaded = took >= late or last_end >= shortest or worst[0] >= STALL
        if problems and loaded and attempt < 2:
            continue
        assert not problems, "\n".join(problems) + (
            f"\n(the stop ended {took:.3f} s in, the last call it ended {last_end:.3f} s in, "
            f"the longest pause {worst[0]:.3f} s)")
        return


def test_a_client_call_that_grpc_cancels_unasked_is_a_result_of_its_row(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A grpc.aio call that ends in ``asyncio.CancelledError`` with no cancel
    of the test's is what that call got, beside the others of its row (which
    the row then weighs, stall or not), not a crash of the whole row."""
    async def slow(request: bytes, context: Any) -> bytes:
        await asyncio.sleep(5)
        return b"late"

    # (the canceller cancels as always but notes nothing: a cancel the test
    # did not make, as far as the row can tell)
    monkeypatch.setattr(_grpc_harness, "_canceller", lambda c, call, t0: call.cancel)
    backend = AioBackend()
    try:
        with backend.serve({"Slow": grpc.unary_unary_rpc_method_handler(slow)}) as address, \
                backend.channel(address) as channel:
            results = backend.invoke_many([
                Call(channel, "unary_unary", "Slow", cancel_at=0.05),
                Call(channel, "unary_unary", "Slow", timeout=0.1 * SCALE)])
    finally:
        backend.close()
    assert [r.code for r in results] == [LOCALLY_CANCELLED, SC.DEADLINE_EXCEEDED], results
