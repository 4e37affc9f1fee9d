"""The public API's arguments, table-driven: every wrong type or value is a ConfigError that names
the argument; what the ecosystem passes (numpy ids and numbers, OpenAI content parts) works."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from metatp import LLM, SamplingParams
from metatp.ir.errors import ConfigError, MetatpError
from metatp.testing.synth import SynthSpec

TEMPLATE = "{% for m in messages %}<|bos|>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
SPEC = SynthSpec(n_layer=1, n_embd=32, n_head=2, n_head_kv=1, n_ff=64, tied=False, seed=5, chat_template=TEMPLATE)
LLM_OPTIONS = {"n_ctx": 64}          # the `llm` fixture (tests/conftest.py)


def sp(**kw) -> SamplingParams:
    return SamplingParams(**kw)


# (what is called, the argument the message must name)
BAD_CALLS = [
    # SamplingParams: wrong type or sign
    (lambda llm: sp(temperature="hot"), "temperature"),
    (lambda llm: sp(temperature=-0.5), "temperature"),
    (lambda llm: sp(top_p=math.nan), "top_p"),
    (lambda llm: sp(top_k=2.5), "top_k"),
    (lambda llm: sp(top_k="5"), "top_k"),
    (lambda llm: sp(min_p=None), "min_p"),
    (lambda llm: sp(max_tokens=3.0), "max_tokens"),
    (lambda llm: sp(max_tokens=True), "max_tokens"),
    (lambda llm: sp(repetition_penalty=-1), "repetition_penalty"),
    (lambda llm: sp(seed=-1), "seed"),
    (lambda llm: sp(seed=1.5), "seed"),
    (lambda llm: sp(stop=5), "stop"),
    (lambda llm: sp(stop_token_ids=[1.5]), "stop_token_ids"),
    (lambda llm: sp(stop_token_ids=7), "stop_token_ids"),
    (lambda llm: sp(ignore_eos="yes"), "ignore_eos"),
    # LLM(...)
    (lambda llm: LLM(123), "model"),
    (lambda llm: LLM(["a.gguf"]), "model"),
    (lambda llm: LLM(llm.model_path, backend="numpy", seed=-3), "seed"),
    (lambda llm: LLM(llm.model_path, backend="numpy", seed="0"), "seed"),
    (lambda llm: LLM(llm.model_path, backend="numpy", n_devices=2, tensor_split=3), "tensor_split"),
    (lambda llm: LLM(llm.model_path, backend="numpy", n_devices=2, tensor_split={"a": 1}), "tensor_split"),
    (lambda llm: LLM(llm.model_path, backend="numpy", n_devices=2, tensor_split=["a", "b"]), "tensor_split"),
    (lambda llm: LLM(llm.model_path, backend="numpy", n_devices=2.0), "n_devices"),
    (lambda llm: LLM(llm.model_path, backend=None), "backend"),
    (lambda llm: LLM(llm.model_path, backend="numpy", n_ctx=12.5), "n_ctx"),
    (lambda llm: LLM(llm.model_path, backend="numpy", n_batch=0), "n_batch"),
    (lambda llm: LLM(llm.model_path, backend="numpy", fit_context="yes"), "fit_context"),
    (lambda llm: LLM(llm.model_path, backend="numpy", memory_budget=[1]), "memory_budget"),
    # tokens
    (lambda llm: llm.tokenize(42), "tokenize"),
    (lambda llm: llm.tokenize(b"bytes"), "bytes"),
    (lambda llm: llm.tokenize(None), "tokenize"),
    (lambda llm: llm.tokenize("x", add_bos="no"), "add_bos"),
    (lambda llm: llm.detokenize([1.7, 2]), "ids[0]"),
    (lambda llm: llm.detokenize("abc"), "ids"),
    (lambda llm: llm.detokenize(np.array([1.0, 2.0])), "ids"),
    (lambda llm: llm.detokenize([10**9]), "out of range"),
    (lambda llm: llm.detokenize({1: 2}), "ids"),
    (lambda llm: llm.score([]), "at least one"),
    (lambda llm: llm.score([3, "4"]), "ids[1]"),
    (lambda llm: llm.score([-1]), "out of range"),
    # generate
    (lambda llm: llm.generate("hi", {"max_tokens": 3}), "sampling_params"),
    (lambda llm: llm.generate("hi", 3), "sampling_params"),
    (lambda llm: llm.generate(["a", "b"], [sp()]), "sampling_params"),
    (lambda llm: llm.generate([]), "prompts"),
    (lambda llm: llm.generate(5), "prompts"),
    (lambda llm: llm.generate([[1, 2.5]]), "prompt[1]"),
    (lambda llm: llm.generate(np.zeros((2, 2, 2), dtype=np.int64)), "prompts"),
    (lambda llm: llm.generate(b"hello"), "bytes"),
    # completions
    (lambda llm: llm("hi", top_k="40"), "top_k"),
    (lambda llm: llm("hi", temperature="0"), "temperature"),
    (lambda llm: llm("hi", stream="yes"), "stream"),
    (lambda llm: llm("hi", seed=-5), "seed"),
    (lambda llm: llm("hi", max_tokens=-2), "max_tokens"),
    (lambda llm: llm.create_chat_completion("hello"), "messages"),
    (lambda llm: llm.create_chat_completion({"role": "user", "content": "x"}), "messages"),
    (lambda llm: llm.create_chat_completion([{"content": "x"}]), "messages[0]"),
    (lambda llm: llm.create_chat_completion([{"role": 1, "content": "x"}]), "role"),
    (lambda llm: llm.create_chat_completion([{"role": "user", "content": 5}]), "content"),
    (lambda llm: llm.create_chat_completion([{"role": "user", "content": [{"type": "image_url"}]}]), "image_url"),
    (lambda llm: llm.create_chat_completion([{"role": "user", "content": [{"text": "x"}]}]), "content"),
    (lambda llm: llm.create_chat_completion([{"role": "user", "content": [{"type": "text", "text": 3}]}]), "text"),
]


@pytest.mark.parametrize("call, names", BAD_CALLS, ids=[f"{i}-{n}" for i, (_, n) in enumerate(BAD_CALLS)])
def test_bad_argument_is_a_config_error_naming_it(llm, call, names):
    with pytest.raises(ConfigError) as info:
        call(llm)
    assert names in str(info.value), str(info.value)


def test_numpy_values_are_accepted(llm):
    ids = np.array(llm.tokenize("hello there"), dtype=np.int32)
    assert llm.detokenize(ids) == llm.detokenize(ids.tolist()) == "hello there"
    assert llm.detokenize([np.int64(ids[0])]) == llm.detokenize([int(ids[0])])
    assert llm.score(ids).shape == (len(ids), llm.n_vocab)
    params = SamplingParams(max_tokens=np.int64(3), temperature=np.float32(0.0), top_k=np.int32(5),
                            seed=np.uint32(4), ignore_eos=np.bool_(True))
    one = llm.generate(ids, params)
    both = llm.generate(np.stack([ids, ids]), params)
    assert len(one) == 1 and len(both) == 2
    assert one[0].outputs[0].token_ids == both[1].outputs[0].token_ids
    assert len(one[0].outputs[0].token_ids) == 3
    with pytest.warns(UserWarning, match="KV heads"):     # the tiny model has one KV head
        tp = LLM(llm.model_path, n_ctx=32, backend="numpy", n_devices=np.int64(2), tensor_split=np.array([3, 1]))
    assert tp.layout.tensor_split == (3.0, 1.0)


def test_one_sampling_params_per_prompt(llm):
    outs = llm.generate(["a", "b"], [SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True),
                                     SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)])
    assert [len(o.outputs[0].token_ids) for o in outs] == [1, 3]


def test_chat_content_forms(llm):
    """None is no content; OpenAI text parts are joined with newlines (as vLLM does)."""
    render = llm.tokenizer.apply_chat_template
    parts = [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]
    kw = dict(max_tokens=2, temperature=0.0)
    a = llm.create_chat_completion([{"role": "user", "content": parts}], **kw)
    b = llm.create_chat_completion([{"role": "user", "content": "one\ntwo"}], **kw)
    assert a["choices"][0]["message"] == b["choices"][0]["message"]
    assert a["usage"] == b["usage"]
    c = llm.create_chat_completion([{"role": "user", "content": "x"}, {"role": "assistant", "content": None}], **kw)
    assert c["usage"]["prompt_tokens"] == len(llm.tokenize(render([{"role": "user", "content": "x"},
                                                                   {"role": "assistant", "content": ""}])))
    assert "None" not in render([{"role": "assistant", "content": ""}])


def test_seed_minus_one_is_random_like_llama_cpp(llm):
    out = llm("hi", max_tokens=2, seed=-1)
    assert out["usage"]["completion_tokens"] <= 2


def test_float_ids_are_not_truncated(llm):
    with pytest.raises(ConfigError, match="integer"):
        llm.detokenize([3.9])
    with pytest.raises(ConfigError):
        llm.generate([[3.0, 4.0]])


def test_every_error_is_a_metatp_error(llm):
    for call, _ in BAD_CALLS:
        with pytest.raises(MetatpError):
            call(llm)


def test_model_given_as_path_object(path):
    assert LLM(Path(path), n_ctx=16, backend="numpy").n_ctx == 16
