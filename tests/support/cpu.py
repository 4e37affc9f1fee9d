"""What this CPU can run: its feature flags, and each ISA build of the compiled kernels, for the
tests that run every build the CPU supports (and compile the others)."""

from __future__ import annotations

import functools
import platform

import pytest

BASE_FLAGS = ("-O3", "-fopenmp", "-fPIC", "-shared", "-std=gnu11", "-w")
# isa -> (compiler flags, the /proc/cpuinfo flags it needs to run)
BUILDS = {
    "avx512-vnni": (("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mavx2", "-mfma", "-mf16c"),
                    ("avx512_vnni", "avx512vl", "avx512bw")),
    "avx-vnni": (("-mavx2", "-mfma", "-mf16c", "-mavxvnni"), ("avx_vnni",)),
    "avx2": (("-mavx2", "-mfma", "-mf16c"), ("avx2", "fma")),
    "portable": ((), ()),
}


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


def isa_library(isa: str):
    """The kernels built for `isa`, checked to be that build; the test skips (after the build, so
    another machine's path must at least compile) where this CPU cannot run it."""
    from metatp.backends.numpy import native

    flags, needs = BUILDS[isa]
    if flags and platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86-64 flags")
    lib = native.build_library(BASE_FLAGS + flags)
    if not set(needs) <= cpu_flags():
        pytest.skip(f"this CPU cannot run the {isa} build (built only)")
    assert native.library_isa(lib) == isa
    return lib
