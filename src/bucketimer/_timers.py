"""TimerThread: the Python side of the native core.

The hot path (``call_later``, ``call_at``, ``Handle.cancel``, ``Port.drain``,
the poll's look at what is due) is C, in ``ext/``, and so is the record of
where timers go (each loop's port, the dispatcher's) and the process-wide
default TimerThread.  This module does the rest, once per loop or once per
TimerThread: connecting a new port to its consumer (the loop's selector
wrapped in a ``PollStamp``, the port's wake through the loop's self-pipe or
an eventfd and ``loop.add_reader``; the dispatcher thread for timers
scheduled outside any loop) -- which ``ext/attach.c`` does in C for a
TimerThread's later loops -- detaching it when the loop closes (as asyncio's
loop closes its selector, or by a hook on ``loop.close``),
closing (or being collected), and what happens at fork() and at exit.
"""

from __future__ import annotations

import asyncio
import atexit
import contextvars
import functools
import gc
import math
import os
import select
import selectors
import socket
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVarTuple, Unpack

from . import _core, _pending
from ._live import Live
from ._reporting import SLOW_CALLBACK_DURATION, logger, report_dropped_at_exit
from ._reporting import check_slow_callback_duration as _check_slow
from ._reporting import loop_reporter as _make_loop_reporter
from ._reporting import report_slow_callback as _report_slow
from ._reporting import report_to_log as _report_to_log
from ._reporting import report_to_loop as _report_to_loop
from ._stats import Stats

_Ts = TypeVarTuple("_Ts")

__all__ = ["Handle", "Stats", "TimerThread", "call_at", "call_later", "default_timer_thread"]

Handle = _core.Handle


