"""Fixtures of the asyncio tests: ``t``, each implementation of the
helpers, and ``run``, a coroutine run on a fresh loop of each kind."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import pytest
from _impls import IMPLS, LOOPS


@pytest.fixture(params=sorted(IMPLS))
def t(request: pytest.FixtureRequest) -> Any:
    return IMPLS[request.param]


@pytest.fixture(params=sorted(LOOPS))
def run(request: pytest.FixtureRequest) -> Callable[[Coroutine[Any, Any, Any]], Any]:
    """run(coroutine) on a fresh loop of the parametrized kind."""
    factory = LOOPS[request.param]

    def _run(coro: Coroutine[Any, Any, Any]) -> Any:
        with asyncio.Runner(loop_factory=factory) as runner:
            return runner.run(coro)

    return _run
