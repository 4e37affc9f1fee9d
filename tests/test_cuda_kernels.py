"""Every CUDA kernel against a numpy reference (needs CuPy and a CUDA GPU).

The checks live in ``tools/gpu_kernels_check.py`` (also a standalone script printing a
markdown table); each group here runs one of them and fails with the table of failing
cases. Without a GPU the GPU tests skip; the few tests at the end check the numpy
oracles themselves and run anywhere.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from metatp.backends.cuda_kernels import gpu_available
from metatp.tools import gpu_kernels_check as gkc

requires_gpu = pytest.mark.skipif(
    not gpu_available(), reason="no CUDA GPU (cupy not installed or no device visible)"
)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("group", gkc.CHECK_NAMES)
def test_kernel_group(group):
    results = gkc.check_all_kernels([group], seed=1234, time_reps=0)
    assert results, "no cases ran"
    bad = [r for r in results if not r["pass"]]
    if bad:
        details = "\n".join(
            f"{r['name']} [{r['dtype']}]: {r.get('error')}\n{r.get('traceback', '')}"
            for r in bad if r.get("error")
        )
        pytest.fail(f"{len(bad)}/{len(results)} cases failed\n{gkc.markdown_table(bad)}\n{details}")


# ------------------------------------------------------------- oracle sanity (CPU)
def test_bf16_bits_match_gguf():
    gguf = pytest.importorskip("gguf")
    x = (np.random.default_rng(0).standard_normal(1000) * 100).astype(np.float32)
    x[:3] = [np.inf, -np.inf, np.nan]
    ours = gkc.f32_to_bf16_bits(x)
    ref = gguf.quants.quantize(x, gguf.GGMLQuantizationType.BF16).view(np.uint16)
    assert np.array_equal(ours, ref)


@pytest.mark.parametrize("wtype", ["q8_0", "q4_0", "q4_1", "q4_k", "q5_k", "q6_k", "bf16"])
def test_make_weight_oracle(wtype):
    raw, deq = gkc.make_weight(np.random.default_rng(1), wtype, 3, 512)
    assert raw.dtype == np.uint8 and raw.shape[0] == 3
    assert deq.shape == (3, 512) and np.isfinite(deq).all() and np.abs(deq).max() > 0


def test_ref_attention_single_key_returns_v():
    rng = np.random.default_rng(2)
    q = rng.standard_normal((1, 4, 8))
    k = rng.standard_normal((1, 2, 8))
    v = rng.standard_normal((1, 2, 8))
    out = gkc.ref_attention(q, k, v, 0.3)
    assert np.allclose(out, v[0][[0, 0, 1, 1]][None])


def test_ref_rope_position_zero_is_identity():
    x = np.random.default_rng(3).standard_normal((2, 3, 16))
    y = gkc.ref_rope(x, np.zeros(2, np.int32), 16, 10000.0, 1.0, neox=True)
    assert np.allclose(x, y)


def test_rel_err_flags_nan():
    assert gkc.rel_err(np.array([1.0, np.nan]), np.array([1.0, 2.0])) == math.inf
    assert gkc.rel_err(np.array([1.0, 2.0]), np.array([1.0, 2.0])) == 0.0
