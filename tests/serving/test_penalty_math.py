"""The penalty arithmetic (metatp.penalties) against a plain numpy reference, without a model or
a compiler: frequency/presence penalties over the generated tokens, logit_bias (-100 bans),
min_tokens' bans, the same result shard by shard, the sampler's use of them, the parameter
checks, and min_tokens' stop-string rule."""

from __future__ import annotations

import collections

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metatp.ir.errors import ConfigError
from metatp.penalties import Penalties, adjust, release_unstopped
from metatp.sampling import Sampler, SamplingParams
from metatp.output_processor import StopMatcher

V = 40


def reference(logits, generated, freq, pres, bias, min_tokens, end_ids) -> np.ndarray:
    """OpenAI's definition, one token at a time: logit[j] -= freq * count[j] + pres * (count[j] > 0),
    then the bias added (-100: banned), then the end tokens banned while fewer than min_tokens
    tokens are out."""
    x = np.asarray(logits, dtype=np.float64).copy()
    for j, c in collections.Counter(generated).items():
        x[j] -= freq * c + pres * (c > 0)
    for j, b in bias.items():
        x[j] = -np.inf if b == -100 else x[j] + b
    if len(generated) < min_tokens:
        for j in end_ids:
            x[j] = -np.inf
    return x


LOGITS = st.lists(st.floats(-30, 30, allow_nan=False, width=32), min_size=V, max_size=V).map(
    lambda v: np.array(v, dtype=np.float32))
PENALTY = st.floats(-2, 2, allow_nan=False)
BIAS = st.dictionaries(st.integers(0, V - 1), st.one_of(st.floats(-100, 100, allow_nan=False), st.just(-100.0)),
                       max_size=8)
CASE = st.tuples(LOGITS, st.lists(st.integers(0, V - 1), max_size=30), PENALTY, PENALTY, BIAS,
                 st.integers(0, 40), st.sets(st.integers(0, V - 1), max_size=3))


@settings(max_examples=300, deadline=None)
@given(CASE)
def test_the_arithmetic_equals_the_numpy_reference(case):
    logits, generated, freq, pres, bias, min_tokens, end_ids = case
    pen = Penalties(freq, pres, bias, min_tokens, end_ids, n_vocab=V)
    got = pen(logits, generated)
    want = reference(logits, generated, freq, pres, bias, min_tokens, end_ids)
    assert np.array_equal(np.asarray(got, np.float64), want)


@settings(max_examples=150, deadline=None)
@given(CASE, st.lists(st.integers(1, V - 1), min_size=1, max_size=4, unique=True))
def test_vocabulary_shards_give_the_whole_rows_result(case, cuts):
    """Applied per vocabulary shard (token ids lo..hi), the pieces put together are the whole row's
    result: the form issue 24 item 6 needs where the logits stay split across devices."""
    logits, generated, freq, pres, bias, min_tokens, end_ids = case
    adj = Penalties(freq, pres, bias, min_tokens, end_ids, n_vocab=V).step(generated)
    if adj is None:
        return
    edges = [0, *sorted(cuts), V]
    pieces = [adjust(logits[lo:hi], adj, lo) for lo, hi in zip(edges, edges[1:])]
    assert np.array_equal(np.concatenate(pieces), adjust(logits, adj))


def test_a_penalty_worked_by_hand():
    logits = np.array([5.0, 4.0, 3.0, 0.0], np.float32)
    out = Penalties(0.5, 1.0, {3: 2.5, 2: -100}, 0, (), n_vocab=4)(logits, [0, 0, 1])
    assert out.tolist() == [5.0 - 0.5 * 2 - 1.0, 4.0 - 0.5 - 1.0, -np.inf, 2.5]


def test_frequency_and_presence_count_only_generated_tokens():
    """The prompt is repetition_penalty's (history), never frequency/presence's."""
    logits = np.array([3.0, 2.9, 0.0], np.float32)
    s = Sampler(SamplingParams(temperature=0.0, frequency_penalty=2.0), np.random.default_rng(0))
    assert s(logits, history=[0, 0, 0]) == 0                  # token 0 only in the prompt: no penalty
    assert s(logits, history=[0, 0, 0], generated=[0]) == 1   # generated once: 3 - 2 < 2.9


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.5])
def test_a_banned_token_is_never_sampled_even_when_it_is_the_likeliest(temperature):
    logits = np.array([10.0, 0.0, -1.0, 0.5], np.float32)
    for seed in range(30):
        s = Sampler(SamplingParams(temperature=temperature, seed=seed, logit_bias={0: -100}), None)
        assert s(logits) != 0
    s = Sampler(SamplingParams(temperature=temperature, seed=1, logit_bias={2: 100}), None)
    assert s(logits) == 2


