"""Single-device path on synthetic models: GGUF -> graph -> numpy backend vs an independent float64 forward."""

from __future__ import annotations

import numpy as np
import pytest

from support.llama_reference import llama_forward
from metatp import LLM, SamplingParams
from metatp.ir.errors import (ConfigError, ContextOverflowError, ModelFormatError, ModelNotFoundError,
                              UnsupportedArchitectureError)
from metatp.testing.synth import SynthSpec

TYPE_SETS = {
    "f32": {},
    "f16": {"q": "F16", "k": "F16", "v": "F16", "o": "F16", "gate": "F16", "up": "F16", "down": "F16"},
    "q8_0": {"q": "Q8_0", "k": "Q8_0", "v": "Q8_0", "o": "Q8_0", "gate": "Q8_0", "up": "Q8_0", "down": "Q8_0",
             "embd": "Q8_0"},
    "q4_0": {"q": "Q4_0", "k": "Q4_0", "v": "Q4_0", "o": "Q4_0", "gate": "Q4_0", "up": "Q4_0", "down": "Q4_0"},
    "q4_1": {"q": "Q4_1", "k": "Q4_1", "v": "Q4_1", "o": "Q4_1", "gate": "Q4_1", "up": "Q4_1", "down": "Q4_1"},
    "mixed_k": {"q": "Q4_0", "k": "Q8_0", "v": "Q4_1", "o": "F16", "down": "Q4_K", "gate": "Q8_0", "up": "Q4_1"},
}


def _reference(spec: SynthSpec, weights, ids, neox=False):
    return llama_forward(weights, n_layer=spec.n_layer, n_head=spec.n_head, n_head_kv=spec.n_head_kv,
                         head_dim=spec.hd, eps=spec.norm_eps, rope_base=spec.rope_base, ids=ids, neox=neox)


def _rel_err(a, b) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("types", list(TYPE_SETS))
def test_score_matches_float64_reference(synth_factory, types):
    spec = SynthSpec(n_ff=256, types=TYPE_SETS[types], seed=3)
    path, weights = synth_factory(spec)
    llm = LLM(str(path), n_ctx=64, backend="numpy")
    ids = [5, 17, 200, 3, 99, 42, 7]
    got = llm.score(ids)
    assert got.dtype == np.float32 and got.shape == (len(ids), spec.n_vocab)
    assert _rel_err(got, _reference(spec, weights, ids)) < 2e-4


@pytest.mark.parametrize("variant", ["qwen2", "qwen3", "untied_gqa1"])
def test_architecture_variants(synth_factory, variant):
    if variant == "qwen2":
        spec = SynthSpec(arch="qwen2", qkv_bias=True, seed=4)
    elif variant == "qwen3":
        spec = SynthSpec(arch="qwen3", qk_norm=True, head_dim=32, seed=5)
    else:
        spec = SynthSpec(n_head=4, n_head_kv=1, tied=False, seed=6)
    path, weights = synth_factory(spec)
    llm = LLM(str(path), n_ctx=64, backend="numpy")
    ids = [9, 8, 7, 6, 5]
    ref = _reference(spec, weights, ids, neox=spec.arch in ("qwen2", "qwen3"))
    assert _rel_err(llm.score(ids), ref) < 2e-4


def test_incremental_decode_equals_batched(synth_factory):
    spec = SynthSpec(seed=7)
    path, _ = synth_factory(spec)
    llm = LLM(str(path), n_ctx=300, backend="numpy", n_batch=4)   # chunked prefill, crosses a KV bucket
    ids = list(np.random.default_rng(0).integers(2, spec.n_vocab, 270))
    full = llm.score(ids)
    eng = llm.engine
    eng.reset()
    eng.forward(ids[:260])
    step = [eng.forward([t]) for t in ids[260:]]
    assert _rel_err(np.stack(step), full[260:]) < 1e-4


def test_graphs_are_reused_per_bucket(synth_factory):
    path, _ = synth_factory(SynthSpec(seed=8))
    llm = LLM(str(path), n_ctx=512, backend="numpy")
    out = llm.generate([0, 5, 6], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 40
    # one prefill graph + decode graphs per 256-token bucket, not one per token
    assert len(llm.engine._plans) <= 3


def test_greedy_generation_is_deterministic_and_seeded_sampling_repeats(synth_factory):
    path, _ = synth_factory(SynthSpec(seed=9))
    llm = LLM(str(path), n_ctx=128, backend="numpy")
    a = llm.generate("hello there", SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0].outputs[0]
    b = llm.generate("hello there", SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0].outputs[0]
    assert a.token_ids == b.token_ids and a.finish_reason == "length"
    p = SamplingParams(max_tokens=8, temperature=0.9, top_k=20, top_p=0.9, seed=123, ignore_eos=True)
    c = llm.generate("hello", p)[0].outputs[0].token_ids
    d = llm.generate("hello", p)[0].outputs[0].token_ids
    assert c == d


def test_context_limits(synth_factory):
    path, _ = synth_factory(SynthSpec(seed=10))
    llm = LLM(str(path), n_ctx=16, backend="numpy")
    with pytest.raises(ContextOverflowError, match="n_ctx"):
        llm.generate(list(range(2, 30)))
    out = llm.generate(list(range(2, 12)), SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True))[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 16 - 10 + 1


def test_bad_inputs_raise_typed_errors(tmp_path, synth_factory):
    with pytest.raises(ModelNotFoundError):
        LLM(str(tmp_path / "nope.gguf"), backend="numpy")
    junk = tmp_path / "junk.gguf"
    junk.write_text("this is not a model")
    with pytest.raises(ModelFormatError, match="not a GGUF"):
        LLM(str(junk), backend="numpy")
    path, _ = synth_factory(SynthSpec(seed=11))
    truncated = tmp_path / "trunc.gguf"
    truncated.write_bytes(path.read_bytes()[:2000])
    with pytest.raises(ModelFormatError):
        LLM(str(truncated), backend="numpy")
    with pytest.raises(ConfigError):
        LLM(str(path), n_ctx=0, backend="numpy")
    with pytest.raises(ConfigError):
        LLM(str(path), backend="tpu")


def test_unsupported_architecture_lists_supported(tmp_path, synth_factory):
    path, _ = synth_factory(SynthSpec(arch="mamba", seed=12))
    with pytest.raises(UnsupportedArchitectureError, match="supported: .*llama"):
        LLM(str(path), backend="numpy")


def test_stop_strings_and_streaming_chunks(synth_factory):
    path, _ = synth_factory(SynthSpec(seed=13))
    llm = LLM(str(path), n_ctx=128, backend="numpy")
    full = llm.generate("ab", SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0].outputs[0].text
    if len(full) >= 4:
        stop = full[2:4]
        cut = llm.generate("ab", SamplingParams(temperature=0.0, max_tokens=12, stop=[stop], ignore_eos=True))[0].outputs[0]
        assert cut.text == full[: full.find(stop)] and cut.finish_reason == "stop"
    chunks = list(llm("ab", max_tokens=12, temperature=0.0, stream=True))
    assert "".join(c["choices"][0]["text"] for c in chunks).startswith(full[:1])
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")


def test_cli_errors_are_one_line(tmp_path, capsys):
    from metatp.cli import main

    rc = main(["generate", "-m", str(tmp_path / "missing.gguf"), "-p", "hi"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1 and err[0].startswith("metatp: error:") and "missing.gguf" in err[0]
    junk = tmp_path / "x.gguf"
    junk.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 20)
    rc = main(["info", "-m", str(junk)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1 and "GGUF" in err[0]
