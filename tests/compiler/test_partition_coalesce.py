"""Partition (cuts, zero slices, PARTIAL leaves) and delayed-reduction coalescing."""

from __future__ import annotations


import numpy as np
import pytest

from metatp.models import cache_dir
from support.require import requires
from metatp.ir import ops
from metatp.ir.graph import Graph
from metatp.ir.models.inputs import graph_inputs, make_feed, sequence_values
from metatp.ir.tensor import Flag
from metatp.passes import STAGES, DeviceLayout, compile_plan
from metatp.passes.plan import single_device_plan
from metatp.passes.state import SplitState
from support.helpers import (assert_close, check_equivalent, leaf, llama_case, llama_hparams, moe_case,
                                 parallel_case, rand, run_single, run_split, values_for)

REAL_MODEL = cache_dir() / "SmolLM2-135M-Instruct.Q4_1.gguf"


def node_named(plan, name):
    return next(n for n in plan.graph.nodes if n.name == name)


def sinks(plan):
    return [plan.graph.nodes[r.node] for r in plan.reductions]


# ---------------------------------------------------------------- dense llama


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_llama_has_two_reductions_per_layer(n):
    hp = llama_hparams(n_layer=3, n_embd=32, n_head=4, n_head_kv=2, hd=8, n_ff=256)
    g, *_ = llama_case(hp, 1, 8, 0, 1)
    plan = compile_plan(g, DeviceLayout(n, "tensor"), hp)
    assert plan.stats["reductions_per_step"] == 6 == len(plan.reductions)
    assert [s.op.name for s in sinks(plan)] == ["MUL_MAT"] * 6
    assert plan.stats["n_subgraphs"] == 7 and plan.stats["reductions_saved"] == 0
    assert plan.stats["bytes_reduced_per_step"] == 6 * 32 * 4


def test_split_mode_none_and_stages():
    hp = llama_hparams(n_layer=1)
    g, *_ = llama_case(hp, 2, 8, 0, 2)
    assert compile_plan(g, DeviceLayout(), hp).stats["reductions_per_step"] == 0
    layout = DeviceLayout(2, "tensor")
    seen = {}
    for stage in STAGES:
        p = compile_plan(g, layout, hp, stop_after=stage)
        assert p.stats["stage"] == stage
        seen[stage] = p
    assert not seen["built"].tensors and not seen["propagated"].subgraphs
    assert len(seen["partitioned"].reductions) == 2 and not seen["coalesced"].of(g.nodes[0]).local
    assert seen["lowered"].of(g.nodes[0]).local


@requires("model", why=None if REAL_MODEL.exists() else "default model not cached")
def test_real_model_decode_plan_and_zero_attention_slices():
    """SmolLM2-135M: 30 layers -> 60 all-reduces; 3 KV heads on 4 devices leave one device without
    attention in every layer (rotating), and the split decode step still equals one device."""
    from metatp.ir.loader import load_model
    from metatp.ir.models import BatchSpec, ModelTensors, build_graph

    m = load_model(REAL_MODEL)
    mt = ModelTensors(m, 256)
    g = build_graph(mt, BatchSpec(n_tokens=1, n_kv=256, n_outputs=1))
    plan = compile_plan(g, DeviceLayout(4, "tensor"), m.hparams)     # compile time: `metatp dump` reports it
    assert plan.stats["reductions_per_step"] == 60 == len(plan.reductions)
    idle = []
    for il in range(30):
        fa = node_named(plan, f"fattn-{il}")
        assert sorted(plan.of(fa).state.extents()) == [0, 3, 3, 3]
        dead = plan.of(fa).compute.index(False)
        idle.append(dead)
    assert len(set(idle)) == 4                       # the empty device rotates with the layer
    attn_sinks = [plan.graph.nodes[r.node] for r in plan.reductions][0::2]
    assert all(not all(plan.of(s).compute) for s in attn_sinks)
    # numerics: one decode step at position 3 over a random cache
    rng = np.random.default_rng(0)
    alias = getattr(mt, "aliases", {})                 # a tied lm head is its own leaf, reading token_embd
    vals = {t: m.dequantize(alias.get(t.name, t.name)) for t in g.leaves if t.flags & Flag.WEIGHT}
    for t in g.leaves:
        if t.flags & Flag.KV_CACHE:
            vals[t] = rand(rng, tuple(reversed(t.ne)))
    inp = graph_inputs(g)
    feed = make_feed(inp, sequence_values(inp, [42], n_past=3))     # token 42 at position 3, cells 0..3 seen
    out = [g.meta["logits"]]
    want = run_single(g, vals, feed, out)[0]
    from support.helpers import upload_and_run

    got = upload_and_run(g, plan, vals, feed, out)[0]
    assert_close(got, want, "real model, 4 devices", rtol=2e-4)


