"""Embeddings (`LLM.embed`, `create_embedding`): pooled final hidden states against an independent
float64 forward, under every split mode, batched through the scheduler, with the pooling the
GGUF asks for or the one given."""

from __future__ import annotations

import numpy as np
import pytest

from support.llama_reference import llama_forward
from metatp import LLM
from metatp.embeddings import model_pooling, pool
from metatp.ir.errors import ConfigError, ContextOverflowError
from metatp.ir.models import BatchSpec, ModelTensors, build_graph
from metatp.passes.compile import compile_plan
from metatp.passes.plan import DeviceLayout
from metatp.passes.state import MIRRORED
from metatp.testing.gguf_edit import read_parts, write_parts
from metatp.testing.synth import SynthSpec

SPEC = SynthSpec(n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, n_vocab=300, seed=11)
INPUTS = [[5, 17, 200, 3, 99, 42, 7], [9, 8, 7], [250, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12]]


def _hidden_reference(weights, ids) -> np.ndarray:
    return llama_forward(weights, n_layer=SPEC.n_layer, n_head=SPEC.n_head, n_head_kv=SPEC.n_head_kv,
                         head_dim=SPEC.hd, eps=SPEC.norm_eps, rope_base=SPEC.rope_base, ids=ids, final_hidden=True)


