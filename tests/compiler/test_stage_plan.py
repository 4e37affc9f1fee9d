"""-sm layer,tensor's plan (passes/stage_plan.py): layers on stages by llama.cpp's rule, each
stage's nodes split over its own group as -sm tensor splits them, all-reduces spanning that group
only, the residual copied device t to device t of the next group; per-device memory; the layout
and flag errors that name the flag."""

from __future__ import annotations

import argparse

import pytest

from metatp.cli import add_split_args, stage_layout
from metatp.ir.errors import ConfigError
from metatp.ir.models import BatchSpec, ModelTensors, build_graph
from metatp.ir.ops import OPS, Op
from metatp.ir.tensor import Flag
from metatp.passes import DeviceLayout, compile_plan
from metatp.passes.layer_split import layer_devices
from metatp.passes.memory import plan_memory
from metatp.testing.synth import SynthSpec
from metatp.tools.dump.view import raw_weight_bytes

SPEC = SynthSpec(n_layer=5, n_embd=64, head_dim=32, n_ff=128, n_vocab=300, seed=41, tied=False,
                 types={"q": "Q8_0", "down": "Q4_0", "up": "Q8_0"})


def _plan(synth_model, layout: DeviceLayout, *others: DeviceLayout):
    """The plan of a 3-token step for `layout` (and, on the same graph, for each of `others`)."""
    from metatp.ir.models.common import cache_type

    ty = cache_type("f32")
    graph = build_graph(ModelTensors(synth_model, 64, ty, ty), BatchSpec(3, 64, 1))
    plans = [compile_plan(graph, lay, synth_model.hparams) for lay in (layout, *others)]
    return plans if others else plans[0]


def _holders(tp) -> list[int]:
    return [d for d, loc in enumerate(tp.local) if loc.nelements]


def _stage_of_leaf(t, stages: list[int]) -> int:
    if t.layer is not None:
        return stages[t.layer]
    return 0 if t.name.startswith("token_embd") else stages[-1]


@pytest.mark.parametrize("pp, tp, ts", [(2, 2, None), (3, 2, (1.0, 2.0)), (2, 3, None)], ids=["2x2", "3x2-ts1,2", "2x3"])
def test_stage_groups_reduce_alone_and_copy_device_to_device(synth_model, pp, tp, ts):
    layout = DeviceLayout(pp * tp, "layer,tensor", ts, tp=tp)
    plan = _plan(synth_model, layout)
    stages = layer_devices(SPEC.n_layer, [1.0] * pp)
    assert plan.stats["layer_stages"] == stages[:-1] and plan.stats["output_stage"] == stages[-1]
    group = [layout.stage_devices(s) for s in range(pp)]
    nodes = plan.graph.nodes
    for sub in plan.subgraphs:                      # a subgraph runs on one stage's devices
        ran = {d for i in range(sub.start, sub.end + 1) if not OPS[nodes[i].op].is_pure_view
               for d, on in enumerate(plan.of(nodes[i]).compute) if on}
        s = min(ran) // tp
        assert ran <= set(group[s])
        if sub.reduction is not None:
            assert tuple(sub.reduction.devices) == group[s]
            assert {d for d, on in enumerate(plan.of(nodes[sub.reduction.node]).compute) if on} <= set(group[s])
    assert len(plan.reductions) == 2 * SPEC.n_layer          # the tensor split's two per layer
    for t in plan.graph.leaves:                              # a stage's weights and cache: its group only
        if t.flags & Flag.INPUT:
            assert _holders(plan.of(t)) == list(range(pp * tp))
        else:
            assert set(_holders(plan.of(t))) <= set(group[_stage_of_leaf(t, stages)]), t.name
    hops = [(a, b) for a, b in zip([0] + stages, stages) if a != b]
    want = [(a * tp + j, b * tp + j) for a, b in hops for j in range(tp)]
    assert [(x.src, x.dst) for x in plan.transfers] == want
    for x in plan.transfers:                                 # the residual, mirrored in the group: whole
        node = nodes[x.node]
        assert node.ne[0] == SPEC.n_embd and x.nbytes == node.nbytes and plan.of(node).compute[x.src]
        assert plan.of(node).local[x.dst].ne == node.ne


