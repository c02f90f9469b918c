"""Bad input: delays and deadlines of every kind, callbacks that are not
callable, contexts that are not Contexts, wrong loops and closed
TimerThreads.  A rejected call raises a clear exception, takes no slot and
changes nothing already scheduled.

The property tests first schedule sentinel timers (three due within
milliseconds, one far away); after the input under test got its exception or
behaviour, the near sentinels must each have run exactly once, the far one
must still be cancellable, and the core's ``scheduled`` counter must have
moved by exactly the number of calls that returned a handle.

The behaviour checked (documented in docs/guarantees.rst):

===============================  ==========================================
delay / when                     result
===============================  ==========================================
bool, str, bytes, None, complex,  TypeError (checked before anything else
list, object()                    is touched)
NaN (float, Decimal, numpy)       ValueError; Decimal sNaN: ValueError
negative or zero, -inf,           fires as soon as possible
ints < -2**1023
+inf, > 9.2e9 s, ints > 2**1023   never fires; ``when()`` is inf (call_later)
                                  or the value (call_at); cancel() -> True
ints (any size), floats,          converted with ``float()``/``__index__``
Decimal, Fraction, __float__,
__index__ objects
an object whose __float__         that exception propagates
raises or returns a non-float
===============================  ==========================================
"""

from __future__ import annotations

import asyncio
import contextvars
import decimal
import fractions
import functools
import math
import threading
import time
from collections import Counter

import pytest
from _helpers import TIME_SCALE, Recorder, examples, fd_count, var, wait_until
from hypothesis import given
from hypothesis import strategies as st

import bucketimer
from bucketimer import _core

pytestmark = pytest.mark.timeout(60)


class NoFloat:
    pass


BAD_CALLS = [
    pytest.param(lambda tt, cb: tt.call_later(0.01, 42), TypeError, id="non-callable"),
    pytest.param(lambda tt, cb: tt.call_later(0.01, None), TypeError, id="callback-None"),
    pytest.param(lambda tt, cb: tt.call_later(math.nan, cb), ValueError, id="nan"),
    pytest.param(lambda tt, cb: tt.call_at(math.nan, cb), ValueError, id="call_at-nan"),
    pytest.param(lambda tt, cb: tt.call_later(decimal.Decimal("NaN"), cb), ValueError, id="decimal-nan"),
    pytest.param(lambda tt, cb: tt.call_later(True, cb), TypeError, id="bool"),
    pytest.param(lambda tt, cb: tt.call_at(False, cb), TypeError, id="call_at-bool"),
    pytest.param(lambda tt, cb: tt.call_later("1", cb), TypeError, id="str"),
    pytest.param(lambda tt, cb: tt.call_later(b"1", cb), TypeError, id="bytes"),
    pytest.param(lambda tt, cb: tt.call_later(None, cb), TypeError, id="None"),
    pytest.param(lambda tt, cb: tt.call_later(1j, cb), TypeError, id="complex"),
    pytest.param(lambda tt, cb: tt.call_later(NoFloat(), cb), TypeError, id="object"),
    pytest.param(lambda tt, cb: tt.call_later(0.01), TypeError, id="no-callback"),
    pytest.param(lambda tt, cb: tt.call_later(), TypeError, id="no-args"),
    pytest.param(lambda tt, cb: tt.call_later(0.01, cb, bogus=1), TypeError, id="bad-keyword"),
    pytest.param(lambda tt, cb: tt.call_later(0.01, cb, context={}), TypeError, id="bad-context"),
    pytest.param(lambda tt, cb: tt.call_later(0.01, cb, loop="loop"), TypeError, id="bad-loop"),
]


@pytest.mark.parametrize("call, exc", BAD_CALLS)
def test_bad_input_raises_and_changes_nothing(tt, call, exc):
    sentinel = Recorder("sentinel")
    keeper = Recorder("keeper")
    # due after the checks below, however slow this machine (an emulated one)
    hs = tt.call_later(0.03 * TIME_SCALE, sentinel)
    hk = tt.call_later(30, keeper)
    before = tt.stats()
    with pytest.raises(exc):
        call(tt, Recorder("bad"))
    after = tt.stats()
    assert after["scheduled"] == before["scheduled"] == 2
    if bucketimer.backend == "native":  # the pure backend has no slots
        assert after["slots"] - after["slots_free"] == 2
    sentinel.wait()
    assert not hs.cancelled()
    assert hk.cancel() is True
    assert keeper.calls == []


