"""-sm layer: llama.cpp's layer assignment, the layer plan (one device per node, copies at the
boundaries, no PARTIAL), its per-device memory, its dump, a quantized cache, and bad -ts."""

from __future__ import annotations

import json

import numpy as np
import pytest

from metatp import LLM, SamplingParams
from metatp.backends.distributed import World
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
LLM_OPTIONS = {"n_ctx": 64}
IDS = [5, 17, 200, 3, 99, 42, 7, 8]

# (n_layer, -ts) -> (device of each layer, device of the output layer), worked by hand from
# llama.cpp's rule: split points = cumulative shares / total (float32); slot il of n_layer + 1
# goes to the first device whose split point is > il / (n_layer + 1); the output is slot n_layer.
TABLE = [
    (2, [1, 1], [0, 0], 1),                       # x = 0, 1/3, 2/3 against 0.5, 1
    (4, [1, 1], [0, 0, 0, 1], 1),                 # x = 0, .2, .4 | .6, .8
    (3, [3, 1], [0, 0, 0], 1),                    # x = .75 equals the split point 0.75: not greater -> dev1
    (2, [3, 1], [0, 0], 0),                       # x = 2/3 < .75: even the output stays on dev0
    (2, [1, 1, 1], [0, 1], 2),                    # x = 1/3 equals float32(1/3): not greater -> dev1
    (4, [0, 1], [1, 1, 1, 1], 1),                 # a zero share: split point 0 takes nothing
    (4, [1, 0], [0, 0, 0, 0], 0),                 # split points 1, 1: all on dev0, dev1 idle
    (4, [1, 0, 1], [0, 0, 0, 2], 2),              # .6, .8 pass the middle device's empty range
    (2, [1, 1, 1, 1], [0, 1], 2),                 # N > n_layer: x = 0, 1/3, 2/3 vs .25 .5 .75; dev3 idle
    (1, [1, 1, 1], [0], 1),
    (6, [2, 1, 1], [0, 0, 0, 0, 1, 1], 2),        # x = i/7: .571, .714 < .75 -> dev1; .857 -> dev2
    (4, [1, 1, 2, 1], [0, 1, 2, 2], 3),           # ties at 1/5, 2/5, 4/5 all move up a device
    (30, [1, 1, 1, 1], [0] * 8 + [1] * 8 + [2] * 8 + [3] * 6, 3),   # i/31 < .25 for i <= 7, ...
    (30, [1, 1, 2, 1], [0] * 7 + [1] * 6 + [2] * 12 + [3] * 5, 3),
]


@pytest.mark.parametrize("n_layer, ts, layers, output", TABLE)
def test_layer_assignment_follows_llamacpp(n_layer, ts, layers, output):
    assert layer_devices(n_layer, ts) == layers + [output]


def _plan(synth_model, layout: DeviceLayout, n_tokens: int = 3, cache: str = "f32"):
    from metatp.ir.models.common import cache_type

    ty = cache_type(cache)
    graph = build_graph(ModelTensors(synth_model, 64, ty, ty), BatchSpec(n_tokens, 64, 1))
    return compile_plan(graph, layout, synth_model.hparams)


def _holders(tp) -> list[int]:
    return [d for d, loc in enumerate(tp.local) if loc.nelements]


LAYOUTS = [DeviceLayout(2, "layer", (1, 2)), DeviceLayout(3, "layer", (2, 1, 1)),
           DeviceLayout(4, "layer", (1, 1, 2, 1)), DeviceLayout(3, "layer", (0, 1, 1))]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: "/".join(f"{x:g}" for x in l.tensor_split))
def test_every_node_on_one_device_and_copies_only_at_boundaries(synth_model, layout):
    n, n_layer, n_embd = layout.n_devices, SPEC.n_layer, SPEC.n_embd
    plan = _plan(synth_model, layout)
    devs = layer_devices(n_layer, layout.ratios())
    assert plan.reductions == [] and plan.stats["layer_devices"] == devs[:n_layer]
    for t, tp in plan.tensors.items():
        assert not tp.state.is_partial and not tp.sync_state.is_partial, t.name
        if t.op is not Op.NONE and not OPS[t.op].is_pure_view:
            assert sum(tp.compute) == 1, t.name
    for t in plan.graph.leaves:
        tp = plan.of(t)
        if t.flags & Flag.INPUT:
            assert _holders(tp) == list(range(n))
        elif t.layer is not None:                              # a layer's weights and KV cache
            assert _holders(tp) == [devs[t.layer]], t.name
        elif t.name.startswith("token_embd"):
            assert _holders(tp) == [0]
        else:                                                  # output norm and lm head
            assert _holders(tp) == [devs[n_layer]], t.name
    for node in plan.graph.nodes:
        w = [s for s in node.src if s is not None and s.flags & Flag.WEIGHT and s.layer is not None]
        if w and node.op is not Op.NONE:
            assert plan.of(node).compute.index(True) == devs[w[0].layer], node.name
    hops = [(a, b) for a, b in zip([0] + devs, devs) if a != b]
    got = [(x.src, x.dst) for x in plan.transfers]
    assert got == hops
    nodes = plan.graph.nodes
    for x in plan.transfers:               # the hidden state, for all tokens or the output rows
        assert nodes[x.node].ne[0] == n_embd and x.nbytes == nodes[x.node].nbytes
        sub = next(s for s in plan.subgraphs if x in s.transfers)
        assert sub.start <= x.node <= sub.end and plan.of(nodes[x.node]).compute[x.src]
    for sub in plan.subgraphs:             # each subgraph runs on one device
        ran = {plan.of(nodes[i]).compute.index(True) for i in range(sub.start, sub.end + 1)
               if not OPS[nodes[i].op].is_pure_view}
        assert len(ran) == 1


