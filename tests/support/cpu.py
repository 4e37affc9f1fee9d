"""What this CPU can run: its feature flags, and each ISA build of the compiled kernels, for the
tests that run every build the CPU supports (and compile the others)."""

from __future__ import annotations

import platform

import pytest

from metatp.backends.numpy.native.lib import BASE_FLAGS, ISA_BUILDS, isa_unrunnable

# isa -> (compiler flags, the /proc/cpuinfo flags it needs to run): the library's own table
BUILDS = ISA_BUILDS


def isa_library(isa: str):
    """The kernels built for `isa`, checked to be that build; the test skips (after the build, so
    another machine's path must at least compile) where this CPU cannot run it."""
    from metatp.backends.numpy import native

    flags, _ = BUILDS[isa]
    if flags and platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86-64 flags")
    lib = native.build_library(BASE_FLAGS + flags)
    why = isa_unrunnable(isa)
    if why:
        pytest.skip(f"this CPU cannot run the {isa} build (built only): {why}")
    assert native.library_isa(lib) == isa
    return lib
