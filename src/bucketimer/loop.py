"""A drop-in asyncio event loop whose timers live in bucketimer's native core.

:class:`EventLoop` is ``asyncio.SelectorEventLoop`` with ``call_at`` and
``call_later`` served by a :class:`bucketimer.TimerThread`: every
``asyncio.sleep``, ``asyncio.timeout``, ``asyncio.wait_for`` and any
library's ``loop.call_later`` then costs an O(1) C call to arm and to
cancel, and the loop's own ``heapq`` of ``TimerHandle`` objects stays empty.
Timers that come due are posted back to the loop through an eventfd and run
in the loop's thread, in the ``contextvars.Context`` captured when they were
scheduled (docs/design.rst, "Delivery").

Usage, on every supported Python::

    bucketimer.run(main())                                       # like uvloop.run
    asyncio.run(main(), loop_factory=bucketimer.new_event_loop)  # 3.12+
    with asyncio.Runner(loop_factory=bucketimer.new_event_loop) as runner: ...
    class Test(unittest.IsolatedAsyncioTestCase):                # 3.13+
        loop_factory = bucketimer.EventLoop

``install()`` and :class:`EventLoopPolicy` use asyncio's event loop
policies, which asyncio deprecates from 3.14 and removes in 3.16: they warn
from 3.14 and are gone from 3.16.

What differs from the stock loop, on purpose:

* ``call_at``/``call_later`` return a ``bucketimer._core.LoopHandle`` (not
  a :class:`bucketimer.Handle`, whose ``cancel()`` returns whether it won):
  ``when()`` (an ``int`` given to ``call_at`` stays one), ``cancel()``
  (returns None), ``cancelled()`` (True once ``cancel()`` was called) and
  ``get_context()`` behave as ``asyncio.TimerHandle``'s.  It is not an
  instance of ``asyncio.TimerHandle`` and is not ordered by ``<`` (nothing
  in asyncio orders handles it did not put in its own heap).
* A timer never fires early (asyncio fires up to ``loop._clock_resolution``
  early), and equal deadlines fire in schedule order.
* In debug mode (``loop.set_debug(True)``, ``PYTHONASYNCIODEBUG=1``,
  ``asyncio.run(debug=True)``) timers go to the stock asyncio path, so that
  debug mode keeps all its checks: the thread check, the coroutine-callback
  check, source tracebacks and the slow-callback warning naming the callback.
* A subclass that overrides ``time()`` (a virtual clock), or a loop whose
  ``time`` is replaced on the instance (``mock.patch.object(loop, "time")``,
  as tests that move time forward do), gets the stock timers too, for as
  long as the replacement lasts: the core's clock is CLOCK_MONOTONIC.

:class:`UVEventLoop` (when uvloop is installed) is the same on top of
``uvloop.Loop``.
"""

from __future__ import annotations

import asyncio
import functools
import selectors
import sys
import warnings
import weakref
from collections.abc import Callable, Coroutine
from time import monotonic as _monotonic
from typing import TYPE_CHECKING, Any, TypeVar

from . import _backend, _patch
from ._backend import TimerThread
from ._pure._arguments import check_delay as _check_delay
from ._pure._arguments import check_when as _check_when
from ._pure._arguments import without_own_frame as _without_own_frame

__all__ = ["EventLoop", "install", "new_event_loop", "run"]
if sys.version_info < (3, 14):
    __all__ += ["EventLoopPolicy"]  # noqa: F822 - made by __getattr__

_T = TypeVar("_T")

_base_time = asyncio.BaseEventLoop.time


class _LoopTimers:
    """What a drop-in loop keeps of its own, off the instance.

    asyncio's loop sets 24 to 27 instance attributes (by version).  Past
    29, CPython stops keeping an instance's attributes inline and every
    ``self._x`` that ``_run_once`` reads gets slower: 11 to 13% of an idle
    iteration on 3.11 to 3.15.  Reading the loop's ``__dict__`` ends the
    inline values too, on 3.11, 3.12, 3.14 and 3.15, and so does a
    ``__slots__`` entry on 3.13 and later.  So a drop-in loop's only
    instance attributes are the two C schedulers of the fast path; this
    lives in ``_LOOP_TIMERS``, keyed weakly by the loop, and holds nothing
    that leads back to the loop (its selector only through a weak
    reference); the close hook (``_timers``) is the loop's own ``close()``.
    """

    __slots__ = ("polled", "timer_thread")

    def __init__(self, timer_thread: TimerThread | None, polled: Any) -> None:
        self.timer_thread = timer_thread
        # the loop's _PollStamp (which holds the loop's reader handles)
        self.polled = None if polled is None else weakref.ref(polled)


