"""The ``backend`` fixture: every test of tests/grpc/ that takes it runs
once against the sync API and once against grpc.aio (``_grpc_harness``)."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

try:
    import grpc.aio  # noqa: F401
except ImportError:  # without the grpc extra there is nothing to test here
    collect_ignore_glob = ["test_*.py"]
else:
    from _grpc_harness import AioBackend, Backend, SyncBackend


@pytest.fixture(params=("sync", "aio"))
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    """The API under test (parametrize with ``indirect=["backend"]`` to pick one)."""
    if request.param == "sync":
        yield SyncBackend()
        return
    b = AioBackend()
    try:
        yield b
    finally:
        b.close()


@pytest.fixture
def stop() -> Iterator[threading.Event]:
    """Set at teardown: lets handlers that ignore their deadline end."""
    ev = threading.Event()
    yield ev
    ev.set()
