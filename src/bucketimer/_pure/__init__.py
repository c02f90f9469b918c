"""The pure-Python backend: the public API without the compiled modules.

Chosen by ``bucketimer._backend`` when ``bucketimer._core`` cannot be
imported (no wheel for this platform, an sdist built where the native core
cannot be) or when ``BUCKETIMER_NO_EXTENSIONS`` is set.  One thread per
:class:`TimerThread` keeps a ``heapq`` of deadlines; due timers go to their
loop in one ``call_soon_threadsafe`` per pass, or to a dispatcher thread.
docs/design.rst ("The pure-Python backend") describes it and
docs/guarantees.rst says which guarantees hold here.
"""
