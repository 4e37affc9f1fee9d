"""Speculative decoding through the scheduler (issue 47 item 3): drafted tokens verified in one
pass give the tokens (greedy) and logprobs of plain decoding, under every split mode, with stop
tokens, stop strings and max_tokens inside an accepted run, after rejected drafts (rolled back),
and structured output does not speculate."""

from __future__ import annotations

import numpy as np
import pytest

from metatp import LLM, SamplingParams
from metatp.ir.errors import ConfigError
from metatp.testing.synth import SynthSpec
from support.require import require

SPEC = SynthSpec(n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, tied=False, seed=47, default_type="Q8_0")
LLM_OPTIONS = {"n_ctx": 256}
NGRAM = {"method": "ngram", "num_speculative_tokens": 4}
GREEDY = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [1, 2, 3], [9, 10, 11, 12, 13, 9, 10]]


@pytest.fixture(scope="module")
def spec_llm(path):
    return LLM(path, backend="numpy", speculative_config=NGRAM, **LLM_OPTIONS)


def ids_of(outs):
    return [o.outputs[0].token_ids for o in outs]


def stats(llm):
    s = llm.scheduler.speculator.stats
    return s.drafted, s.accepted


def test_greedy_tokens_are_those_of_plain_decoding(llm, spec_llm):
    before = stats(spec_llm)
    assert ids_of(spec_llm.generate(PROMPTS, GREEDY)) == ids_of(llm.generate(PROMPTS, GREEDY))
    drafted, accepted = (a - b for a, b in zip(stats(spec_llm), before))
    assert 0 < accepted < drafted           # both accepted and rejected drafts were exercised


class WrongProposer:
    """Drafts tokens the target never picks (each the pick + 1 of nothing: a fixed odd run)."""

    def propose(self, context_ids, k):
        return [(int(context_ids[-1]) * 7 + 3 + i) % 300 for i in range(k)]


def test_rejected_drafts_never_influence_later_tokens(path, llm):
    """Every draft rejected: its rows were written to the cache and rolled back, and the tokens
    are still plain decoding's."""
    spec = LLM(path, backend="numpy", speculative_config=NGRAM, **LLM_OPTIONS)
    spec.scheduler.speculator.proposer = WrongProposer()
    want = ids_of(llm.generate(PROMPTS, GREEDY))
    assert ids_of(spec.generate(PROMPTS, GREEDY)) == want
    s = spec.scheduler.speculator.stats
    assert s.drafted > 0 and s.accepted < s.drafted / 4


def test_stop_tokens_max_tokens_and_stop_strings_inside_an_accepted_run(llm, spec_llm):
    plain = ids_of(llm.generate(PROMPTS, GREEDY))
    for i, out in enumerate(plain):
        stop_tok = out[9]
        p = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop_token_ids=[stop_tok])
        a, b = llm.generate([PROMPTS[i]], p)[0].outputs[0], spec_llm.generate([PROMPTS[i]], p)[0].outputs[0]
        assert (b.token_ids, b.finish_reason, b.text) == (a.token_ids, a.finish_reason, a.text)
        for n in (1, 2, 7, 13):
            p = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
            assert ids_of(spec_llm.generate([PROMPTS[i]], p)) == [out[:n]]
        text = llm.generate([PROMPTS[i]], GREEDY)[0].outputs[0].text
        stop = text[len(text) // 2: len(text) // 2 + 2]
        p = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=[stop])
        a, b = llm.generate([PROMPTS[i]], p)[0].outputs[0], spec_llm.generate([PROMPTS[i]], p)[0].outputs[0]
        assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason)


def test_logprobs_are_those_of_plain_decoding(llm, spec_llm):
    p = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2)
    for a, b in zip(llm.generate(PROMPTS, p), spec_llm.generate(PROMPTS, p)):
        a, b = a.outputs[0], b.outputs[0]
        assert a.token_ids == b.token_ids
        assert len(b.logprobs) == len(b.token_ids)
        for x, y in zip(a.logprobs, b.logprobs):
            assert x.keys() == y.keys()
            assert [x[k] for k in x] == pytest.approx([y[k] for k in x], abs=1e-5)


def test_penalties_apply_to_drafted_tokens_as_to_generated_ones(llm, spec_llm):
    p = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, frequency_penalty=0.5,
                       repetition_penalty=1.1, logit_bias={7: 3.0}, min_tokens=5)
    assert ids_of(spec_llm.generate(PROMPTS, p)) == ids_of(llm.generate(PROMPTS, p))