def test_one_stage_is_the_tensor_plan(synth_model):
    tensor, staged = _plan(synth_model, DeviceLayout(2, "tensor", (1.0, 3.0)), DeviceLayout(2, "layer,tensor", (1.0, 3.0)))
    assert [(s.start, s.end) for s in staged.subgraphs] == [(s.start, s.end) for s in tensor.subgraphs]
    assert [r.devices for r in staged.reductions] == [None] * len(tensor.reductions) and staged.transfers == []
    for t, tp in tensor.tensors.items():
        sp = staged.of(t)
        assert (sp.state, sp.sync_state, sp.local, sp.compute) == (tp.state, tp.sync_state, tp.local, tp.compute)


def test_memory_plan_counts_each_stage_on_its_group(synth_model):
    layout = DeviceLayout(4, "layer,tensor", tp=2)
    plan, tensor = _plan(synth_model, layout, DeviceLayout(2, "tensor"))
    stages = layer_devices(SPEC.n_layer, [1.0, 1.0])
    mem, inner = plan_memory(plan, raw_weight_bytes, 64), plan_memory(tensor, raw_weight_bytes, 64)
    want_w, want_kv = [0] * 4, [0] * 4
    for t in plan.graph.leaves:
        if t.flags & Flag.INPUT:
            continue
        s = _stage_of_leaf(t, stages)
        for j in range(2):
            loc = tensor.of(t).local[j]
            if t.flags & Flag.WEIGHT:
                want_w[2 * s + j] += raw_weight_bytes(t, loc.ne)
            elif t.flags & Flag.KV_CACHE:
                want_kv[2 * s + j] += loc.nelements * t.nbytes // t.nelements
    assert mem.weights == want_w and mem.kv == want_kv
    assert [mem.weights[j] + mem.weights[2 + j] for j in range(2)] == inner.weights


def test_layout_errors():
    with pytest.raises(ConfigError, match="needs the tensor-parallel size"):
        DeviceLayout(4, "layer,tensor")
    with pytest.raises(ConfigError, match="--pp x --tp must be the device count"):
        DeviceLayout(4, "layer,tensor", tp=3)
    with pytest.raises(ConfigError, match=r"--tp \(tp\) must be an integer >= 1"):
        DeviceLayout(4, "layer,tensor", tp=0)
    with pytest.raises(ConfigError, match="needs split_mode='layer,tensor'"):
        DeviceLayout(4, "tensor", tp=2)
    with pytest.raises(ConfigError, match="3 entries for 2 devices of a tensor group"):
        DeviceLayout(4, "layer,tensor", (1.0, 1.0, 1.0), tp=2)
    lay = DeviceLayout(6, "layer,tensor", (1.0, 2.0))
    assert (lay.pp, lay.tp, lay.stage_devices(2), lay.ratios()) == (3, 2, (4, 5), (1.0, 2.0))


@pytest.mark.parametrize("flags, want", [
    (["-sm", "layer,tensor", "--pp", "2", "--tp", "2"], (4, "layer,tensor", (1.0, 1.0))),
    (["-sm", "layer,tensor", "--pp", "2", "--tp", "2", "-ts", "1,3"], (4, "layer,tensor", (1.0, 3.0))),
    (["-sm", "layer,tensor", "--tp", "2", "--devices", "6"], (6, "layer,tensor", (1.0, 1.0))),
    (["-sm", "layer,tensor", "--pp", "2", "--devices", "6"], (6, "layer,tensor", (1.0, 1.0, 1.0))),
    (["-sm", "tensor", "--devices", "2"], (2, "tensor", None)),
    # vLLM's spellings choose the mode when -sm is not given (and agree with it when it is)
    (["--pp", "2"], (2, "layer", None)),
    (["-tp", "2"], (2, "tensor", None)),
    (["-sm", "tensor", "--tp", "2"], (2, "tensor", None)),
    (["--tensor-parallel-size", "2", "--pipeline-parallel-size", "2"], (4, "layer,tensor", (1.0, 1.0))),
])
def test_flags_give_the_layout(flags, want):
    assert _flags(flags) == want
    n, mode, ts = want
    DeviceLayout(n, mode, ts)                               # and the layout takes it


