import asyncio

import bucketimer

# First thing at start-up, before importing the libraries whose timeouts it
# should reach: asyncio.timeout(), timeout_at() and wait_for() become bucketimer's.
bucketimer.patch_asyncio()


async def handler() -> str:
    # Unchanged asyncio code, as in any library: the timers are native now.
    async with asyncio.timeout(0.5):
        await asyncio.sleep(0.01)
    try:
        return await asyncio.wait_for(asyncio.sleep(3600, "in time"), 0.05)
    except TimeoutError:
        return "timed out"


async def main() -> None:
    armed = bucketimer.default_timer_thread().stats()["scheduled"]
    print(await handler())
    print("native timers:", bucketimer.default_timer_thread().stats()["scheduled"] - armed)


# The drop-in loop as well: every loop.call_later() is native too.  The same
# two lines in one: bucketimer.run(main(), patch_asyncio=True)
bucketimer.run(main())