_LOOP_TIMERS: weakref.WeakKeyDictionary[Any, _LoopTimers] = weakref.WeakKeyDictionary()


class _NativeTimersMixin:
    """``call_at``/``call_later`` served by a bucketimer TimerThread.

    Mixed in before an asyncio loop class.  While the loop is not in debug
    mode (and its class keeps the stock ``time``/``call_at``/``call_later``)
    the two methods are replaced on the instance by C callables bound to
    (TimerThread, loop), so ``loop.call_later(d, cb)`` is one C call.
    """

    _bt_closes_ports = True  # close() detaches this loop's ports (_timers.loop_closing)

    # -- switches ----------------------------------------------------------------

    # A ``time`` set on (or deleted from) the instance switches the timers
    # to the stock path and back, so that they follow the clock the loop
    # reads: the C schedulers on the instance are never asked (docs/asyncio.rst).
    # Every other store is object's: in C on the native backend
    # (ext/loop_attrs.c), as asyncio's loop sets some 30 attributes in its
    # life; in Python, as super() would, where a class further up the MRO
    # has a __setattr__ or __delattr__ of its own (__init_subclass__).
    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if name == "time":
            self._bt_clock_changed()

    def __delattr__(self, name: str) -> None:
        super().__delattr__(name)
        if name == "time":
            self._bt_clock_changed()

    def _bt_clock_changed(self) -> None:
        if self._bt is not None:
            self._bt_update_fast_path()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if not _backend.NATIVE:
            return
        mro = cls.__mro__
        after = mro[mro.index(_NativeTimersMixin) + 1:-1]
        python = any("__setattr__" in vars(k) or "__delattr__" in vars(k) for k in after)
        stores: tuple[Any, Any] = (
            (_NativeTimersMixin.__setattr__, _NativeTimersMixin.__delattr__) if python
            else (_core._loop_setattr, _core._loop_delattr))
        own = vars(cls)
        if "__setattr__" not in own:  # (a class's own calls these through super())
            cls.__setattr__ = stores[0]  # type: ignore[method-assign]
        if "__delattr__" not in own:
            cls.__delattr__ = stores[1]  # type: ignore[method-assign]

    def __new__(cls, *args: Any, timer_thread: TimerThread | None = None, **kwargs: Any) -> Any:
        # Refused before a loop exists: a half-made one would complain when
        # collected.
        if timer_thread is not None and not isinstance(timer_thread, TimerThread):
            raise TypeError(
                f"timer_thread must be a bucketimer.TimerThread, not {type(timer_thread).__name__}"
            )
        return super().__new__(cls)

    def _bt_init(self, timer_thread: TimerThread | None, polled: Any = None) -> bool:
        """Whether the new loop's timers go to the native core (_bt_native)."""
        bt = _LOOP_TIMERS[self] = _LoopTimers(timer_thread, polled)
        return self._bt_update_fast_path(bt)

    @property
    def _bt(self) -> _LoopTimers | None:
        """This loop's _LoopTimers; None inside the base __init__ (whose
        set_debug() comes before _bt_init)."""
        return _LOOP_TIMERS.get(self)

    @property
    def _bt_polled(self) -> Any:
        """The loop's _PollStamp (when its last poll returned), or None for a
        loop that does not say (_timers' reader drains all then)."""
        bt = self._bt
        return None if bt is None or bt.polled is None else bt.polled()

    # -- which TimerThread ---------------------------------------------------

    @property
    def timer_thread(self) -> TimerThread:
        """The TimerThread serving this loop's timers (default: the process-wide one)."""
        bt = self._bt
        tt = None if bt is None else bt.timer_thread
        if tt is None:
            return _backend.default_timer_thread()
        return tt

    def _bt_native(self) -> bool:
        """True when timers go to the native core: the native backend, not in
        debug mode, and ``time`` is the stock clock, neither overridden by a
        subclass nor replaced on the instance (``mock.patch.object(loop,
        "time")``).  On the pure backend they are the host loop's.  The
        instance is asked through ``self.time``, not ``self.__dict__``
        (_LoopTimers says why)."""
        cls = type(self)
        return (
            _backend.NATIVE
            and not self.get_debug()  # type: ignore[attr-defined]
            and cls.time is cls._bt_stock_time  # type: ignore[attr-defined]
            and getattr(self.time, "__func__", None) is cls.time  # type: ignore[attr-defined]
        )

    def _bt_update_fast_path(self, bt: _LoopTimers | None = None) -> bool:
        """Sets or drops the C call_at/call_later on the instance; returns
        _bt_native().  ``bt``: the loop's _LoopTimers, if the caller has it."""
        cls = type(self)
        native = self._bt_native()
        # Set and deleted as attributes, never through self.__dict__
        # (_LoopTimers says why).
        if (native and not self.is_closed()  # type: ignore[attr-defined]
                and cls.call_at is _NativeTimersMixin.call_at
                and cls.call_later is _NativeTimersMixin.call_later):
            make = self._bt_scheduler(bt)
            me: Any = self
            self.call_at = make(me, True)  # type: ignore[method-assign]
            self.call_later = make(me, False)  # type: ignore[method-assign]
        else:
            self._bt_drop_fast_path()
        return native

    def _bt_scheduler(self, bt: _LoopTimers | None = None) -> Any:
        """What makes a C call_at or call_later bound to (TimerThread, loop),
        ``make(loop, absolute)``: without a TimerThread of its own, bound to
        the default one, whichever it is (made anew once closed).  ``bt``:
        the loop's _LoopTimers, if the caller has it."""
        if bt is None:
            bt = self._bt
        tt = None if bt is None else bt.timer_thread
        return _core._scheduler if tt is None else tt._scheduler

    def _bt_drop_fast_path(self) -> None:
        for name in ("call_at", "call_later"):
            try:
                delattr(self, name)
            except AttributeError:  # not set: the class's method serves
                pass

    # -- the two methods -------------------------------------------------------

    def call_at(self, when: float, callback: Callable[..., object], *args: Any,
                context: Any = None) -> Any:
        """Like ``call_later()``, but uses an absolute time (``loop.time()`` clock)."""
        if type(when) is not float and type(when) is not int:
            _check_when(when)
        if not self._bt_native():
            return _without_own_frame(
                super().call_at(when, callback, *args, context=context)  # type: ignore[misc]
            )
        if self.is_closed():  # type: ignore[attr-defined]
            raise RuntimeError("Event loop is closed")
        return self._bt_scheduler()(self, True)(when, callback, *args, context=context)

    def call_later(self, delay: float, callback: Callable[..., object], *args: Any,
                   context: Any = None) -> Any:
        """Arrange for ``callback(*args)`` to be called after ``delay`` seconds."""
        if type(delay) is not float and type(delay) is not int:
            _check_delay(delay)
        if not self._bt_native():
            return _without_own_frame(
                super().call_later(delay, callback, *args, context=context)  # type: ignore[misc]
            )
        if type(self).call_at is not _NativeTimersMixin.call_at:
            # A subclass's call_at: go through it, as asyncio's call_later does.
            return _without_own_frame(
                self.call_at(self.time() + delay, callback, *args, context=context)  # type: ignore[attr-defined]
            )
        if self.is_closed():  # type: ignore[attr-defined]
            raise RuntimeError("Event loop is closed")
        return self._bt_scheduler()(self, False)(delay, callback, *args, context=context)

    def set_debug(self, enabled: bool) -> None:
        super().set_debug(enabled)  # type: ignore[misc]
        if self._bt is not None:
            self._bt_update_fast_path()

    def close(self) -> None:
        # The schedulers hold the loop that holds them: a cycle that would
        # leave a closed loop to the cycle collector, where the stock loop
        # goes with its last reference.  A closed loop never makes them again.
        self._bt_drop_fast_path()
        if _backend.NATIVE:
            _timers.loop_closing(self)
        super().close()  # type: ignore[misc]