class TimerThread(_core.TimerThread):
    """One native timer thread and the timers it keeps.

    ``TimerThread(buckets=13, *, drain_threshold=4096,
    slow_callback_duration=0.1)`` starts the thread (the defaults are
    ``_core.DEFAULT_BUCKETS`` and ``_core.DEFAULT_DRAIN_THRESHOLD``).
    Schedule from any thread with :meth:`call_later` / :meth:`call_at`; a
    timer scheduled inside a running event loop (or with ``loop=``) runs in
    that loop's thread, any other on this TimerThread's one dispatcher
    thread, where a callback that runs ``slow_callback_duration`` seconds or
    longer is logged.  :meth:`close` stops the thread; pending timers are
    dropped, never called.
    """

    def __init__(self, buckets: int = _core.DEFAULT_BUCKETS, *,
                 drain_threshold: int = _core.DEFAULT_DRAIN_THRESHOLD,
                 slow_callback_duration: float | None = SLOW_CALLBACK_DURATION) -> None:
        slow = _check_slow(slow_callback_duration)
        super().__init__(buckets, drain_threshold=drain_threshold)
        self._slow_after = slow
        self._lock = threading.RLock()
        self._orphan_port: _core.Port | None = None
        self._thread: threading.Thread | None = None
        self._wake_r, self._wake_w = -1, -1
        self._closing = False
        # the dispatcher audits the loops (set under _lock, by the first
        # loop's _attach; cleared by the dispatcher once there are none)
        self._audits = False
        self._pid = os.getpid()
        _live.add(self)

    @property
    def slow_callback_duration(self) -> float | None:
        """Seconds a no-loop callback may hold the dispatcher thread before
        it is logged (a WARNING on the ``bucketimer`` logger once it
        returns); None logs none.  Settable at any time."""
        return self._slow_after

    @slow_callback_duration.setter
    def slow_callback_duration(self, value: float | None) -> None:
        self._slow_after = _check_slow(value)
        with self._lock:
            if self._dispatcher is not None:
                _time_callbacks(self._dispatcher, self._slow_after)

    # -- where timers go ---------------------------------------------------

    def _attach(self, loop: Any, port: _core.Port) -> None:
        """Connects a port the native base has just opened and recorded for
        ``loop`` (None: the dispatcher's) to its consumer.  Called once per
        port, by the first timer that goes there, unless ``ext/attach.c``
        connected it (the same changes, for a loop armed from inside once
        ``_fast_attach`` is set); raising refuses the port, which the base
        then forgets and releases."""
        with self._lock:
            if self._closing:
                raise RuntimeError("TimerThread is closed")
            if loop is None:
                port.on_error = _report_to_log
                _time_callbacks(port, self._slow_after)
                port._wake_by()
                self._start_dispatcher(port)
                return
            in_loop = asyncio.events._get_running_loop() is loop or loop is _core._made_loop()
            port.on_error = _make_loop_reporter(loop)
            self._start_audits()
            closed = self._watch_close(loop, in_loop)
        # Inside the loop, its poll is ours to watch; then, if it is
        # asyncio's own, the port wakes it through its self-pipe, with no fd
        # of its own to register (docs/design.rst, "Waking a stock loop").
        stamp = _poll_stamp(loop) if in_loop else None
        sock, peer = _self_pipe(loop) if stamp is not None else (-1, -1)
        if not closed:
            if stamp is not None and sock >= 0 and peer >= 0:
                stamp._watch(port)  # before the first wake can come
            else:
                sock = -1
            try:
                port._wake_by(sock, peer)
            except RuntimeError:  # the loop's close detached it meanwhile
                closed = True
        if closed:
            raise RuntimeError("cannot schedule on a closed event loop")
        if in_loop:
            _connect(loop, port, stamp)
        else:
            # Not from inside the loop: its selector is its own thread's
            # (asyncio is not thread-safe, even for a loop that is not
            # running now and may start or close meanwhile), so the loop adds
            # the reader itself, first thing when it runs.  Raises
            # RuntimeError if the loop is closed.
            loop.call_soon_threadsafe(_add_reader_if_open, loop, port)
        # A close from another thread that began before the hook was
        # installed runs without it: refuse.
        if loop.is_closed():
            raise RuntimeError("cannot schedule on a closed event loop")

    def _start_audits(self) -> None:
        """The dispatcher releases what a closed loop leaves behind, and
        looks at the loops while there are any: woken once, when the first
        comes (a wake per loop would hand it the GIL each time).  From then
        on, the ports of loops armed from inside may be connected in C
        (ext/attach.c), which does what _attach does.  Under _lock."""
        self._port(None)
        if not self._audits:
            self._audits = True
            self._poke_dispatcher()
        self._fast_attach = True

    def _watch_close(self, loop: Any, in_loop: bool) -> bool:
        """Detach the loop's port when the loop closes.

        Returns True if the loop is closed already.  A hook on the loop's
        ``close`` detaches it first, unless the loop's own close does:
        bucketimer's loops call loop_closing() from close(), and asyncio's
        selector loop closes its selector last, which, wrapped by the
        PollStamp that watches the port from inside the loop, detaches the
        ports it watches (``PollStamp.close``).  A close that another thread
        began before the hook was installed does not run it; the
        dispatcher's audit (_audit_loops) finds such loops."""
        cls: Any = type(loop)
        if getattr(cls, "_bt_closes_ports", False) or (
                in_loop and _closes_selector(cls) and _stampable(loop)):
            return bool(loop.is_closed())
        ref = weakref.ref(self)
        orig_close = loop.close
        mine = object()  # marks this wrapper, which must not name itself (a cycle)

        def close() -> None:
            tt = ref()
            if tt is not None:
                tt._loop_closing(loop)
            orig_close()
            # This closure holds the loop that holds it: once the loop is
            # closed, nothing is left to watch, and the cycle would leave the
            # loop to the cycle collector.
            if getattr(getattr(loop, "__dict__", {}).get("close"), "_bt_mark", None) is mine:
                del loop.close

        close._bt_mark = mine  # type: ignore[attr-defined]
        try:
            loop.close = close
        except (AttributeError, TypeError):  # a loop class without __dict__
            pass
        return bool(loop.is_closed())

    def _loop_closing(self, loop: Any) -> None:
        """``loop.close()`` is about to run: detach its port.  Not in a child
        of fork(), where the port's eventfd and the loop's epoll set are
        shared with the parent: detaching would unregister the parent's
        reader and eat its pending signal.  Not from a running loop, which
        refuses to close (its close() raises): it keeps its port and its
        timers."""
        if self._pid == os.getpid() and not loop.is_running():
            self._detach_loop(loop)

    def _detach_loop(self, loop: Any) -> None:
        port = self._forget(loop)
        if port is None:
            return
        fd = port.fileno()
        if fd >= 0 and not port.wakes_socket and not loop.is_closed():
            try:
                loop.remove_reader(fd)
            except Exception:  # a loop half torn down: nothing to unregister
                pass
        port.detach()
        # Timers not yet due would otherwise keep the loop (through their
        # callbacks and this port) alive until their deadlines.
        port.cancel_pending()

    def _audit_loops(self) -> None:
        """Detach the ports of loops that closed without our close hook
        running: a close that raced a loop's first timer from another thread,
        or a loop whose close cannot be wrapped.  Their queued timers are
        released unrun, later ones go to the orphan port, their eventfds are
        closed.  Run by the dispatcher thread about once a second while this
        TimerThread serves loops (docs/guarantees.rst, "Never deliver to a
        closed loop")."""
        for loop in [loop for loop in self._ports if loop.is_closed()]:
            self._detach_loop(loop)

    # -- the dispatcher thread ----------------------------------------------

    def _poke_dispatcher(self) -> None:
        """Wakes the dispatcher.  Never blocks (a loop's thread calls it, with
        _lock held): the pipe is non-blocking, and a full pipe already holds
        a wake, which is all the dispatcher needs, as asyncio's self-pipe."""
        if self._wake_w >= 0:
            try:
                os.write(self._wake_w, b"p")
            except (BlockingIOError, BrokenPipeError):  # full, or the dispatcher is gone
                pass

    def _start_dispatcher(self, port: _core.Port) -> None:
        """Starts the dispatcher thread, which drains PORT (the dispatcher's)
        and the orphan port, and audits the loops.  Under _lock."""
        if self._thread is not None:
            return
        self._orphan_port = self._orphans()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        # Its fds and a weak reference: the thread holds nothing that would
        # keep this TimerThread alive (_dispatch).
        t = threading.Thread(
            target=_dispatch,
            args=(port.fileno(), self._orphan_port.fileno(), self._wake_r, weakref.ref(self)),
            name="bucketimer-dispatcher",
            daemon=True,
        )
        self._thread = t
        t.start()

    # -- lifecycle --------------------------------------------------------------

    def close(self) -> None:
        """Stop and join the timer thread; drop pending timers without calling them.

        After ``close()`` returns no callback of this TimerThread starts, and
        scheduling raises ``RuntimeError``.  A callback already running
        finishes.  Idempotent.

        Raises ``RuntimeError`` if the core's thread cannot be joined: the
        TimerThread is then stopped (no callback starts, scheduling raises)
        but nothing else was undone -- its pending timers, loops and
        dispatcher are kept -- and ``close()`` again tries to finish.
        """
        self._close(join_timeout=1.0)

    def _close(self, join_timeout: float) -> None:
        if os.getpid() != self._pid:
            # A copy inherited through fork(): another thread of the parent
            # may have held _lock at the fork, and nobody would release it.
            self._closing = True
            self._fast_attach = False
            return
        with self._lock:
            if self._closing:
                return
            self._closing = True
            self._fast_attach = False
        try:
            self._close_core()
        except RuntimeError:  # not joined, nothing dropped: a later close() retries
            with self._lock:
                self._closing = False
            raise
        for loop in list(self._ports):
            if loop.is_closed() or asyncio.events._get_running_loop() is loop or not loop.is_running():
                self._detach_loop(loop)
            else:
                try:
                    loop.call_soon_threadsafe(self._detach_loop, loop)
                except RuntimeError:  # closed meanwhile
                    self._detach_loop(loop)
        t = self._thread
        if t is not None:
            self._poke_dispatcher()  # it sees _closing and exits
            if t is not threading.current_thread():
                t.join(timeout=join_timeout)
            os.close(self._wake_w)  # the dispatcher closes _wake_r as it exits
            self._wake_w = -1
        dispatcher = self._dispatcher
        if dispatcher is not None:
            dispatcher.detach()
        if self._orphan_port is not None:
            self._orphan_port.drain()

    def __enter__(self) -> TimerThread:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self, _warn: Any = warnings.warn) -> None:
        # Collected without close(), as asyncio's loop is: warned, then
        # closed (its threads stopped, its fds released, its timers dropped).
        if getattr(self, "_closing", True):
            return
        _warn(f"unclosed TimerThread {self!r}", ResourceWarning, source=self)
        self._close(join_timeout=0.0)

    pending = _pending.pending

    def __repr__(self) -> str:
        state = "closed" if self.closed else "running"
        return f"<bucketimer.TimerThread {state} ports={len(self._ports)}>"


