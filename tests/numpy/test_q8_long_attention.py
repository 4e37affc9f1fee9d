"""numerics="q8" runs attention compiled at any pass length (backends/numpy/kernels/attention.py):
the integer products already do, and a numpy attention between them handed the two cores from
OpenMP's threads to BLAS's and back every layer (pp512 ran at 0.4x of one thread). The long-pass
kernel must give the attention numpy computes, to float rounding, for every cache type."""

from __future__ import annotations

import numpy as np
import pytest

from metatp import LLM
from metatp.testing.synth import SynthSpec
from support.require import requires

SPEC = SynthSpec(n_layer=2, n_embd=128, n_head=4, n_head_kv=2, n_ff=256, tied=False, seed=41, default_type="Q8_0")


@requires("cpu_kernels")
@pytest.mark.parametrize("cache", ["f32", "f16", "q8_0"])
def test_long_q8_passes_take_the_compiled_attention(path, cache, monkeypatch):
    """A 150-row q8 pass goes through the compiled attention (the kernel itself is held to the
    float64 oracle at long T in test_kv_cache_types / test_cpu_kernels). Against numpy's
    attention the logits differ by more than float rounding, because q8 rounds every activation
    to int8 and a last-bit difference flips codes; the greedy picks agree."""
    from metatp.backends.numpy.kernels import attention as attn

    ids = [int(t) for t in np.random.default_rng(3).integers(1, 200, size=150)]
    calls = {"n": 0}
    real = attn.prepare_attention

    def counting(q, *a, **k):
        calls["n"] += q.shape[1] > 64
        return real(q, *a, **k)
    monkeypatch.setattr(attn, "prepare_attention", counting)
    fast = LLM(path, n_ctx=256, backend="numpy", numerics="q8", cache_type_k=cache).score(ids)
    assert calls["n"] > 0                                     # the 150-row pass went through the kernel
    monkeypatch.setattr(attn, "attention_usable", lambda *a, **k: False)   # every attention in numpy
    slow = LLM(path, n_ctx=256, backend="numpy", numerics="q8", cache_type_k=cache).score(ids)
    assert np.abs(fast - slow).max() < 0.05 * np.abs(slow).max()
    assert (fast.argmax(axis=1) == slow.argmax(axis=1)).mean() >= 0.95


def test_exact_numerics_take_the_compiled_attention_where_their_products_do(path, monkeypatch):
    """Exact mode runs long passes' attention compiled where its products run compiled at any
    length (512-bit builds: the row-group float kernel); elsewhere it keeps numpy's attention
    between the BLAS products. Either way the scores are those of numpy's attention."""
    from metatp.backends.numpy.kernels import attention as attn

    seen: list[int] = []
    real = attn.prepare_attention
    monkeypatch.setattr(attn, "prepare_attention", lambda q, *a, **k: seen.append(q.shape[1]) or real(q, *a, **k))
    ids = list(range(1, 151))
    llm = LLM(path, n_ctx=256, backend="numpy")
    fast = llm.score(ids)
    if llm.backend.groups_rows():
        assert max(seen) > 64
    else:
        assert all(t <= 64 for t in seen)
    monkeypatch.setattr(attn, "prepare_attention", real)
    slow = LLM(path, n_ctx=256, backend="numpy", cpu_kernels=False).score(ids)
    assert np.allclose(fast, slow, rtol=1e-4, atol=1e-4 * np.abs(slow).max())