if _backend.NATIVE:
    from . import _core, _timers
    from ._timers import PollStamp as _PollStamp

    @functools.cache
    def _stamp_class(selector_class: type) -> type[_PollStamp]:
        """_PollStamp under the name of the selector class it wraps, which
        asyncio's loop logs ("Using selector: EpollSelector")."""
        return type(selector_class.__name__, (_PollStamp,), {"__module__": __name__})


if TYPE_CHECKING or _backend.NATIVE:

    class EventLoop(_NativeTimersMixin, asyncio.SelectorEventLoop):  # type: ignore[misc]
        """``asyncio.SelectorEventLoop`` whose ``call_at``/``call_later`` use bucketimer.

        ``EventLoop(selector=None, *, timer_thread=None)``; ``timer_thread``
        defaults to :func:`bucketimer.default_timer_thread`.
        """

        _bt_stock_time = _base_time

        def __init__(self, selector: selectors.BaseSelector | None = None, *,
                     timer_thread: TimerThread | None = None) -> None:
            polled = None
            if _backend.NATIVE:
                selector = selector or selectors.DefaultSelector()
                polled = selector = _stamp_class(type(selector))(selector)
            super().__init__(selector)
            if self._bt_init(timer_thread, polled):
                # its port now, not on its first timer (_timers.open_port_of;
                # not on uvloop, which warns of a reader left on a loop dropped
                # unrun)
                _timers.open_port_of(
                    self, _timers.default_timer_thread() if timer_thread is None else timer_thread)

