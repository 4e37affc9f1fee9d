"""What this CPU can run: its feature flags, for the tests that load each ISA build of the kernels."""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """/proc/cpuinfo's flags (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()
