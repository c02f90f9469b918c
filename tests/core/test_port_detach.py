"""Port.detach() when the core refuses the detach: a clear exception, and the
port is left as it was (docs/guarantees.rst, "Calling the core from its own
callbacks" and "Never deliver to a closed loop")."""

from __future__ import annotations

import os

import pytest
from _helpers import check_ok, run_python

import bucketimer

# Ports are the native backend's (the pure one hands batches to the loop itself).
pytestmark = pytest.mark.native


def test_detaching_the_orphan_port_raises_valueerror_and_changes_nothing() -> None:
    tt = bucketimer.TimerThread()
    try:
        orphans = tt._orphans()
        fd = orphans.fileno()
        assert fd >= 0
        with pytest.raises(ValueError, match="orphan port"):
            orphans.detach()
        assert orphans.fileno() == fd  # still open: the dispatcher still polls it
        os.fstat(fd)
    finally:
        tt.close()


# The fork waits for the timer thread's first pass: a thread still starting
# up may hold the ASan allocator's lock (nox -s sanitize), which the child
# would then never get.
DETACH_IN_A_FORK_CHILD = r"""
import os
import bucketimer
from _helpers import wait_until

tt = bucketimer.TimerThread()
port = tt._port(None)
fd = port.fileno()
assert wait_until(lambda: tt.stats()["passes"] >= 1, timeout=30)
pid = os.fork()
if pid == 0:
    try:
        port.detach()
    except RuntimeError as e:
        os._exit(0 if "fork" in str(e) else 3)
    except BaseException:
        os._exit(2)
    os._exit(1)  # no exception
_, status = os.waitpid(pid, 0)
print("child", os.waitstatus_to_exitcode(status))
# The parent's port is untouched by the child's refused detach.
assert port.fileno() == fd
os.fstat(fd)
port.detach()
assert port.fileno() == -1
tt.close()
print("ok")
"""


def test_detach_in_a_fork_child_raises_runtimeerror_and_leaves_the_port() -> None:
    out = check_ok(run_python(DETACH_IN_A_FORK_CHILD, timeout=60))
    assert out.split() == ["child", "0", "ok"], out
