"""What a result was measured on: platform, CPU model and count, load
average, Python and package versions (stored with every run)."""

from __future__ import annotations

import os
import platform
import sys
import time
from importlib import metadata
from typing import Any

import bucketimer

PACKAGES = ("bucketimer", "cffi", "uvloop", "tqdm", "matplotlib", "pandas", "numpy")


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or ""


def loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return None


def machine_info() -> dict[str, Any]:
    """Platform, CPUs, Python and package versions: stored with every result."""
    try:
        usable: int | None = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count()
    return {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_model": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": usable,
        "python": sys.version.split()[0],
        "python_implementation": platform.python_implementation(),
        "bucketimer": bucketimer.__version__,
        "backend": bucketimer.backend,
        "packages": {d: _version(d) for d in PACKAGES},
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "loadavg": loadavg(),
    }