def test_closed_loop_is_refused(tt):
    loop = asyncio.new_event_loop()
    loop.close()
    cb = Recorder()
    sentinel = tt.call_later(30, cb)
    with pytest.raises(RuntimeError):
        tt.call_later(0, cb, loop=loop)
    assert sentinel.cancel() is True


@pytest.mark.parametrize(
    "delay",
    [0, 0.0, -0.0, -1, -1e300, -math.inf, -(10**400), fractions.Fraction(-1, 3), decimal.Decimal(-5)],
    ids=repr,
)
def test_zero_and_negative_delays_fire_as_soon_as_possible(tt, delay):
    cb = Recorder()
    t0 = time.monotonic()
    h = tt.call_later(delay, cb)
    call = cb.wait(5)
    assert call["at"] - t0 < 5
    assert not h.cancelled()


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda tt, cb: tt.call_later(math.inf, cb), id="inf"),
        pytest.param(lambda tt, cb: tt.call_at(math.inf, cb), id="call_at-inf"),
        pytest.param(lambda tt, cb: tt.call_later(10**400, cb), id="huge-int"),
        pytest.param(lambda tt, cb: tt.call_later(2**63, cb), id="2**63"),
        pytest.param(lambda tt, cb: tt.call_later(1e300, cb), id="1e300"),
        pytest.param(lambda tt, cb: tt.call_at(10**30, cb), id="call_at-huge"),
    ],
)
def test_infinite_delays_never_fire_but_can_be_cancelled(tt, make):
    never = Recorder("never")
    soon = Recorder("soon")
    h = make(tt, never)
    tt.call_later(0.02, soon)  # a later, finite timer still fires
    soon.wait()
    time.sleep(0.02)
    assert never.calls == []
    assert h.when() == math.inf or h.when() > 1e9
    assert h.cancel() is True
    assert h.cancelled()


def test_int_and_float_subclasses_and_numbers_are_accepted(tt):
    cb = Recorder()
    done = []
    hs = [
        tt.call_later(fractions.Fraction(1, 100), done.append, 1),
        tt.call_later(decimal.Decimal("0.01"), done.append, 2),
        tt.call_at(time.monotonic(), done.append, 3),
        tt.call_at(int(time.monotonic()), done.append, 4),
        tt.call_later(0, cb),
    ]
    cb.wait()
    deadline = time.monotonic() + 5
    while len(done) < 4 and time.monotonic() < deadline:
        time.sleep(0.005)
    assert sorted(done) == [1, 2, 3, 4]
    assert not any(h.cancelled() for h in hs)


def test_closed_timer_thread_refuses_new_timers():
    tt = bucketimer.TimerThread()
    other = bucketimer.TimerThread()
    try:
        cb = Recorder()
        keep = other.call_later(30, cb)
        tt.close()
        assert tt.closed
        with pytest.raises(RuntimeError):
            tt.call_later(0.01, cb)
        with pytest.raises(RuntimeError):
            tt.call_at(time.monotonic(), cb)
        tt.close()  # idempotent
        assert keep.cancel() is True  # another TimerThread is unaffected
    finally:
        other.close()


def test_context_manager_closes():
    with bucketimer.TimerThread() as tt:
        assert not tt.closed
        h = tt.call_later(30, print)
    assert tt.closed
    assert h.cancel() is False
    with pytest.raises(RuntimeError):
        tt.call_later(1, print)


def test_constructor_arguments():
    with pytest.raises(ValueError):
        bucketimer.TimerThread(0)
    with pytest.raises(ValueError):
        bucketimer.TimerThread(257)
    with pytest.raises(ValueError):
        bucketimer.TimerThread(drain_threshold=1)
    with bucketimer.TimerThread(1, drain_threshold=16) as tt:
        cb = Recorder()
        tt.call_later(0, cb)
        cb.wait()


