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
