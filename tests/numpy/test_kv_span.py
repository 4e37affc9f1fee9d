"""The attended span of a few-token pass (engine.kv_span, NumpyBackend.kv_span_floor): with the
compiled kernels a decode attends over the first KV_SPAN_FLOOR cells whatever its depth (their
attention reads only the cells a row sees), so a growing cache compiles no new plans; the span
changes no result; `Engine.warm_up` compiles a server's decode plans before its first request."""

from __future__ import annotations

import numpy as np

from metatp import LLM, SamplingParams
from metatp.backends.numpy.backend import KV_SPAN_FLOOR
from metatp.testing.synth import SynthSpec
from support.require import requires

SPEC = SynthSpec(n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, tied=False, seed=61, default_type="Q8_0",
                 n_ctx_train=8192)

pytestmark = requires("cpu_kernels")


def _spans(llm) -> set[int]:
    return {key[1] for key in llm.engine._plans}


def test_a_decode_deeper_than_kv_pad_compiles_no_new_plan(path):
    llm = LLM(path, n_ctx=1024, backend="numpy")
    eng = llm.engine
    assert eng.kv_span(1, 1) == eng.kv_span(900, 16) == 1024          # the floor covers this cache
    assert eng.kv_span(900, 600) == 1024 and eng.kv_span(10, 600) == 256   # a long pass: the span in use
    sp = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    llm.generate([[1, 2, 3]], sp)
    plans = set(eng._plans)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=600, temperature=0, ignore_eos=True))    # past 256 and 512
    assert set(eng._plans) == plans and _spans(llm) == {1024}


def test_the_span_changes_no_token_and_no_logit(path, monkeypatch):
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
    sp = SamplingParams(max_tokens=300, temperature=0, ignore_eos=True, logprobs=3)
    floored = LLM(path, n_ctx=2048, backend="numpy", max_num_seqs=3)
    got = floored.generate(prompts, sp)
    assert _spans(floored) == {2048}
    plain = LLM(path, n_ctx=2048, backend="numpy", max_num_seqs=3)
    monkeypatch.setattr(type(plain.engine.backend), "kv_span_floor", lambda self, n_rows: 0)
    want = plain.generate(prompts, sp)
    assert len(_spans(plain)) > 1                       # without the floor: a plan per 256 cells in use
    for a, b in zip(got, want):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs        # the same floats, not close ones


def test_warm_up_compiles_each_decode_and_arrival_bucket_once(path):
    llm = LLM(path, n_ctx=8192, backend="numpy", max_num_seqs=16)
    eng = llm.engine
    assert eng.warm_up(16) == 29
    buckets = (1, 2, 4, 8, 12, 16)
    decode = [(t, KV_SPAN_FLOOR, t) for t in buckets]                 # at 8192 cells: the floor
    # passes of 16..small_rows rows (prompts of one or several requests) with 1..16 logits rows
    arriving = [(T, KV_SPAN_FLOOR, n) for T in (16, 32, 48, eng.small_rows) for n in buckets if n < T]
    assert sorted(eng._plans) == sorted(decode + arriving)
    assert len(eng._plans) <= eng.max_plans                             # none evicted by the warm-up
    assert eng.warm_up(16) == 0                       # compiled already
    before = set(eng._plans)
    llm.generate([[1, 2, 3, 4]] * 5, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    decode = {k for k in set(eng._plans) - before if k[0] == k[2]}
    assert not decode, f"decode plans compiled after the warm-up: {decode}"
    assert np.isfinite(llm.score([1, 2, 3])).all()
