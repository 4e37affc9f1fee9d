"""Fixtures the numpy backend's kernel tests share."""

from __future__ import annotations

import pytest

from metatp.backends.numpy import native
from support.cpu import BUILDS, isa_library


@pytest.fixture(scope="module", params=list(BUILDS))
def build(request):
    """Each ISA build, in use for the module's kernel calls; skipped where this CPU cannot run it
    (it is still compiled, so another machine's path must at least build)."""
    isa = request.param
    lib = isa_library(isa)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(native.lib, "_library", lambda: (lib, native.library_isa(lib)))
        yield isa


@pytest.fixture(scope="module", autouse=True)
def fixed_thread_counts():
    """The thread governor off (csrc/threads.c): a test that names 2 threads gets 2, not 1 while
    another process holds a core (the bit-identity tests across thread counts would then compare
    one thread with itself). test_thread_governor.py switches it on where it tests it."""
    native.set_adaptive_threads(False)
    yield
    native.set_adaptive_threads(None)