# ---------------------------------------------------------------- coalescing


def test_moe_delays_past_bias_scale_and_expert_sum():
    layout = DeviceLayout(2, "tensor")
    n_embd, T, n_used = 16, 3, 3
    case = moe_case(n_embd, 256, 4, n_used, T)
    plan = check_equivalent(case, layout)
    (sink,) = sinks(plan)
    assert sink.name == f"esum{n_used - 1}"
    assert plan.stats["bytes_reduced_per_step"] == n_embd * T * 4
    plan0 = compile_plan(case[0], layout, coalesce=False)
    assert sinks(plan0)[0].name == "down"
    assert plan0.stats["bytes_reduced_per_step"] == n_embd * n_used * T * 4   # n_used times the bytes
    assert plan.of(node_named(plan, "down_b")).state.is_partial


def test_no_delay_when_an_unreduced_value_has_another_reader():
    """The expert output is also read by SUM_ROWS (not linear-with-mirrored): reduce right away."""
    g, vals, feed, outs, hp = moe_case(16, 128, 3, 2, 2, bias=False)
    down = next(n for n in g.nodes if n.name == "down")
    extra = ops.sum_rows(ops.unary(down, ops.UnaryOp.SILU), name="extra")
    g2 = Graph([g.outputs[0], extra])
    layout = DeviceLayout(3, "tensor", (1, 2, 0))
    plan, got = run_split(g2, layout, vals, feed, [g.outputs[0], extra])
    want = run_single(g2, vals, feed, [g.outputs[0], extra])
    assert [s.name for s in sinks(plan)] == ["down"]
    for w, o in zip(want, got):
        assert_close(o, w)


def test_weighted_value_read_twice_stops_the_chain_there():
    g, vals, feed, outs, hp = moe_case(16, 128, 3, 2, 2, bias=False)
    weighted = next(n for n in g.nodes if n.name == "weighted")
    extra = ops.cont(weighted, name="extra")
    g2 = Graph([g.outputs[0], extra])
    plan, got = run_split(g2, DeviceLayout(2, "tensor"), vals, feed, [g.outputs[0], extra])
    want = run_single(g2, vals, feed, [g.outputs[0], extra])
    assert [s.name for s in sinks(plan)] == ["weighted"]
    for w, o in zip(want, got):
        assert_close(o, w)


def test_parallel_branches_merge_and_zero_fill():
    """One KV head on two devices: attention lives on one device only, the FFN on both. The
    merged reduction needs the idle device's attention output as exact zeros (zero_fill)."""
    case = parallel_case(16, 2, 1, 4, 256, 2)
    plan = check_equivalent(case, DeviceLayout(2, "tensor"))
    assert plan.stats["reductions_before_coalescing"] == 2 and plan.stats["reductions_per_step"] == 1
    assert [s.name for s in sinks(plan)] == ["both"]
    attn = plan.of(node_named(plan, "attn_out"))
    assert attn.compute.count(False) == 1 and attn.zero_fill == [not c for c in attn.compute]


