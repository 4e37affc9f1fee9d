"""Split execution equals single-device execution (float32 rounding), on random graph fragments.

The fragments (tests/helpers.py): the llama graph, fused QKV views, a MoE block, parallel
PARTIAL branches and reshape/view/permute chains; device counts 1..8 with random asymmetric
tensor_split (zeros allowed).
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from support.helpers import (chain_case, check_equivalent, check_granularity, fused_qkv_case, layouts, llama_case,
                     llama_hparams, moe_case, parallel_case)
from metatp.ir.tensor import GGMLType
from metatp.passes import DeviceLayout


SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@settings(max_examples=60, **SETTINGS)
@given(layout=layouts(), n_head_kv=st.integers(1, 4), n_gqa=st.integers(1, 3), hd=st.sampled_from([4, 8]),
       n_embd=st.sampled_from([16, 24, 32]), ff=st.integers(1, 3), T=st.integers(1, 3), n_past=st.integers(0, 3),
       variant=st.sampled_from(["plain", "bias", "qk_norm", "untied"]), seed=st.integers(0, 2**16))
def test_llama_graph_equivalence(layout, n_head_kv, n_gqa, hd, n_embd, ff, T, n_past, variant, seed):
    hp = llama_hparams(n_layer=2, n_embd=n_embd, n_head=n_head_kv * n_gqa, n_head_kv=n_head_kv, hd=hd, n_ff=128 * ff,
                       n_vocab=40)
    kw = {"qkv_bias": variant == "bias", "qk_norm": variant == "qk_norm", "tied": variant != "untied"}
    n_out = 1 if T > 1 and seed % 2 else T
    g, vals, feed, outs = llama_case(hp, T, n_ctx=8, n_past=n_past, n_outputs=n_out, seed=seed, **kw)
    plan = check_equivalent((g, vals, feed, outs, hp), layout, seed=seed)
    assert plan.stats["reductions_per_step"] == 2 * hp.n_layer
    check_granularity(plan, hp)


@settings(max_examples=50, **SETTINGS)
@given(layout=layouts(), n_head_kv=st.integers(1, 3), n_gqa=st.integers(1, 3), hd=st.sampled_from([4, 8]),
       hd_v=st.sampled_from([4, 8, 12]), T=st.integers(1, 3), bias=st.booleans(), seed=st.integers(0, 2**16))
def test_fused_qkv_views_equivalence(layout, n_head_kv, n_gqa, hd, hd_v, T, bias, seed):
    case = fused_qkv_case(24, n_head_kv * n_gqa, n_head_kv, hd, hd_v, T, seed, bias)
    plan = check_equivalent(case, layout, seed=seed)
    w = next(t for t in plan.graph.leaves if t.name == "blk.0.attn_qkv.weight")
    assert plan.of(w).state.n_segments == (2 if hd == hd_v else 3)


@settings(max_examples=50, **SETTINGS)
@given(layout=layouts(), ff=st.integers(1, 3), n_expert=st.integers(2, 5), n_used=st.integers(1, 3),
       T=st.integers(1, 3), bias=st.booleans(), fused=st.booleans(), seed=st.integers(0, 2**16))
def test_moe_equivalence(layout, ff, n_expert, n_used, T, bias, fused, seed):
    n_used = min(n_used, n_expert)
    plan = check_equivalent(moe_case(16, 128 * ff, n_expert, n_used, T, seed, bias, fused), layout, seed=seed)
    assert plan.stats["reductions_per_step"] == 1


@settings(max_examples=40, **SETTINGS)
@given(layout=layouts(), n_head_kv=st.integers(1, 3), n_gqa=st.integers(1, 2), ff=st.integers(1, 2),
       T=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_parallel_branches_equivalence(layout, n_head_kv, n_gqa, ff, T, seed):
    case = parallel_case(16, n_head_kv * n_gqa, n_head_kv, 4, 128 * ff, T, seed)
    plan = check_equivalent(case, layout, seed=seed)
    assert plan.stats["reductions_before_coalescing"] == 2
    assert plan.stats["reductions_per_step"] == 1


@settings(max_examples=50, **SETTINGS)
@given(layout=layouts(), ff=st.integers(1, 3), c=st.sampled_from([2, 4, 8, 16, 32, 64, 128]), T=st.integers(1, 3),
       seed=st.integers(0, 2**16))
def test_reshape_view_permute_chains_equivalence(layout, ff, c, T, seed):
    check_equivalent(chain_case(12, 128 * ff, c, T, seed), layout, seed=seed)


def test_quantized_granularity_llama():
    """Q4_1 attn_output / ffn_down: cuts stay on 32-element blocks (and heads) and results match."""
    hp = llama_hparams(n_layer=2, n_embd=64, n_head=4, n_head_kv=2, hd=16, n_ff=384, n_vocab=40)
    q = GGMLType.Q4_1
    types = {"attn_output.weight": q, "ffn_down.weight": q, "ffn_up.weight": q, "attn_q.weight": q}
    g, vals, feed, outs = llama_case(hp, 2, n_ctx=8, n_past=2, n_outputs=2, types=types)
    for layout in (DeviceLayout(3, "tensor"), DeviceLayout(4, "tensor", (1, 3, 0, 2))):
        plan = check_equivalent((g, vals, feed, outs, hp), layout, coalesce_both=False)
        check_granularity(plan, hp)
        for t in g.leaves:
            s = plan.of(t).state
            if t.type == q and s.is_split and s.axis == 0:
                assert all(x % 32 == 0 for x in s.extents()), (t.name, str(s))
