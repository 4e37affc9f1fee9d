"""A GGUF's chat template and hyper-parameters are attacker-controlled input.

Templates run in a budgeted sandbox: whatever they do, rendering ends within its time budget
with a typed error. Hyper-parameters are checked for type and range and against each other and
the tensors at load, naming the key or tensor. A broken model's NaN logits are an error. A
hypothesis property mutates metadata values of a synthetic model (the same mutators as
`python -m scripts.fuzz_gguf --values`), and the CLI reports all of it on one line.
"""

from __future__ import annotations

import math
import os
import time
import tracemalloc

import gguf
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metatp import LLM, SamplingParams
from metatp.cli import main
from metatp.ir import chat_template as chat_template
from metatp.ir.errors import ConfigError, MetatpError, ModelFormatError, ModelNotFoundError, NumericalError
from metatp.ir.loader import load_model
from metatp.ir.tokenizer import Tokenizer
from metatp.ir.tokenizer_tables import gpt2_byte_table
from metatp.testing.gguf_edit import read_parts, write_parts
from metatp.testing.synth import SynthSpec
from scripts import fuzz_gguf as fz

VT = gguf.GGUFValueType
SPEC = SynthSpec(n_layer=2, n_embd=32, n_head=2, n_head_kv=1, n_ff=64, tied=False, seed=9)   # the `path` fixture
BUDGET_SECONDS = 0.3          # the template time budget in these tests (2 s in production)


@pytest.fixture(scope="module")
def base(path):
    return read_parts(path)


@pytest.fixture(autouse=True)
def short_budget(monkeypatch):
    monkeypatch.setattr(chat_template, "TEMPLATE_SECONDS", BUDGET_SECONDS)


def mutant(base, tmp_path, *mutations, name="m.gguf") -> str:
    import copy

    parts = copy.deepcopy(base)
    for _, apply in mutations:
        apply(parts)
    path = tmp_path / name
    write_parts(path, parts)
    return str(path)


# ---------------------------------------------------------------- templates
def bpe_tokenizer(template: str) -> Tokenizer:
    table = gpt2_byte_table()
    tokens = ["<|bos|>", "<|eos|>"] + [table[b] for b in range(256)]
    return Tokenizer.from_metadata({
        "tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt2", "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3, 3] + [1] * 256, "tokenizer.ggml.merges": [],
        "tokenizer.ggml.bos_token_id": 0, "tokenizer.ggml.eos_token_id": 1, "tokenizer.chat_template": template})


ACCEPTED = {"{{ cycler }}", "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"}
USER_ERRORS = {"{{ raise_exception('no') }}", "{{ messages[5]['content'] }}", ""}     # "": no template


@pytest.mark.parametrize("template", fz.HOSTILE_TEMPLATES, ids=[t[:40] for t in fz.HOSTILE_TEMPLATES])
def test_hostile_template_is_a_typed_error_in_bounded_time_and_memory(template):
    tok = bpe_tokenizer(template)
    tracemalloc.start()
    start = time.perf_counter()
    try:
        out = tok.apply_chat_template([{"role": "user", "content": "hi"}])
        outcome = "ok"
    except MetatpError as e:
        outcome = type(e).__name__
        assert "chat template" in str(e)
    finally:
        elapsed = time.perf_counter() - start
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    # tracemalloc slows Python code down; the bound is the budget plus a generous margin
    assert elapsed < BUDGET_SECONDS * 3 + 1.0, elapsed
    assert peak < 400 * 2**20, peak
    if template in ACCEPTED:
        assert outcome == "ok" and len(out) < 100
    elif template in USER_ERRORS:
        assert outcome == "ConfigError"
    else:
        assert outcome == "ModelFormatError"