def test_unrelated_mirrored_nodes_in_the_range_stay_fresh():
    """llama.cpp disables skipped unrelated nodes on a device whose PARTIAL node is disabled, so
    their MIRRORED values go stale there. Here `u` sits inside the delayed range and is read after
    the reduction on every device, including the one with an empty expert slice."""
    n_embd, n_ff, n_exp, T = 16, 256, 3, 2
    rng = np.random.default_rng(0)
    x = leaf("x", (n_embd, T), Flag.INPUT)
    sel = leaf("sel", (1, T), Flag.INPUT, ops.GGMLType.I32)
    xe = ops.reshape(x, n_embd, 1, T)
    up = ops.mul_mat_id(leaf("blk.0.ffn_up_exps.weight", (n_embd, n_ff, n_exp)), xe, sel)
    down = ops.mul_mat_id(leaf("blk.0.ffn_down_exps.weight", (n_ff, n_embd, n_exp)), ops.unary(up, ops.UnaryOp.SILU),
                          sel, name="down")
    u = ops.mul(ops.rms_norm(x, 1e-5), leaf("blk.0.ffn_norm.weight", (n_embd,)), name="u")   # unrelated, MIRRORED
    scaled = ops.mul(ops.reshape(down, n_embd, T), ops.unary(u, ops.UnaryOp.SIGMOID), name="scaled")
    out = ops.add(ops.add(scaled, u, name="sum"), x, name="out")
    g = Graph([out])
    vals = values_for(g, rng)
    feed = {x: rand(rng, (T, n_embd)), sel: np.array([[1], [2]], np.int32)}
    layout = DeviceLayout(3, "tensor", (0, 1, 1))       # device 0 holds no expert rows
    plan, got = run_split(g, layout, vals, feed, [out])
    want = run_single(g, vals, feed, [out])
    assert [s.name for s in sinks(plan)] == ["scaled"]
    idx = plan.graph.index
    assert idx[node_named(plan, "down")] < idx[node_named(plan, "u")] < idx[node_named(plan, "scaled")]
    assert plan.of(node_named(plan, "u")).compute == [True, True, True]
    assert plan.of(node_named(plan, "scaled")).compute == [False, True, True]
    assert_close(got[0], want[0])


def test_partial_final_node_is_reduced():
    x, w = leaf("x", (8, 2)), leaf("w", (8, 6))
    y = ops.mul_mat(w, x, name="y")
    g = Graph([y])
    rng = np.random.default_rng(0)
    vals = values_for(g, rng)
    feed = {}
    layout = DeviceLayout(2, "tensor")
    split = SplitState.split(0, (5, 3))
    plan, got = run_split(g, layout, vals, feed, [y], overrides={x: split, w: split})
    assert plan.subgraphs[-1].reduction is not None and plan.subgraphs[-1].reduction.node == len(g.nodes) - 1
    assert_close(got[0], run_single(g, vals, feed, [y])[0])


def test_partial_bias_stays_exact_with_zero_slices():
    """llama.cpp ends with (n-1)/n of the expert bias when a device's slice is empty; here the
    bias lives on an owner that computes the ADD_ID, and the sum is exact."""
    case = moe_case(16, 128, 3, 2, 2, bias=True)
    for ts in ((0, 1, 1), (1, 0, 0, 1), (3, 0)):
        layout = DeviceLayout(len(ts), "tensor", ts)
        plan = check_equivalent(case, layout)
        bias = next(t for t in plan.graph.leaves if t.name == "blk.0.ffn_down_exps.bias")
        tp = plan.of(bias)
        assert tp.state.is_partial and ts[tp.owner] > 0
        assert plan.of(node_named(plan, "down_b")).compute[tp.owner]


def test_partial_bias_outside_a_chain_is_mirrored():
    """Without coalescing the ADD_ID cannot see un-reduced data: the bias is mirrored instead."""
    case = moe_case(16, 128, 3, 2, 2, bias=True)
    plan = compile_plan(case[0], DeviceLayout(2, "tensor"), coalesce=False)
    assert plan.stats["partial_leaves_mirrored"] == ["blk.0.ffn_down_exps.bias"]
    check_equivalent(case, DeviceLayout(2, "tensor"))


def test_single_device_tensor_mode_runs_the_pipeline():
    hp = llama_hparams(n_layer=2)
    g, vals, feed, outs = llama_case(hp, 2, 8, 1, 2)
    plan = check_equivalent((g, vals, feed, outs, hp), DeviceLayout(1, "tensor"), coalesce_both=False)
    assert plan.stats["reductions_per_step"] == 4
    assert single_device_plan(g).stats["reductions_per_step"] == 0
