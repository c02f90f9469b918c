import asyncio

import bucketimer

IDLE = 0.2  # seconds without a message before the reader gives up


async def read_until_idle(queue: asyncio.Queue[str]) -> list[str]:
    loop = asyncio.get_running_loop()
    got: list[str] = []
    try:
        async with bucketimer.timeout(IDLE) as cm:
            while True:
                got.append(await queue.get())
                cm.reschedule(loop.time() + IDLE)  # moves the armed timer in place
    except TimeoutError:
        return got


async def main() -> None:
    queue: asyncio.Queue[str] = asyncio.Queue()

    async def producer() -> None:
        for i in range(5):
            await asyncio.sleep(0.05)
            queue.put_nowait(f"message {i}")

    async with asyncio.TaskGroup() as tg:
        tg.create_task(producer())
        print(await read_until_idle(queue))  # all five, then IDLE seconds of silence


bucketimer.run(main())
