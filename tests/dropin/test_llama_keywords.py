"""llama-cpp-python's idioms on a synthetic GGUF: the constructor keywords (each honoured or
refused by name), bytes tokenize / detokenize, the n_*() / token_*() methods, echo with
logprobs, streams and response_format (`metatp.Llama`, `metatp.llama_compat`)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from metatp import LLM, Llama
from metatp.ir.errors import ConfigError
from metatp.testing.synth import SynthSpec
from support.require import requires

TEMPLATE = "{% for m in messages %}<|bos|>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"
SPEC = SynthSpec(n_layer=2, n_embd=32, n_head=2, n_head_kv=1, n_ff=64, seed=47, chat_template=TEMPLATE)
LLM_OPTIONS = {"n_ctx": 64}          # the `llm` fixture (tests/conftest.py)


@pytest.fixture(scope="module")
def dropin_llama(path) -> Llama:
    return Llama(model_path=path, n_ctx=64, n_batch=32, n_threads=1, n_gpu_layers=-1, seed=1, verbose=False,
                 backend="numpy")


# ---------------------------------------------------------------- the constructor keywords
def test_model_path_is_the_model_and_once_only(path, dropin_llama):
    assert str(dropin_llama.model_path) == path
    with pytest.raises(ConfigError, match="model_path"):
        Llama(path, model_path=path, backend="numpy")


def test_backend_options_numerics_cpu_kernels_allreduce_are_applied_or_refused(path):
    """LLM's own keywords that are also backend options: given only in backend_options they are
    applied (they used to be overwritten by the keywords' defaults); given both ways differently,
    a ConfigError naming both (before the model is read)."""
    llm = LLM(path, n_ctx=32, backend="numpy", backend_options={"numerics": "q8", "cpu_kernels": False})
    assert llm.backend.numerics == "q8" and llm.backend.use_kernels is False
    assert LLM(path, n_ctx=32, backend="numpy", numerics="q8",
               backend_options={"numerics": "q8"}).backend.numerics == "q8"
    with pytest.raises(ConfigError, match=r"numerics='q8' contradicts backend_options numerics='exact'"):
        LLM("no-such-file.gguf", backend="numpy", numerics="q8", backend_options={"numerics": "exact"})
    with pytest.raises(ConfigError, match=r"cpu_kernels=True contradicts backend_options cpu_kernels=False"):
        LLM("no-such-file.gguf", backend="numpy", cpu_kernels=True, backend_options={"cpu_kernels": False})

def test_n_threads_sets_the_cpu_kernels_threads(path, dropin_llama):
    assert dropin_llama.backend.kernel_threads == 1
    assert LLM(path, n_ctx=32, backend="numpy", n_threads=3).backend.kernel_threads == 3
    for bad in (0, -2, 1.5, "4"):
        with pytest.raises(ConfigError, match="n_threads"):
            LLM(path, n_ctx=32, backend="numpy", n_threads=bad)
    with pytest.raises(ConfigError, match="n_threads=2 contradicts"):
        LLM(path, n_ctx=32, backend="numpy", n_threads=2, backend_options={"kernel_threads": 3})


@requires("emulator")
def test_n_threads_is_accepted_by_a_gpu_backend(path, monkeypatch):
    """The cupy backend computes nothing on CPU threads: n_threads asks nothing of it (and is
    not passed on as the numpy backend's kernel_threads, which cupy would refuse)."""
    import metatp.backends as backends
    import metatp.backends.cuda.backend as cuda_backend
    from metatp.testing import EmuRuntime

    rt = EmuRuntime()
    monkeypatch.setattr(backends, "gpu_probe", lambda: (True, ""))
    monkeypatch.setattr(cuda_backend, "CupyRuntime", lambda: rt)
    llm = Llama(model_path=path, backend="cupy", n_ctx=64, n_batch=32, n_threads=8, n_gpu_layers=-1)
    assert llm.backend.name == "cupy" and llm.tokenize(b"hi") == llm.model.tokenizer.encode("hi")


def test_n_gpu_layers_covering_the_model_or_cpu_only(path):
    for ok in (-1, 2, 99):           # the synthetic model has 2 layers
        assert LLM(path, n_ctx=32, backend="numpy", n_gpu_layers=ok).n_ctx == 32
    assert LLM(path, n_ctx=32, n_gpu_layers=0).backend.name == "numpy"       # every layer on the CPU
    with pytest.raises(ConfigError, match="n_gpu_layers=1 would leave 1 of the model's 2 layers on the CPU"):
        LLM(path, n_ctx=32, backend="numpy", n_gpu_layers=1)
    with pytest.raises(ConfigError, match="n_gpu_layers=0 keeps every layer on the CPU"):
        LLM(path, n_ctx=32, backend="cupy", n_gpu_layers=0)
    for bad in (-2, 1.0, "all"):
        with pytest.raises(ConfigError, match="n_gpu_layers"):
            LLM(path, n_ctx=32, backend="numpy", n_gpu_layers=bad)


def test_split_mode_numbers_are_llama_cpp_enum(path):
    with pytest.warns(UserWarning, match="KV heads"):        # one KV head: device 1 gets no attention slice
        tp = LLM(path, n_ctx=32, backend="numpy", n_devices=2, split_mode=2, tensor_split=[3, 1])
    assert (tp.layout.split_mode, tp.layout.tensor_split) == ("tensor", (3.0, 1.0))
    assert LLM(path, n_ctx=32, backend="numpy", n_devices=2, split_mode=1).layout.split_mode == "layer"
    assert LLM(path, n_ctx=32, backend="numpy", split_mode=0).layout.split_mode == "none"
    with pytest.raises(ConfigError, match="split_mode 3 is not one of llama.cpp's"):
        LLM(path, n_ctx=32, backend="numpy", split_mode=3)


def test_main_gpu_zero_only(path):
    assert LLM(path, n_ctx=32, backend="numpy", main_gpu=0).n_ctx == 32
    with pytest.raises(ConfigError, match="main_gpu=1 is not supported.*CUDA_VISIBLE_DEVICES=1"):
        LLM(path, n_ctx=32, backend="numpy", main_gpu=1)
    with pytest.raises(ConfigError, match="main_gpu"):
        LLM(path, n_ctx=32, backend="numpy", main_gpu=-1)


def test_chat_format_known_names_only(path):
    assert LLM(path, n_ctx=32, backend="numpy", chat_format=None).tokenizer.chat_template == TEMPLATE
    with pytest.raises(ConfigError, match="chat_format 'vicuna' is not supported; metatp knows chatml, llama-3"):
        LLM(path, n_ctx=32, backend="numpy", chat_format="vicuna")
    with pytest.raises(ConfigError, match=r"chat_format 'chatml' writes <\|im_start\|>, which is not a token"):
        LLM(path, n_ctx=32, backend="numpy", chat_format="chatml")


def test_embedding_logits_all_and_seed_keywords(path):
    llm = LLM(path, n_ctx=32, backend="numpy", embedding=True, logits_all=True, seed=-1)
    assert llm.embedding and llm.logits_all
    for name in ("embedding", "logits_all"):
        with pytest.raises(ConfigError, match=name):
            LLM(path, n_ctx=32, backend="numpy", **{name: "yes"})


def test_a_keyword_metatp_does_not_know_is_named(path):
    with pytest.raises(TypeError, match="use_mlock"):
        Llama(model_path=path, use_mlock=True)


# ---------------------------------------------------------------- tokens
def test_tokenize_takes_bytes_and_detokenize_gives_bytes(dropin_llama, llm):
    ids = dropin_llama.tokenize(b"hello there")
    assert ids == dropin_llama.tokenize("hello there") == llm.tokenize("hello there")
    assert dropin_llama.detokenize(ids) == b"hello there"
    assert dropin_llama.detokenize(ids, prev_tokens=ids) == b"hello there"
    e_acute = dropin_llama.tokenize("é".encode())
    assert len(e_acute) == 2 and dropin_llama.detokenize(e_acute[:1]) == b"\xc3"     # a character's first byte
    assert llm.detokenize(e_acute[:1]) == "\ufffd"                                  # LLM keeps metatp's str
    with pytest.raises(ConfigError, match="not valid UTF-8"):
        dropin_llama.tokenize(b"\xff\xfe")
    with pytest.raises(ConfigError, match="tokens"):
        dropin_llama.detokenize([1.5])


def test_special_tokens_are_text_unless_asked(dropin_llama):
    assert dropin_llama.tokenize(b"<|eos|>", special=True) == [1]
    assert 1 not in dropin_llama.tokenize(b"<|eos|>")               # llama-cpp-python's default: plain text
    assert dropin_llama.detokenize([1]) == b"" and dropin_llama.detokenize([1], special=True) == b"<|eos|>"


def test_add_bos_follows_the_model(path):
    from metatp.ir.tokenizer import Tokenizer

    llama = Llama(path, n_ctx=32, backend="numpy")
    assert llama.tokenizer.add_bos is False                          # the synthetic model adds none
    assert llama.tokenize(b"hi", add_bos=True) == llama.tokenize(b"hi", add_bos=False)
    assert isinstance(llama.tokenizer, Tokenizer)


def test_count_methods_and_token_ids(dropin_llama):
    assert dropin_llama.n_ctx() == dropin_llama.n_ctx == 64
    assert dropin_llama.n_vocab() == dropin_llama.n_vocab == 300
    assert (dropin_llama.token_bos(), dropin_llama.token_eos()) == (0, 1)
    assert dropin_llama.detokenize([dropin_llama.token_nl()]) == b"\n"


# ---------------------------------------------------------------- completions
def _log_softmax(row: np.ndarray) -> np.ndarray:
    x = row.astype(np.float64)
    return x - (x.max() + math.log(np.exp(x - x.max()).sum()))


def test_call_with_echo_and_logprobs_scores_the_prompt(dropin_llama):
    prompt = "hello there"
    out = dropin_llama(prompt, max_tokens=4, echo=True, logprobs=2, temperature=0)
    choice = out["choices"][0]
    lp = choice["logprobs"]
    ids = dropin_llama.tokenize(prompt)
    assert choice["text"].startswith(prompt) and "".join(lp["tokens"]) == choice["text"]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    want = dropin_llama.score(ids)
    for i in range(1, len(ids)):
        assert lp["token_logprobs"][i] == pytest.approx(_log_softmax(want[i - 1])[ids[i]], abs=1e-5)
        assert len(lp["top_logprobs"][i]) == 2
    plain = dropin_llama(prompt, max_tokens=4, logprobs=2, temperature=0)["choices"][0]
    assert choice["text"] == prompt + plain["text"]
    assert lp["token_logprobs"][len(ids):] == pytest.approx(plain["logprobs"]["token_logprobs"], abs=1e-6)


def test_stream_chunks_spell_the_completion(dropin_llama):
    whole = dropin_llama.create_completion("hello", max_tokens=6, temperature=0)["choices"][0]["text"]
    chunks = list(dropin_llama.create_completion("hello", max_tokens=6, temperature=0, stream=True))
    assert all(c["object"] == "text_completion" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == whole
    assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")


def test_chat_response_format_constrains_the_answer(dropin_llama):
    messages = [{"role": "user", "content": "yes or no?"}]
    schema = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
              "additionalProperties": False}
    for fmt in ({"type": "json_object", "schema": schema},
                {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}):
        out = dropin_llama.create_chat_completion(messages, response_format=fmt, max_tokens=48, temperature=0)
        choice = out["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        assert json.loads(choice["message"]["content"])["answer"] in ("yes", "no")
    free = dropin_llama.create_chat_completion(messages, response_format={"type": "text"}, max_tokens=4,
                                               temperature=0)
    assert free == dropin_llama.create_chat_completion(messages, max_tokens=4, temperature=0) | \
        {"id": free["id"], "created": free["created"]}
    for bad in ({"type": "xml"}, "json", {"type": "json_schema"}):
        with pytest.raises(ConfigError, match="response_format"):
            dropin_llama.create_chat_completion(messages, response_format=bad)


def test_prompts_parse_special_tokens_as_llama_cpp_python_does(dropin_llama, llm):
    """create_completion tokenizes its prompt with special=True in llama-cpp-python too: the
    same ids as LLM's, whatever Llama.tokenize's own default."""
    prompt = "<|bos|>hello"
    out = dropin_llama.create_completion(prompt, max_tokens=1, temperature=0)
    assert out["usage"]["prompt_tokens"] == len(llm.prompt_ids(prompt)) < len(dropin_llama.tokenize(prompt))
    assert dropin_llama.prompt_ids(prompt) == llm.prompt_ids(prompt) == dropin_llama.tokenize(prompt.encode(),
                                                                                             special=True)