def test_budget_leaves_the_trace_function_and_other_threads_alone():
    import sys
    import threading

    def tracer(frame, event, arg):
        return None

    sys.settrace(tracer)
    try:
        with pytest.raises(ModelFormatError, match="ran longer"):
            bpe_tokenizer(fz.HOSTILE_TEMPLATES[0]).apply_chat_template([])
        assert sys.gettrace() is tracer
    finally:
        sys.settrace(None)
    # one thread's runaway template does not stop another thread's render
    ok = bpe_tokenizer("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    results = []
    t = threading.Thread(target=lambda: results.append(ok.apply_chat_template([{"role": "u", "content": "x"}])))
    with pytest.raises(ModelFormatError):
        t.start()
        bpe_tokenizer(fz.HOSTILE_TEMPLATES[1]).apply_chat_template([])
    t.join()
    assert results == ["x"]


def test_real_template_features_still_render():
    tok = bpe_tokenizer("{{ bos_token }}{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' }}"
                        "{{ m['content'] | trim }}{{ ('x' * 3) ~ '|' ~ (2 ** 10) }}{% endfor %}"
                        "{{ messages | tojson(indent=2) | length > 0 }}{{ '%s-%d' | format('a', 3) }}"
                        "{{ '{}!'.format('hey') }}{{ 'ab'.replace('a', 'c') }}{{ ['p', 'q'] | join(', ') }}")
    out = tok.apply_chat_template([{"role": "user", "content": " hi "}])
    assert out == "<|bos|><|im_start|>user\nhixxx|1024Truea-3hey!cbp, q"


# ---------------------------------------------------------------- hyper-parameters and tensors
A = "{arch}"
BAD_HPARAMS = [
    (fz.set_key(f"{A}.context_length", 0, VT.UINT32), "context_length"),
    (fz.set_key(f"{A}.context_length", -1, VT.INT32), "context_length"),
    (fz.set_key(f"{A}.context_length", math.nan, VT.FLOAT32), "context_length"),
    (fz.set_key(f"{A}.context_length", "4096", VT.STRING), "context_length"),
    (fz.set_key(f"{A}.block_count", 1 << 31, VT.UINT32), "block_count"),
    (fz.set_key(f"{A}.block_count", 5, VT.UINT32), "block_count"),
    (fz.set_key(f"{A}.block_count", 1, VT.UINT32), "block_count"),
    (fz.set_key(f"{A}.block_count", 2.0, VT.FLOAT32), "block_count"),
    (fz.set_key(f"{A}.embedding_length", 1 << 40, VT.UINT64), "embedding_length"),
    (fz.set_key(f"{A}.attention.head_count", 0, VT.UINT32), "head_count"),
    (fz.set_key(f"{A}.attention.head_count_kv", 3, VT.UINT32), "head_count"),
    (fz.set_key(f"{A}.rope.dimension_count", 0, VT.UINT32), "rope.dimension_count"),
    (fz.set_key(f"{A}.rope.dimension_count", 7, VT.UINT32), "rope.dimension_count"),
    (fz.set_key(f"{A}.rope.dimension_count", 4096, VT.UINT32), "rope.dimension_count"),
    (fz.set_key(f"{A}.rope.freq_base", 0.0, VT.FLOAT32), "rope.freq_base"),
    (fz.set_key(f"{A}.rope.freq_base", -1.0, VT.FLOAT32), "rope.freq_base"),
    (fz.set_key(f"{A}.rope.freq_base", math.inf, VT.FLOAT32), "rope.freq_base"),
    (fz.set_key(f"{A}.attention.layer_norm_rms_epsilon", math.nan, VT.FLOAT32), "layer_norm_rms_epsilon"),
    (fz.set_key(f"{A}.attention.layer_norm_rms_epsilon", -1e-5, VT.FLOAT32), "layer_norm_rms_epsilon"),
    (fz.set_key(f"{A}.attention.layer_norm_rms_epsilon", "1e-5", VT.STRING), "layer_norm_rms_epsilon"),
    (fz.set_key(f"{A}.vocab_size", 299, VT.UINT32), "vocab_size"),
    (fz.set_key(f"{A}.attention.key_length", 0, VT.UINT32), "key_length"),
    (fz.set_key(f"{A}.expert_count", 8, VT.UINT32), "expert_used_count"),
    (fz.set_key(f"{A}.expert_weights_norm", "yes", VT.STRING), "expert_weights_norm"),
    (fz.set_key(f"{A}.final_logit_softcapping", math.nan, VT.FLOAT32), "final_logit_softcapping"),
    (fz.set_key("general.architecture", "gpt-j", VT.STRING), "gpt-j"),
    (fz.reshape_tensor(0, "flat"), "token_embd.weight"),      # tensor #0 is token_embd (2-D -> 1-D)
    (fz.drop_tensor(0), "token_embd.weight"),
]


def _scale_rope(p):
    p.kvs[f"{p.arch}.rope.scaling.type"] = ("linear", VT.STRING, None)
    p.kvs[f"{p.arch}.rope.scaling.factor"] = (0.0, VT.FLOAT32, None)


def _vocab_tokens(p):
    toks = p.kvs["tokenizer.ggml.tokens"]
    p.kvs["tokenizer.ggml.tokens"] = (toks[0] + ["extra"], toks[1], toks[2])
    types = p.kvs["tokenizer.ggml.token_type"]
    p.kvs["tokenizer.ggml.token_type"] = (types[0] + [1], types[1], types[2])


def _rank(p):
    for i, (name, data, q, ne) in enumerate(p.tensors):
        if name == "blk.0.attn_q.weight":
            p.tensors[i] = (name, data, q, (ne[0], 1, ne[1]))


BAD_HPARAMS += [
    (("rope scaling factor 0", _scale_rope), "rope.scaling.factor"),
    (("one token more than embedding rows", _vocab_tokens), "tokenizer.ggml.tokens"),
    (("attn_q as a 3-D tensor", _rank), "blk.0.attn_q.weight"),
]


@pytest.mark.parametrize("mutation, named", BAD_HPARAMS, ids=[m[0][:50] for m, _ in BAD_HPARAMS])
def test_bad_hparam_is_refused_at_load_naming_it(base, tmp_path, mutation, named):
    path = mutant(base, tmp_path, mutation)
    with pytest.raises(MetatpError) as info:
        load_model(path)
    assert named in str(info.value), str(info.value)
    assert isinstance(info.value, (ModelFormatError, ConfigError)) or "gpt-j" in str(info.value)


def test_nan_weights_give_an_error_not_token_zero(base, tmp_path):
    path = mutant(base, tmp_path, ("NaN output norm", _fill("output_norm.weight", math.nan)))
    llm = LLM(path, n_ctx=32, backend="numpy")
    with pytest.raises(NumericalError, match="NaN"):
        llm.generate("hello", SamplingParams(max_tokens=3, temperature=0.0))
    with pytest.raises(NumericalError):
        list(llm("hello", max_tokens=3, stream=True))
    with pytest.raises(NumericalError):
        llm.score([3, 4])


def _fill(name: str, value: float):
    def apply(p):
        for i, (n, data, q, ne) in enumerate(p.tensors):
            if n == name:
                p.tensors[i] = (n, data * 0 + value, q, ne)
    return apply


def test_vocabulary_that_cannot_write_text():
    table = gpt2_byte_table()
    tokens = ["<|bos|>"] + [table[b] for b in range(256) if b != 0x04]
    tok = Tokenizer.from_metadata({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt2",
                                   "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.merges": []})
    assert tok.decode(tok.encode("fine text")) == "fine text"
    with pytest.raises(ConfigError, match="cannot represent"):
        tok.encode("a\x04b")                 # the missing byte is not silently dropped
    with pytest.raises(ModelFormatError, match="printable ASCII"):
        Tokenizer.from_metadata({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt2",
                                 "tokenizer.ggml.tokens": ["<s>", "hello", "world"], "tokenizer.ggml.merges": []})


# ---------------------------------------------------------------- the property
mutations = (
    st.tuples(st.sampled_from(fz.HPARAM_KEYS), st.sampled_from(fz.HOSTILE_VALUES)).map(
        lambda kv: fz.set_key(kv[0], *kv[1]))
    | st.sampled_from(fz.HPARAM_KEYS).map(fz.delete_key)
    | st.sampled_from(fz.HOSTILE_TEMPLATES).map(fz.set_template)
    | st.integers(0, 63).map(fz.drop_tensor)
    | st.tuples(st.integers(0, 63), st.sampled_from(["flat", "3d", "transpose", "split"])).map(
        lambda a: fz.reshape_tensor(*a))
    | st.tuples(st.integers(0, 63), st.sampled_from([math.nan, math.inf, 1e30])).map(lambda a: fz.scale_tensor(*a))
)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(muts=st.lists(mutations, min_size=1, max_size=3))
def test_value_mutations_load_or_raise_a_metatp_error(base, tmp_path, muts):
    try:
        path = mutant(base, tmp_path, *muts, name="prop.gguf")
    except Exception:       # noqa: BLE001 -- gguf's writer refused the value (e.g. -1 as UINT32): no file to test
        return
    fz.check_values(path, time_limit=8.0)


def test_value_fuzzer_runs_clean():
    """`python -m scripts.fuzz_gguf --values`, bounded for CI."""
    assert fz.run_values(12, seed=3, base=None) == 0


# ---------------------------------------------------------------- the CLI
def one_error_line(capsys) -> str:
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1, err
    return err[0]


def test_cli_special_files_as_model(tmp_path, capsys):
    fifo = tmp_path / "pipe.gguf"
    os.mkfifo(fifo)
    for model, kind in (("/dev/null", "character device"), (str(fifo), "FIFO")):
        assert main(["generate", "-m", model, "-p", "x"]) == 1
        line = one_error_line(capsys)
        assert kind in line and "does not exist" not in line, line
    with pytest.raises(ModelNotFoundError, match="FIFO"):
        LLM(str(fifo))


@pytest.mark.parametrize("argv, needle", [
    (["generate", "-n", "abc", "-p", "x"], "invalid int value: 'abc'"),
    (["generate", "--temp", "warm", "-p", "x"], "--temp"),
    (["generate", "-c", "1.5", "-p", "x"], "invalid int value"),
    (["generate", "--no-such-flag"], "unrecognized arguments"),
    (["bench", "--devices", "0"], "--devices"),
    (["bench", "--devices", "2,-1"], "--devices"),
])
def test_cli_bad_flags_are_one_line(capsys, argv, needle):
    assert main(argv) != 0
    line = one_error_line(capsys)
    assert line.startswith("metatp") and "error:" in line and needle in line, line


def test_cli_seed_minus_one_and_bad_prompt_file(base, tmp_path, capsys):
    path = mutant(base, tmp_path)
    assert main(["generate", "-m", path, "-p", "hi", "-n", "2", "-s", "-1"]) == 0
    capsys.readouterr()
    bad = tmp_path / "prompt.txt"
    bad.write_bytes(b"caf\xe9 au lait")
    assert main(["generate", "-m", path, "-f", str(bad)]) == 1
    line = one_error_line(capsys)
    assert "not UTF-8" in line and "offset 3" in line, line


def test_cli_hostile_model_is_not_an_internal_error(base, tmp_path, capsys):
    for i, mutation in enumerate([fz.set_key(f"{A}.context_length", math.nan, VT.FLOAT32),
                                  fz.set_key(f"{A}.rope.dimension_count", 7, VT.UINT32),
                                  fz.set_key(f"{A}.block_count", 1 << 31, VT.UINT32)]):
        path = mutant(base, tmp_path, mutation, name=f"h{i}.gguf")
        assert main(["generate", "-m", path, "-p", "x", "-n", "1"]) == 1
        line = one_error_line(capsys)
        assert line.startswith("metatp: error:") and "internal error" not in line, line
