"""Memory planning: the plan matches what the numpy backend allocates; budgets refuse or fit n_ctx."""

from __future__ import annotations

import pytest

from metatp import LLM, SamplingParams
from metatp.ir.errors import ConfigError, MemoryPlanError
from metatp.passes.memory import parse_bytes
from metatp.testing.synth import SynthSpec
from support.require import require


def test_plan_matches_numpy_allocation_within_10_percent(synth_factory):
    path, _ = synth_factory(SynthSpec(n_vocab=2000, n_embd=128, n_ff=256, seed=21))
    llm = LLM(str(path), n_ctx=256, backend="numpy", n_batch=64)
    llm.score(list(range(2, 66)))                      # runs the largest (n_batch) plan
    llm.generate("hi", SamplingParams(temperature=0.0))
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
        llm.generate("hi", SamplingParams(temperature=0.0))
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


@pytest.mark.parametrize("T", [1, 16, 100])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_buffers_born_early_share_memory_only_with_buffers_dead_by_then(synth_factory, T, seed):
    """`assign_offsets(born_at=)`: a node's buffer that a fusion writes at an earlier node lives
    from there; no two buffers whose lives overlap share a byte (lives taken from the graph: from
    the birth to the last reader of the buffer or its views; outputs to the end)."""
    import numpy as np

    from metatp.backends.numpy.backend import NumpyBackend
    from metatp.engine import Engine, padded_kv
    from metatp.ir.loader import load_model
    from metatp.ir.models import BatchSpec
    from metatp.ir.ops import Op
    from metatp.passes.memory import assign_offsets, owns_buffer
    from metatp.passes.plan import DeviceLayout

    path, _ = synth_factory(SynthSpec(seed=11))
    eng = Engine(load_model(path), 256, DeviceLayout(), NumpyBackend(DeviceLayout()))
    plan = eng.plan_for(BatchSpec(T, padded_kv(T, 256), 1))[0]
    nodes, idx = plan.graph.nodes, plan.graph.index
    rng = np.random.default_rng(seed)
    # every MUL_MAT after the first reader of its x born at that first reader (as the groups do),
    # or at a random earlier node after x
    born = {}
    for n in nodes:
        if n.op is Op.MUL_MAT and owns_buffer(n):
            x = n.src[1]
            first = min(idx[r] for r in nodes if r.op is Op.MUL_MAT and r.src[1] is x)
            lo = first if rng.random() < 0.5 else idx.get(x, -1) + 1
            if lo < idx[n]:
                born[n] = int(rng.integers(max(lo, 0), idx[n] + 1))
    offsets, size = assign_offsets(plan, 0, lambda t: 4, born_at=born)
    last = {}
    for i, n in enumerate(nodes):
        for s in n.src:
            if s is not None:
                o = s.view_src or s
                last[o] = max(last.get(o, -1), i)
    outs = {t.view_src or t for t in plan.graph.outputs}
    lives = []
    for t, off in offsets.items():
        start = born.get(t, idx[t])
        end = len(nodes) if t in outs else max(last.get(t, idx[t]), idx[t])
        nbytes = -(-max(int(np.prod(plan.of(t).local[0].ne)) * 4, 1) // 64) * 64
        lives.append((start, end, off, off + nbytes))
    for i, (s1, e1, a1, b1) in enumerate(lives):
        assert b1 <= size
        for s2, e2, a2, b2 in lives[i + 1:]:
            if s1 <= e2 and s2 <= e1:           # alive together at some node
                assert b1 <= a2 or b2 <= a1
