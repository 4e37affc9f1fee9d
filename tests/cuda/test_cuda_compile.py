"""Compile every CUDA source with nvcc (sm_80 and sm_90) and check the loader's view of them.

The nvcc tests compile the exact text NVRTC will get (``module_source``: local headers
pasted in) with ``-Werror all-warnings`` (sm_80 to PTX, sm_90 to a cubin with ptxas's resource
report) and check that the entry points are exactly the kernel names the launchers of
``backends/cuda/kernels/`` launch, and that every sm_90 kernel's registers let its largest block
launch. They skip only when nvcc is not on PATH; no GPU is needed.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import pytest

from metatp.backends.cuda import kernels as ck, runtime
from support.require import requires

ARCHS = ("sm_80", "sm_90")
NVCC = shutil.which("nvcc")


def test_one_source_per_family():
    srcs = ck.kernel_sources()
    assert "quant.cuh" in srcs
    assert sorted(n[:-3] for n in srcs if n.endswith(".cu")) == sorted(ck.FAMILIES)


@pytest.mark.parametrize("family", ck.FAMILIES)
def test_module_source_is_self_contained(family):
    src = ck.module_source(family)
    # NVRTC gets no include path and has no host headers: nothing may be included.
    assert not re.search(r"^\s*#\s*include", src, re.MULTILINE), "unexpanded #include"
    assert "METATP_QUANT_CUH" in src
    # no C++ name mangling surprises: every launched name is an extern "C" entry
    assert 'extern "C"' in src


def test_weight_types_match_gguf():
    import gguf
    for name, (qk, nbytes) in ck.WEIGHT_TYPES.items():
        assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name.upper()]] == (qk, nbytes)


def test_kv_cache_types_match_gguf_and_the_graph():
    """The quantized cache blocks the kernels write and read are gguf's, and every KV cache type
    the graph offers has its set_rows and attention entry points."""
    import gguf
    from metatp.ir.models.common import KV_CACHE_TYPES

    for name, (qk, nbytes) in ck.KV_QUANT_TYPES.items():
        assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name.upper()]] == (qk, nbytes)
    assert set(ck.CACHE_TYPES) == set(KV_CACHE_TYPES)
    eps = ck.expected_entry_points()
    for t in ck.CACHE_TYPES:
        assert f"set_rows_f32_{t}" in eps["kv"] and f"attn_prefill_{t}" in eps["attn"]
        assert all(f"attn_decode_{t}_g{g}" in eps["attn"] for g in (1, 2, 4, 8))


def test_import_without_cupy():
    code = (
        "import sys; sys.modules['cupy'] = None\n"
        "import metatp.backends.cuda.kernels as ck, metatp.backends.cuda.runtime as rt\n"
        "import metatp.backends.cuda.backend\n"
        "assert rt.gpu_available() is False\n"
        "assert ck.kernel_sources()\n"
        "print('ok')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


#: sm_80 / sm_90 (and sm_86 / sm_89): 64K 32-bit registers for a block, allocated to each warp in
#: units of 256 (8 a thread); a block needing more is refused ("too many resources requested for launch")
_REGISTERS_A_BLOCK = 65536
_REGISTER_UNIT_A_WARP = 256
_ENTRY_RE = re.compile(r"Compiling entry function '(\w+)' for '(sm_\d+)'\n(.*?)(?=Compiling entry function|\Z)", re.S)
_compiled: dict[tuple[str, str], tuple[set[str], str]] = {}     # (family, arch) -> (entry points, ptxas report)


def _compile(family: str, arch: str) -> tuple[set[str], str]:
    """nvcc on the family's NVRTC text: sm_80 to PTX (its .entry names), sm_90 to a cubin with
    --resource-usage (the entries ptxas compiled, and its report). Once per (family, arch)."""
    key = (family, arch)
    if key not in _compiled:
        with tempfile.TemporaryDirectory() as tmp:
            cu = Path(tmp) / f"{family}.cu"
            cu.write_text(ck.module_source(family), encoding="utf-8")
            cubin = arch == "sm_90"
            out = Path(tmp) / f"{family}_{arch}.{'cubin' if cubin else 'ptx'}"
            cmd = [NVCC, "-cubin" if cubin else "-ptx", f"-arch={arch}", "-Werror", "all-warnings",
                   *(["--resource-usage"] if cubin else []), "-o", str(out), str(cu)]
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            assert r.returncode == 0, f"{' '.join(cmd)}\n{r.stdout}\n{r.stderr}"
            report = r.stdout + r.stderr
            entries = ({m[0] for m in _ENTRY_RE.findall(report)} if cubin
                       else set(re.findall(r"\.entry\s+(\w+)", out.read_text())))
        _compiled[key] = entries, report
    return _compiled[key]


@requires("nvcc", why=None if NVCC else "nvcc not on PATH")
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("family", ck.FAMILIES)
def test_nvcc_compiles(family, arch):
    entries, _ = _compile(family, arch)
    expected = set(ck.expected_entry_points()[family])
    assert entries == expected, (
        f"missing: {sorted(expected - entries)}; unexpected: {sorted(entries - expected)}"
    )


def registers_a_block(registers: int, threads: int) -> int:
    """The registers a block of `threads` takes when each thread uses `registers` (whole warps,
    each given a multiple of 256)."""
    per_warp = -(-registers * 32 // _REGISTER_UNIT_A_WARP) * _REGISTER_UNIT_A_WARP
    return -(-threads // 32) * per_warp


def test_registers_a_block_rounds_as_the_gpu_allocates():
    assert registers_a_block(255, 256) == 65536 and registers_a_block(255, 257) > 65536
    assert registers_a_block(64, 1024) == 65536 and registers_a_block(65, 1024) > 65536
    assert registers_a_block(33, 32) == 40 * 32 and registers_a_block(1, 1) == 256


@requires("nvcc", why=None if NVCC else "nvcc not on PATH")
@pytest.mark.parametrize("family", ck.FAMILIES)
def test_kernels_fit_their_largest_block(family):
    """Each sm_90 entry point's registers (ptxas) for its largest block: __launch_bounds__(N) -> N
    threads, none -> 1024 (what a launch may ask). Spills are printed (-rP shows them), not failed."""
    from metatp.testing.cuda_emulator import launch_bounds

    _, report = _compile(family, "sm_90")
    bounds = launch_bounds(ck.module_source(family))
    too_big, spills = [], []
    for name, _arch, props in _ENTRY_RE.findall(report):
        registers = int(re.search(r"Used (\d+) registers", props).group(1))
        threads = bounds.get(name, 1024)
        need = registers_a_block(registers, threads)
        if need > _REGISTERS_A_BLOCK:
            too_big.append(f"{name}: {registers} registers x {threads} threads = {need} > {_REGISTERS_A_BLOCK}")
        stores, loads = map(int, re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", props).groups())
        if stores or loads:
            spills.append(f"{name}: {registers} registers, {stores} B spill stores, {loads} B spill loads")
    print(f"{family} (sm_90) spills:", *(spills or ["none"]), sep="\n  ")
    assert not too_big, "blocks the driver would refuse:\n" + "\n".join(too_big)


# ------------------------------------------------------------- the GPU probe ("auto")
def _fake_cupy(device: bool = True, error: Exception | None = None):
    """A stand-in for the cupy module: a device or not, a RawKernel that runs or raises."""
    import types

    import numpy as np

    class Buffer:
        def __init__(self) -> None:
            self.value = np.zeros(1, np.int32)

        def get(self):
            return self.value

    class RawKernel:
        def __init__(self, code: str, name: str) -> None:
            assert name in code

        def __call__(self, grid, block, args):
            if error is not None:
                raise error
            args[0].value[0] = 7

    cuda = types.SimpleNamespace(is_available=lambda: device)
    return types.SimpleNamespace(cuda=cuda, RawKernel=RawKernel, zeros=lambda n, dtype: Buffer())


@pytest.fixture
def fresh_probe(monkeypatch):
    monkeypatch.setattr(runtime, "_probe_result", None)
    return monkeypatch


@pytest.mark.parametrize("error, hint", [
    (RuntimeError("CuPy failed to load libnvrtc.so.12: OSError: libnvrtc.so.12: cannot open shared object file"),
     "nvidia-cuda-nvrtc-cu12"),
    (RuntimeError("Failed to find CUDA headers. Please install CUDA toolkit headers (e.g., pip install "
                  "cupy-cuda12x[ctk])"), "nvidia-cuda-runtime-cu12"),
    (RuntimeError("Failed to auto-detect CUDA root directory. Please specify `CUDA_PATH`"), "nvidia-cuda-runtime-cu12"),
])
def test_auto_falls_back_to_numpy_with_one_warning(fresh_probe, error, hint):
    """A visible GPU whose kernels cannot compile (no NVRTC, no headers): "auto" picks numpy
    and warns once, saying what to install; "cupy" is refused with the same reason."""
    from metatp.backends import resolve_backend_name
    from metatp.ir.errors import BackendUnavailableError

    fresh_probe.setitem(sys.modules, "cupy", _fake_cupy(error=error))
    with pytest.warns(RuntimeWarning, match=hint) as caught:
        assert resolve_backend_name("auto") == "numpy"
    assert len(caught) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")                 # probed once: no second warning
        assert resolve_backend_name("auto") == "numpy"
        with pytest.raises(BackendUnavailableError, match=hint):
            resolve_backend_name("cupy")


def test_probe_without_device_is_silent_and_with_a_working_kernel_picks_cupy(fresh_probe):
    from metatp.backends import resolve_backend_name

    fresh_probe.setitem(sys.modules, "cupy", _fake_cupy(device=False))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert runtime.gpu_probe() == (False, "cupy is installed but sees no CUDA device")
    fresh_probe.setattr(runtime, "_probe_result", None)
    fresh_probe.setitem(sys.modules, "cupy", _fake_cupy())
    assert resolve_backend_name("auto") == "cupy"


def test_one_gpu_probe():
    """backends.gpu_available is cuda.runtime.gpu_available: one probe, one cached answer."""
    import metatp.backends as backends

    assert backends.gpu_available is runtime.gpu_available and backends.gpu_probe is runtime.gpu_probe


def test_installed_cupy_without_gpu_is_quick_and_silent():
    """This machine (cupy may be installed, no GPU): the probe says no, fast, with no warning,
    so the whole suite runs on numpy."""
    if runtime.gpu_available():
        pytest.skip("a GPU is usable here")
    code = ("import time, warnings; warnings.simplefilter('error'); t = time.perf_counter()\n"
            "import metatp.backends as b\n"
            "ok, why = b.gpu_probe()\n"
            "assert ok is False and b.resolve_backend_name('auto') == 'numpy', why\n"
            "print(round(time.perf_counter() - t, 2), why)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert float(r.stdout.split()[0]) < 10, r.stdout