def _time_callbacks(port: _core.Port, slow_after: float | None) -> None:
    """The dispatcher's port times each callback against ``slow_after``
    (None: times none, at no cost)."""
    port.slow_after = math.inf if slow_after is None else slow_after
    port.on_slow = None if slow_after is None else _report_slow


def _add_reader_if_open(loop: Any, port: _core.Port) -> None:
    if port.fileno() >= 0 and not loop.is_closed():
        _connect(loop, port, _poll_stamp(loop))


def open_port_of(loop: Any, tt: TimerThread) -> None:
    """Called by bucketimer's own loops as they are made: their port is
    opened and connected then, as the running loop's would be (no other
    thread can have the loop yet), so that their first timer costs what any
    other does.  An error leaves it to the first timer, which raises it."""
    try:
        tt._port_of_made(loop)
    except Exception:
        pass


def _connect(loop: Any, port: _core.Port, stamp: PollStamp | None) -> None:
    """In the loop's thread: its poll (``stamp``, the loop's ``_poll_stamp``)
    watches the port, and unless the port wakes the loop's self-pipe, the
    port's drain becomes the loop's reader of its eventfd."""
    if not port.wakes_socket:
        # (no key of a closed eventfd can be left for this fd number: every
        # path that detaches the port of a live loop removes its reader first)
        loop.add_reader(port.fileno(), port.drain)
    if stamp is not None:
        stamp._watch(port)


