"""The ``native`` fixture: a :class:`NativeTimers` for each drop-in loop class."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from _native_loop import LOOPS, NativeTimers


@pytest.fixture(params=LOOPS)
def native(request: pytest.FixtureRequest) -> Iterator[NativeTimers]:
    timers = NativeTimers(request.param)
    try:
        yield timers
    finally:
        timers.close()