def test_memory_plan_counts_each_devices_layers_only(synth_model):
    layout = DeviceLayout(3, "layer", (2, 1, 1))
    plan = _plan(synth_model, layout)
    devs = layer_devices(SPEC.n_layer, layout.ratios())
    mem = plan_memory(plan, raw_weight_bytes, 64)
    want_w, want_kv = [0] * 3, [0] * 3
    for t in plan.graph.leaves:
        d = devs[t.layer] if t.layer is not None else (0 if t.name.startswith("token_embd") else devs[-1])
        if t.flags & Flag.WEIGHT:
            want_w[d] += raw_weight_bytes(t, t.ne)
        elif t.flags & Flag.KV_CACHE:
            want_kv[d] += t.nbytes
    assert mem.weights == want_w and mem.kv == want_kv
    assert sum(mem.weights) == sum(raw_weight_bytes(t, t.ne) for t in plan.graph.leaves if t.flags & Flag.WEIGHT)


def test_numpy_stores_each_devices_share_only(path):
    llm = LLM(path, backend="numpy", n_devices=3, split_mode="layer", tensor_split=[2, 1, 1], n_ctx=128, n_batch=64)
    llm.score(list(range(2, 66)))                      # runs the largest (n_batch) plan
    planned, held = llm.memory.totals(), llm.backend.allocated_bytes()
    plan = max((p for p, _ in llm.engine._plans.values()), key=lambda p: p.graph.meta["spec"].n_tokens)
    shared = sum(t.nbytes for t in plan.graph.leaves if t.flags & Flag.INPUT)   # one host array for all devices
    for d in range(3):
        assert abs(planned[d] - held[d]) < 0.10 * held[d] + shared, (d, planned, held)
    be = llm.backend                           # not the whole model on every device: a layer's share only
    for t in plan.graph.leaves:
        if t.flags & (Flag.WEIGHT | Flag.KV_CACHE):
            for d in range(3):
                has = be.leaf[d][t].size > 0 or be.packed(t, d) is not None
                assert has == (d in _holders(plan.of(t))), (t.name, d)


def _rel(a, b) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("cache", ["q8_0", "f16"])
def test_quantized_kv_cache_under_layer_split(path, cache):
    opts = dict(backend="numpy", cache_type_k=cache, cache_type_v=cache, **LLM_OPTIONS)
    one = LLM(path, **opts)
    split = LLM(path, n_devices=3, split_mode="layer", tensor_split=[1, 1, 1], **opts)
    assert _rel(split.score(IDS), one.score(IDS)) < 1e-5
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    assert split.generate([IDS[:4]], params)[0].outputs[0].token_ids == \
        one.generate([IDS[:4]], params)[0].outputs[0].token_ids
    plan = _plan(split.model, split.layout, cache=cache)
    devs = layer_devices(SPEC.n_layer, (1, 1, 1))
    for t in plan.graph.leaves:
        if t.flags & Flag.KV_CACHE:
            assert t.type.name == cache.upper() and _holders(plan.of(t)) == [devs[t.layer]]
    assert all(kv > 0 for kv in split.memory.kv)


def test_copies_are_what_carries_the_hidden_state(path):
    """Without the copy step the later devices read zeros: the equivalence above depends on it."""
    llm = LLM(path, backend="numpy", n_devices=2, split_mode="layer", tensor_split=[1, 1], **LLM_OPTIONS)
    good = llm.score(IDS[:3])
    for plan, ex in llm.engine._plans.values():
        assert plan.transfers and any(ex.transfers)
        ex._serial = [f for f in ex._serial if getattr(f, "func", None) is not np.copyto]
    llm.engine.reset()
    assert _rel(llm.score(IDS[:3]), good) > 1e-3


