"""vLLM's spellings in the Python API: LLM(tensor_parallel_size=T, pipeline_parallel_size=P) maps
onto n_devices / split_mode / tensor_split as the command line's --tp / --pp do (one function,
`metatp.parallel.parallel_layout`), and a contradiction is refused naming both settings."""

from __future__ import annotations

import numpy as np
import pytest

from metatp import LLM
from metatp.ir.errors import ConfigError
from metatp.parallel import FLAGS, KEYWORDS, parallel_layout
from metatp.testing.synth import SynthSpec

SPEC = SynthSpec(n_layer=4, n_embd=64, head_dim=16, n_ff=128, n_vocab=300, seed=7)
IDS = [5, 17, 100, 3, 99, 42]


@pytest.mark.parametrize("pp, tp, want", [
    (None, 2, (2, "tensor", None)),
    (1, 3, (3, "tensor", None)),
    (2, None, (2, "layer", None)),
    (3, 1, (3, "layer", None)),
    (2, 2, (4, "layer,tensor", (1.0, 1.0))),
    (1, 1, (1, "none", None)),
])
def test_sizes_choose_the_split(pp, tp, want):
    assert parallel_layout(None, None, None, pp, tp, KEYWORDS) == want


def test_given_settings_that_agree_are_kept():
    assert parallel_layout(2, "tensor", (3.0, 1.0), None, 2, KEYWORDS) == (2, "tensor", (3.0, 1.0))
    assert parallel_layout(4, None, (1.0, 3.0), 2, 2, KEYWORDS) == (4, "layer,tensor", (1.0, 3.0))
    assert parallel_layout(6, "layer,tensor", None, None, 2, KEYWORDS) == (6, "layer,tensor", (1.0, 1.0))
    assert parallel_layout(None, None, None, None, None, KEYWORDS) == (None, None, None)


@pytest.mark.parametrize("n, mode, ts, pp, tp, want", [
    (4, None, None, None, 2, "tensor_parallel_size is 2 but n_devices gives 4 devices"),
    (None, "layer", None, None, 2, "tensor_parallel_size 2 contradicts split_mode layer"),
    (None, "tensor", None, 2, None, "pipeline_parallel_size 2 contradicts split_mode tensor"),
    (None, "tensor", None, 2, 2, "pipeline_parallel_size 2 contradicts split_mode tensor"),
    (None, "none", None, None, 2, "tensor_parallel_size 2 contradicts split_mode none"),
    (None, None, (1.0, 1.0, 1.0), None, 2, "tensor_split has 3 shares but tensor_parallel_size is 2"),
    (None, None, (1.0, 1.0, 1.0), 2, 2, "tensor_split has 3 shares but tensor_parallel_size is 2"),
    (6, None, None, 2, 2, "pipeline_parallel_size 2 x tensor_parallel_size 2 is 4 devices, but n_devices gives 6"),
    (None, None, None, 0, 2, "pipeline_parallel_size must be >= 1"),
    (None, None, None, None, "2", "tensor_parallel_size must be an integer"),
    (None, None, None, True, None, "pipeline_parallel_size must be an integer"),
    ("4", None, None, None, 2, "n_devices must be an integer"),
])
def test_contradictions_are_refused_by_name(n, mode, ts, pp, tp, want):
    with pytest.raises(ConfigError, match=want):
        parallel_layout(n, mode, ts, pp, tp, KEYWORDS)


def test_the_flag_spellings_are_the_command_lines():
    with pytest.raises(ConfigError, match="--pp 2 x --tp 2 is 4 devices, but --devices / mpiexec -n gives 3"):
        parallel_layout(3, "layer,tensor", None, 2, 2, FLAGS)


def test_llm_tensor_parallel_size_is_split_mode_tensor(path):
    vllm = LLM(path, backend="numpy", n_ctx=64, tensor_parallel_size=2)
    ours = LLM(path, backend="numpy", n_ctx=64, n_devices=2, split_mode="tensor")
    assert (vllm.layout.n_devices, vllm.layout.split_mode) == (2, "tensor")
    np.testing.assert_array_equal(vllm.score(IDS), ours.score(IDS))


def test_llm_pipeline_parallel_size_is_split_mode_layer(path):
    llm = LLM(path, backend="numpy", n_ctx=64, pipeline_parallel_size=2)
    assert (llm.layout.n_devices, llm.layout.split_mode) == (2, "layer")


def test_llm_both_sizes_are_layer_tensor(path):
    llm = LLM(path, backend="numpy", n_ctx=64, pipeline_parallel_size=2, tensor_parallel_size=2,
              tensor_split=[1, 3])
    assert (llm.layout.n_devices, llm.layout.split_mode, llm.layout.pp, llm.layout.tp) == (4, "layer,tensor", 2, 2)
    assert llm.layout.ratios() == (1.0, 3.0)


def test_llm_refuses_a_contradiction_before_reading_the_model(tmp_path):
    missing = str(tmp_path / "missing.gguf")
    with pytest.raises(ConfigError, match="tensor_parallel_size 2 contradicts split_mode layer"):
        LLM(missing, backend="numpy", split_mode="layer", tensor_parallel_size=2)
    with pytest.raises(ConfigError, match="tensor_parallel_size is 2 but n_devices gives 3"):
        LLM(missing, backend="numpy", n_devices=3, tensor_parallel_size=2)
