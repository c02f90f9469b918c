import asyncio

import bucketimer


async def main() -> None:
    # asyncio.timeout() and asyncio.wait_for(), with the timer in the native core
    async with bucketimer.timeout(0.5):
        await asyncio.sleep(0.1)
    print(await bucketimer.wait_for(asyncio.sleep(0.1, "in time"), 0.5))


# The drop-in loop: every library's loop.call_later() is native too
bucketimer.run(main())
