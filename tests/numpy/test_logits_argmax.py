"""Greedy tokens from vocabulary-split logits without gathering them (backends/logits_read.py,
issue 24 item 6): each device reduces its slice to (max, global index, finite) per row, and the
pick equals numpy's argmax of the gathered row -- the lowest index among equal maxima -- at every
split, with ties across device boundaries; a row with NaN/inf gives None (the caller then reads
the row and raises as before). End to end: greedy runs under a vocabulary split gather nothing."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from metatp import LLM, SamplingParams
from metatp.backends.logits_read import _device_best, _one_row, combine
from metatp.testing.synth import SynthSpec

SPEC = SynthSpec(n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, tied=False, seed=24, default_type="Q8_0")


@settings(max_examples=200, deadline=None)
@given(rows=st.integers(1, 6), cuts=st.lists(st.integers(1, 9), min_size=1, max_size=5), seed=st.integers(0, 2**31),
       levels=st.integers(2, 5))
def test_the_pick_is_the_argmax_of_the_gathered_row(rows, cuts, seed, levels):
    rng = np.random.default_rng(seed)
    n = sum(cuts)
    full = rng.integers(0, levels, size=(rows, n)).astype(np.float32)      # few values: many ties
    if seed % 5 == 0:
        full[0, rng.integers(n)] = np.nan
    if seed % 7 == 0:
        full[-1, rng.integers(n)] = -np.inf
    every, slices, spans, g = [], [], [], 0
    for c in cuts:                                # one chunk per device, in vocabulary order
        every.append(_device_best(full[:, g:g + c], [(g, 0, c)]))
        slices.append(full[:, g:g + c])
        spans.append([(g, 0, c)])
        g += c
    got = combine(every)
    for r in range(rows):
        one = _one_row([s[r:r + 1] for s in slices], spans)    # the one-row path of a decode step
        if not np.isfinite(full[r]).all():
            assert got[r] is None and one is None
        else:
            assert got[r] == one == int(np.argmax(full[r]))


def test_several_chunks_on_one_device_keep_the_first_maximum():
    full = np.array([[1, 5, 2, 5, 5, 0]], dtype=np.float32)
    dev0 = _device_best(full[:, [0, 1, 4, 5]], [(0, 0, 2), (4, 2, 2)])   # device 0 holds [0:2] and [4:6]
    dev1 = _device_best(full[:, [2, 3]], [(2, 0, 2)])
    assert combine([dev0, dev1]) == [1] and combine([dev1, dev0]) == [1]
    held = [full[:, [0, 1, 4, 5]], full[:, [2, 3]]]
    chunks = [[(0, 0, 2), (4, 2, 2)], [(2, 0, 2)]]
    assert _one_row(held, chunks) == 1 and _one_row(held[::-1], chunks[::-1]) == 1


@pytest.mark.parametrize("n", [2, 3])
def test_greedy_under_a_vocabulary_split_gathers_nothing_and_equals_one_device(path, n):
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    one = [o.outputs[0].token_ids for o in LLM(path, n_ctx=256, backend="numpy").generate(prompts, greedy)]
    tp = LLM(path, n_ctx=256, backend="numpy", n_devices=n, split_mode="tensor")
    assert [o.outputs[0].token_ids for o in tp.generate(prompts, greedy)] == one
    assert tp.engine.logits_bytes == 0          # one process: nothing crosses, nothing is gathered
    with_lp = tp.generate(prompts, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1))
    assert [o.outputs[0].token_ids for o in with_lp] == one     # the gathered path picks the same tokens

