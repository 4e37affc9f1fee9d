"""KV cache types under tensor parallelism: the graph, the split and the memory plan.

A quantized cache (q8_0, q4_0, ...) is split by whole heads like an f32 one, and every device's
slice is whole quant blocks; a head size that is not whole blocks is refused before anything is
allocated; the memory plan counts the cache at its stored size.
"""

from __future__ import annotations

import pytest

from metatp.ir.errors import ConfigError
from metatp.ir.loader import load_model
from metatp.ir.models import BatchSpec, ModelTensors, build_graph
from metatp.ir.models.common import KV_CACHE_TYPES, cache_type
from metatp.ir.tensor import GGMLType, block_size, row_bytes
from metatp.passes.compile import compile_plan
from metatp.passes.memory import plan_memory
from metatp.passes.plan import DeviceLayout
from metatp.testing.synth import SynthSpec

LAYOUTS = [DeviceLayout(), DeviceLayout(2, "tensor", (3.0, 1.0)), DeviceLayout(3, "tensor", (1.0, 2.0, 1.0)),
           DeviceLayout(4, "tensor", (2.0, 1.0, 0.0, 1.0))]
SPEC = SynthSpec(n_embd=128, n_head=8, n_head_kv=4, head_dim=32, seed=5)    # the `synth_model` fixture


@pytest.mark.parametrize("name", list(KV_CACHE_TYPES))
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: f"n{lay.n_devices}")
def test_cache_split_is_whole_heads_and_blocks(synth_model, name, layout):
    ty = cache_type(name)
    tensors = ModelTensors(synth_model, 64, ty)
    plan = compile_plan(build_graph(tensors, BatchSpec(1, 64, 1)), layout, synth_model.hparams)
    hd = synth_model.hparams.head_dim_k
    for cache in tensors.cache_k + tensors.cache_v:
        assert cache.type == ty
        extents = [loc.ne[0] for loc in plan.of(cache).local]
        assert sum(extents) == cache.ne[0] or plan.of(cache).state.is_mirrored
        for e in extents:
            assert e % hd == 0 and e % block_size(ty) == 0, (name, extents)


def test_k_and_v_types_may_differ(synth_model):
    tensors = ModelTensors(synth_model, 64, GGMLType.Q8_0, GGMLType.F16)
    assert {t.type for t in tensors.cache_k} == {GGMLType.Q8_0}
    assert {t.type for t in tensors.cache_v} == {GGMLType.F16}


def test_head_size_not_whole_blocks_is_a_config_error(synth_factory):
    path, _ = synth_factory(SynthSpec(n_embd=160, n_head=4, n_head_kv=2, head_dim=40, seed=6))
    m = load_model(path)
    ModelTensors(m, 64, GGMLType.F16)                  # a float cache takes any head size
    with pytest.raises(ConfigError) as e:
        ModelTensors(m, 64, GGMLType.F16, GGMLType.Q4_0)
    msg = str(e.value)
    assert "cache_v_l0" in msg and "40" in msg and "32" in msg


def test_unknown_cache_type_names_the_choices():
    with pytest.raises(ConfigError) as e:
        cache_type("q3_k")
    assert "q8_0" in str(e.value) and "f16" in str(e.value)


@pytest.mark.parametrize("name", ["f32", "f16", "q8_0", "q4_0"])
def test_memory_plan_counts_the_stored_cache(synth_model, name):
    ty = cache_type(name)
    tensors = ModelTensors(synth_model, 256, ty)
    plan = compile_plan(build_graph(tensors, BatchSpec(1, 256, 1)), LAYOUTS[2], synth_model.hparams)
    mem = plan_memory(plan, lambda t, ne, p: 0, 256)
    for d in range(3):
        want = sum(row_bytes(ty, plan.of(c).local[d].ne[0]) * 256 if plan.of(c).local[d].ne[0] else 0
                   for c in tensors.cache_k + tensors.cache_v)
        assert mem.kv[d] == want


def test_dump_counts_the_cache_type(synth_model):
    """`metatp dump -ctk q8_0` shows the cache at its block bytes (34 per 32 values)."""
    import json

    from metatp.tools.dump import DumpRequest, dump_model

    def kv(name):
        out = json.loads(dump_model(DumpRequest(model=str(synth_model.path), n_devices=2, fmt="json", n_ctx=256,
                                                cache_type_k=name)))
        return out["summary"]["memory"]["kv"]
    assert [4 * q for q in kv("q8_0")] == [34 * f // 32 for f in kv("f32")]
