"""Fixtures of the pytest-benchmark wrappers: fresh loops of the kit's
contenders (``bucketimer.bench``), closed after each benchmark."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator

import pytest
from _kinds import LOOP_KINDS

from bucketimer.bench.workloads import new_loop


@pytest.fixture
def make_loop() -> Iterator[Callable[[str], asyncio.AbstractEventLoop]]:
    """``make_loop(kind)``: a new loop of a kind of ``LOOP_KINDS``."""
    loops: list[asyncio.AbstractEventLoop] = []

    def make(kind: str) -> asyncio.AbstractEventLoop:
        loop = new_loop(LOOP_KINDS[kind])
        loops.append(loop)
        return loop

    yield make
    for loop in loops:
        loop.close()
