"""End to end on the real default model (SmolLM2-135M-Instruct Q4_1) against llama.cpp and transformers.

llama.cpp quantizes activations (Q8) inside its CPU matmuls; `numerics="llamacpp"` does the same,
and that mode is what the llama.cpp oracle is compared with. The exact float32 mode is compared
with the transformers float32 reference.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from conftest import default_model_path
from metatp import LLM, SamplingParams

REFS = Path(__file__).resolve().parents[2] / "shared" / "refs" / "smollm2"   # ../shared beside the checkout

pytestmark = pytest.mark.slow


def _cases() -> list[dict]:
    f = REFS / "cases.json"
    if not f.exists():
        pytest.skip(f"reference data not found at {REFS}")
    return json.loads(f.read_text())["cases"]


@pytest.fixture(scope="module")
def llm():
    return LLM(str(default_model_path()), n_ctx=512, backend="numpy")


@pytest.fixture(scope="module")
def llm_llamacpp(llm):
    return LLM(str(llm.model_path), n_ctx=512, backend="numpy", numerics="llamacpp")


def _cos(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


def test_tokenize_matches_llamacpp(llm):
    for case in _cases():
        assert llm.tokenize(case["prompt"]) == case["ids_used_for_logits"]
        assert llm.detokenize(case["greedy_ids"]) == case["greedy_text_special"]


def test_exact_logits_match_transformers_fp32(llm):
    for case in _cases():
        logits = llm.score(case["ids_used_for_logits"])
        hf = np.load(REFS / f"hf_p{case['index']}_last.npy")
        assert np.abs(logits[-1] - hf).max() < 0.05


def test_llamacpp_numerics_match_llamacpp_oracle(llm_llamacpp):
    for case in _cases():
        ref = np.load(REFS / f"llama_p{case['index']}_all.npz")["logits"]
        logits = llm_llamacpp.score(case["ids_used_for_logits"])
        assert (logits.argmax(-1) == ref.argmax(-1)).all()
        assert _cos(logits, ref).min() >= 0.998


def test_exact_argmax_matches_llamacpp_at_every_prompt_position(llm):
    for case in _cases():
        ref = np.load(REFS / f"llama_p{case['index']}_all.npz")["logits"]
        logits = llm.score(case["ids_used_for_logits"])
        assert (logits.argmax(-1) == ref.argmax(-1)).all()
        assert _cos(logits, ref).min() >= 0.997


def test_teacher_forced_greedy_agrees_where_margin_is_clear(llm):
    for case in _cases():
        ids = case["ids_used_for_logits"] + case["greedy_ids"][:-1]
        logits = llm.score(ids)[len(case["ids_used_for_logits"]) - 1:]
        for step, (row, want) in enumerate(zip(logits, case["greedy_ids"])):
            if case["greedy_steps"][step]["top1_top2_margin"] > 0.5:
                assert int(row.argmax()) == want, f"prompt {case['index']} step {step}"


def test_capital_of_france_and_two_plus_two(llm):
    out = llm.generate("The capital of France is", SamplingParams(max_tokens=4))[0].outputs[0]
    assert "Paris" in out.text
    chat = llm.create_chat_completion([{"role": "user", "content": "What is 2+2?"}], max_tokens=24, temperature=0.0)
    assert "4" in chat["choices"][0]["message"]["content"]
