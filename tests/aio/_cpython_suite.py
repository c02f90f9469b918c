"""Runs one of CPython's own asyncio test modules (``test.test_asyncio.<name>``
of the running interpreter) with ``bucketimer.patch_asyncio()`` applied and
the drop-in loop as asyncio's default, and prints one JSON line: the unittest
result and how many timers the process-wide TimerThread armed meanwhile.

    python tests/aio/_cpython_suite.py test_timeouts
"""

from __future__ import annotations

import asyncio
import importlib
import json
import sys
import unittest
import warnings

import bucketimer


def main(name: str) -> int:
    assert bucketimer.patch_asyncio()
    with warnings.catch_warnings():  # policies are deprecated from 3.14
        warnings.simplefilter("ignore", DeprecationWarning)
        bucketimer.install()
        probe = asyncio.new_event_loop()
    loop_class = type(probe).__name__
    probe.close()
    tt = bucketimer.default_timer_thread()
    before = tt.stats()["scheduled"]
    module = importlib.import_module(f"test.test_asyncio.{name}")
    suite = unittest.defaultTestLoader.loadTestsFromModule(module)
    result = unittest.TextTestRunner(stream=sys.stderr, verbosity=1).run(suite)
    print(json.dumps({
        "run": result.testsRun,
        "failures": len(result.failures),
        "errors": len(result.errors),
        "skipped": len(result.skipped),
        "loop": loop_class,
        "patched": asyncio.timeout is bucketimer.timeout,
        "native_scheduled": tt.stats()["scheduled"] - before,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
