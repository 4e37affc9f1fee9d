"""The compiled greedy pick of logits rows (csrc/row_best.c, `native.row_best`): per row numpy's
argmax (the lowest index among equal maxima, -0.0 equal to 0.0) and the value at it, and whether
every value is finite, on every ISA build this CPU runs (the others are compiled), over row
lengths that cross the vector widths, strided rows, many ties, and NaN/inf/-inf anywhere."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from metatp.backends.logits_read import _device_best
from metatp.backends.numpy import native
from metatp.testing.synth import SynthSpec
from support.require import requires

pytestmark = requires("cpu_kernels")

SPEC = SynthSpec(n_layer=1, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, seed=31, default_type="Q8_0")


@settings(max_examples=80, deadline=None)
@given(rows=st.integers(1, 9), n=st.one_of(st.integers(1, 70), st.sampled_from([127, 128, 129, 300])),
       pad=st.integers(0, 17), levels=st.integers(1, 4), seed=st.integers(0, 2**31),
       bad=st.lists(st.tuples(st.integers(0, 8), st.integers(0, 299), st.sampled_from([np.nan, np.inf, -np.inf])),
                    max_size=3),
       threads=st.sampled_from([1, 2]))
def test_the_pick_is_numpys_argmax_and_non_finite_rows_are_flagged(build, rows, n, pad, levels, seed, bad, threads):
    rng = np.random.default_rng(seed)
    buf = rng.standard_normal((rows, n + pad)).astype(np.float32) * 50
    x = buf[:, :n]
    x[...] = rng.integers(-levels, levels + 1, size=(rows, n))          # few values: many ties
    x[rng.random((rows, n)) < 0.2] = -0.0
    for r, i, v in bad:
        if r < rows and i < n:
            x[r, i] = v
    val, idx, finite = native.row_best(x, threads)
    for r in range(rows):
        assert finite[r] == np.isfinite(x[r]).all()
        if finite[r]:
            assert idx[r] == np.argmax(x[r])
            assert val[r].tobytes() == x[r, idx[r]].tobytes()


def test_a_big_block_on_two_threads_matches_numpy(build):
    x = np.random.default_rng(1).standard_normal((16, 49152)).astype(np.float32)
    x[4, 40000] = x[4].max() + 1.0
    x[9, 123] = np.inf
    val, idx, finite = native.row_best(x, 2)
    assert list(finite) == [r != 9 for r in range(16)]
    keep = finite.nonzero()[0]
    assert (idx[keep] == x[keep].argmax(axis=1)).all() and (val[keep] == x[keep].max(axis=1)).all()


def test_views_the_kernel_does_not_take_fall_back_to_numpy():
    assert native.row_best(np.zeros((2, 8), np.float64)) is None
    assert native.row_best(np.zeros((2, 8), np.float32)[:, ::2]) is None
    assert native.row_best(np.zeros((0, 8), np.float32)) is None


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 5), cuts=st.lists(st.integers(1, 40), min_size=1, max_size=4), seed=st.integers(0, 2**31))
def test_the_device_pick_is_the_same_with_and_without_the_kernel(rows, cuts, seed):
    rng = np.random.default_rng(seed)
    n = sum(cuts)
    local = rng.integers(0, 3, size=(rows, n)).astype(np.float32)
    if seed % 3 == 0:
        local[rng.integers(rows), rng.integers(n)] = np.nan
    spans, g = [], 0
    for c in cuts:                                          # chunks of a device, global starts apart
        spans.append((1000 * len(spans), g, c))
        g += c
    compiled = _device_best(local, spans)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(native.lib, "_library", lambda: (None, "off"))
        plain = _device_best(local, spans)
    fin = plain[2] > 0
    assert (compiled[2] == plain[2]).all()
    assert (compiled[:2, fin] == plain[:2, fin]).all()


def test_the_pick_runs_on_the_backends_kernel_threads(monkeypatch, path):
    """A greedy step of several sequences picks on the threads the user gave the backend."""
    import metatp.backends.logits_read as logits_read
    from metatp import LLM, SamplingParams

    seen = []
    real = logits_read.row_best
    monkeypatch.setattr(logits_read, "row_best", lambda x2, threads=None: seen.append(threads) or real(x2, threads))
    llm = LLM(path, n_ctx=256, backend="numpy", backend_options={"kernel_threads": 1})
    llm.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert seen and set(seen) == {1}
