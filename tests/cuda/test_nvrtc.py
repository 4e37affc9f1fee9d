"""Every CUDA module through real NVRTC, exactly as ``cupy.RawModule`` compiles it, with no GPU.

``RawModule(code=..., options=COMPILE_OPTIONS)`` hands the source to CuPy, which assembles its
options (``assemble_cupy_compiler_options``: the bundled CCCL and CuPy include folders, the
CUDA headers, its ``--std``), then compiles through ``_compile_module_with_cache`` (adds
``-ftz=true``, compiles an empty file to key its cache, adds ``-arch=sm_XX`` and
``--device-as-default-execution-space``) and loads the cubin into the driver. This test calls
the same CuPy functions with the same arguments; only two device-bound steps are replaced:
the per-device memo around the ``-arch`` choice (its undecorated function is called, with an
explicit arch) and the driver's module load (the cubin is kept instead). So the NVRTC text,
options and library are exactly a GPU machine's.

Option sets: CuPy 14 (``--std=c++17``, its default) and CuPy 13 (``--std=c++11``, its default
then); archs sm_80 and sm_90. Each compile must succeed with an empty NVRTC log (no
warnings) and export exactly ``expected_entry_points()`` as kernels.

Every (option set, arch) pair is compiled: four compiles a module. The two axes are nearly
independent (the option set changes only the front end, the C++ standard; the arch only the
``__CUDA_ARCH__`` branches, which hold inline PTX: ``mt_mma_s8``'s mma at sm_80+,
``griddepcontrol`` at sm_90+), but only the product checks their interaction, e.g. CuPy 13's
C++11 front end on the sm_90 branches a Hopper user of CuPy 13 compiles. ``METATP_NVRTC_ALL=0``
compiles the diagonal alone ({CuPy 14, sm_90}, {CuPy 13, sm_80}: each option set and each arch
once, half the time) for a quick local run; CI, with the suite at about 7 minutes since the
emulator's fibers got cheaper, runs the product again.

Needs the ``nvrtc`` extra (``pip install -e '.[nvrtc]'``: cupy-cuda12x, the NVRTC and CUDA
runtime-header wheels; about 230 MB of downloads, no GPU): .ci/run installs it. The tests
skip, saying why, only where those wheels cannot be imported.
"""

from __future__ import annotations

import io
import os
import struct
import types

import pytest

from metatp.backends.cuda import kernels as ck, runtime
from support.require import requires

#: (name, --std) of the option sets of the CuPy versions the backend supports
OPTION_SETS = (("cupy14", "c++17"), ("cupy13", "c++11"))
ARCHS = ("80", "90")
#: every (option set, arch) pair; METATP_NVRTC_ALL=0: each option set and each arch once
ALL_PAIRS = os.environ.get("METATP_NVRTC_ALL", "1") != "0"


def compile_targets() -> list[tuple[str, str, str]]:
    """(cupy version, --std, arch) to compile: the full product, or with METATP_NVRTC_ALL=0 the
    diagonal {CuPy 14, sm_90}, {CuPy 13, sm_80} (each option set and each arch once)."""
    if ALL_PAIRS:
        return [(version, std, arch) for version, std in OPTION_SETS for arch in ARCHS]
    return [(version, std, arch) for (version, std), arch in zip(OPTION_SETS, reversed(ARCHS))]


def _toolchain():
    """(compiler module, core module, NVRTC version) or a skip reason."""
    try:
        from cupy._core import core
        from cupy.cuda import compiler, nvrtc

        version = nvrtc.getVersion()
    except Exception as e:  # noqa: BLE001 - ImportError, or CuPy failing to load libnvrtc
        return None, (f"cupy with NVRTC is not importable ({type(e).__name__}: {e}); "
                      "pip install -e '.[nvrtc]' brings cupy-cuda12x and the NVRTC/header wheels")
    if not hasattr(compiler._get_arch_for_options_for_nvrtc, "__wrapped__"):
        return None, "this CuPy's arch selection cannot be called without a device"
    return (compiler, core, version), ""


TOOLCHAIN, WHY_NOT = _toolchain()
requires_nvrtc = requires("nvrtc", why=WHY_NOT if TOOLCHAIN is None else None)


class _KeptModule:
    """Stands in for cupy.cuda.function.Module: keeps the cubin instead of loading it."""

    def __init__(self) -> None:
        self.cubin: bytes | None = None
        self.mapping = None

    def load(self, cubin: bytes) -> None:
        self.cubin = bytes(cubin)

    def _set_mapping(self, mapping) -> None:
        self.mapping = mapping