def test_sampled_output_is_deterministic_under_a_seed_and_stays_in_top_k(spec_llm):
    p = SamplingParams(max_tokens=30, temperature=0.8, top_k=3, seed=11, ignore_eos=True)
    a = ids_of(spec_llm.generate(PROMPTS, p))
    assert a == ids_of(spec_llm.generate(PROMPTS, p))
    p2 = SamplingParams(max_tokens=30, temperature=0.8, top_k=3, seed=12, ignore_eos=True)
    assert a != ids_of(spec_llm.generate(PROMPTS, p2))
    # every token is among the target's top 3 after what precedes it
    for prompt, out in zip(PROMPTS, a):
        logits = spec_llm.score(prompt + out)
        for j, tok in enumerate(out):
            row = logits[len(prompt) + j - 1]
            assert tok in np.argsort(-row)[:3]


def test_structured_output_does_not_speculate(llm, spec_llm):
    require("structured")
    p = SamplingParams(max_tokens=20, temperature=0, guided_regex="[a-c]{3,12}")
    before = stats(spec_llm)
    assert ids_of(spec_llm.generate(PROMPTS, p)) == ids_of(llm.generate(PROMPTS, p))
    assert stats(spec_llm) == before


def test_bad_speculative_settings_are_config_errors(path):
    for kw, word in [({"speculative_config": {"method": "ngram", "num_speculative_tokens": 0}}, "num_speculative_tokens"),
                     ({"speculative_config": {"method": "medusa", "num_speculative_tokens": 2}}, "medusa"),
                     ({"num_speculative_tokens": 2, "speculative_config": {"method": "ngram", "k": 2}}, "'k'"),
                     ({"speculative_config": {"method": "draft", "num_speculative_tokens": 2}}, "draft model")]:
        with pytest.raises(ConfigError, match=word):
            LLM(path, backend="numpy", **kw, **LLM_OPTIONS)


@pytest.mark.parametrize("split", ["tensor", "layer"])
def test_greedy_tokens_are_plain_decodings_under_a_split(path, llm, split):
    spec = LLM(path, backend="numpy", n_devices=2, split_mode=split, speculative_config=NGRAM, **LLM_OPTIONS)
    assert ids_of(spec.generate(PROMPTS, GREEDY)) == ids_of(llm.generate(PROMPTS, GREEDY))
    assert stats(spec)[1] > 0


def test_preempted_speculating_requests_keep_their_tokens(path, llm):
    """A cache too small for every request: preemptions happen and the tokens stay plain's."""
    spec = LLM(path, backend="numpy", n_ctx=96, max_num_seqs=4, speculative_config=NGRAM)
    p = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    prompts = PROMPTS + [[4, 4, 4, 4]]
    assert ids_of(spec.generate(prompts, p)) == ids_of(llm.generate(prompts, p))
    assert spec.scheduler.metrics.preemptions > 0


DRAFT_SPEC = SynthSpec(n_layer=1, n_embd=32, n_head=2, n_head_kv=1, n_ff=64, tied=True, seed=5)


@pytest.mark.parametrize("split", ["none", "tensor"])
def test_a_model_drafting_for_itself_is_always_accepted(path, llm, split):
    spec = LLM(path, backend="numpy", speculative_model=path, num_speculative_tokens=4,
               n_devices=2 if split != "none" else 1, split_mode=split, **LLM_OPTIONS)
    assert spec.scheduler.speculator.draft.engine.layout.n_devices == 1    # the draft runs whole on one device
    assert ids_of(spec.generate(PROMPTS, GREEDY)) == ids_of(llm.generate(PROMPTS, GREEDY))
    drafted, accepted = stats(spec)
    assert drafted > 30 and accepted == drafted
    assert spec.scheduler.speculator.draft.engine.cells.n_used == 0       # every request's draft sequence freed


def test_a_smaller_draft_model_keeps_the_targets_tokens(path, llm, synth_factory):
    draft = str(synth_factory(DRAFT_SPEC)[0])
    spec = LLM(path, backend="numpy", speculative_config={"model": draft, "num_speculative_tokens": 3}, **LLM_OPTIONS)
    p = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, logprobs=1)
    a, b = llm.generate(PROMPTS, p), spec.generate(PROMPTS, p)
    assert ids_of(a) == ids_of(b)
    assert [len(o.outputs[0].logprobs) for o in b] == [30] * len(PROMPTS)
    assert stats(spec)[0] > 0
    s = SamplingParams(max_tokens=20, temperature=0.9, seed=4, ignore_eos=True)
    assert ids_of(spec.generate(PROMPTS, s)) == ids_of(spec.generate(PROMPTS, s))


