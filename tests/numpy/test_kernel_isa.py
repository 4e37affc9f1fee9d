"""METATP_KERNEL_ISA: the kernels built for one named ISA path instead of -march=native (to run
what an AVX2-only machine runs on a CPU that has more), refused by name where the value is unknown
or the CPU cannot run that build (rather than dying of an illegal instruction)."""

from __future__ import annotations

import platform

import numpy as np
import pytest

from metatp.backends.numpy import native
from metatp.backends.numpy.native import lib
from metatp.ir.errors import ConfigError
from support.require import requires

pytestmark = requires("cpu_kernels")


@pytest.fixture
def fresh_library(monkeypatch):
    """The library chosen anew under this test's environment, and the usual one again after it."""
    lib._library.cache_clear()
    yield monkeypatch
    monkeypatch.undo()
    lib._library.cache_clear()


def test_an_unknown_isa_is_refused_by_name(fresh_library):
    fresh_library.setenv("METATP_KERNEL_ISA", "avx3")
    with pytest.raises(ConfigError, match=r"METATP_KERNEL_ISA='avx3'.*avx2"):
        lib.available()


def test_an_isa_this_cpu_lacks_is_refused_by_name(fresh_library):
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86-64 builds")
    fresh_library.setenv("METATP_KERNEL_ISA", "avx512-vnni")
    fresh_library.setattr(lib, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    with pytest.raises(ConfigError, match="lacks avx512_vnni"):
        lib.available()


@pytest.mark.parametrize("isa", ["avx2", "portable"])
def test_the_named_build_is_the_one_in_use(fresh_library, isa):
    why = lib.isa_unrunnable(isa)
    if why:
        pytest.skip(f"the {isa} build: {why}")
    fresh_library.setenv("METATP_KERNEL_ISA", isa)
    assert lib.isa() == isa
    assert f"METATP_KERNEL_ISA={isa}" in lib.kernel_info()
    x = np.random.default_rng(0).standard_normal((3, 64)).astype(np.float32)
    w = np.random.default_rng(1).standard_normal(64).astype(np.float32)
    out = np.empty_like(x)
    native.prepare_rms_norm(x, w, out, 1e-6)()           # the build in use computes
    ref = x / np.sqrt((x.astype(np.float64) ** 2).mean(axis=1, keepdims=True) + 1e-6) * w
    assert np.allclose(out, ref, rtol=1e-5, atol=1e-6)

def test_native_is_the_default(fresh_library):
    fresh_library.delenv("METATP_KERNEL_ISA", raising=False)
    assert "METATP_KERNEL_ISA" not in lib.kernel_info()     # -march=native or its fallbacks


AMX_CPU = frozenset({"avx2", "fma", "avx512_vnni", "avx512vl", "avx512bw", "amx_tile", "amx_int8"})


@pytest.mark.parametrize("flags, amx", [(AMX_CPU, True), (AMX_CPU - {"amx_int8"}, False),
                                        (frozenset({"avx2", "fma"}), False)])
def test_native_takes_the_amx_tiles_where_the_cpu_has_them(fresh_library, flags, amx):
    """-march=native builds q8_amx.c's tiles first where the CPU reports amx_tile and amx_int8,
    with the plain native sets after it (a compiler without AMX falls back to them)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86-64 builds")
    fresh_library.delenv("METATP_KERNEL_ISA", raising=False)
    fresh_library.setattr(lib, "cpu_flags", lambda: flags)
    sets = lib._chosen_flag_sets()
    assert ("-DMETATP_AMX" in sets[0]) is amx and "-march=native" in sets[0]
    assert sets[-len(lib._FLAG_SETS):] == lib._FLAG_SETS


def test_the_native_build_here_says_whether_it_runs_amx_tiles(fresh_library):
    """On this machine: an AMX CPU gets the avx512-amx path (or the OS's refusal is reported),
    any other CPU the path its flags give."""
    fresh_library.delenv("METATP_KERNEL_ISA", raising=False)
    if lib.isa_unrunnable("avx512-amx") is None:
        assert lib.isa() == "avx512-amx"
        assert lib.amx_refused(lib._library()[0]) == ("refused by the OS" in lib.kernel_info())
    else:
        assert lib.isa() != "avx512-amx"
