"""Memory planning: the plan matches what the numpy backend allocates; budgets refuse or fit n_ctx."""

from __future__ import annotations

import pytest

from metatp import LLM
from metatp.ir.errors import ConfigError, MemoryPlanError
from metatp.passes.memory import parse_bytes
from metatp.testing.synth import SynthSpec
from support.require import require


def test_plan_matches_numpy_allocation_within_10_percent(synth_factory):
    path, _ = synth_factory(SynthSpec(n_vocab=2000, n_embd=128, n_ff=256, seed=21))
    llm = LLM(str(path), n_ctx=256, backend="numpy", n_batch=64)
    llm.score(list(range(2, 66)))                      # runs the largest (n_batch) plan
    llm.generate("hi", )
    planned = sum(llm.memory.totals())
    actual = sum(llm.backend.allocated_bytes())
    assert abs(planned - actual) / actual < 0.10, (planned, actual)


def test_plan_matches_allocation_with_int8_coded_weights(synth_factory):
    """Quantized weights kept as int8 codes (compiled CPU kernels): no float32 copy, one
    dequantization slab per device; the plan still matches what is allocated."""
    require("cpu_kernels")
    types = {r: "Q4_1" for r in ("q", "k", "v", "o", "gate", "up", "down")} | {"embd": "Q8_0"}
    path, _ = synth_factory(SynthSpec(n_vocab=2000, n_embd=128, n_ff=256, seed=22, types=types))
    for n_devices in (1, 2):
        llm = LLM(str(path), n_ctx=256, backend="numpy", n_batch=64, n_devices=n_devices)
        llm.score(list(range(2, 66)))                  # the largest plan: long-prompt matmuls use the slab
        llm.generate("hi")
        assert llm.backend._encoded_only                # some weights are kept as codes only
        planned = sum(llm.memory.totals())
        actual = sum(llm.backend.allocated_bytes())
        assert abs(planned - actual) / actual < 0.10, (n_devices, planned, actual)


def test_budget_refusal_names_what_fits(synth_factory):
    path, _ = synth_factory(SynthSpec(n_vocab=2000, n_embd=128, n_ff=256, seed=21))
    small = LLM(str(path), n_ctx=256, backend="numpy", n_batch=64)
    need = sum(small.memory.totals()) + small.memory.host - sum(small.memory.kv)   # host: cell table, masks
    budget = need + 300 * small.memory.kv_per_token[0]       # room for ~300 context tokens
    with pytest.raises(MemoryPlanError, match=r"n_ctx=256 would fit"):
        LLM(str(path), n_ctx=4096, backend="numpy", n_batch=64, memory_budget=budget)
    fitted = LLM(str(path), n_ctx=4096, backend="numpy", n_batch=64, memory_budget=budget, fit_context=True)
    assert fitted.n_ctx == 256
    with pytest.raises(MemoryPlanError, match="even the smallest context does not fit"):
        LLM(str(path), n_ctx=256, backend="numpy", memory_budget=1000)


def test_parse_bytes():
    assert parse_bytes("8GiB") == 8 * 2**30
    assert parse_bytes("512MB") == 512 * 10**6
    assert parse_bytes(1234) == 1234
    for bad in ("lots", "-1G", "0", 0):
        with pytest.raises(ConfigError):
            parse_bytes(bad)
