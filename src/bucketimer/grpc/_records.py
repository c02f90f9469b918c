"""What the interceptors log on the ``bucketimer.grpc`` logger: one
function per kind of record, every record with the same ``extra`` fields
(:data:`FIELDS`; None where one does not apply), so that a formatter or a
structured-logging handler can name any of them (docs/grpc.rst, "Logging").

Every message is one line.  The handler's stack of a slow call, when
asked for, is the record's ``stack_info`` (what ``logging`` shows after
the message, and JSON formatters put in a field of its own), from the
handler's first frame on (:func:`handler_stack`).
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable
from types import FrameType
from typing import TYPE_CHECKING, Any

import grpc

if TYPE_CHECKING:
    from ._common import DeadlineEvent, SlowCall

logger = logging.getLogger("bucketimer.grpc")

#: the ``extra`` fields of every record, and what each holds
FIELDS = {
    "grpc_event": 'what happened: "deadline", "slow", "slow_end", "hook_error" or "abort_error"',
    "grpc_side": '"client" or "server"',
    "grpc_method": "the full method name, /package.Service/Method",
    "grpc_code": 'the name of the call\'s status code ("OK", "DEADLINE_EXCEEDED"...), when known',
    "grpc_elapsed": "seconds since the call (the handler, on the server) started",
    "grpc_budget": "the call's budget in seconds (ServerDeadlineInterceptor)",
    "grpc_source": 'which limit was the budget: "client" (its deadline) or "max_time"',
    "grpc_threshold": "the slow-call threshold in seconds (SlowCallInterceptor)",
    "grpc_finished": "slow-call records: False at the threshold, True at the call's end",
}

#: what a slow call's ``stack_info`` starts with, as ``logging``'s own
STACK_HEADER = "Stack (most recent call last):\n"


def check_level(level: Any) -> int:
    """``level`` as ``logging`` takes it (an int, or a level name such as
    ``"WARNING"``), as an int; a clear error naming the argument else."""
    if isinstance(level, bool) or not isinstance(level, (int, str)):
        raise TypeError(f"level must be an int or a logging level name, not {type(level).__name__}")
    if isinstance(level, int):
        return level
    number = logging.getLevelNamesMapping().get(level)
    if number is None:
        raise ValueError(f"level must be an int or a logging level name such as 'WARNING', got {level!r}")
    return number


def _extra(event: str, side: str | None, method: str | None, *, code: grpc.StatusCode | None = None,
           elapsed: float | None = None, budget: float | None = None, source: str | None = None,
           threshold: float | None = None, finished: bool | None = None) -> dict[str, Any]:
    return {"grpc_event": event, "grpc_side": side, "grpc_method": method,
            "grpc_code": None if code is None else code.name,
            "grpc_elapsed": elapsed, "grpc_budget": budget, "grpc_source": source,
            "grpc_threshold": threshold, "grpc_finished": finished}


def _deadline_extra(event: str, ev: DeadlineEvent) -> dict[str, Any]:
    return _extra(event, "server", ev.method, code=grpc.StatusCode.DEADLINE_EXCEEDED,
                  elapsed=ev.elapsed, budget=ev.budget, source=ev.source)


def _slow_extra(event: str, info: SlowCall, threshold: float | None) -> dict[str, Any]:
    return _extra(event, info.side, info.method, code=info.code, elapsed=info.elapsed,
                  threshold=threshold, finished=info.finished)


def log_deadline(ev: DeadlineEvent) -> None:
    """A server call ran out of its budget (it ends with DEADLINE_EXCEEDED):
    a WARNING, which a default-configured service shows."""
    if not logger.isEnabledFor(logging.WARNING):
        return
    how = " (handler interrupted)" if ev.interrupted else " (handler cancelled)" if ev.cancelled else ""
    logger.warning("gRPC server call %s ran out of its %.3f s budget (%s) after %.3f s%s",
                   ev.method, ev.budget, ev.source, ev.elapsed, how,
                   extra=_deadline_extra("deadline", ev))


def end_level(level: int) -> int:
    """The level of a slow call's end: INFO (``level`` if lower), so that
    one slow call is one record at ``level``."""
    return min(level, logging.INFO)


def log_slow(level: int, info: SlowCall, threshold: float) -> None:
    """A call passed its slow-call threshold (at ``level``), or a slow call
    ended (at :func:`end_level` of it)."""
    if info.finished:
        level = end_level(level)
    if not logger.isEnabledFor(level):
        return
    if info.finished:
        code = info.code.name if info.code is not None else "unknown status"
        logger.log(level, "slow gRPC %s call %s finished after %.3f s (%s)",
                   info.side, info.method, info.elapsed, code,
                   extra=_slow_extra("slow_end", info, threshold))
        return
    msg, args = "slow gRPC %s call %s still running after %.3f s", (info.side, info.method, info.elapsed)
    extra = _slow_extra("slow", info, threshold)
    if not info.stack:
        logger.log(level, msg, *args, extra=extra)
        return
    # logger.log() would take stack_info from this thread: the record is
    # made here, with the handler's
    fn, lno, func, _ = logger.findCaller()
    logger.handle(logger.makeRecord(logger.name, level, fn, lno, msg, args, None, func, extra,
                                    STACK_HEADER + info.stack.rstrip("\n")))


def handler_stack(top: FrameType, limit: int | None, *,
                  wrapper: Callable[[FrameType], bool] | None = None,
                  handler: Callable[[FrameType], bool] | None = None) -> str:
    """The stack of a handler's thread, whose innermost frame is ``top``,
    formatted as ``traceback.format_stack`` does, from the handler's first
    frame on: the frames the interceptor's wrapper called (the outermost
    frame ``wrapper`` recognises, left out), or from the outermost frame
    ``handler`` recognises (where the wrapper has no frame of its own).
    What grpc's pool runs the wrapper in (``threading``,
    ``concurrent.futures``, ``grpc._server``) is left out; the whole stack
    if no frame is recognised.  At most ``limit`` frames, the innermost."""
    frames: list[FrameType] = []
    keep = None
    f: FrameType | None = top
    while f is not None:
        if wrapper is not None and wrapper(f):
            keep = len(frames)
        frames.append(f)
        if handler is not None and handler(f):
            keep = len(frames)
        f = f.f_back
    if keep is not None:
        del frames[keep:]
    stack = traceback.StackSummary.extract(((fr, fr.f_lineno) for fr in frames), limit=limit)
    stack.reverse()
    return "".join(stack.format())


def log_hook_error(what: str, hook: Any, arg: Any) -> None:
    """``hook`` raised on ``arg`` (``what``: ``"on_slow"``, given a
    SlowCall, or ``"on_deadline"``, given a DeadlineEvent): an ERROR with
    the traceback, in the except block that caught it."""
    if what == "on_slow":
        extra = _slow_extra("hook_error", arg, None)
    else:
        extra = _deadline_extra("hook_error", arg)
    logger.exception("bucketimer.grpc: %s hook %r raised", what, hook, extra=extra)


def log_abort_error(method: str) -> None:
    """Ending an expired sync server call failed (it ended meanwhile): a
    DEBUG record with the traceback, in the except block."""
    logger.debug("bucketimer.grpc: cancelling an expired call failed", exc_info=True,
                 extra=_extra("abort_error", "server", method, code=grpc.StatusCode.DEADLINE_EXCEEDED))
