"""Speculative decoding's core (metatp.speculative): the n-gram proposer, the acceptance rules on
explicit distributions (a chi-square test that the output is distributed as the target's), and
the configuration's errors."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from metatp.ir.errors import ConfigError
from metatp.sampling import Sampler, SamplingParams
from metatp.speculative import (NgramProposer, SpecConfig, SpecStats, accept_greedy, accept_sampled,
                                spec_config)

# chi-square critical values at p = 0.001 (a true test fails 1 run in 1000; the seeds are fixed)
CHI2_999 = {3: 16.266, 4: 18.467, 5: 20.515}


def chi_square(counts: np.ndarray, p: np.ndarray) -> float:
    n = counts.sum()
    return float(((counts - n * p) ** 2 / (n * p)).sum())


def test_ngram_proposes_what_followed_the_latest_earlier_match():
    prop = NgramProposer(n_max=3, n_min=1)
    ctx = [1, 2, 3, 4, 5, 9, 9, 1, 2, 3]
    assert prop.propose(ctx, 2) == [4, 5]
    assert prop.propose(ctx, 10) == [4, 5, 9, 9, 1, 2, 3]
    # the longest n wins over a later shorter match
    assert prop.propose([7, 8, 1, 2, 6, 8, 2, 7, 8], 1) == [1]
    # the latest occurrence of the same n-gram
    assert prop.propose([5, 1, 5, 2, 5], 1) == [2]
    assert prop.propose([1, 2, 3], 4) == []
    assert prop.propose([1], 4) == []
    assert prop.propose([1, 1, 1], 0) == []
    assert NgramProposer(n_max=2, n_min=2).propose([4, 1, 9, 1], 3) == []


@given(st.lists(st.integers(0, 5), min_size=0, max_size=40), st.integers(1, 6), st.integers(1, 4))
@settings(max_examples=200, deadline=None)
def test_ngram_proposals_always_continue_an_earlier_match(ctx, k, n_max):
    out = NgramProposer(n_max=n_max).propose(ctx, k)
    assert len(out) <= k
    if out:
        n = next(n for n in range(n_max, 0, -1) if len(ctx) > n and any(
            ctx[i:i + n] == ctx[-n:] for i in range(len(ctx) - n)))
        starts = [i + n for i in range(len(ctx) - n) if ctx[i:i + n] == ctx[-n:]]
        assert out == ctx[starts[-1]:starts[-1] + k]


def test_greedy_acceptance_keeps_the_agreeing_prefix_and_adds_the_targets_token():
    picks = [4, 7, 1, 3]
    assert accept_greedy([4, 7, 1], lambda i: picks[i]) == [4, 7, 1, 3]
    assert accept_greedy([4, 8, 1], lambda i: picks[i]) == [4, 7]
    assert accept_greedy([5, 7, 1], lambda i: picks[i]) == [4]
    assert accept_greedy([], lambda i: picks[i]) == [4]


P0 = np.array([0.1, 0.3, 0.05, 0.4, 0.15])
P1 = np.array([0.2, 0.2, 0.2, 0.2, 0.2])
IDS = np.arange(5)


def first_two_tokens(draft, draft_dists, seed, n=20000):
    """Counts of (first token, second token) over n verifications against P0 then P1: of
    `draft`, or (with `draft_dists`) of two tokens drawn from those each time."""
    rng = np.random.default_rng(seed)
    dists = [(IDS, P0), (IDS, P1), (IDS, P1)]
    first = np.zeros(5)
    second = np.zeros(5)
    for _ in range(n):
        if draft_dists is not None:
            draft = [int(rng.choice(5, p=q)) for _, q in draft_dists]
        out = accept_sampled(draft, lambda i: dists[i], rng, draft_dists)
        first[out[0]] += 1
        if out[0] == draft[0] and len(out) > 1:
            second[out[1]] += 1
    return first, second


@pytest.mark.parametrize("draft, q", [([3, 1], None), ([2, 0], None),
                                      (None, [(IDS, np.array([0.5, 0.1, 0.1, 0.1, 0.2])),
                                                (IDS, np.array([0.7, 0.1, 0.1, 0.05, 0.05]))])])
def test_rejection_sampling_gives_the_targets_distribution(draft, q):
    first, second = first_two_tokens(draft, q, seed=47)
    assert chi_square(first, P0) < CHI2_999[4]
    assert chi_square(second, P1) < CHI2_999[4]      # after an accepted token: the next position's p


def test_the_chi_square_check_catches_a_rule_that_ignores_the_target():
    """The statistical test can fail: always accepting the draft is not distributed as P0."""
    rng = np.random.default_rng(1)
    counts = np.zeros(5)
    for _ in range(20000):
        counts[int(rng.choice(5, p=P0)) if rng.random() < 0.5 else 3] += 1     # a draft-biased rule
    assert chi_square(counts, P0) > CHI2_999[4]


def test_rejection_sampling_is_deterministic_under_a_seed():
    a = first_two_tokens([3, 1], None, seed=5, n=200)
    b = first_two_tokens([3, 1], None, seed=5, n=200)
    assert all((x == y).all() for x, y in zip(a, b))


def test_a_sure_target_token_is_always_accepted_and_a_zero_one_never():
    rng = np.random.default_rng(0)
    sure = (np.array([2]), np.ones(1))
    for _ in range(50):
        assert accept_sampled([2, 2], lambda i: sure, rng) == [2, 2, 2]
    two = (np.array([1, 2]), np.array([0.5, 0.5]))
    for _ in range(50):
        assert accept_sampled([7], lambda i: two, rng)[0] in (1, 2)


def test_sampler_distribution_is_what_the_sampler_draws_from():
    """Penalties, top-k and temperature applied as a plain draw applies them."""
    logits = np.array([2.0, 1.0, 0.5, 3.0, -1.0, 0.0], dtype=np.float32)
    params = SamplingParams(temperature=0.7, top_k=4, logit_bias={3: -2.0}, seed=3)
    ids, p = Sampler(params, np.random.default_rng(0)).distribution(logits)
    assert p.sum() == pytest.approx(1.0)
    x = logits.astype(np.float64).copy()
    x[3] -= 2.0
    keep = np.argsort(-x)[:4]
    z = np.exp((x[keep] - x[keep].max()) / 0.7)
    want = dict(zip(keep.tolist(), z / z.sum()))
    assert dict(zip(ids.tolist(), p)) == pytest.approx(want)
    s = Sampler(params, np.random.default_rng(0))
    counts = np.zeros(6)
    for _ in range(4000):
        counts[s(logits)] += 1
    full = np.array([want.get(i, 0.0) for i in range(6)])
    assert counts[full == 0].sum() == 0
    assert chi_square(counts[full > 0], full[full > 0]) < CHI2_999[3]
    g = Sampler(SamplingParams(temperature=0), np.random.default_rng(0)).distribution(logits)
    assert g[0].tolist() == [3] and g[1].tolist() == [1.0]


def test_spec_config_spellings_and_errors():
    assert spec_config() is None
    assert spec_config({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 5}) == \
        SpecConfig("ngram", 4, 5, 1)
    assert spec_config(speculative_model="d.gguf", num_speculative_tokens=3) == SpecConfig("draft", 3, draft_model="d.gguf")
    assert spec_config({"model": "d.gguf"}, num_speculative_tokens=2).method == "draft"
    assert spec_config({"method": "draft_model", "model": "d.gguf", "num_speculative_tokens": 2}).method == "draft"
    for bad, word in [({"method": "eagle", "num_speculative_tokens": 2}, "eagle"),
                      ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
                      ({"method": "ngram", "num_speculative_tokens": 99}, "num_speculative_tokens"),
                      ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
                      ({"method": "ngram"}, "num_speculative_tokens"),
                      ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 1}, "lookahead"),
                      ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 0}, "prompt_lookup_max"),
                      ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4}, "prompt_lookup_min"),
                      ({"method": "draft", "num_speculative_tokens": 2}, "draft model"),
                      ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "ngram")]:
        with pytest.raises(ConfigError, match=word):
            spec_config(bad)
    with pytest.raises(ConfigError, match="contradicts"):
        spec_config({"method": "ngram", "num_speculative_tokens": 2}, num_speculative_tokens=3)
    with pytest.raises(ConfigError, match="speculative_config must be a dict"):
        spec_config("ngram")


def test_stats_count_accepted_tokens():
    s = SpecStats()
    s.count(4, 5)
    s.count(4, 1)
    s.count(0, 1)
    assert (s.steps, s.drafted, s.accepted, s.emitted) == (3, 8, 4, 7)
    assert s.acceptance == 0.5


def test_a_requests_draft_length_follows_its_acceptance():
    from metatp.speculative import Speculator

    spec = Speculator(SpecConfig("ngram", 8))
    ctx = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 1]
    assert len(spec.propose(7, ctx, 8)) == 8
    spec.record(7, 8, 3)                    # 2 kept: 3 next time
    assert len(spec.propose(7, ctx, 8)) == 3
    spec.record(7, 3, 1)                    # none kept: 1
    assert len(spec.propose(7, ctx, 8)) == 1
    spec.record(7, 1, 2)                    # all kept: doubled
    assert len(spec.propose(7, ctx, 8)) == 2
    assert len(spec.propose(8, ctx, 8)) == 8        # another request starts at k
    assert len(spec.propose(7, ctx, 1)) == 1        # the caller's cap holds
    spec.forget(7)
    assert len(spec.propose(7, ctx, 8)) == 8
    assert (spec.stats.drafted, spec.stats.accepted) == (12, 3)


def test_the_runners_verification_samples_each_position_as_a_plain_step_would():
    """ModelRunner's VERIFY on explicit logits, with a frequency penalty and top-k: the first
    token is distributed as a plain step's draw from row 0, and after an accepted drafted token
    the next as a plain step's draw from row 1 with that token counted as generated."""
    from types import SimpleNamespace

    from metatp.runner import ModelRunner, Purpose, SamplingState, ScheduledItem

    rows = np.log(np.array([[0.1, 0.3, 0.2, 0.25, 0.15, 1e-9],
                            [0.3, 0.1, 0.3, 0.1, 0.1, 0.1],
                            [0.2, 0.2, 0.2, 0.2, 0.1, 0.1]])).astype(np.float32)
    params = SamplingParams(temperature=1.0, top_k=5, frequency_penalty=1.0, seed=9)
    state = SamplingState(params, np.random.default_rng(0), (), SimpleNamespace(n_vocab=6))
    req = SimpleNamespace(history=[0, 1], output_ids=[1])
    item = ScheduledItem(req, None, [1, 2, 4], Purpose.VERIFY)
    want0 = dict(zip(*Sampler(params, np.random.default_rng(0)).distribution(rows[0], [0, 1], [1])))
    want1 = dict(zip(*Sampler(params, np.random.default_rng(0)).distribution(rows[1], [0, 1, 2], [1, 2])))
    first, second = np.zeros(6), np.zeros(6)
    for _ in range(20000):
        out = [r.token for r in ModelRunner._verify(item, state, rows)]
        first[out[0]] += 1
        if out[0] == 2:
            second[out[1]] += 1
    for counts, want in ((first, want0), (second, want1)):
        p = np.array([want.get(i, 0.0) for i in range(6)])
        assert counts[p == 0].sum() == 0
        assert chi_square(counts[p > 0], p[p > 0]) < CHI2_999[(p > 0).sum() - 1]