def _kernel_symbols(elf: bytes) -> set[str]:
    """Names of the global functions (the kernels) in a cubin's ELF symbol table."""
    if elf[:4] != b"\x7fELF" or elf[4] != 2:
        raise ValueError("not a 64-bit ELF cubin")
    shoff = struct.unpack_from("<Q", elf, 0x28)[0]
    shentsize, shnum = struct.unpack_from("<HH", elf, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", elf, shoff + i * shentsize) for i in range(shnum)]
    names: set[str] = set()
    for sec in sections:
        if sec[1] != 2:                                    # SHT_SYMTAB
            continue
        strtab_off = sections[sec[6]][4]
        for off in range(sec[4], sec[4] + sec[5], 24):
            name, info = struct.unpack_from("<IB", elf, off)
            if info >> 4 == 1 and info & 0xF == 2:         # STB_GLOBAL, STT_FUNC
                start = strtab_off + name
                names.add(elf[start:elf.index(b"\0", start)].decode())
    return names


@pytest.fixture
def cupy_compile(monkeypatch):
    """compile(family, std, arch) -> (cubin, NVRTC log, final NVRTC options), through CuPy."""
    compiler, core, _ = TOOLCHAIN
    monkeypatch.setenv("CUPY_CACHE_IN_MEMORY", "1")          # always compile: no disk cache hit
    monkeypatch.setattr(compiler, "_get_arch_for_options_for_nvrtc",
                        compiler._get_arch_for_options_for_nvrtc.__wrapped__)
    monkeypatch.setattr(compiler, "function", types.SimpleNamespace(Module=_KeptModule))
    finals: list[tuple] = []
    real_compile = compiler._NVRTCProgram.compile

    def compile_and_keep_options(self, options=(), log_stream=None):
        finals.append(tuple(options))
        return real_compile(self, options, log_stream)
    monkeypatch.setattr(compiler._NVRTCProgram, "compile", compile_and_keep_options)
    default_std = next(o for o in core.assemble_cupy_compiler_options(()) if o.startswith("--std="))

    def run(family: str, std: str, arch: str):
        opts = tuple(ck.COMPILE_OPTIONS)
        if default_std != f"--std={std}":      # the other CuPy major's default, as its user would get it
            opts += (f"--std={std}",)
        log = io.StringIO()
        finals.clear()
        mod = compiler._compile_module_with_cache(ck.module_source(family), core.assemble_cupy_compiler_options(opts),
                                                  arch=arch, log_stream=log)
        return mod.cubin, log.getvalue(), finals[-1]
    return run


def test_the_default_targets_cover_each_option_set_and_each_arch():
    """The diagonal still compiles every option set and every arch at least once."""
    targets = compile_targets()
    assert {(v, s) for v, s, _ in targets} == set(OPTION_SETS)
    assert {a for _, _, a in targets} == set(ARCHS)


@requires_nvrtc
@pytest.mark.parametrize("cupy_version, std, arch", compile_targets())
@pytest.mark.parametrize("family", ck.FAMILIES)
def test_rawmodule_compiles_through_nvrtc(cupy_compile, family, cupy_version, std, arch):
    cubin, log, options = cupy_compile(family, std, arch)
    assert [o for o in options if o.startswith(("--std=", "-std="))] == [f"--std={std}"]
    assert f"-arch=sm_{arch}" in options and "-ftz=true" in options       # a cubin, flushed denormals
    assert "--device-as-default-execution-space" in options
    assert log.strip("\x00 \n") == "", f"NVRTC warnings for {family} ({cupy_version}, sm_{arch}):\n{log}"
    assert cubin is not None, "CuPy produced no module image"
    kernels = _kernel_symbols(cubin)
    expected = set(ck.expected_entry_points()[family])
    assert kernels == expected, f"missing: {sorted(expected - kernels)}; unexpected: {sorted(kernels - expected)}"


@requires_nvrtc
def test_probe_kernel_compiles_through_nvrtc(cupy_compile, monkeypatch):
    """The one-line kernel gpu_available() compiles on a GPU machine is valid CUDA for NVRTC."""
    monkeypatch.setattr(ck, "module_source", lambda family: runtime.PROBE_SOURCE)
    cubin, log, _ = cupy_compile("probe", "c++17", "90")
    assert _kernel_symbols(cubin) == {"metatp_probe"} and log.strip("\x00 \n") == ""


def test_kernel_symbols_reads_elf_symbols():
    """The ELF reader itself, on a hand-made symbol table (runs without NVRTC)."""
    strtab = b"\0kern_a\0helper\0"
    sym = struct.Struct("<IBBHQQ")
    symtab = sym.pack(0, 0, 0, 0, 0, 0) + sym.pack(1, 0x12, 0, 1, 0, 0) + sym.pack(8, 0x02, 0, 1, 0, 0)
    body = strtab + symtab
    shoff = 64 + len(body)
    header = bytearray(64)
    header[:5] = b"\x7fELF\x02"
    struct.pack_into("<Q", header, 0x28, shoff)
    struct.pack_into("<HH", header, 0x3A, 64, 3)
    sec = struct.Struct("<IIQQQQIIQQ")
    sections = (sec.pack(0, 0, 0, 0, 0, 0, 0, 0, 0, 0) + sec.pack(0, 3, 0, 0, 64, len(strtab), 0, 0, 1, 0)
                + sec.pack(0, 2, 0, 0, 64 + len(strtab), len(symtab), 1, 0, 8, 24))
    assert _kernel_symbols(bytes(header) + body + sections) == {"kern_a"}
    with pytest.raises(ValueError):
        _kernel_symbols(b"not an elf")