@pytest.mark.parametrize("flags, want", [
    (["-sm", "tensor", "--pp", "2"], "--pp 2 contradicts -sm tensor"),
    (["-sm", "layer", "--tp", "2"], "--tp 2 contradicts -sm layer"),
    (["--tp", "2", "--devices", "3"], "--tp is 2 but --devices / mpiexec -n gives 3 devices"),
    (["-sm", "layer,tensor"], "-sm layer,tensor needs --tp T"),
    (["-sm", "layer,tensor", "--pp", "0", "--tp", "2"], "--pp must be >= 1"),
    (["-sm", "layer,tensor", "--pp", "2", "--tp", "-1"], "--tp must be >= 1"),
    (["-sm", "layer,tensor", "--pp", "2", "--tp", "2", "-ts", "1,1,1"], "-ts has 3 shares but --tp is 2"),
    (["-sm", "layer,tensor", "--pp", "2", "--tp", "2", "--devices", "3"], "--pp 2 x --tp 2 is 4 devices"),
    (["-sm", "layer,tensor", "--tp", "2"], "--tp 2: give --pp P too"),
    (["-sm", "layer,tensor", "--tp", "4", "--devices", "6"], "--tp 4 does not divide the 6 devices"),
    (["-sm", "layer,tensor", "--pp", "2"], "--pp 2: give --tp T too"),
])
def test_bad_flag_combinations_name_the_flag(flags, want):
    with pytest.raises(ConfigError, match=want.replace("(", r"\(")):
        _flags(flags)


def _flags(argv: list[str]):
    p = argparse.ArgumentParser()
    add_split_args(p)
    p.add_argument("--devices", type=int, default=None)
    a = p.parse_args(argv)
    ts = DeviceLayout.parse_split(a.tensor_split) if a.tensor_split else None
    return stage_layout(a.devices, a.split_mode, ts, a.pp, a.tp)


def test_nodes_of_a_stage_are_split_like_the_tensor_plan(synth_model):
    """Every node's Locals on its stage are the 2-device tensor plan's, empty elsewhere."""
    plan, tensor = _plan(synth_model, DeviceLayout(4, "layer,tensor", tp=2), DeviceLayout(2, "tensor"))
    for node in plan.graph.nodes:
        if node.op is Op.NONE or OPS[node.op].is_pure_view:
            continue
        tp, inner = plan.of(node), tensor.of(node)
        s = [d for d, on in enumerate(tp.compute) if on]
        if not s:
            continue
        stage = s[0] // 2
        assert tp.local[2 * stage:2 * stage + 2] == inner.local, node.name
        assert tp.compute[2 * stage:2 * stage + 2] == inner.compute, node.name


def test_dump_shows_stages_groups_copies_and_the_bill(path):
    """Two stages of two: stage 0 runs layers 0-2 (6 all-reduces of one hidden vector, which a
    2-device butterfly sends whole) and sends the residual once per device."""
    import json

    from metatp.tools.dump import DumpRequest, dump_model

    req = DumpRequest(model=path, n_devices=4, split_mode="layer,tensor", tensor_split=(1.0, 1.0))
    text = dump_model(req)
    assert "stage 0 [dev0,dev1]: 3 layer(s) 0-2 + input layer; 6 all-reduce(s)" in text
    assert "stage 1 [dev2,dev3]: 2 layer(s) 3-4 + output layer; 4 all-reduce(s)" in text
    assert "all-reduce #0 within [dev0,dev1]" in text and "dev1 -> dev3" in text
    bill = json.loads(dump_model(DumpRequest(**{**req.__dict__, "fmt": "json"})))["summary"]["stages"]
    hidden = SPEC.n_embd * 4
    assert [s["allreduce_bytes_per_rank_per_step"] for s in bill["stages"]] == [6 * hidden, 4 * hidden]
    assert [(m["src"], m["dst"]) for m in bill["copies"]["transfers"]] == [(0, 2), (1, 3)]
    assert bill["busiest_rank_bytes_per_token"] == 7 * hidden
    assert bill["busiest_rank_bytes_per_prompt"] == 7 * hidden * 512