# -- close ------------------------------------------------------------------------------


NEVER_S = _core.SECONDS_RANGE  # the core's "forever" threshold, seconds


SOON_S = 0.05  # deadlines closer than this may fire while the example runs


HORIZON_S = 2.0  # deadlines further than this must not fire during it


@pytest.fixture(scope="module")
def mtt():
    tt = bucketimer.TimerThread()
    yield tt
    tt.close()


class Sentinels:
    """Timers that must survive whatever the example does to the TimerThread."""

    def __init__(self, tt: bucketimer.TimerThread) -> None:
        self.tt = tt
        self.hits: Counter = Counter()
        self.done = threading.Event()
        self.base = tt.stats()["scheduled"]
        self.near = [tt.call_later(0.001 * (i + 1), self._hit, i) for i in range(3)]
        self.far = tt.call_later(60, self._hit, "far")
        self.accepted = 4  # calls that returned a handle, sentinels included

    def _hit(self, key) -> None:
        self.hits[key] += 1

    def check(self) -> None:
        assert wait_until(lambda: all(self.hits[i] for i in range(3)), timeout=5), self.hits
        time.sleep(0.001)
        assert dict(self.hits) == {0: 1, 1: 1, 2: 1}, self.hits
        assert self.far.cancel() is True, "the far sentinel was lost"
        s = self.tt.stats()
        assert s["scheduled"] - self.base == self.accepted, (s["scheduled"] - self.base, self.accepted)
        assert s["early_fires"] == 0


# -- kinds of values -----------------------------------------------------------------


class IndexOnly:
    def __init__(self, v: int) -> None:
        self.v = v

    def __index__(self) -> int:
        return self.v

    def __repr__(self) -> str:
        return f"IndexOnly({self.v})"


class FloatLike:
    def __init__(self, v: float) -> None:
        self.v = v

    def __float__(self) -> float:
        return self.v

    def __repr__(self) -> str:
        return f"FloatLike({self.v!r})"


class FloatRaises:
    def __float__(self) -> float:
        raise ZeroDivisionError("from __float__")


class FloatReturnsStr:
    def __float__(self):
        return "1.0"


TYPE_ERRORS = st.one_of(
    st.booleans(),
    st.text(max_size=4),
    st.binary(max_size=4),
    st.none(),
    st.complex_numbers(),
    st.lists(st.integers(), max_size=2),
    st.tuples(st.floats()),
    st.builds(object),
    st.just(FloatReturnsStr()),
    st.dictionaries(st.integers(), st.integers(), max_size=1),
)


NUMBERS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.floats(min_value=-0.01, max_value=0.01),
    st.integers(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.integers(min_value=2**1023, max_value=2**1100),  # beyond float range
    st.integers(min_value=-(2**1100), max_value=-(2**1023)),
    st.decimals(allow_nan=True, allow_infinity=True),
    st.decimals(min_value=-1, max_value=1, places=6),
    st.fractions(max_denominator=10**6),
    st.fractions(min_value=-1, max_value=1, max_denominator=1000),
    st.builds(IndexOnly, st.integers(-5, 5)),
    st.builds(FloatLike, st.floats(allow_nan=True, allow_infinity=True)),
    st.sampled_from([-(2**63), 2**63 - 1, 2**64 + 1, NEVER_S, NEVER_S * 1.0000001, NEVER_S * 0.999, -NEVER_S, 5e-324, -0.0]),
)


VALUES = st.one_of(NUMBERS, TYPE_ERRORS, st.just(FloatRaises()))


