"""Sampling from vocabulary-split logits without gathering them (backends/candidates.py,
metatp.sampling.CandidateSpec, issue 24 item 6): each device sends its top candidates, its max
and its sum of exp; where they provably cover what the sampler may pick, the draw equals the
gathered row's from the same seed (the same arithmetic on the same kept tokens), and logprobs
from the distributed log-sum-exp agree within 1e-9; where they do not (ties at the bound,
a min-p threshold below it, NaN), `covers` says so and the row is gathered."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import assume, given, settings, strategies as st

from metatp import LLM, SamplingParams
from metatp.backends.candidates import device_candidates, merge_rows
from metatp.logprobs import token_logprob
from metatp.sampling import CandidateSpec, Sampler
from metatp.testing.synth import SynthSpec

SPEC = SynthSpec(n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, n_vocab=2048, tied=False, seed=24,
                 default_type="Q8_0")
LP_TOL = 1e-9         # logprobs: the log-sum-exp adds per device, then across devices


def _candidates(row: np.ndarray, cuts: list[int], k: int, temperature: float = 1.0, adj=None):
    """The row's RowCandidates over devices holding consecutive slices of `cuts` entries."""
    every, g = [], 0
    temps = [temperature if temperature > 0 else 1.0]
    for c in cuts:
        every.append(device_candidates(row[None, g:g + c], [(g, 0, c)], k, temps, [adj]))
        g += c
    return merge_rows(every, cuts, k, row.size, temps)[0]


@settings(max_examples=300, deadline=None)
@given(cuts=st.lists(st.integers(1, 40), min_size=1, max_size=4), seed=st.integers(0, 2**31 - 1),
       levels=st.sampled_from([3, 20, 10**6]), top_k=st.sampled_from([-1, 1, 2, 5, 17]),
       min_p=st.sampled_from([0.0, 0.05, 0.5]), top_p=st.sampled_from([1.0, 0.9, 0.3]),
       temperature=st.sampled_from([0.0, 1e-300, 0.5, 1.0, 3.0]), logprobs=st.sampled_from([None, 0, 1, 4]),
       k_cap=st.sampled_from([2, 3, 6, 1000]), peak=st.sampled_from([8.0, 40.0]),
       penalties=st.sampled_from([None, "presence", "bias", "min_tokens"]))
def test_covered_candidates_draw_what_the_gathered_row_draws(cuts, seed, levels, top_k, min_p, top_p, temperature,
                                                            logprobs, k_cap, peak, penalties):
    rng = np.random.default_rng(seed)
    n = sum(cuts)
    row = (rng.integers(0, levels, size=n) / levels * peak).astype(np.float32)     # few levels: many ties
    assume(n >= 3 or penalties is None)          # a ban of the whole vocabulary is refused
    generated = [int(t) for t in rng.integers(0, n, size=5)]
    extra = {None: {}, "presence": {"presence_penalty": 1.5, "frequency_penalty": -0.5},
             "bias": {"logit_bias": {int(rng.integers(n)): 30.0, int(rng.integers(n)): -100}},
             "min_tokens": {"min_tokens": 9, "stop_token_ids": [int(rng.integers(n))]}}[penalties]
    p = SamplingParams(temperature=temperature, top_k=top_k, min_p=min_p, top_p=top_p, seed=seed, logprobs=logprobs,
                       **extra)
    sampler = Sampler(p, rng, end_ids=p.stop_token_ids, n_vocab=n)
    spec = sampler.candidate_spec(n)
    if spec is None:            # greedy alone: the argmax read; plain temperature: the row; penalties + logprobs
        assert (temperature == 0 and logprobs is None and sampler.penalties is None) or \
            (temperature > 0 and min_p == 0 and not 0 < top_k < n and top_p == 1.0) or \
            (sampler.penalties is not None and logprobs is not None)
        return
    spec = sampler.step_spec(dataclasses.replace(spec, k=min(spec.k, k_cap)), generated)   # bounds matter
    rc = _candidates(row, cuts, spec.k, temperature, spec.adjust)
    if not spec.covers(rc):
        return
    want = Sampler(p, np.random.default_rng(0), end_ids=p.stop_token_ids, n_vocab=n)(row, generated=generated)
    got = Sampler(p, np.random.default_rng(0), end_ids=p.stop_token_ids, n_vocab=n).from_candidates(rc)
    assert got == want
    if logprobs is not None:
        lp_full, top_full = token_logprob(row, want, logprobs)
        lp, top = token_logprob(rc, got, logprobs)
        assert abs(lp - lp_full) <= LP_TOL and list(top) == list(top_full)
        assert all(abs(top[t] - top_full[t]) <= LP_TOL for t in top)


