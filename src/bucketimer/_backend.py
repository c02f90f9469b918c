"""Which implementation of the API runs: the one place that chooses.

The native backend (``bucketimer._core`` over the C core) when its modules
import; the pure-Python one (``bucketimer._pure``) when they do not (no
wheel for this platform, an sdist built where the core cannot be) or when
the environment variable ``BUCKETIMER_NO_EXTENSIONS`` is set to any
non-empty value, as aio-libs' ``MULTIDICT_NO_EXTENSIONS`` and
``YARL_NO_EXTENSIONS`` are read.  ``backend`` says which: ``"native"`` or
``"python"``.  The rest of the package imports the API from here.
"""

from __future__ import annotations

import os
import sys
from types import ModuleType
from typing import TYPE_CHECKING

NO_EXTENSIONS = bool(os.environ.get("BUCKETIMER_NO_EXTENSIONS"))


def _native_core() -> ModuleType | None:
    """``bucketimer._core`` if it can be used, else None."""
    if NO_EXTENSIONS:
        return None
    try:
        from . import _core
    except ImportError:
        return None
    return _core


NATIVE = _native_core() is not None

# A type checker reads the native API: the pure one has the same signatures
# (mypy checks its modules on their own).
if TYPE_CHECKING or NATIVE:
    backend = "native"
    from . import aio
    from ._core import DEFAULT_DRAIN_THRESHOLD as DEFAULT_DRAIN_THRESHOLD
    from ._core import HIST_BUCKETS as HIST_BUCKETS
    from ._core import monotonic_ns
    from ._timers import Handle, TimerThread, call_at, call_later, default_timer_thread
    from .aio import Timeout, timeout, timeout_at, wait_for
else:
    backend = "python"
    from time import monotonic_ns as _monotonic_ns

    def monotonic_ns() -> int:
        """The clock of the timers, CLOCK_MONOTONIC ns (``time.monotonic_ns()``,
        with a signature that ``inspect`` can read on every version)."""
        return _monotonic_ns()

    from ._pure import aio
    from ._pure._default import call_at, call_later, default_timer_thread
    from ._pure._handle import Handle
    from ._pure._scheduler import HIST_BUCKETS as HIST_BUCKETS
    from ._pure._timer_thread import DEFAULT_DRAIN_THRESHOLD as DEFAULT_DRAIN_THRESHOLD
    from ._pure._timer_thread import TimerThread
    from ._pure.aio import Timeout, timeout, timeout_at, wait_for

    # ``bucketimer.aio`` is public: on this backend it is the pure module
    # (as ``os.path`` is ``posixpath``), so ``import bucketimer.aio`` and
    # ``from bucketimer import aio`` never reach the native one.
    sys.modules[f"{__package__}.aio"] = aio

__all__ = ["NATIVE", "Handle", "Timeout", "TimerThread", "aio", "backend", "call_at",
           "call_later", "default_timer_thread", "monotonic_ns", "timeout", "timeout_at",
           "wait_for"]
