import time

import bucketimer

tt = bucketimer.TimerThread()
h = tt.call_later(0.5, print, "never printed")
print(h.cancel())  # True: it will never run
tt.call_at(time.monotonic() + 0.05, print, "fired on the dispatcher thread")
time.sleep(0.2)  # timers still pending at exit are dropped: let this one run
tt.close()
