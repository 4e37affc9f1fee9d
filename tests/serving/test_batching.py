"""Continuous batching: many sequences per step give each one what it gets alone.

Where bit-identity holds on the numpy backend (quantized weights, so that few-row passes take
the compiled kernels): a decode step's logits are the same bits whatever other sequences share
the step (1 to 20 neighbours, one or two passes), whether the sequence runs alone (a one-row
pass) or not, with one or two kernel threads, and wherever its KV range lies -- the matmul
kernels' per-row sums never mix rows, and the attention kernel's chunks and blocks sit at fixed
cache positions (multiples of 128) with masked cells of other sequences contributing nothing;
the engine starts every sequence's range on a 128-cell page (metatp.engine.KV_PAGE) so that its
window has the same phase as alone from cell 0. A sequence that cannot get an aligned range
(a full, fragmented cache) still gets correct results, only not the same bits.
Where it does not hold: prompt chunks longer than 16 tokens run through BLAS (whose per-row
sums depend on the number of rows) and the numpy attention over the whole padded window
(pairwise sums over n_kv); greedy tokens agree, logits only to float tolerance. Unquantized
F32 weights take BLAS at every step, so they are not batch-invariant either.
"""

from __future__ import annotations

import numpy as np
import pytest

from metatp import LLM, SamplingParams
from metatp.engine import StepItem
from metatp.testing.synth import SynthSpec

SPEC = SynthSpec(n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, tied=False, seed=5, default_type="Q8_0",
                 n_ctx_train=4096)
LLM_OPTIONS = {"n_ctx": 2048}       # the `llm` fixture (tests/conftest.py)
PROMPTS = ["hello there", "the other one", "a", "xyz xyz", "0123456789", "batch", "one more prompt", "q"]