def expected(value) -> tuple:
    """("raise", ExcType) or ("ok", seconds as a float)."""
    if isinstance(value, bool):
        return ("raise", TypeError)
    if isinstance(value, FloatRaises):
        return ("raise", ZeroDivisionError)
    if isinstance(value, FloatReturnsStr):
        return ("raise", TypeError)
    if isinstance(value, IndexOnly):
        return ("ok", float(value.v))
    if isinstance(value, FloatLike):
        f = value.v
    elif isinstance(value, decimal.Decimal):
        if value.is_nan():
            return ("raise", ValueError)
        f = float(value)
    elif isinstance(value, (int, float, fractions.Fraction)):
        try:
            f = float(value)
        except OverflowError:
            f = -math.inf if value < 0 else math.inf
    else:
        return ("raise", TypeError)
    if math.isnan(f):
        return ("raise", ValueError)
    return ("ok", f)


@examples(default=150, slow=5000)
@given(value=VALUES, absolute=st.booleans())
def test_delays_and_deadlines_of_every_kind(mtt, value, absolute):
    kind, what = expected(value)
    schedule = mtt.call_at if absolute else mtt.call_later
    sentinels = Sentinels(mtt)
    if kind == "raise":
        with pytest.raises(what):
            schedule(value, sentinels._hit, "bad")
        sentinels.check()
        return

    f = what
    hits = []
    t_before = time.monotonic()
    h = schedule(value, hits.append, "x")
    t_after = time.monotonic()
    sentinels.accepted += 1
    # when(), and when the timer is due relative to now.
    if absolute:
        # an int stays one, as asyncio's TimerHandle keeps it
        assert h.when() == (value if type(value) is int else f)
        assert type(h.when()) is (int if type(value) is int else float)
        due_in = f - t_after
        never = f >= NEVER_S
    else:
        never = f > NEVER_S
        if never:
            assert h.when() == math.inf
        elif f < -NEVER_S:
            assert h.when() <= t_after
        else:
            assert t_before + f - 1e-6 <= h.when() <= t_after + f + 1e-6
        due_in = f
    if never or due_in > HORIZON_S:
        time.sleep(0.001)
        assert hits == []
        assert h.cancel() is True
        assert h.cancelled()
    elif due_in <= 0:
        assert wait_until(lambda: hits, timeout=5), "a due timer did not fire"
        assert h.cancel() is False
    else:
        wait_until(lambda: hits, timeout=min(due_in, SOON_S) + 0.005)
        won = h.cancel()
        if not won:  # it had started: it runs to the end
            assert wait_until(lambda: hits, timeout=10), "a timer that lost its cancel never ran"
        time.sleep(0.002)  # a cancel that won: nothing may run after it
        assert len(hits) + won == 1, (hits, won)
    if hits:
        assert hits == ["x"]
        assert time.monotonic() >= h.when()
    sentinels.check()


@pytest.mark.parametrize("absolute", [False, True])
def test_negative_fraction_beyond_float_range_fires_at_once(mtt, absolute):
    hits = []
    schedule = mtt.call_at if absolute else mtt.call_later
    h = schedule(fractions.Fraction(-(10**400)), hits.append, 1)
    try:
        assert wait_until(lambda: hits, timeout=10)
    finally:
        h.cancel()


@examples(default=40, slow=1000)
@given(cb=st.one_of(st.integers(), st.floats(), st.text(max_size=3), st.none(), st.binary(max_size=3),
                    st.lists(st.integers(), max_size=2), st.builds(object), st.booleans(),
                    st.tuples(st.integers())),
       delay=st.sampled_from([0, 0.001, -1, 60, math.inf]))
def test_non_callable_callbacks_raise_typeerror(mtt, cb, delay):
    sentinels = Sentinels(mtt)
    with pytest.raises(TypeError, match="callable"):
        mtt.call_later(delay, cb)
    with pytest.raises(TypeError, match="callable"):
        mtt.call_at(time.monotonic() + delay, cb)
    sentinels.check()


class CallableObject:
    def __init__(self, out):
        self.out = out

    def __call__(self, *args):
        self.out.append(("obj", args))