else:  # asyncio's timers, on the loop's heap (docs/design.rst, "The pure-Python backend")
    from ._pure._loop import EventLoop


def new_event_loop() -> EventLoop:
    """A new :class:`EventLoop` (pass as ``asyncio.run(..., loop_factory=...)``)."""
    return EventLoop()


def run(main: Coroutine[Any, Any, _T], *, debug: bool | None = None,
        loop_factory: Callable[[], asyncio.AbstractEventLoop] | None = None,
        patch_asyncio: bool = False) -> _T:
    """Run ``main`` on a new :class:`EventLoop` and return its result, as
    ``asyncio.run(main, debug=debug)`` does on the stock loop.

    ``loop_factory`` makes the loop instead, e.g. ``new_uv_event_loop`` or
    ``lambda: EventLoop(timer_thread=tt)``.  ``patch_asyncio=True`` calls
    :func:`bucketimer.patch_asyncio` first (it stays on after the run).
    """
    if asyncio._get_running_loop() is not None:
        raise RuntimeError("bucketimer.run() cannot be called from a running event loop")
    if patch_asyncio:
        _patch.patch_asyncio()
    factory = new_event_loop if loop_factory is None else loop_factory
    if sys.version_info >= (3, 12):
        return asyncio.run(main, debug=debug, loop_factory=factory)
    with asyncio.Runner(debug=debug, loop_factory=factory) as runner:
        return runner.run(main)


# -- asyncio's event loop policies: deprecated from 3.14, removed in 3.16 ----------

_POLICY_DEPRECATED = sys.version_info >= (3, 14)


def _policy_deprecated(what: str, stacklevel: int) -> None:
    """Warns (3.14, 3.15) or raises (3.16+) for a use of the policy system."""
    advice = "use bucketimer.run() or asyncio.run(main, loop_factory=bucketimer.new_event_loop)"
    if not hasattr(asyncio, "set_event_loop_policy"):
        raise AttributeError(
            f"{what} went away with asyncio's event loop policies in Python 3.16: {advice}"
        )
    if _POLICY_DEPRECATED:
        warnings.warn(
            f"{what} is deprecated, as asyncio's event loop policies are "
            f"(removal in Python 3.16): {advice}",
            DeprecationWarning,
            stacklevel=stacklevel + 1,
        )


@functools.cache
def _policy_class(name: str) -> type:
    """EventLoopPolicy or UVEventLoopPolicy, made on first use so that merely
    importing bucketimer touches no deprecated asyncio name; named as this
    module's."""
    cls = _make_policy_class(name)
    cls.__qualname__ = name
    cls.__module__ = __name__
    return cls


