"""vLLM's constructor keywords (`LLM(model, dtype=..., gpu_memory_utilization=..., ...)`): each
honoured or refused by name (`metatp.vllm_compat.engine_keywords`), never swallowed."""

from __future__ import annotations

import pytest

from metatp import LLM
from metatp.ir.errors import ConfigError, MemoryPlanError
from metatp.testing.synth import SynthSpec
from metatp.vllm_compat import engine_keywords
from support.require import requires

SPEC = SynthSpec(n_layer=2, n_embd=32, n_head=2, n_head_kv=1, n_ff=64, seed=49)
LLM_OPTIONS = {"n_ctx": 32}          # the `llm` fixture (tests/conftest.py)


def small(path, **kw) -> LLM:
    return LLM(path, n_ctx=32, backend="numpy", **kw)


def on(backend: str, **kw):
    return engine_keywords(lambda: backend, kw.pop("backend_options", {}), kw.pop("n_batch", None),
                           kw.pop("memory_budget", None), **kw)


# ---------------------------------------------------------------- dtype
def test_dtype_maps_to_the_cupy_types_and_numpy_float32():
    assert on("cupy", dtype="float32").backend_options == {"matmul_dtype": "f32", "kv_dtype": "f32"}
    assert on("cupy", dtype="half").backend_options == {"matmul_dtype": "f16", "kv_dtype": "f16"}
    assert on("cupy", dtype="auto").backend_options == {}
    assert on("numpy", dtype="float32").backend_options == {}
    with pytest.raises(ConfigError, match="dtype='bfloat16'.*kv_dtype"):
        on("cupy", dtype="bfloat16")
    with pytest.raises(ConfigError, match="dtype='float16': the numpy backend computes in float32"):
        on("numpy", dtype="float16")
    with pytest.raises(ConfigError, match="dtype must be one of"):
        on("numpy", dtype="int8")
    with pytest.raises(ConfigError, match="dtype='float32'.*kv_dtype='f16'"):
        on("cupy", dtype="float32", backend_options={"kv_dtype": "f16"})


def test_dtype_on_an_llm(path):
    assert small(path, dtype="float32").backend.name == "numpy"
    with pytest.raises(ConfigError, match="dtype='bfloat16'"):
        small(path, dtype="bfloat16")


@requires("emulator")
def test_dtype_and_enforce_eager_reach_the_cupy_backend(path, monkeypatch):
    import metatp.backends as backends
    import metatp.backends.cuda.backend as cuda_backend
    from metatp.testing import EmuRuntime

    monkeypatch.setattr(backends, "gpu_probe", lambda: (True, ""))
    monkeypatch.setattr(cuda_backend, "CupyRuntime", lambda: EmuRuntime())
    llm = LLM(path, backend="cupy", n_ctx=32, dtype="float32", enforce_eager=True)
    b = llm.backend
    assert (b.matmul_dtype, b.kv_dtype, b.cuda_graphs) == ("f32", "f32", False)


# ---------------------------------------------------------------- memory
def test_gpu_memory_utilization_is_a_fraction_of_the_free_memory(path, monkeypatch):
    llm = small(path, gpu_memory_utilization=0.5)
    need = sum(llm.memory.totals()) + llm.memory.host
    free = 4 * need
    monkeypatch.setattr(type(llm.backend), "memory_budget", lambda self: (free, True))
    small(path, gpu_memory_utilization=0.5)                  # half of 4x: fits
    with pytest.raises(MemoryPlanError, match="does not fit"):
        small(path, gpu_memory_utilization=0.2)              # a fifth of 4x: does not
    monkeypatch.setattr(type(llm.backend), "memory_budget", lambda self: (None, True))
    with pytest.raises(ConfigError, match="gpu_memory_utilization=0.5: the numpy backend reports no free memory"):
        small(path, gpu_memory_utilization=0.5)


def test_gpu_memory_utilization_checks():
    for bad in (0, 1.5, -0.1, True, "0.9"):
        with pytest.raises(ConfigError, match="gpu_memory_utilization must be a fraction"):
            on("numpy", gpu_memory_utilization=bad)
    with pytest.raises(ConfigError, match="gpu_memory_utilization=0.9 and memory_budget='8GiB'"):
        on("numpy", gpu_memory_utilization=0.9, memory_budget="8GiB")
    assert on("numpy", gpu_memory_utilization=1).memory_fraction == 1.0


# ---------------------------------------------------------------- the rest
def test_enforce_eager_turns_cuda_graphs_off():
    assert on("cupy", enforce_eager=True).backend_options == {"cuda_graphs": False}
    assert on("numpy", enforce_eager=True).backend_options == {}
    assert on("cupy", enforce_eager=False).backend_options == {}
    with pytest.raises(ConfigError, match="enforce_eager=True.*cuda_graphs=True"):
        on("cupy", enforce_eager=True, backend_options={"cuda_graphs": True})
    with pytest.raises(ConfigError, match="enforce_eager must be True or False"):
        on("cupy", enforce_eager="yes")


def test_max_num_batched_tokens_is_n_batch(path):
    assert small(path, max_num_batched_tokens=16).engine.n_batch == 16
    assert small(path).engine.n_batch == 512
    with pytest.raises(ConfigError, match="max_num_batched_tokens=16 and n_batch=8"):
        small(path, max_num_batched_tokens=16, n_batch=8)
    with pytest.raises(ConfigError, match="max_num_batched_tokens must be a positive integer"):
        small(path, max_num_batched_tokens=0)


def test_tokenizer_must_be_the_model(path, tmp_path):
    assert small(path, tokenizer=path).tokenizer.n_vocab > 0
    with pytest.raises(ConfigError, match="tokenizer='gpt2' is not the model"):
        small(path, tokenizer="gpt2")
    with pytest.raises(ConfigError, match="tokenizer must be a model name or path"):
        small(path, tokenizer=3)


def test_quantization_swap_space_trust_remote_code_log_stats_and_seed(path):
    llm = small(path, quantization="gguf", swap_space=4, trust_remote_code=True, disable_log_stats=True, seed=None)
    assert llm.backend.name == "numpy"
    with pytest.raises(ConfigError, match="quantization='awq' is not supported"):
        small(path, quantization="awq")
    with pytest.raises(ConfigError, match="swap_space must be a size in GiB"):
        small(path, swap_space=-1)
    with pytest.raises(ConfigError, match="trust_remote_code must be True or False"):
        small(path, trust_remote_code="yes")
    with pytest.raises(ConfigError, match="disable_log_stats=False"):
        small(path, disable_log_stats=False)


def test_an_unknown_keyword_is_still_a_type_error(path):
    with pytest.raises(TypeError, match="block_size"):
        small(path, block_size=16)