@pytest.mark.parametrize("ts, why", [([1, -1], ">= 0"), ([0, 0], "positive entry"), ([1, 2, 3], "3 entries for 2"),
                                     ([1, float("nan")], "finite")])
def test_bad_tensor_split_is_a_config_error_naming_it(path, ts, why):
    with pytest.raises(ConfigError, match="tensor_split") as e:
        LLM(path, backend="numpy", n_devices=2, split_mode="layer", tensor_split=ts, **LLM_OPTIONS)
    assert why in str(e.value)
    with pytest.raises(ConfigError, match="tensor_split"):
        layer_devices(4, ts if ts != [1, 2, 3] else [-1, 2, 3])


def test_cli_flags_reach_the_layout(path, capsys):
    from metatp.cli import main

    assert main(["generate", "-m", path, "-c", "64", "--backend", "numpy", "-sm", "layer", "-ts", "1,2",
                 "-p", "hi", "-n", "3"]) == 0
    assert main(["generate", "-m", path, "-c", "64", "--backend", "numpy", "-sm", "layer", "-ts", "1,-2",
                 "-p", "hi", "-n", "3"]) != 0
    assert "tensor_split" in capsys.readouterr().err


def test_mpi_takes_layer_by_name():
    """Under mpiexec -sm layer is one process per device (tests/mpi/test_mpi_layer.py runs it)."""
    world = World(comm=None, rank=0, size=2)
    assert world.layout_for(None, "layer", None) == (2, "layer")
    assert world.layout_for(None, "tensor", None) == (2, "tensor")


def test_dump_shows_assignment_and_bill(path, capsys):
    from metatp.cli import main

    assert main(["dump", "-m", path, "-c", "64", "--devices", "3", "-sm", "layer", "-ts", "2,1,1"]) == 0
    text = capsys.readouterr().out
    devs = layer_devices(SPEC.n_layer, (2, 1, 1))
    assert "layer assignment" in text and "copy bill" in text and "-sm layer" in text
    assert "dev0: 3 layer(s) 0-2" in text and "dev1: 2 layer(s) 3-4" in text
    assert f"output layer (final norm, lm head): dev{devs[-1]}" in text
    boundaries = sum(a != b for a, b in zip([0] + devs, devs))
    per_token = boundaries * SPEC.n_embd * 4
    assert f"per token: {per_token} B" in text and f"{text.count('==== copy of node')}" == str(boundaries)
    assert main(["dump", "-m", path, "-c", "64", "--devices", "3", "-sm", "layer", "-ts", "2,1,1",
                 "--format", "json", "--phase", "prefill", "--n-tokens", "16"]) == 0
    data = json.loads(capsys.readouterr().out)
    bill = data["summary"]["transfers"]
    assert data["summary"]["communication"] is None and data["summary"]["reductions_per_step"] == 0
    assert bill["layer_devices"] == devs[:-1] and bill["output_device"] == devs[-1]
    layers = devs[:-1]                      # a prompt's last row alone goes into the output layer
    between = sum(a != b for a, b in zip([0] + layers, layers))
    assert between == 1 and devs[-2] != devs[-1]
    assert bill["bytes_per_token"] == per_token
    assert bill["bytes_per_prompt"] == (512 * between + 1) * SPEC.n_embd * 4
    assert bill["transfers_per_step"] == boundaries
    assert sum(len(s["transfers"]) for s in data["subgraphs"]) == boundaries
    assert main(["dump", "-m", path, "-c", "64", "--devices", "2", "-sm", "layer", "--stage", "coalesced"]) != 0
    assert "--stage coalesced" in capsys.readouterr().err


def test_side_by_side_devices_run_the_copies_too(path):
    one = LLM(path, backend="numpy", **LLM_OPTIONS).score(IDS)
    llm = LLM(path, backend="numpy", n_devices=3, split_mode="layer", tensor_split=[1, 1, 1],
              backend_options={"parallel_devices": True}, **LLM_OPTIONS)
    assert _rel(llm.score(IDS), one) < 1e-5


def test_a_backend_without_copies_refuses_the_layer_plan(path):
    """The executor template's default transfer_step names the mode (the cupy backend has none yet)."""
    from metatp.backends.executor import PlanExecutor
    from metatp.backends.numpy.backend import NumpyBackend
    from metatp.backends.numpy.executable import NumpyExecutable
    from metatp.ir.errors import UnsupportedOpError
    from metatp.ir.loader import load_model

    class NoCopies(NumpyExecutable):
        transfer_step = PlanExecutor.transfer_step

    layout = DeviceLayout(2, "layer", (1, 1))
    model = load_model(path)
    plan = _plan(model, layout)
    backend = NumpyBackend(layout)
    for t in plan.graph.leaves:
        if t.flags & Flag.WEIGHT:
            backend.upload(t, model.dequantize(t.name) if t.name in model.weights else np.zeros(t.ne[::-1], np.float32),
                           plan)
    with pytest.raises(UnsupportedOpError, match="split_mode='layer'"):
        NoCopies(backend, plan)
    assert NumpyExecutable(backend, plan).transfers


