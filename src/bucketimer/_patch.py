"""patch_asyncio(): asyncio's timeout helpers become bucketimer's.

After :func:`patch_asyncio`, ``asyncio.timeout``, ``asyncio.timeout_at`` and
``asyncio.wait_for`` are :mod:`bucketimer.aio`'s, and so are the same names
in the submodules asyncio's own code calls them through, so every caller
that looks the name up at call time (``asyncio.timeout(...)``,
``asyncio.wait_for(...)``, asyncio's ``staggered`` and
``shutdown_default_executor``) arms its timer in the native core.  The
helpers follow the running Python's asyncio (docs/asyncio.rst), so nothing
but the timer changes.  On the pure-Python backend the helpers patched in
are that backend's (asyncio's own, with the order of due timers and the NaN
deadline of the native ones), so a patched program behaves the same on
either backend.

``asyncio.Timeout`` (the class) is left alone: code that subclasses it, or
builds one with ``asyncio.Timeout(when)``, keeps asyncio's Python class and
its internals; the price is that ``isinstance(asyncio.timeout(1),
asyncio.Timeout)`` is false while the patch is on (``bucketimer.Timeout``
is the type then).  docs/asyncio.rst ("One line: patch_asyncio()") says why.
"""

from __future__ import annotations

import asyncio
import threading
from asyncio import tasks, timeouts
from types import ModuleType
from typing import Any

from ._backend import aio

__all__ = ("patch_asyncio", "unpatch_asyncio")

# Every place a caller finds the helpers by name at call time: the package,
# and the modules asyncio's own code reads them from (tasks.wait_for calls
# timeouts.timeout from 3.12; base_events.shutdown_default_executor calls
# timeouts.timeout from 3.12; staggered calls tasks.wait_for).  Checked
# against Lib/asyncio of 3.11 to 3.15: no other module binds these names.
_TARGETS: tuple[tuple[ModuleType, str], ...] = (
    (asyncio, "timeout"),
    (asyncio, "timeout_at"),
    (asyncio, "wait_for"),
    (timeouts, "timeout"),
    (timeouts, "timeout_at"),
    (tasks, "wait_for"),
)

_lock = threading.Lock()
# (module, name) -> asyncio's own object, while the patch is on.
_originals: dict[tuple[ModuleType, str], Any] | None = None


def patch_asyncio() -> bool:
    """Make ``asyncio.timeout``, ``asyncio.timeout_at`` and
    ``asyncio.wait_for`` bucketimer's (:mod:`bucketimer.aio`), in the
    ``asyncio`` package and in the submodules asyncio calls them through.

    Call it first, before importing the libraries whose timeouts it should
    reach: a name bound by ``from asyncio import wait_for`` before the call
    keeps asyncio's object.  Idempotent and safe from any thread; process-wide
    until :func:`unpatch_asyncio`.  Returns whether asyncio's helpers are
    bucketimer's after the call (always, since both backends patch).
    """
    global _originals
    with _lock:
        if _originals is None:
            _originals = {(module, name): getattr(module, name) for module, name in _TARGETS}
            for module, name in _TARGETS:
                setattr(module, name, getattr(aio, name))
    return True


def unpatch_asyncio() -> None:
    """Put asyncio's own helpers back (the very objects :func:`patch_asyncio`
    replaced).  A name that somebody rebound after the patch is left to
    them.  Idempotent; a no-op when the patch is off."""
    global _originals
    with _lock:
        if _originals is None:
            return
        for (module, name), original in _originals.items():
            if getattr(module, name) is getattr(aio, name):
                setattr(module, name, original)
        _originals = None