def _make_policy_class(name: str) -> type:
    with warnings.catch_warnings():
        # The caller has already been told (_policy_deprecated).
        warnings.simplefilter("ignore", DeprecationWarning)
        if name == "EventLoopPolicy":

            class EventLoopPolicy(asyncio.DefaultEventLoopPolicy):
                """The default asyncio policy, making :class:`EventLoop` loops."""

                _loop_factory = EventLoop

            return EventLoopPolicy
        if name == "UVEventLoopPolicy" and _uvloop is not None:

            class UVEventLoopPolicy(_uvloop.EventLoopPolicy):  # type: ignore[misc]
                """uvloop's policy, making :class:`UVEventLoop` loops."""

                def _loop_factory(self) -> Any:
                    return UVEventLoop()

            return UVEventLoopPolicy
    raise AttributeError(f"module 'bucketimer.loop' has no attribute '{name}'")


def _policy(name: str, stacklevel: int) -> type:
    """``EventLoopPolicy`` or ``UVEventLoopPolicy`` for a module's
    ``__getattr__`` (``stacklevel`` 2: the code that asked for it)."""
    _policy_deprecated(f"bucketimer.{name}", stacklevel + 1)
    return _policy_class(name)


def __getattr__(name: str) -> Any:
    if name in ("EventLoopPolicy", "UVEventLoopPolicy"):
        return _policy(name, stacklevel=2)
    raise AttributeError(f"module 'bucketimer.loop' has no attribute '{name}'")


def __dir__() -> list[str]:
    # The API and the module's own dunders, not the names its code imports.
    return sorted({*__all__, *(name for name in globals() if name.startswith("__"))})


def install() -> None:
    """``asyncio.set_event_loop_policy(EventLoopPolicy())``: asyncio's
    default loop becomes :class:`EventLoop`.  Deprecated from Python 3.14
    and gone from 3.16, with asyncio's policies: use :func:`run`, or
    ``loop_factory=bucketimer.new_event_loop``."""
    _policy_deprecated("bucketimer.install()", 2)
    policy = _policy_class("EventLoopPolicy")()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        asyncio.set_event_loop_policy(policy)


try:  # the same on top of uvloop
    import uvloop as _uvloop
except ImportError:  # pragma: no cover - uvloop is optional
    _uvloop = None  # type: ignore[assignment]

if _uvloop is not None:

    if TYPE_CHECKING or _backend.NATIVE:

        class UVEventLoop(_NativeTimersMixin, _uvloop.Loop):  # type: ignore[misc]
            """``uvloop.Loop`` whose ``call_at``/``call_later`` use bucketimer.

            ``UVEventLoop(*, timer_thread=None)``.  ``time()`` is
            ``time.monotonic()``, the core's clock, instead of uvloop's cached
            millisecond libuv clock (which lags it by up to a loop iteration and
            makes ``call_at(loop.time() + d)`` fire early).  On the pure-Python
            backend the timers are uvloop's own, and so is ``time()``: a
            deadline on one clock armed on the other would fire early.
            """

            def time(self) -> float:
                """``time.monotonic()``: the clock of the native timers."""
                return _monotonic()

            _bt_stock_time = time

            def __init__(self, *, timer_thread: TimerThread | None = None) -> None:
                super().__init__()
                self._bt_init(timer_thread)

        # Both clocks read CLOCK_MONOTONIC: the helpers keep their timers in
        # the core on these loops (a clock of a loop's own gets the loop's).
        from . import _core

        _core._add_monotonic_clock(_uvloop.Loop.time)
        _core._add_monotonic_clock(UVEventLoop.time)
    else:  # uvloop's timers and clock, after the same checks
        from ._pure._loop import uv_event_loop_class

        UVEventLoop = uv_event_loop_class(_uvloop.Loop)

    def new_uv_event_loop() -> UVEventLoop:
        """A new :class:`UVEventLoop`."""
        return UVEventLoop()

    __all__ += ["UVEventLoop", "new_uv_event_loop"]
    if sys.version_info < (3, 14):
        __all__ += ["UVEventLoopPolicy"]  # noqa: F822 - made by __getattr__