def test_a_draft_whose_cache_is_full_drafts_nothing_and_the_tokens_stay(path, llm, synth_factory):
    """A draft with a 40-token context: three requests overflow its cache and pass its context;
    those drafts are skipped, never wrong, and its cells all come back."""
    draft = str(synth_factory(SynthSpec(n_layer=1, n_embd=32, n_head=2, n_head_kv=1, n_ff=64, seed=5,
                                        n_ctx_train=40))[0])
    spec = LLM(path, backend="numpy", speculative_model=draft, num_speculative_tokens=4,
               **LLM_OPTIONS)
    assert spec.scheduler.speculator.draft.engine.n_ctx == 40
    assert ids_of(spec.generate(PROMPTS, GREEDY)) == ids_of(llm.generate(PROMPTS, GREEDY))
    assert stats(spec)[0] > 0
    assert spec.scheduler.speculator.draft.engine.cells.n_used == 0


def test_the_draft_models_memory_counts_in_the_budget(path, synth_factory):
    """A budget that holds the target but not target + draft is a MemoryPlanError naming the
    draft; fit_context shrinks both caches."""
    import re

    from metatp.ir.errors import MemoryPlanError

    draft = str(synth_factory(DRAFT_SPEC)[0])
    opts = dict(backend="numpy", n_ctx=512)
    spec = LLM(path, speculative_model=draft, num_speculative_tokens=3, **opts)
    target = spec.memory.total(0) + spec.memory.host
    d = spec.scheduler.speculator.draft.memory_plan(512)
    extra = d.total(0) + d.host
    assert extra > 0 and spec.scheduler.speculator.draft.engine.n_ctx == 512
    LLM(path, memory_budget=target, **opts)                                       # the target alone fits
    with pytest.raises(MemoryPlanError, match=f"draft model {re.escape(draft)}"):
        LLM(path, memory_budget=target + extra - 1, speculative_model=draft, num_speculative_tokens=3, **opts)
    LLM(path, memory_budget=target + extra, speculative_model=draft, num_speculative_tokens=3, **opts)
    fitted = LLM(path, memory_budget=target + extra - 1, fit_context=True, speculative_model=draft,
                 num_speculative_tokens=3, **opts)
    assert fitted.n_ctx == 256 and fitted.scheduler.speculator.draft.engine.n_ctx == 256
    assert ids_of(fitted.generate(PROMPTS, GREEDY)) == ids_of(LLM(path, **opts).generate(PROMPTS, GREEDY))


def test_a_draft_with_another_vocabulary_is_refused_naming_both(path, synth_factory):
    other = str(synth_factory(SynthSpec(n_layer=1, n_embd=32, n_head=2, n_head_kv=1, n_ff=64, n_vocab=280, seed=6))[0])
    with pytest.raises(ConfigError, match="different vocabularies") as e:
        LLM(path, backend="numpy", speculative_model=other, num_speculative_tokens=2, **LLM_OPTIONS)
    assert other in str(e.value) and path in str(e.value)


QUOTE = ("The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. "
         "Repeat the sentence: The quick brown")


@pytest.mark.slow
@pytest.mark.parametrize("split", ["none", "tensor", "layer"])
def test_default_model_greedy_tokens_are_plain_decodings(default_llm, default_model, split):
    layout = {} if split == "none" else {"n_devices": 2, "split_mode": split}
    plain = default_llm if split == "none" else LLM(str(default_model), n_ctx=512, backend="numpy", **layout)
    spec = LLM(str(default_model), n_ctx=512, backend="numpy", speculative_config=NGRAM, **layout)
    p = SamplingParams(max_tokens=48, temperature=0)
    assert ids_of(spec.generate([QUOTE, "Once upon a time"], p)) == ids_of(plain.generate([QUOTE, "Once upon a time"], p))
    assert stats(spec)[1] > 0


