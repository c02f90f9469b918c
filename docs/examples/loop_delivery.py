import asyncio
import threading

import bucketimer


async def main() -> None:
    tt = bucketimer.TimerThread()
    done = asyncio.Event()
    # Scheduled inside a running loop: delivered to this loop, run in its thread.
    tt.call_later(0.1, done.set)
    await done.wait()
    print("set in", threading.current_thread().name)
    tt.close()


asyncio.run(main())
