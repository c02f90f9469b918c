"""Fixtures of the core's tests (tests/conftest.py has the shared ones)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest


@pytest.fixture
def new_loop() -> Iterator[asyncio.AbstractEventLoop]:
    """A stock event loop, not running, closed after the test."""
    loop = asyncio.new_event_loop()
    try:
        yield loop
    finally:
        if not loop.is_closed():
            loop.close()
