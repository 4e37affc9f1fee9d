"""Bad configurations, generation limits and soak: every failure is one clear typed error."""

from __future__ import annotations

import math

import pytest

from metatp import LLM, SamplingParams
from metatp.output_processor import StopMatcher
from metatp.cli import main
from metatp.ir.errors import BackendUnavailableError, ConfigError, ContextOverflowError
from metatp.testing.synth import SynthSpec

SPEC = SynthSpec(n_layer=1, n_embd=32, n_head=2, n_head_kv=1, n_ff=64, seed=31)   # the `path` fixture


@pytest.mark.parametrize("kwargs, match", [
    ({"n_devices": 2, "split_mode": "tensor", "tensor_split": [1, 2, 3]}, "3 entries for 2 devices"),
    ({"n_devices": 2, "split_mode": "tensor", "tensor_split": [1, -1]}, ">= 0"),
    ({"n_devices": 2, "split_mode": "tensor", "tensor_split": [0, 0]}, "positive entry"),
    ({"n_devices": 2, "split_mode": "tensor", "tensor_split": [1, math.nan]}, "finite"),
    ({"n_devices": 0}, "n_devices must be"),
    ({"n_devices": 2, "split_mode": "none"}, "needs split_mode='tensor'"),
    ({"split_mode": "row"}, "split_mode must be one of"),
    ({"n_ctx": 0}, "n_ctx must be a positive integer"),
    ({"n_ctx": -5}, "n_ctx must be a positive integer"),
    ({"backend": "tpu"}, "unknown backend"),
    ({"numerics": "fast"}, "numerics='fast' is not one of exact, llamacpp"),
])
def test_bad_configuration(path, kwargs, match):
    with pytest.raises(ConfigError, match=match):
        LLM(path, **{"backend": "numpy", **kwargs})


def test_cupy_without_gpu_is_a_clear_error(path):
    from metatp.backends import gpu_available

    if gpu_available():
        pytest.skip("a GPU is present: cupy is usable here")
    with pytest.raises(BackendUnavailableError, match="backend='numpy'"):
        LLM(path, backend="cupy")


def test_context_beyond_training_warns(path):
    with pytest.warns(UserWarning, match="trained context"):
        LLM(path, n_ctx=SPEC.n_ctx_train + 1, backend="numpy")


@pytest.mark.parametrize("kwargs", [
    {"temperature": -1.0}, {"temperature": math.inf}, {"top_p": 0.0}, {"top_p": 1.5}, {"top_k": -5},
    {"max_tokens": -1}, {"min_p": 2.0}, {"repetition_penalty": 0.0}, {"seed": "x"}, {"stop": [1, 2]},
])
def test_bad_sampling_params(kwargs):
    with pytest.raises(ConfigError):
        SamplingParams(**kwargs)


def test_generation_limits(path):
    llm = LLM(path, n_ctx=32, backend="numpy")
    with pytest.raises(ContextOverflowError, match="prompt has 40 tokens"):
        llm.generate([list(range(2, 42))])
    out = llm.generate([list(range(2, 22))], SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True))[0].outputs[0]
    assert out.finish_reason == "length" and 20 + len(out.token_ids) == 33
    empty = llm.generate("", SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))[0]
    assert empty.prompt_token_ids == [0] and len(empty.outputs[0].token_ids) == 3
    assert llm.generate("abc", SamplingParams(max_tokens=0))[0].outputs[0].token_ids == []


def test_stop_strings_spanning_token_boundaries():
    m = StopMatcher(["STOP"])
    emitted = [m.feed(p) for p in ["hello S", "T", "O", "P and more"]]
    assert "".join(t for t, _ in emitted) == "hello "
    assert emitted[-1][1] == "STOP"
    m = StopMatcher(["xyz"])
    assert m.feed("abx")[0] == "ab" and m.feed("q")[0] == "xq" and m.flush() == ""


def test_streaming_never_splits_a_utf8_character(path):
    from metatp.ir.tokenizer import StreamDecoder

    llm = LLM(path, n_ctx=32, backend="numpy")
    tok = llm.tokenizer
    ids = tok.encode("naïve 😀 日本")
    dec = StreamDecoder(tok)
    pieces = [dec.push(i) for i in ids] + [dec.flush()]
    assert "".join(pieces) == "naïve 😀 日本" and not any("\ufffd" in p for p in pieces)


@pytest.mark.parametrize("argv, needle", [
    (["generate", "-p", "x", "-ts", "1,-1"], ">= 0"),
    (["generate", "-p", "x", "-ts", "a,b"], "tensor_split"),
    (["generate", "-p", "x", "--devices", "0"], "n_devices"),
    (["generate", "-p", "x", "-c", "0"], "n_ctx"),
    (["generate", "-p", "x", "--backend", "tpu"], "unknown backend"),
    (["generate", "-p", "x", "--temp", "-1"], "temperature"),
    (["generate", "-p", "x", "--top-p", "2"], "top_p"),
    (["generate"], "no prompt"),
    (["generate", "-f", "/nonexistent/prompt.txt"], "cannot read prompt file"),
    (["generate", "-p", "x", "-n", "-3"], "n-predict"),
])
def test_cli_error_paths_print_one_line(path, capsys, argv, needle):
    """One error line on stderr, and nothing on stdout before it (the prompt is echoed only once
    the request is accepted)."""
    rc = main([argv[0], "-m", path, *argv[1:]])
    out = capsys.readouterr()
    err = [line for line in out.err.splitlines() if line.strip()]
    assert rc != 0 and len(err) == 1 and err[0].startswith("metatp: error:") and needle in err[0], err
    assert out.out == "", out.out


def test_soak_is_flat_and_deterministic(path):
    from scripts.soak import soak

    a = soak(path, 120, seed=5)
    b = soak(path, 120, seed=5)
    assert a["digest"] == b["digest"]
    assert a["rss_end"] - a["rss_after_warmup"] < 16 * 2**20