def _cosine(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


@pytest.fixture(scope="module")
def embed_model(synth_factory):
    return synth_factory(SPEC)


@pytest.fixture(scope="module")
def embed_llm(embed_model):
    return LLM(str(embed_model[0]), n_ctx=64, backend="numpy")


@pytest.mark.parametrize("how", ["mean", "cls", "last"])
def test_each_pooling_matches_the_float64_reference(embed_model, how):
    path, weights = embed_model
    llm = LLM(str(path), n_ctx=64, backend="numpy", pooling=how)
    assert llm.pooling == how
    got = llm.embed(INPUTS)
    for ids, vec in zip(INPUTS, got):
        want = pool(_hidden_reference(weights, ids), how)
        assert len(vec) == SPEC.n_embd
        assert _cosine(vec, want) >= 0.9999
        assert abs(np.linalg.norm(vec) - 1.0) < 1e-6          # L2-normalized, as OpenAI returns them
    raw = llm.embed(INPUTS[0], normalize=False)
    want = pool(_hidden_reference(weights, INPUTS[0]), how)
    np.testing.assert_allclose(raw, want, rtol=2e-4, atol=2e-4 * np.abs(want).max())


@pytest.mark.parametrize("mode", ["tensor", "layer"])
def test_split_modes_give_the_single_device_embeddings(embed_model, embed_llm, mode):
    single = np.array(embed_llm.embed(INPUTS))
    llm = LLM(str(embed_model[0]), n_ctx=64, backend="numpy", n_devices=2, split_mode=mode)
    np.testing.assert_allclose(np.array(llm.embed(INPUTS)), single, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["tensor", "layer"])
def test_the_hidden_output_is_whole_after_the_last_reduction(embed_model, mode):
    """The split passes leave the graph's hidden-state output mirrored under -sm tensor (every
    device holds the reduced rows) and on the last stage under -sm layer."""
    llm_model = LLM(str(embed_model[0]), n_ctx=64, backend="numpy").model
    tensors = ModelTensors(llm_model, 64)
    graph = build_graph(tensors, BatchSpec(4, 256, 4, hidden=True))
    out = graph.meta["output"]
    assert out is graph.meta["hidden"] and out.ne[0] == SPEC.n_embd and "logits" not in graph.meta
    assert all(t.name != "result_output" for t in graph.nodes)        # no lm head in an embedding graph
    plan = compile_plan(graph, DeviceLayout(2, mode), llm_model.hparams)
    if mode == "tensor":
        assert plan.of(out).state.axis == MIRRORED


def test_batched_inputs_equal_each_alone_and_free_their_cells(embed_llm):
    cells = embed_llm.engine.cells
    before = cells.n_used + cells.n_cached
    together = embed_llm.embed(INPUTS)
    alone = [embed_llm.embed(ids) for ids in INPUTS]
    np.testing.assert_allclose(np.array(together), np.array(alone), rtol=1e-5, atol=1e-6)
    assert cells.n_used + cells.n_cached == before           # no KV kept after an embedding
    assert embed_llm.scheduler.metrics.max_step_seqs >= len(INPUTS)    # they shared steps


def test_generation_after_an_embedding_plan_uploads_the_lm_head(embed_model):
    """An embedding plan reads no lm head: the first logits plan after it uploads it."""
    path, weights = embed_model
    llm = LLM(str(path), n_ctx=64, backend="numpy")
    llm.embed(INPUTS[1])
    ref = llama_forward(weights, n_layer=SPEC.n_layer, n_head=SPEC.n_head, n_head_kv=SPEC.n_head_kv,
                        head_dim=SPEC.hd, eps=SPEC.norm_eps, rope_base=SPEC.rope_base, ids=INPUTS[0])
    got = llm.score(INPUTS[0])
    assert float(np.abs(got - ref).max() / np.abs(ref).max()) < 2e-4


def test_text_and_token_id_forms(embed_llm):
    one = embed_llm.embed("hello world")
    assert isinstance(one, list) and all(isinstance(x, float) for x in one)     # one input: one vector
    ids = embed_llm.tokenize("hello world")
    np.testing.assert_allclose(embed_llm.embed(ids), one, rtol=1e-6, atol=1e-7)
    two = embed_llm.embed(["hello world", "bye"])
    assert len(two) == 2 and np.allclose(two[0], one, atol=1e-7)
    vecs, count = embed_llm.embed([ids, [5, 6]], return_count=True)
    assert count == len(ids) + 2 and len(vecs) == 2
    answer = embed_llm.create_embedding(["hello world", "bye"])
    assert answer["object"] == "list" and [d["index"] for d in answer["data"]] == [0, 1]
    assert answer["data"][0]["object"] == "embedding" and np.allclose(answer["data"][0]["embedding"], one, atol=1e-7)
    n = len(ids) + len(embed_llm.tokenize("bye"))
    assert answer["usage"] == {"prompt_tokens": n, "total_tokens": n}
    assert answer["model"] == str(embed_llm.model_path)
    assert embed_llm.create_embedding("bye", model="m")["model"] == "m"


@pytest.mark.parametrize("bad, match", [
    ("", r"'input' is an empty string"),
    ([], r"'input' is an empty list"),
    ([[1, 2], "x", 3.5], r"'input' \[2\] must be a string or a list of token ids"),
    ([[1, 999]], r"'input' \[0\] has token id 999, out of range"),
    (None, r"'input' must be a string, a list of strings"),
    ({"a": 1}, r"'input' must be a string, a list of strings"),
])
def test_bad_inputs_are_refused_naming_input(embed_llm, bad, match):
    with pytest.raises(ConfigError, match=match):
        embed_llm.embed(bad)


def test_an_input_past_the_context_is_refused_or_truncated(embed_llm):
    long = list(range(1, 80))
    with pytest.raises(ContextOverflowError, match=r"input\[1\] has 79 tokens but a request may hold at most 64"):
        embed_llm.embed([[1, 2], long])
    cut = embed_llm.embed(long, truncate=True)
    np.testing.assert_allclose(cut, embed_llm.embed(long[:64]), rtol=1e-6, atol=1e-7)


def test_pooling_names_are_checked_before_the_model_is_read(embed_model):
    for name, match in (("rank", "pooling 'rank' .* is not supported"), ("none", "pooling 'none' .* is not supported"),
                        ("max", "pooling must be one of mean, cls, last"), (3, "pooling must be one of")):
        with pytest.raises(ConfigError, match=match):
            LLM("/nonexistent.gguf", pooling=name)


def _with_pooling_type(src, dst, value: int) -> str:
    import gguf

    parts = read_parts(src)
    parts.kvs[f"{parts.arch}.pooling_type"] = (value, gguf.GGUFValueType.UINT32, None)
    write_parts(dst, parts)
    return str(dst)


def test_the_gguf_pooling_type_chooses_the_pooling(embed_model, tmp_path):
    path, weights = embed_model
    assert LLM(str(path), n_ctx=64, backend="numpy").pooling == "last"      # no key: vLLM's decoder default
    for value, want in ((0, "last"), (1, "mean"), (2, "cls"), (3, "last")):
        llm = LLM(_with_pooling_type(path, tmp_path / f"p{value}.gguf", value), n_ctx=64, backend="numpy")
        assert llm.pooling == want
    mean = LLM(_with_pooling_type(path, tmp_path / "mean.gguf", 1), n_ctx=64, backend="numpy")
    assert _cosine(mean.embed(INPUTS[0]), pool(_hidden_reference(weights, INPUTS[0]), "mean")) >= 0.9999
    assert LLM(str(tmp_path / "mean.gguf"), n_ctx=64, backend="numpy", pooling="cls").pooling == "cls"   # override
    rank = LLM(_with_pooling_type(path, tmp_path / "rank.gguf", 4), n_ctx=64, backend="numpy")
    with pytest.raises(ConfigError, match="pooling type is rank .* pass pooling="):
        rank.embed("x")
    assert model_pooling({"llama.pooling_type": -1}, "llama") == "last"


@pytest.mark.slow
def test_default_model_embeddings_match_the_float64_reference():
    llm = LLM(n_ctx=128, backend="numpy")
    hp = llm.model.hparams
    weights = {name: llm.model.dequantize(name) for name in llm.model.weights}
    ids = llm.tokenize("The quick brown fox jumps over the lazy dog.")
    hidden = llama_forward(weights, n_layer=hp.n_layer, n_head=hp.n_head, n_head_kv=min(hp.n_head_kv),
                           head_dim=hp.head_dim_k, eps=hp.norm_eps, rope_base=hp.rope_freq_base, ids=ids,
                           final_hidden=True)
    for how in ("mean", "last"):
        llm._pooling = how
        assert _cosine(llm.embed(ids), pool(hidden, how)) >= 0.9999


def test_embeddings_share_steps_with_generation(embed_llm):
    """A step carrying decode rows and embedding rows runs them in passes of their own: each
    gives what it gives alone."""
    from metatp.sampling import SamplingParams

    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    alone_text = embed_llm.generate([INPUTS[0]], greedy)[0].outputs[0].token_ids
    alone_vecs = np.array(embed_llm.embed(INPUTS))
    steps = embed_llm.scheduler.metrics.steps
    gen = embed_llm.submit(INPUTS[0], greedy)
    vecs = np.array(embed_llm.embed(INPUTS))          # steps the scheduler: the generation runs in them too
    assert gen.result().token_ids == alone_text
    np.testing.assert_allclose(vecs, alone_vecs, rtol=1e-5, atol=1e-6)
    assert embed_llm.scheduler.metrics.steps - steps == len(alone_text)     # the embeddings rode the first step


@pytest.mark.parametrize("n", [1, 2])
def test_cupy_backend_on_the_emulator_gives_the_numpy_embeddings(embed_model, embed_llm, monkeypatch, n):
    from support.require import require

    require("emulator")
    import metatp.backends as backends
    import metatp.backends.cuda.backend as cuda_backend
    from metatp.testing import EmuRuntime

    monkeypatch.setattr(backends, "gpu_probe", lambda: (True, ""))
    monkeypatch.setattr(cuda_backend, "CupyRuntime", lambda: EmuRuntime(n_gpus=n))
    llm = LLM(str(embed_model[0]), backend="cupy", n_ctx=64, n_batch=64, n_devices=n,
              backend_options={"kv_dtype": "f32", "matmul_dtype": "f32"})
    np.testing.assert_allclose(np.array(llm.embed(INPUTS)), np.array(embed_llm.embed(INPUTS)), rtol=1e-4, atol=1e-5)


def test_the_pooling_flag_takes_llama_cpps_names_and_refuses_what_metatp_does_not_pool():
    import argparse

    from metatp.cli import _build_parser
    from metatp.cli_args import add_pooling_arg, pooling_option

    p = argparse.ArgumentParser()
    add_pooling_arg(p)
    assert pooling_option(p.parse_args([])) is None
    assert pooling_option(p.parse_args(["--pooling", "mean"])) == "mean"
    with pytest.raises(ConfigError, match="--pooling 'rank' .* is not supported"):
        pooling_option(p.parse_args(["--pooling", "rank"]))
    assert _build_parser().parse_args(["serve", "--pooling", "cls"]).pooling == "cls"    # serve has the flag


ARCH_SPECS = {
    "phi3": SynthSpec(arch="phi3", fused_qkv=True, fused_up_gate=True, n_ff=128, tied=False, seed=41),
    "command-r": SynthSpec(arch="command-r", layer_norm=True, logit_scale=0.5, qk_norm=True, qk_norm_per_head=True,
                           n_ff=128, seed=42),
    "qwen3moe": SynthSpec(arch="qwen3moe", qk_norm=True, head_dim=32, n_expert=4, n_expert_used=2, n_ff_exp=64,
                          seed=43),
    "gemma3": SynthSpec(arch="gemma3", n_layer=3, qk_norm=True, post_norms=True, sliding_window=4, rope_base=1e6,
                        head_dim=32, n_ff=128, norm_eps=1e-6, seed=44),
}


@pytest.mark.parametrize("arch", list(ARCH_SPECS))
@pytest.mark.parametrize("mode", ["none", "tensor"])
def test_every_architecture_embeds_the_state_its_lm_head_reads(synth_factory, arch, mode):
    """Each builder's hidden output is what its lm head reads: the last position's embedding
    (pooling last, not normalized) times the output weight (and command-r's logit scale) is the
    logits' last row."""
    spec = ARCH_SPECS[arch]
    path, weights = synth_factory(spec)
    llm = LLM(str(path), n_ctx=64, backend="numpy", pooling="last", n_devices=2 if mode == "tensor" else 1,
              split_mode=mode)
    ids = [5, 17, 200, 3, 99, 42, 7]
    h = np.array(llm.embed(ids, normalize=False))
    w_out = weights.get("output.weight", weights["token_embd.weight"]).astype(np.float64)
    want = llm.score(ids)[-1]
    got = (h @ w_out.T) * (spec.logit_scale or 1.0)
    assert float(np.abs(got - want).max() / np.abs(want).max()) < 1e-4