class PollStamp(_core.PollStamp, selectors.BaseSelector):
    """A loop's selector, and what its poll tells the core: when its last
    ``select()`` returned (``polled_ns``, the core's clock; before the
    first, when it began watching a port), which bounds the loop's port
    drain with the core's schedule order then, and, right after each poll,
    the timers of the loop's ports due by then, posted (the timer thread's
    pass or one run here) and their reader queued with this iteration's I/O
    callbacks: asyncio runs a timer in the first iteration whose poll came
    after its deadline (docs/design.rst, "Order on the loop").  ``select``
    is ``_core.PollStamp``'s, in C: it runs every iteration."""

    def register(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self.selector.register(fileobj, events, data)

    def unregister(self, fileobj: Any) -> selectors.SelectorKey:
        return self.selector.unregister(fileobj)

    def modify(self, fileobj: Any, events: int, data: Any = None) -> selectors.SelectorKey:
        return self.selector.modify(fileobj, events, data)

    def get_key(self, fileobj: Any) -> selectors.SelectorKey:
        return self.selector.get_key(fileobj)

    def get_map(self) -> Mapping[Any, selectors.SelectorKey]:
        return self.selector.get_map()

    def close(self) -> None:
        try:
            self._close_ports()
        finally:
            self.selector.close()

    def _wake_event(self, port: _core.Port) -> tuple[selectors.SelectorKey, int]:
        """What a poll's events get to queue ``port.drain`` when the port
        wakes the loop through its self-pipe: the key asyncio's
        ``add_reader`` would have made, read as the loop reads its own."""
        handle = asyncio.Handle(port.drain, (), port.loop, None)  # type: ignore[arg-type]
        key = selectors.SelectorKey(port, port.fileno(), selectors.EVENT_READ, (handle, None))
        return key, selectors.EVENT_READ


def _public_api_forced(name: str) -> bool:
    """``BUCKETIMER_PUBLIC_API`` as ``ext/compat.c`` reads it: "1" turns every
    read of private state off, a comma-separated list of names just those."""
    value = os.environ.get("BUCKETIMER_PUBLIC_API", "")
    if value in ("", "0"):
        return False
    return "_" not in value or name in value.split(",")


# Wrapping a stock loop's selector reads and writes asyncio's private
# ``loop._selector``: only where the loop is asyncio's selector loop and the
# attribute is a selector, and never with BUCKETIMER_PUBLIC_API; without it
# the loop's timers reach it through its eventfd alone, up to a timer
# thread's pass later (docs/design.rst, "Order on the loop").
_WRAP_SELECTOR = not _public_api_forced("loop_selector")


# Waking a stock loop through its self-pipe reads asyncio's private
# ``loop._csock`` and counts on the order in which its ``_process_events``
# queues a poll's events; only where the loop's class keeps asyncio's own
# methods for both (_self_pipe_wakes), and never with BUCKETIMER_PUBLIC_API:
# then the port has an eventfd and a reader of its own.
_WAKE_SELF_PIPE = not _public_api_forced("loop_csock")


@functools.lru_cache(maxsize=64)
def _self_pipe_wakes(cls: Any) -> bool:
    """Whether a loop of class ``cls`` is asyncio's selector loop in what
    a self-pipe wake counts on: a zero byte on ``_csock`` wakes its poll and
    is discarded by its reader (``_read_from_self``, ``_process_self_data``),
    and a poll's events are queued in their order (``_process_events``)."""
    base = asyncio.selector_events.BaseSelectorEventLoop
    if not (isinstance(cls, type) and issubclass(cls, base)):
        return False
    own: Any = base  # (asyncio's private methods, which its stubs leave out)
    own_self_data = {own._process_self_data}
    unix = getattr(asyncio, "unix_events", None)
    if unix is not None:
        own_self_data.add(unix._UnixSelectorEventLoop._process_self_data)
    mine: Any = cls
    return bool(mine._process_events is own._process_events
                and mine._read_from_self is own._read_from_self
                and mine._add_callback is own._add_callback
                and mine._process_self_data in own_self_data)


@functools.lru_cache(maxsize=64)
def _closes_selector(cls: Any) -> bool:
    """Whether ``cls.close`` is asyncio's own selector loop's: it refuses to
    close a running loop before it changes anything, and closes the loop's
    selector last, once the loop refuses callbacks."""
    own: set[Any] = {asyncio.selector_events.BaseSelectorEventLoop.close}
    unix = getattr(asyncio, "unix_events", None)
    if unix is not None:
        own.add(unix._UnixSelectorEventLoop.close)
    return getattr(cls, "close", None) in own


def _attach_class(cls: Any) -> bool:
    """Whether a port of a loop of class ``cls`` may be connected in C
    (``ext/attach.c``): a loop whose self-pipe may wake it, whose selector may
    be wrapped, whose attributes are read and set as any object's (or as
    bucketimer's loop sets them, ``ext/loop_attrs.c``), whose ``is_closed``
    is asyncio's, so that it is open while it runs (the C path does not ask
    a running loop whether it is closed), and whose close detaches its
    ports with no hook of ours: asyncio's own (closing the selector, the
    PollStamp, last), or bucketimer's loop's (``_bt_closes_ports``)."""
    return bool(_WAKE_SELF_PIPE and _WRAP_SELECTOR and _self_pipe_wakes(cls)
                and cls.__getattribute__ is object.__getattribute__
                and cls.__setattr__ in (object.__setattr__, _core._loop_setattr)
                and cls.__dictoffset__ != 0
                and cls.is_closed is asyncio.BaseEventLoop.is_closed
                and (getattr(cls, "_bt_closes_ports", False) or _closes_selector(cls)))


def _self_pipe(loop: Any) -> tuple[int, int]:
    """The fds of ``loop``'s self-pipe, the end asyncio writes its wakes to
    and the end its reader reads, if the loop may be woken through it; else
    (-1, -1)."""
    cls: Any = type(loop)
    if not (_WAKE_SELF_PIPE and _self_pipe_wakes(cls)):
        return -1, -1
    csock, ssock = getattr(loop, "_csock", None), getattr(loop, "_ssock", None)
    if type(csock) is not socket.socket or type(ssock) is not socket.socket:
        return -1, -1
    return csock.fileno(), ssock.fileno()


def _to_wrap(loop: Any) -> selectors.BaseSelector | None:
    """The selector of a stock selector loop that a PollStamp may wrap."""
    selector = getattr(loop, "_selector", None)
    if (_WRAP_SELECTOR and isinstance(loop, asyncio.selector_events.BaseSelectorEventLoop)
            and isinstance(selector, selectors.BaseSelector)
            and not isinstance(selector, PollStamp)):
        return selector
    return None


def _stampable(loop: Any) -> bool:
    """Whether ``loop`` polls through a PollStamp, or will once
    ``_poll_stamp`` wraps its selector."""
    return isinstance(getattr(loop, "_selector", None), PollStamp) or _to_wrap(loop) is not None


def _poll_stamp(loop: Any) -> PollStamp | None:
    """The PollStamp ``loop`` polls through: bucketimer's loop's own, or a
    stock selector loop's selector, wrapped on first use; None for a loop
    with no selector to wrap (uvloop)."""
    selector = getattr(loop, "_selector", None)
    if isinstance(selector, PollStamp):
        return selector
    selector = _to_wrap(loop)
    if selector is None:
        return None
    stamp = PollStamp(selector)
    loop._selector = stamp
    return stamp


# How often the dispatcher looks for loops that closed behind our back, and
# how long it goes on once none is left: a process that runs asyncio.run()
# per request, per test or per notebook cell would otherwise see the audits
# stop between two runs, and each run's first timer connect its loop in
# Python and wake the dispatcher again (docs/design.rst, "Who connects the
# port").
_AUDIT_PERIOD = 1.0
_AUDIT_IDLE = 60.0


def _dispatch(port_fd: int, orphans_fd: int, wake_r: int, tt_ref: Any) -> None:
    """The dispatcher thread: runs timers that belong to no loop, releases
    (without running) timers whose loop closed before they came due, and
    while its TimerThread serves loops, audits them once a second.  A byte
    on the wake pipe means "look again": at the loops, and at whether the
    TimerThread is closing, when the thread exits.  (No byte carries a
    meaning of its own: a full pipe drops pokes.)  Between wakes it holds
    only fds and a weak reference: a TimerThread nobody references is
    collected, and its finaliser's close wakes this thread to exit."""
    # poll, not select: a process may hold fds past FD_SETSIZE (1024)
    poller = select.poll()
    for fd in (port_fd, orphans_fd, wake_r):
        poller.register(fd, select.POLLIN)
    next_audit = time.monotonic() + _AUDIT_PERIOD
    idle_since: float | None = None  # when the audit last found loops gone
    try:
        while True:
            tt = tt_ref()
            serves_loops = tt is not None and tt._audits
            del tt
            timeout = max(0.0, next_audit - time.monotonic()) if serves_loops else None
            try:
                events = poller.poll(None if timeout is None else timeout * 1000)
            except OSError:  # pragma: no cover - poll fails only when out of memory
                return
            if any(mask & select.POLLNVAL for _, mask in events):
                return  # an fd was closed under us: closing
            if any(fd == wake_r for fd, _ in events):
                os.read(wake_r, 4096)
            tt = tt_ref()
            if tt is None or tt._closing:
                return
            try:
                if tt._dispatcher is not None:
                    tt._dispatcher.drain()
                if tt._orphan_port is not None:
                    tt._orphan_port.drain()
            except BaseException:  # KeyboardInterrupt/SystemExit from a callback
                logger.exception("bucketimer dispatcher: callback raised")
            now = time.monotonic()
            if not serves_loops:
                next_audit = now + _AUDIT_PERIOD
                idle_since = None
            elif now >= next_audit:
                next_audit = now + _AUDIT_PERIOD
                tt._audit_loops()
                with tt._lock:
                    if tt._ports:
                        idle_since = None
                    elif idle_since is None:
                        idle_since = now
                    elif now - idle_since >= _AUDIT_IDLE:
                        # none left for a while: sleep until the next first loop
                        tt._audits = tt._fast_attach = False
                        idle_since = None
            del tt
    finally:
        os.close(wake_r)


# -- the process-wide default ----------------------------------------------------

_live: Live[TimerThread] = Live()


def loop_closing(loop: Any) -> None:
    """Called by bucketimer's own loops first thing in ``close()``: every
    TimerThread detaches its port for ``loop`` (the others have none)."""
    for tt in _live.snapshot():
        tt._loop_closing(loop)


def default_timer_thread() -> TimerThread:
    """The process-wide TimerThread, created on first use (and anew once
    closed, or after fork())."""
    return _core.default_timer_thread()  # type: ignore[return-value]  # (_set_default_class)


if TYPE_CHECKING:
    def call_later(delay: float, callback: Callable[[Unpack[_Ts]], object], /, *args: *_Ts,
                   loop: asyncio.AbstractEventLoop | None = None,
                   context: contextvars.Context | None = None) -> _core.Handle:
        """``default_timer_thread().call_later(...)``."""

    def call_at(when: float, callback: Callable[[Unpack[_Ts]], object], /, *args: *_Ts,
                loop: asyncio.AbstractEventLoop | None = None,
                context: contextvars.Context | None = None) -> _core.Handle:
        """``default_timer_thread().call_at(...)``."""
else:
    # C, and the default TimerThread's: a Python frame in front costs a new
    # loop's first timer about a third of what asyncio's first call_later
    # costs (docs/performance.rst, "A short-lived loop").
    call_later = _core.call_later
    call_at = _core.call_at


# Functions of call_later's and call_at's signatures that do nothing: the C
# functions let them raise their argument errors, in this Python's own words
# (3.13 added "Did you mean ...?").
def _call_later_signature(delay: Any, callback: Any, /, *args: Any, loop: Any = None,
                          context: Any = None) -> None:
    pass


def _call_at_signature(when: Any, callback: Any, /, *args: Any, loop: Any = None,
                       context: Any = None) -> None:
    pass


_call_later_signature.__qualname__ = "call_later"
_call_at_signature.__qualname__ = "call_at"
_core._set_signatures(_call_later_signature, _call_at_signature)


def _after_fork_in_child() -> None:
    # Nothing of the parent's threads exists here: forget its TimerThreads
    # (their cores refuse work; the native default is made anew on first use).
    for tt in _live.snapshot():
        tt._closing = True
    _live.clear()


# At exit, how long in all to wait for dispatcher callbacks still running
# (their threads are daemons: the interpreter does not wait for them).
_EXIT_JOIN_BUDGET = 0.2


def _close_all_at_exit() -> None:
    deadline = time.monotonic() + _EXIT_JOIN_BUDGET
    dropped = 0
    for tt in _live.snapshot():
        try:
            dispatcher = None if tt.closed else tt._dispatcher
            if dispatcher is not None:  # the no-loop timers this exit drops
                dropped += dispatcher.cancel_pending()
            tt._close(join_timeout=max(0.0, deadline - time.monotonic()))
        except Exception:  # pragma: no cover - best effort at exit
            pass
    report_dropped_at_exit(dropped)


os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(_close_all_at_exit)


def _before_collection(phase: str, info: object, _release: Any = _core._release_returned) -> None:
    # The StopIteration the C awaitables raise again and again (a read of
    # CPython internals, docs/design.rst) keeps the value it last carried,
    # the Timeout an ``async with`` entered: let it go before a collection,
    # or that Timeout's Task, and its loop, could never be collected.
    if phase == "start":
        _release()


gc.callbacks.append(_before_collection)


def _start_default() -> None:
    """The default TimerThread and its dispatcher, made in the background at
    import so that the first timer finds them running (making them costs a
    few hundred microseconds, most of it the dispatcher thread's start), and
    its audits started, so that the first loop's port is connected in C.
    A failure is left to the first timer, which raises it."""
    try:
        tt = default_timer_thread()
        with tt._lock:
            if not tt._closing:
                # (the process's first loop is then connected in C too; with
                # no loop for _AUDIT_IDLE, the dispatcher stops its audits)
                tt._start_audits()
        # What the C attach asks of the first loop, answered once here: the
        # verdict on asyncio's loop class, and the ABC check of the default
        # selector (each some 20 us the first time, a cold path).
        _attach_class(asyncio.SelectorEventLoop)
        issubclass(selectors.DefaultSelector, selectors.BaseSelector)
    except Exception:  # pragma: no cover - the first timer reports it
        pass


# The native module makes the default (and the timeouts' TimerThread) of this class.
_core._set_default_class(TimerThread)
_core._set_attach(_attach_class, PollStamp, _report_to_loop, socket.socket,
                  selectors.BaseSelector)

# Last, once the native module knows the default's class: a start thread
# that ran before would find none, fail quietly, and leave the first timer
# to make them after all.  BUCKETIMER_LAZY_START=1: the first timer makes
# them (no thread at import; docs/asyncio.rst, "The first timer").
if os.environ.get("BUCKETIMER_LAZY_START", "") in ("", "0"):
    threading.Thread(target=_start_default, name="bucketimer-start", daemon=True).start()