def greedy(n: int = 12, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


def decode_logits(llm: LLM, k_before: int, k_with: int, steps: int = 3) -> list[np.ndarray]:
    """Decode logits of one sequence whose cells come after `k_before` other sequences' and whose
    steps are shared with `k_with` other sequences (all at the engine level)."""
    eng = llm.engine
    prompt = llm.tokenize(PROMPTS[0])
    before = [eng.new_sequence() for _ in range(k_before)]
    for i, s in enumerate(before):
        eng.run([StepItem(s, llm.tokenize(PROMPTS[1 + i % 7]), "last")])
    seq = eng.new_sequence()
    others = [eng.new_sequence() for _ in range(k_with)]
    eng.run([StepItem(seq, prompt, "last")] + [StepItem(o, llm.tokenize(PROMPTS[i % 8]), "last")
                                                for i, o in enumerate(others)])
    got = []
    for t in range(steps):
        out = eng.run([StepItem(o, [7 + t], "last") for o in others[: k_with // 2]]
                      + [StepItem(seq, [20 + t], "last")]
                      + [StepItem(o, [9 + t], "last") for o in others[k_with // 2:]])
        got.append(out[k_with // 2])
    for s in before + [seq] + others:
        eng.free(s)
    assert eng.cells.n_used == 0
    return got


@pytest.mark.parametrize("k_before,k_with", [(0, 3), (2, 1), (1, 7), (5, 12), (0, 20)])
def test_decode_logits_bit_identical_across_batches(llm, k_before, k_with):
    """Same bits with 1..20 neighbours (20: two passes) and cells at another offset."""
    want = decode_logits(llm, 0, 1)
    got = decode_logits(llm, k_before, k_with)
    for g, w in zip(got, want):
        assert np.array_equal(g, w)


def test_decode_alone_bit_identical_to_batched(llm):
    """A one-row pass (the matmul kernels' one-token path) sums as a batched row does."""
    want = decode_logits(llm, 0, 1)
    got = decode_logits(llm, 0, 0)
    assert all(np.array_equal(g, w) for g, w in zip(got, want))


def test_decode_bit_identical_with_threaded_attention(path, monkeypatch):
    """Two kernel threads share the attention's chunks: still the same bits (n_kv differs too)."""
    monkeypatch.setenv("METATP_NUM_THREADS", "2")
    threaded = LLM(path, n_ctx=2048, backend="numpy")
    want = decode_logits(threaded, 0, 1)
    got = decode_logits(threaded, 3, 12)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)        # close in any case
    assert all(np.array_equal(g, w) for g, w in zip(got, want))


def test_generate_batch_equals_each_prompt_alone(llm):
    alone = [llm.generate(p, greedy())[0].outputs[0] for p in PROMPTS]
    before = llm.scheduler.metrics.max_step_seqs
    batched = [r.outputs[0] for r in llm.generate(PROMPTS, greedy())]
    assert [o.token_ids for o in batched] == [o.token_ids for o in alone]
    assert [o.text for o in batched] == [o.text for o in alone]
    assert llm.scheduler.metrics.max_step_seqs >= len(PROMPTS) > before
    assert llm.engine.cells.n_used == 0


def test_long_prompts_batched_greedy_equal(llm):
    """Prompts past 16 tokens take BLAS: greedy tokens agree, logits to float tolerance."""
    long = ["a long prompt that has more than sixteen tokens in it", "another long prompt, also well past 16"]
    alone = [llm.generate(p, greedy(8))[0].outputs[0].token_ids for p in long]
    got = [r.outputs[0].token_ids for r in llm.generate(long + PROMPTS[:3], greedy(8))]
    assert got[:2] == alone
    ids = llm.tokenize(long[0])
    eng = llm.engine
    a, b = eng.new_sequence(), eng.new_sequence()
    x = eng.run([StepItem(a, ids, "all")])[0]
    eng.free(a)
    y = eng.run([StepItem(b, llm.tokenize(long[1]), "last"), StepItem(a := eng.new_sequence(), ids, "all")])[1]
    eng.free(a)
    eng.free(b)
    np.testing.assert_allclose(y, x, rtol=1e-4, atol=1e-4)


def test_n_samples_seeds_and_stops(llm):
    p = SamplingParams(max_tokens=10, temperature=1.0, seed=11, n=3, ignore_eos=True, logprobs=2)
    a = llm.generate(["hello", "world"], p)
    b = llm.generate(["hello", "world"], p)
    assert [[o.token_ids for o in r.outputs] for r in a] == [[o.token_ids for o in r.outputs] for r in b]
    assert [o.index for o in a[0].outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in a[0].outputs}) == 3          # each sample its own stream
    one = llm.generate("hello", SamplingParams(max_tokens=10, temperature=1.0, seed=11, ignore_eos=True))
    assert one[0].outputs[0].token_ids == a[0].outputs[0].token_ids     # sample 0 is the n=1 result
    for o in a[0].outputs:
        assert len(o.logprobs) == len(o.token_ids)
        for tok, d in zip(o.token_ids, o.logprobs):
            assert tok in d and len(d) <= 3 and all(v.logprob <= 0 for v in d.values())
        assert o.cumulative_logprob == pytest.approx(sum(d[t].logprob for d, t in zip(o.logprobs, o.token_ids)))
    # per-sequence stop strings and limits in one batch
    text = llm.generate("hello", greedy(12))[0].outputs[0].text
    stop = text[3:5]
    outs = llm.generate(["hello", "hello"], [greedy(12, stop=[stop]), greedy(4)])
    assert outs[0].outputs[0].finish_reason == "stop" and outs[0].outputs[0].text == text[:text.index(stop)]
    assert outs[1].outputs[0].finish_reason == "length" and len(outs[1].outputs[0].token_ids) == 4
    assert llm.engine.cells.n_used == 0


def test_more_prompts_than_cells_wait_their_turn(path):
    """A small context: requests wait for cells (admission at step boundaries), all complete."""
    small = LLM(path, n_ctx=64, backend="numpy", max_num_seqs=4)
    prompts = PROMPTS * 2
    alone = [small.generate(p, greedy(10))[0].outputs[0].token_ids for p in prompts]
    got = [r.outputs[0].token_ids for r in small.generate(prompts, greedy(10))]
    assert got == alone
    assert small.scheduler.metrics.max_step_seqs <= 4
    assert small.engine.cells.n_used == 0


def test_tensor_parallel_batch_equals_solo(path):
    tp = LLM(path, n_ctx=1024, backend="numpy", n_devices=2, split_mode="tensor")
    alone = [tp.generate(p, greedy(8))[0].outputs[0].token_ids for p in PROMPTS[:4]]
    got = [r.outputs[0].token_ids for r in tp.generate(PROMPTS[:4], greedy(8))]
    assert got == alone
    want = decode_logits(tp, 0, 1)
    assert all(np.array_equal(g, w) for g, w in zip(decode_logits(tp, 2, 5), want))


def test_default_model_batch_equals_solo(default_llm):
    """The real default model (Q4_1), when it is cached: batched greedy tokens equal solo ones."""
    real = default_llm
    prompts = ["The capital of France is", "1, 2, 3, 4,", "Once upon a time"]
    alone = [real.generate(p, greedy(6))[0].outputs[0].token_ids for p in prompts]
    assert [r.outputs[0].token_ids for r in real.generate(prompts, greedy(6))] == alone


def test_batched_bench_cli(path, capsys):
    """`metatp batched-bench`: one row per (PP, TG, B) with llama-batched-bench's quantities."""
    import json

    from metatp.cli import main

    assert main(["batched-bench", "-m", path, "--backend", "numpy", "-npp", "8", "-ntg", "4", "-npl", "1,3",
                 "--ttft", "-o", "jsonl"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [(r["pp"], r["tg"], r["b"], r["n_kv"]) for r in rows] == [(8, 4, 1, 12), (8, 4, 3, 36)]
    for r in rows:
        assert r["s_tg"] > 0 and r["s_pp"] > 0 and r["ttft_max"] >= r["ttft_median"] > 0
        assert abs(r["s_tg"] - r["b"] * r["tg"] / r["t_tg"]) < 1e-6 * r["s_tg"]
    assert main(["batched-bench", "-m", path, "--backend", "numpy", "-c", "16", "-npp", "8", "-ntg", "4",
                 "-npl", "4"]) == 1                        # does not fit: one line, exit 1
    assert "KV cells" in capsys.readouterr().err