def test_min_tokens_bans_the_end_tokens_until_then():
    logits = np.array([0.0, 9.0, 1.0, 8.0], np.float32)          # 1: EOS, 3: a stop id, both likeliest
    s = Sampler(SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[3]), None, end_ids=(1, 3), n_vocab=4)
    assert [s(logits, generated=g) for g in ([], [2], [2, 2])] == [2, 2, 1]


def test_defaults_do_no_work_and_change_nothing():
    assert Sampler(SamplingParams(), None).penalties is None
    assert Sampler(SamplingParams(min_tokens=3, ignore_eos=True), None).penalties is None   # nothing to ban
    assert Sampler(SamplingParams(logit_bias={4: 0.0}), None).penalties is None
    rng_logits = np.random.default_rng(5).standard_normal(V).astype(np.float32)
    plain = [Sampler(SamplingParams(temperature=0.9, seed=s), None)(rng_logits) for s in range(20)]
    zeros = [Sampler(SamplingParams(temperature=0.9, seed=s, frequency_penalty=0.0, presence_penalty=0.0,
                                    logit_bias={}, min_tokens=0), None)(rng_logits, generated=[1, 2]) for s in range(20)]
    assert plain == zeros


@pytest.mark.parametrize("kw, name", [
    (dict(frequency_penalty=2.5), "frequency_penalty"), (dict(presence_penalty=-3), "presence_penalty"),
    (dict(presence_penalty=float("nan")), "presence_penalty"), (dict(frequency_penalty="1"), "frequency_penalty"),
    (dict(logit_bias={"5": 1.0}), "logit_bias"), (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(logit_bias={5: 101}), "logit_bias"), (dict(logit_bias={5: float("inf")}), "logit_bias"),
    (dict(logit_bias={True: 1.0}), "logit_bias"), (dict(logit_bias=[(5, 1.0)]), "logit_bias"),
    (dict(min_tokens=-1), "min_tokens"), (dict(min_tokens=2.0), "min_tokens"),
    (dict(min_tokens=5, max_tokens=4), "min_tokens"), (dict(logit_bias={5: 10 ** 400}), "logit_bias"),
    (dict(frequency_penalty=10 ** 400), "frequency_penalty"), (dict(temperature=10 ** 400), "temperature"),
])
def test_bad_values_are_a_config_error_naming_the_field(kw, name):
    with pytest.raises(ConfigError, match=name):
        SamplingParams(**kw)


def test_logit_bias_ids_are_checked_against_the_vocabulary():
    with pytest.raises(ConfigError, match="logit_bias.*outside the vocabulary"):
        Sampler(SamplingParams(logit_bias={V: 1.0}), None, n_vocab=V)
    with pytest.raises(ConfigError, match="logit_bias.*outside the vocabulary"):
        Sampler(SamplingParams(logit_bias={2 ** 70: 1.0}), None)
    with pytest.raises(ConfigError, match="bans every token"):
        Sampler(SamplingParams(logit_bias={i: -100 for i in range(V)}), None, n_vocab=V)


def test_the_keyword_arguments_of_the_llama_cpp_style_calls():
    p = SamplingParams().with_keywords({"frequency_penalty": 1.0, "presence_penalty": None, "logit_bias": {3: -100}})
    assert (p.frequency_penalty, p.presence_penalty, p.logit_bias) == (1.0, 0.0, {3: -100.0})
    with pytest.raises(TypeError, match="mirostat"):
        SamplingParams().with_keywords({"mirostat": 2})
    with pytest.raises(ConfigError, match="frequency_penalty"):
        SamplingParams().with_keywords({"frequency_penalty": 9})


def test_stop_strings_end_nothing_before_min_tokens_but_may_start_there():
    """Before min_tokens all text is released except a tail that could start a stop string; a
    stop that ends in a later token's text stops, one that ended earlier does not (vLLM)."""
    m = StopMatcher(["xy", "e"])
    assert release_unstopped(m, "hello x") == "hello " and m.text == "x"
    assert m.feed("y!") == ("", "xy")                  # started before min_tokens, ends after it: stops
    m = StopMatcher(["e"])
    assert release_unstopped(m, "ee") == "ee" and m.text == ""
    assert m.feed("ab") == ("ab", None)


@settings(max_examples=100, deadline=None)
@given(CASE)
def test_counts_kept_a_token_at_a_time_equal_the_reference_at_every_step(case):
    """The sampler is called with the request's own growing list: its counts are updated in place."""
    logits, generated, freq, pres, bias, min_tokens, end_ids = case
    pen = Penalties(freq, pres, bias, min_tokens, end_ids, n_vocab=V)
    grown: list[int] = []
    for tok in generated:
        want = reference(logits, grown, freq, pres, bias, min_tokens, end_ids)
        assert np.array_equal(np.asarray(pen(logits, grown), np.float64), want)
        grown.append(tok)