def test_callables_of_every_kind_run(mtt):
    out = []

    class Cls:
        def __init__(self, *args):
            out.append(("cls", args))

        def method(self, *args):
            out.append(("method", args))

    sentinels = Sentinels(mtt)
    cbs = [
        (lambda *a: out.append(("lambda", a)), (1,)),
        (functools.partial(out.append, ("partial", (1,))), ()),
        (Cls, (1,)),
        (Cls.__new__(Cls).method, (1,)),
        (CallableObject(out), (1,)),
        (out.append, (("builtin", (1,)),)),  # a builtin method
    ]
    for cb, args in cbs:
        mtt.call_later(0, cb, *args)
    sentinels.accepted += len(cbs)
    assert wait_until(lambda: len(out) == len(cbs), timeout=5), out
    assert sorted(out) == sorted(
        [("lambda", (1,)), ("partial", (1,)), ("cls", (1,)), ("method", (1,)), ("obj", (1,)), ("builtin", (1,))]
    )
    sentinels.check()


@examples(default=30, slow=500)
@given(ctx=st.one_of(st.integers(), st.text(max_size=3), st.builds(object), st.builds(dict),
                     st.just(contextvars.ContextVar("v")), st.booleans()))
def test_bad_contexts_raise_typeerror(mtt, ctx):
    sentinels = Sentinels(mtt)
    with pytest.raises(TypeError, match="context"):
        mtt.call_later(0, print, context=ctx)
    sentinels.check()


def test_context_none_and_a_real_context(mtt):
    sentinels = Sentinels(mtt)
    seen = []
    ctx = contextvars.copy_context()
    ctx.run(var.set, "in ctx")
    mtt.call_later(0, lambda: seen.append(var.get()), context=ctx)
    mtt.call_later(0, lambda: seen.append(var.get()), context=None)
    sentinels.accepted += 2
    assert wait_until(lambda: len(seen) == 2)
    assert sorted(seen) == ["in ctx", "unset"]
    sentinels.check()


def test_bad_keyword_and_too_few_arguments(mtt):
    sentinels = Sentinels(mtt)
    with pytest.raises(TypeError):
        mtt.call_later(0, print, loops=None)
    with pytest.raises(TypeError):
        mtt.call_later(0)
    with pytest.raises(TypeError):
        mtt.call_at()
    sentinels.check()


def _reference_call_later(delay, callback, /, *args, loop=None, context=None):
    return None


def _reference_call_at(when, callback, /, *args, loop=None, context=None):
    return None


# a keyword or two of every kind: taken, positional-only, unknown
_KEYWORD_SETS = [{}, {"bogus": 1}, {"delay": 1}, {"when": 1}, {"callback": print},
                 {"bogus": 1, "delay": 2, "callback": print}, {"delay": 1, "bogus": 2},
                 {"loops": None}, {"context": None, "bogus": 1}]


@pytest.mark.parametrize("nargs", [0, 1])
@pytest.mark.parametrize("kwargs", _KEYWORD_SETS, ids=lambda k: ",".join(k) or "none")
@pytest.mark.parametrize("name", ["call_later", "call_at"])
def test_the_module_functions_refuse_arguments_in_pythons_words(name, kwargs, nargs):
    """bucketimer.call_later/call_at (C on the native backend) raise what
    a Python function of their signature raises, word for word."""
    ref = globals()[f"_reference_{name}"]
    args = (0,)[:nargs]
    with pytest.raises(TypeError) as want:
        ref(*args, **kwargs)
    with pytest.raises(TypeError) as got:
        getattr(bucketimer, name)(*args, **kwargs)
    assert str(got.value) == str(want.value).replace("_reference_", "")


# -- wrong loops ---------------------------------------------------------------------------


@examples(default=40, slow=1000)
@given(obj=st.one_of(st.integers(), st.floats(allow_nan=False), st.text(max_size=3), st.builds(object),
                     st.booleans(), st.binary(max_size=2), st.tuples(st.integers()),
                     st.lists(st.integers(), max_size=1), st.builds(dict),
                     st.just(asyncio.Runner()), st.just(threading.Thread())))
@pytest.mark.native
def test_non_loop_objects_raise_typeerror(mtt, obj):
    sentinels = Sentinels(mtt)
    ports = dict(mtt._ports)
    with pytest.raises(TypeError):
        mtt.call_later(0, print, loop=obj)
    assert mtt._ports == ports
    sentinels.check()