# ---------------------------------------------------------------- hand-built and random graphs


def _layer_layouts():
    from hypothesis import strategies as st

    def make(ts: list[int], first_positive: int) -> DeviceLayout:
        if sum(ts) == 0:
            ts[first_positive % len(ts)] = 1
        return DeviceLayout(len(ts), "layer", tuple(ts))
    return st.builds(make, st.lists(st.integers(0, 4), min_size=1, max_size=5), st.integers(0, 16))


def test_layer_plans_equal_one_device_on_random_llama_steps():
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    from support.helpers import assert_close, llama_case, llama_hparams, run_single, run_split

    @settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(layout=_layer_layouts(), n_layer=st.integers(1, 5), T=st.integers(1, 3), n_past=st.integers(0, 3),
           tied=st.booleans(), seed=st.integers(0, 2**16))
    def check(layout, n_layer, T, n_past, tied, seed):
        hp = llama_hparams(n_layer=n_layer, n_embd=16, n_head=2, n_head_kv=1, hd=8, n_ff=32, n_vocab=40)
        g, vals, feed, outs = llama_case(hp, T, n_ctx=8, n_past=n_past, n_outputs=1, seed=seed, tied=tied)
        want = run_single(g, vals, feed, outs)
        plan, got = run_split(g, layout, vals, feed, outs, hp)
        for w, o, t in zip(want, got, outs):
            assert_close(o, w, f"{t.name} on {layout}", rtol=1e-6)
        devs = layer_devices(n_layer, layout.ratios())
        assert [(x.src, x.dst) for x in plan.transfers] == [(a, b) for a, b in zip([0] + devs, devs) if a != b]
    check()


def test_a_weight_every_layer_reads_is_held_by_every_device():
    """A global weight read inside every layer (llama.cpp duplicates rope_freqs per layer) is mirrored."""
    from metatp.ir import ops
    from metatp.ir.graph import Graph
    from metatp.ir.tensor import GGMLType
    from support.helpers import assert_close, run_single, run_split

    rng = np.random.default_rng(3)
    tok = ops.new_tensor("token_embd.weight", (8, 10), flags=Flag.WEIGHT)
    ids = ops.new_tensor("inp_tokens", (3,), GGMLType.I32, Flag.INPUT)
    shared = ops.new_tensor("shared_scale.weight", (8,), flags=Flag.WEIGHT)
    h = ops.get_rows(tok, ids, name="inp_embd")
    for il in range(3):
        w = ops.new_tensor(f"blk.{il}.w.weight", (8, 8), flags=Flag.WEIGHT)
        h = ops.add(ops.mul(ops.mul_mat(w, h), shared), h, name=f"l_out-{il}")
    out = ops.mul_mat(ops.new_tensor("output.weight", (8, 10), flags=Flag.WEIGHT), h, name="result_output")
    g = Graph([out])
    vals = {t: rng.standard_normal(t.ne[::-1]).astype(np.float32) for t in g.leaves if t.flags & Flag.WEIGHT}
    feed = {ids: np.array([1, 7, 3], np.int32)}
    layout = DeviceLayout(3, "layer", (1, 1, 1))
    plan, got = run_split(g, layout, vals, feed, [out])
    assert_close(got[0], run_single(g, vals, feed, [out])[0], rtol=1e-6)
    assert plan.of(shared).state.is_mirrored and _holders(plan.of(shared)) == [0, 1, 2]
    assert layer_devices(3, (1, 1, 1)) == [0, 0, 1, 2]        # x = .25 < 1/3, .5, .75
    assert [(x.src, x.dst) for x in plan.transfers] == [(0, 1), (1, 2)]


def test_several_sequences_in_one_step_match_one_device(path):
    """The engine's batched steps (several prompts, then their decode tokens together)."""
    prompts = [IDS[:3], IDS[2:7], IDS[1:2]]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    one = LLM(path, backend="numpy", **LLM_OPTIONS).generate(prompts, params)
    split = LLM(path, backend="numpy", n_devices=4, split_mode="layer", tensor_split=[1, 1, 2, 1],
                **LLM_OPTIONS).generate(prompts, params)
    assert [o.outputs[0].token_ids for o in split] == [o.outputs[0].token_ids for o in one]