@pytest.mark.slow
def test_default_model_drafting_for_itself(default_llm, default_model):
    spec = LLM(str(default_model), n_ctx=512, backend="numpy", speculative_model=str(default_model),
               num_speculative_tokens=4)
    p = SamplingParams(max_tokens=24, temperature=0)
    assert ids_of(spec.generate(["Once upon a time"], p)) == ids_of(default_llm.generate(["Once upon a time"], p))
    drafted, accepted = stats(spec)
    assert drafted > 0 and accepted >= 0.9 * drafted


def test_generate_flags_speculate_with_the_same_text(path, capsys):
    from metatp.cli import main

    base = ["generate", "-m", path, "--backend", "numpy", "-c", "128", "-p", "abcabcabc", "-n", "24", "--temp", "0"]
    assert main(base) == 0
    plain = capsys.readouterr().out
    for extra in (["--spec", "ngram", "--draft-max", "4", "--lookup-ngram-max", "2"], ["-md", path, "--draft-max", "3"]):
        assert main(base + extra) == 0
        assert capsys.readouterr().out == plain


def test_speculative_flags_are_checked_by_name():
    from metatp.cli import _build_parser
    from metatp.cli_args import speculative_kwargs

    parse = _build_parser().parse_args
    assert speculative_kwargs(parse(["serve", "--spec", "ngram", "--draft-max", "5"])) == {"speculative_config": {
        "method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3, "prompt_lookup_min": 1}}
    assert speculative_kwargs(parse(["generate", "-md", "d.gguf"])) == {"speculative_config": {
        "method": "draft", "num_speculative_tokens": 8, "model": "d.gguf"}}
    assert speculative_kwargs(parse(["serve"])) == {}
    for argv, word in [(["serve", "--draft-max", "3"], "--draft-max"), (["serve", "--spec", "draft"], "-md"),
                       (["generate", "--spec", "ngram", "-md", "x"], "ngram"),
                       (["generate", "--spec", "ngram", "--draft-max", "0"], "--draft-max")]:
        with pytest.raises(ConfigError, match=word):
            speculative_kwargs(parse(argv))


@pytest.fixture(scope="module")
def spec_server(path, tmp_path_factory):
    from support.serving import MetatpServe

    s = MetatpServe(path, "-c", "512", "-np", "4", "--spec", "ngram", "--draft-max", "4",
                    log=tmp_path_factory.mktemp("spec-serve") / "serve.log")
    yield s
    s.stop()


def test_the_server_speculates_for_concurrent_requests(spec_server, llm):
    """Four requests at once, each speculating: each gets plain decoding's text."""
    from concurrent.futures import ThreadPoolExecutor

    require("serve")
    prompts = ["abcabcabcabc", "hello hello hello", "xyz", "one two one two one"]
    client = spec_server.client()

    def ask(prompt):
        return client.completions.create(model="m", prompt=prompt, max_tokens=24, temperature=0).choices[0].text

    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(ask, prompts))
    want = [llm(p, max_tokens=24, temperature=0)["choices"][0]["text"] for p in prompts]
    assert got == want


def test_metrics_count_drafted_and_accepted_tokens(spec_server):
    """/metrics: vLLM's spec_decode counters (as metatp_...) after speculating requests."""
    import httpx

    client = spec_server.client()
    client.completions.create(model="m", prompt="abcabcabcabcabc", max_tokens=24, temperature=0)
    text = httpx.get(f"http://127.0.0.1:{spec_server.port}/metrics", timeout=30).text
    values = {line.split()[0]: float(line.split()[1]) for line in text.splitlines()
              if line.startswith("metatp_spec_decode_")}
    drafted = values["metatp_spec_decode_num_draft_tokens_total"]
    accepted = values["metatp_spec_decode_num_accepted_tokens_total"]
    assert drafted > 0 and 0 < accepted <= drafted
    assert values["metatp_spec_decode_draft_acceptance_rate"] == pytest.approx(accepted / drafted)
    assert values["metatp_spec_decode_num_emitted_tokens_total"] == accepted + values["metatp_spec_decode_num_drafts_total"]
    assert "# TYPE metatp_spec_decode_num_draft_tokens_total counter" in text


def test_metrics_lines_follow_the_stats():
    from metatp.server.metrics import speculative_lines
    from metatp.speculative import SpecStats

    assert speculative_lines(None) == []

    class Fake:
        stats = SpecStats()
    Fake.stats.count(4, 3)           # 4 drafted, 2 accepted + the target's own
    Fake.stats.count(4, 5)           # all 4 accepted + 1
    lines = speculative_lines(Fake())
    assert "metatp_spec_decode_num_draft_tokens_total 8" in lines
    assert "metatp_spec_decode_num_accepted_tokens_total 6" in lines
    assert "metatp_spec_decode_num_drafts_total 2" in lines
    assert "metatp_spec_decode_draft_acceptance_rate 0.75" in lines


def test_bench_speculative_prints_both_rows_with_the_same_tokens(path, capsys):
    from metatp.cli import main

    assert main(["bench", "-m", path, "--backend", "numpy", "--speculative", "ngram", "--draft-max", "4",
                 "-n", "12", "-r", "1", "-o", "csv"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("prompt,method,k,n_gen,plain_ts,spec_ts,speedup,acceptance")
    rows = [line.split(",") for line in lines[1:]]
    assert [r[0] for r in rows] == ["quote", "free"]
    assert all(r[-1] == "True" for r in rows)
    assert main(["bench", "-m", path, "--backend", "numpy", "--speculative", "draft", "-n", "4", "-r", "1"]) != 0
    assert "needs a draft model: -md PATH" in capsys.readouterr().err


def test_a_follower_replays_speculative_steps_and_their_rewinds(path, llm):
    """Under MPI rank 0 posts each step with its cell operations: a follower replaying them
    (rewinds of rejected drafts included) runs the same passes on the same cells."""
    from metatp.lockstep import STOP, StepBatch, follow
    from support.serving import LoopbackPosts, record_steps

    def make(**kw) -> LLM:
        return LLM(path, backend="numpy", n_devices=2, split_mode="tensor", distributed="none", **kw, **LLM_OPTIONS)

    lead, rest = make(speculative_config=NGRAM), make()
    lead.scheduler.speculator.proposer = WrongProposer()      # rejections: rewinds to replay
    posts: list = []
    lead.scheduler.lead(LoopbackPosts(0, posts))
    logs = record_steps(lead.engine, rest.engine)
    outs = lead.generate(PROMPTS, GREEDY)
    assert all(isinstance(b, StepBatch) for b in posts)
    assert "rewind" in [op[0] for b in posts for op in b.ops]
    assert follow(rest.engine, LoopbackPosts(1, posts + [STOP])) == len(logs[0])
    for (own_a, outs_a), (own_b, outs_b) in zip(*logs):
        assert np.array_equal(own_a, own_b)
        assert all((a is None and b is None) or np.array_equal(a, b) for a, b in zip(outs_a, outs_b))
    assert rest.engine.cells.n_used == 0 and lead.engine.cells.n_used == 0
    assert ids_of(outs) == ids_of(llm.generate(PROMPTS, GREEDY))


@pytest.mark.requires("emulator")
def test_greedy_tokens_are_plain_decodings_on_the_cupy_backend(path, monkeypatch):
    """The cupy backend (on the CPU emulator), split over two devices: a verification pass of
    k+1 rows gives plain decoding's tokens."""
    import metatp.backends as backends
    import metatp.backends.cuda.backend as cuda_backend
    from metatp.testing import EmuRuntime

    rt = EmuRuntime()
    monkeypatch.setattr(backends, "gpu_probe", lambda: (True, ""))
    monkeypatch.setattr(cuda_backend, "CupyRuntime", lambda: rt)
    kw = dict(backend="cupy", n_ctx=128, n_batch=64, n_devices=2, split_mode="tensor")
    p = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)      # verification passes of k+1 rows, each with a rejection
    plain = ids_of(LLM(path, **kw).generate(PROMPTS[:2], p))
    spec = LLM(path, speculative_config=NGRAM, **kw)
    spec.scheduler.speculator.proposer = OracleProposer(PROMPTS[:2], plain)
    assert ids_of(spec.generate(PROMPTS[:2], p)) == plain
    drafted, accepted = stats(spec)
    assert 0 < accepted < drafted


class OracleProposer:
    """Drafts the known continuation with its last drafted token wrong: long accepted runs and a
    rejection every step."""

    def __init__(self, prompts, outputs):
        self.full = [list(a) + list(b) for a, b in zip(prompts, outputs)]

    def propose(self, context_ids, k):
        ctx = list(context_ids)
        full = next(f for f in self.full if f[:len(ctx)] == ctx)
        draft = full[len(ctx):len(ctx) + k]
        return draft[:-1] + [(draft[-1] + 1) % 300] if len(draft) > 1 else draft
