"""A library that binds asyncio's helpers when it is imported, as asyncpg
binds ``wait_for`` and redis-py ``timeout``: patch_asyncio() reaches it only
if it ran first."""

from __future__ import annotations

from asyncio import timeout, wait_for
from typing import Any


async def query(aw: Any, limit: float) -> Any:
    return await wait_for(aw, limit)


async def guarded(aw: Any, limit: float) -> Any:
    async with timeout(limit):
        return await aw