@pytest.mark.native
def test_a_loop_whose_is_closed_raises_keeps_its_port(mtt):
    # The TimerThread asks a loop it already serves whether it closed
    # behind its back; an is_closed() that raises is the loop's error to
    # report, not a sign to release the port and the timers on it.
    class Flaky(asyncio.SelectorEventLoop):
        fail = False

        def is_closed(self):
            if self.fail:
                raise ZeroDivisionError("is_closed")
            return super().is_closed()

    loop = Flaky()
    other = asyncio.new_event_loop()
    try:
        pending = mtt.call_later(3600, print, loop=loop)
        port = mtt._ports[loop]
        mtt.call_later(3600, print, loop=other)  # the lookup cache now holds `other`
        loop.fail = True
        with pytest.raises(ZeroDivisionError):
            mtt.call_later(0, print, loop=loop)
        loop.fail = False
        assert mtt._ports[loop] is port and port.fileno() >= 0
        assert pending.cancel() is True
    finally:
        loop.close()
        other.close()


@pytest.mark.native
def test_closed_loop_raises_runtimeerror(mtt):
    sentinels = Sentinels(mtt)
    loop = asyncio.new_event_loop()
    loop.close()
    before = fd_count()
    ports = dict(mtt._ports)
    for schedule in (mtt.call_later, mtt.call_at):
        with pytest.raises(RuntimeError, match="closed"):
            schedule(0, print, loop=loop)
    assert mtt._ports == ports and fd_count() == before
    sentinels.check()


def test_loop_closed_after_use_raises_runtimeerror(mtt):
    sentinels = Sentinels(mtt)
    loop = asyncio.new_event_loop()
    loop.run_until_complete(asyncio.sleep(0))
    mtt.call_later(60, print, loop=loop)
    sentinels.accepted += 1
    loop.close()
    with pytest.raises(RuntimeError, match="closed"):
        mtt.call_later(0, print, loop=loop)
    sentinels.check()


def test_loop_running_in_another_thread_works(mtt):
    sentinels = Sentinels(mtt)
    loop = asyncio.new_event_loop()
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()
    try:
        seen = []
        done = threading.Event()

        def cb(i):
            seen.append((i, threading.current_thread() is t, asyncio.get_running_loop() is loop))
            if len(seen) == 5:
                done.set()

        hs = [mtt.call_later(0.001 * i, cb, i, loop=loop) for i in range(5)]
        sentinels.accepted += 5
        assert all(h.loop is loop for h in hs)
        assert done.wait(5)
        assert sorted(seen) == [(i, True, True) for i in range(5)]
    finally:
        loop.call_soon_threadsafe(loop.stop)
        t.join(5)
        loop.close()
    sentinels.check()


def test_loop_not_running_gets_its_timers_when_it_runs(mtt):
    sentinels = Sentinels(mtt)
    loop = asyncio.new_event_loop()
    try:
        seen = []
        posted = mtt.stats()["posted"]
        mtt.call_later(0, lambda: seen.append(asyncio.get_running_loop()), loop=loop)
        mtt.call_later(0.001, lambda: seen.append(asyncio.get_running_loop()), loop=loop)
        sentinels.accepted += 2
        # both are due and posted to the loop's port ...
        assert wait_until(lambda: mtt.stats()["posted"] >= posted + 2, timeout=10)
        assert seen == []  # ... but only a running loop runs them
        loop.run_until_complete(asyncio.sleep(0.01))
        assert seen == [loop, loop]
    finally:
        loop.close()
    sentinels.check()


def test_closed_timer_thread_raises_runtimeerror_before_looking_at_arguments():
    tt = bucketimer.TimerThread()
    tt.close()
    for args in [(0, print), ("not a delay", print), (math.nan, print), (0, "not callable")]:
        with pytest.raises(RuntimeError, match="closed"):
            tt.call_later(*args)
        with pytest.raises(RuntimeError, match="closed"):
            tt.call_at(*args)

