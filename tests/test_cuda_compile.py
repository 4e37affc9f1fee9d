"""Compile every CUDA source with nvcc (sm_80 and sm_90) and check the loader's view of them.

The nvcc tests compile the exact text NVRTC will get (``module_source``: local headers
pasted in) to PTX with ``-Werror all-warnings`` and check that the PTX entry points are
exactly the kernel names ``backends/cuda_kernels.py`` launches. They skip only when
nvcc is not on PATH; no GPU is needed.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys

import pytest

from metatp.backends import cuda_kernels as ck

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
    gguf = pytest.importorskip("gguf")
    for name, (qk, nbytes) in ck.WEIGHT_TYPES.items():
        assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name.upper()]] == (qk, nbytes)


def test_import_without_cupy():
    code = (
        "import sys; sys.modules['cupy'] = None\n"
        "import metatp.backends.cuda_kernels as ck\n"
        "assert ck.gpu_available() is False\n"
        "assert ck.kernel_sources()\n"
        "print('ok')\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


@pytest.mark.skipif(NVCC is None, reason="nvcc not on PATH")
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("family", ck.FAMILIES)
def test_nvcc_compiles(family, arch, tmp_path):
    cu = tmp_path / f"{family}.cu"
    cu.write_text(ck.module_source(family), encoding="utf-8")
    ptx = tmp_path / f"{family}_{arch}.ptx"
    cmd = [NVCC, "-ptx", f"-arch={arch}", "-Werror", "all-warnings", "-o", str(ptx), str(cu)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"{' '.join(cmd)}\n{r.stdout}\n{r.stderr}"
    entries = set(re.findall(r"\.entry\s+(\w+)", ptx.read_text()))
    expected = set(ck.expected_entry_points()[family])
    assert entries == expected, (
        f"missing: {sorted(expected - entries)}; unexpected: {sorted(entries - expected)}"
    )