def test_a_tie_with_the_bound_is_not_covered_and_the_whole_vocabulary_always_is():
    row = np.array([5, 1, 1, 1, 4, 1, 1, 1], dtype=np.float32)
    spec = CandidateSpec(k=2, temperature=1.0, top_k=3, min_p=0.0)     # the 3rd largest ties with untold 1s
    assert not spec.covers(_candidates(row, [4, 4], 2))
    every = CandidateSpec(k=4, temperature=1.0, top_k=3, min_p=0.0)
    assert every.covers(_candidates(row, [4, 4], 4))                    # every token sent: nothing untold
    ok = CandidateSpec(k=3, temperature=1.0, top_k=2, min_p=0.0)
    assert ok.covers(_candidates(row, [4, 4], 3))


def test_a_min_p_threshold_below_the_bound_is_not_covered():
    row = np.log(np.array([8, 4, 2, 1, 8, 4, 2, 1], dtype=np.float32))
    assert not CandidateSpec(k=2, temperature=1.0, top_k=-1, min_p=0.2).covers(_candidates(row, [4, 4], 2))
    assert CandidateSpec(k=2, temperature=1.0, top_k=-1, min_p=0.6).covers(_candidates(row, [4, 4], 2))


def test_a_top_p_nucleus_inside_the_candidates_is_covered_and_a_wider_one_is_not():
    row = np.array([9, 0, 0, 0, 0, 7, 0, 0, 0, 0, 0, 0], dtype=np.float32)
    rc = _candidates(row, [6, 6], 2)
    assert CandidateSpec(k=2, temperature=1.0, top_k=-1, min_p=0.0, top_p=0.5).covers(rc)
    p = SamplingParams(temperature=1.0, top_p=0.5, seed=1)
    assert Sampler(p, np.random.default_rng(0)).from_candidates(rc) == 0 == Sampler(p, np.random.default_rng(0))(row)
    assert not CandidateSpec(k=2, temperature=1.0, top_k=-1, min_p=0.0, top_p=0.999).covers(rc)
    hot = _candidates(row, [6, 6], 2, temperature=5.0)       # flatter: the nucleus reaches the untold zeros
    assert not CandidateSpec(k=2, temperature=5.0, top_k=-1, min_p=0.0, top_p=0.9).covers(hot)


def test_a_non_finite_logit_is_never_covered():
    row = np.array([5, 1, 2, np.nan, 4, 1], dtype=np.float32)
    assert not CandidateSpec(k=2, temperature=0.0, top_k=-1, min_p=0.0, logprobs=1).covers(_candidates(row, [3, 3], 2))


def test_what_is_read_as_candidates():
    rng = np.random.default_rng(0)
    spec = Sampler(SamplingParams(temperature=0.8, top_k=40, logprobs=5), rng).candidate_spec(1000)
    assert spec is not None and spec.k == 41 and spec.top_k == 40
    assert Sampler(SamplingParams(temperature=0.8, top_p=0.9), rng).candidate_spec(1000).k == 65
    for p in (SamplingParams(temperature=0.8), SamplingParams(temperature=0.8, top_k=300),
              SamplingParams(temperature=0.8, top_k=40, presence_penalty=1, logprobs=1),
              SamplingParams(temperature=0.8, top_k=40, repetition_penalty=1.1), SamplingParams(temperature=0)):
        assert Sampler(p, rng).candidate_spec(1000) is None, p
    assert Sampler(SamplingParams(temperature=0.8, top_k=300, min_p=0.1), rng).candidate_spec(1000).k == 65


PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
PARAMS = [SamplingParams(max_tokens=10, temperature=0.9, top_k=20, seed=3, ignore_eos=True, logprobs=3),
          SamplingParams(max_tokens=10, temperature=0.6, min_p=0.5, top_p=0.9, seed=4, ignore_eos=True),
          SamplingParams(max_tokens=10, temperature=0.7, min_p=0.2, seed=5, ignore_eos=True, logprobs=1),
          SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=2),
          SamplingParams(max_tokens=10, temperature=0.05, top_p=0.6, seed=6, ignore_eos=True),
          SamplingParams(max_tokens=10, temperature=0.9, top_k=20, seed=7, presence_penalty=1.0,
                         logit_bias={5: 5.0, 9: -100}, min_tokens=3, stop_token_ids=[12], ignore_eos=True),
          SamplingParams(max_tokens=10, temperature=0, frequency_penalty=0.5, ignore_eos=True)]


def _outputs(llm: LLM) -> list:
    return [[(c.token_ids, c.logprobs) for o in llm.generate(PROMPTS, p) for c in o.outputs] for p in PARAMS]


def _same(a: list, b: list) -> None:
    for xa, xb in zip(a, b):
        for (ta, la), (tb, lb) in zip(xa, xb):
            assert ta == tb
            for da, db in zip(la or [], lb or []):
                assert da.keys() == db.keys() and all(abs(da[t].logprob - db[t].logprob) <= LP_TOL for t in da)


@pytest.mark.filterwarnings("ignore:.*KV heads")          # 3 and 4 devices for 2 KV heads
@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_seeded_samples_from_candidates_equal_the_gathered_path(path, n, monkeypatch):
    kw = {} if n == 1 else {"n_devices": n, "split_mode": "tensor"}
    llm = LLM(path, n_ctx=256, backend="numpy", **kw)
    cand = _outputs(llm)
    rows = llm.engine.candidate_rows
    monkeypatch.setattr(Sampler, "candidate_spec", lambda self, n_vocab: None)
    _same(cand, _outputs(llm))
    total = len(PARAMS) * len(PROMPTS) * 10
    if n == 1:
        assert rows == 0                       # nothing split: the row is read as it always was
    else:
        assert total // 2 <= rows < total      # most rows from candidates; the flat min_p=0.2 falls back
    assert llm.engine.logits_bytes == 0        # one process: nothing crosses


def test_a_request_samples_the_same_alone_and_among_others(path):
    llm = LLM(path, n_ctx=256, backend="numpy", n_devices=2, split_mode="tensor")
    p = PARAMS[0]
    alone = llm.generate([PROMPTS[1]], p)[0].outputs[0]
    among = llm.generate(PROMPTS, [PARAMS[3], p, PARAMS[1]])[1].outputs[0]
    assert among.token_ids == alone.token_ids and among.logprobs == alone.logprobs



def test_the_dump_bills_the_bytes_each_logits_read_moves_per_row(path):
    from metatp.ir.models import BatchSpec
    from metatp.tools.logits_bill import bill_lines, logits_bill

    llm = LLM(path, n_ctx=256, backend="numpy", n_devices=2, split_mode="tensor")
    plan, _ = llm.engine.plan_for(BatchSpec(1, 32, 1))
    bill = logits_bill(plan, ks=(41, 300))
    assert bill == {"n_vocab": 2048, "n_devices": 2, "gathered": 4 * 1024, "argmax": 24,
                    "candidates": {41: 8 * 87, 300: None}}          # 300 per device would outweigh the row
    assert "greedy: 24 B" in "\n".join(bill_lines(bill))
    one = LLM(path, n_ctx=256, backend="numpy")
    assert logits_bill(one.engine.plan_for(BatchSpec(1, 32, 1))[0]) is None
