"""Device slices of a split weight held by one process lie end to end in memory, in device order
(`codes.adjacent`): the node's grouped product reads them in that order as one stream."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from metatp.backends.numpy.codes import AffineWeight, adjacent
from metatp.sampling import SamplingParams
from metatp.testing.synth import SynthSpec

SPEC = SynthSpec(n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, tied=False, seed=61, default_type="Q4_1")


def _weight(rows: int, k: int, offset: bool, rng) -> AffineWeight:
    q = rng.integers(0, 255, (rows, k // 2), dtype=np.uint8)
    scale = rng.standard_normal((rows, k // 32)).astype(np.float16)
    off = rng.standard_normal((rows, k // 32)).astype(np.float16) if offset else None
    return AffineWeight(q=q, scale=scale, offset=off, block=32, bits=4, group=8)


def _start(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


@settings(max_examples=30, deadline=None)
@given(rows=st.lists(st.sampled_from([0, 8, 16, 24, 64]), min_size=2, max_size=4),
       k=st.sampled_from([32, 64, 96]), offset=st.booleans())
def test_adjacent_keeps_every_value_and_puts_the_slices_end_to_end(rows, k, offset):
    rng = np.random.default_rng(len(rows) * 1000 + k)
    ws = [_weight(r, k, offset, rng) for r in rows]
    out = adjacent(ws)
    fields = ("q", "scale", "offset") if offset else ("q", "scale")
    for w, o in zip(ws, out):
        assert (o.offset is None) == (not offset) and o.group == w.group and o.bits == w.bits
        for f in fields:
            a, b = getattr(w, f), getattr(o, f)
            assert b.dtype == a.dtype and b.shape == a.shape and np.array_equal(a, b)
            assert not np.shares_memory(a, b)
    for f in fields:
        arrs = [getattr(o, f) for o in out if getattr(o, f).nbytes]     # an empty slice has no place
        for a, b in zip(arrs, arrs[1:]):
            assert _start(a) % 64 == 0
            gap = _start(b) - (_start(a) + a.nbytes)
            assert 0 <= gap < 64, f"{f}: slices {gap} bytes apart"


def test_weights_with_and_without_offsets_are_left_as_they_are():
    rng = np.random.default_rng(0)
    ws = [_weight(8, 32, True, rng), _weight(8, 32, False, rng)]
    assert all(a is b for a, b in zip(adjacent(ws), ws))


def test_a_split_weights_device_slices_are_adjacent_and_decode_as_one_device(path):
    from metatp import LLM

    prompts = [[1, 5, 9, 2], [3, 7]]
    sp = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    one = LLM(path, n_ctx=128, backend="numpy", numerics="q8")
    tp = LLM(path, n_ctx=128, backend="numpy", numerics="q8", n_devices=2, split_mode="tensor")
    be = tp.backend
    tp.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=1))      # the weights are uploaded with the first plan
    split = [t for t in be._packed[0] if t in be._packed[1] and be._packed[0][t] is not be._packed[1][t]]
    assert split, "no split weight kept as codes on both devices"
    for t in split:
        a, b = be._packed[0][t].q, be._packed[1][t].q
        assert 0 <= _start(b) - (_start(a) + a.nbytes) < 64, t.name
    assert ([o.outputs[0].token_ids for o in tp.generate(prompts, sp)]
            == [o.outputs[0].token_ids for o in one.generate(prompts, sp)])
