"""Graph fragments and runners shared by the split-equivalence tests.

Fragments: the llama graph from ir.models (GQA attention with the KV cache, set_rows and flash
attention; column->row MLP; residual adds; optional q/k/v biases and q/k norms), fused QKV with
views into the fused output, a MoE block, two PARTIAL branches added (parallel residual), and
reshape/view/permute chains with nr > 1; plus `upload_and_run` (a graph on the numpy backend),
`check_equivalent` (split == single device) and the hypothesis strategy of device layouts.
"""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np

from hypothesis import strategies as st

from metatp.ir.dtypes import np_shape
from metatp.backends.numpy.backend import NumpyBackend
from metatp.ir import ops
from metatp.ir.graph import Graph
from metatp.ir.loader import HParams
from metatp.ir.models import BatchSpec, ModelTensors, build_graph
from metatp.ir.models.inputs import graph_inputs, make_feed, sequence_values

from metatp.ir.ops import GluOp, RopeMode, UnaryOp
from metatp.ir.tensor import Flag, GGMLType, Tensor
from metatp.passes import DeviceLayout, compile_plan
from metatp.passes.plan import Plan, single_device_plan

F32 = GGMLType.F32
I32 = GGMLType.I32

# ---------------------------------------------------------------- running a graph


def upload_and_run(graph: Graph, plan: Plan, values: dict[Tensor, np.ndarray], inputs: dict[Tensor, np.ndarray],
                   outputs: list[Tensor], partial_rng: np.random.Generator | None = None) -> list[np.ndarray]:
    """Upload leaves, run one step, read `outputs`. partial_rng: a PARTIAL leaf's value is split
    at random over the devices that compute all its consumers (zeros elsewhere), rather than
    owner + zeros, so that a linear rule cannot pass by coincidence."""
    be = NumpyBackend(plan.layout)
    consumers = graph.consumers()
    for t, v in values.items():
        be.upload(t, v, plan)
        if partial_rng is not None and plan.n_devices > 1 and plan.of(t).state.is_partial:
            devs = [d for d in range(plan.n_devices) if all(plan.of(c).compute[d] for c in consumers.get(t, []))]
            parts = {d: partial_rng.standard_normal(v.shape).astype(np.float32) for d in devs[1:]}
            parts[devs[0]] = v.astype(np.float32) - sum(parts.values(), np.zeros(v.shape, np.float32))
            for d in range(plan.n_devices):
                p = parts.get(d, np.zeros(v.shape, np.float32))
                be.leaf[d][t] = np.ascontiguousarray(p.reshape(be.leaf[d][t].shape))
    ex = be.prepare(plan)
    ex.run(inputs)
    return [ex.read(o) for o in outputs]


def run_split(graph, layout, values, inputs, outputs, hparams=None, coalesce=True, overrides=None, partial_rng=None):
    plan = compile_plan(graph, layout, hparams, coalesce=coalesce, overrides=overrides)
    return plan, upload_and_run(graph, plan, values, inputs, outputs, partial_rng)


def run_single(graph, values, inputs, outputs):
    return upload_and_run(graph, single_device_plan(graph), values, inputs, outputs)


def assert_close(got: np.ndarray, want: np.ndarray, what: str = "", rtol: float = 1e-4) -> None:
    got = np.asarray(got, dtype=np.float64).reshape(np.shape(want))
    want = np.asarray(want, dtype=np.float64)
    scale = max(1.0, float(np.abs(want).max(initial=0.0)))
    np.testing.assert_allclose(got, want, rtol=rtol, atol=rtol * scale, err_msg=what)


def check_invariants(plan: Plan) -> None:
    """Extents add up to the full size; no negative extents; locals agree with states."""
    for t, tp in plan.tensors.items():
        for s in (tp.state, tp.sync_state):
            if s.is_split:
                assert s.total() == t.ne[s.axis], (t.name, str(s))
                assert all(x >= 0 for seg in s.ne for x in seg)
        if tp.sync_state.is_split and tp.local:
            for j, loc in enumerate(tp.local):
                assert loc.ne[tp.sync_state.axis] == tp.sync_state.extent(j)


def check_granularity(plan: Plan, hparams) -> None:
    """Leaf cuts: every device's share of a segment is whole heads / quant blocks, and all
    but at most one device's share is a multiple of the row's granule."""
    from metatp.passes.compile import make_table

    table = make_table(plan.graph, plan.layout, hparams)
    for t in plan.graph.leaves:
        if t.flags & Flag.INPUT or table.row(t).kind != "split" or not plan.of(t).state.is_split:
            continue
        row, s = table.row(t), plan.of(t).state
        for seg, g, unit in zip(s.ne, row.granule, row.unit):
            assert all(x % unit == 0 for x in seg), (t.name, str(s), unit)
            assert sum(1 for x in seg if x % g) <= 1, (t.name, str(s), g)


def layouts(max_n: int = 8):
    """(n, tensor_split) with integer ratios 0..5, at least one positive."""
    def make(ts: list[int], first_positive: int) -> DeviceLayout:
        if sum(ts) == 0:
            ts[first_positive % len(ts)] = first_positive % 5 + 1
        return DeviceLayout(len(ts), "tensor", tuple(ts))
    return st.builds(make, st.lists(st.integers(0, 5), min_size=1, max_size=max_n), st.integers(0, 64))


def rand(rng, shape, scale=0.5):
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def leaf(name: str, ne, flags=Flag.WEIGHT, type=F32) -> Tensor:
    return ops.new_tensor(name, ne, type, flags)


def values_for(graph: Graph, rng, skip=()) -> dict[Tensor, np.ndarray]:
    """Random values for every weight / KV leaf (norm weights near 1)."""
    out = {}
    for t in graph.leaves:
        if t.flags & Flag.INPUT or t in skip:
            continue
        v = rand(rng, np_shape(t.ne))
        if "norm" in t.name:
            v = 1.0 + 0.1 * v
        out[t] = v
    return out


# ---------------------------------------------------------------- llama (ir.models)


def llama_hparams(n_layer=2, n_embd=32, n_head=4, n_head_kv=2, hd=8, n_ff=256, n_vocab=64, arch="llama") -> HParams:
    return HParams(arch=arch, n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=[n_head_kv] * n_layer,
                   n_ff=[n_ff] * n_layer, n_vocab=n_vocab, n_ctx_train=256, head_dim_k=hd, head_dim_v=hd,
                   rope_dims=hd, rope_freq_base=10000.0, rope_freq_scale=1.0, rope_freq_base_swa=10000.0,
                   norm_eps=1e-5)


def fake_model(hp: HParams, tied=True, qkv_bias=False, qk_norm=False, types: dict[str, GGMLType] | None = None):
    """What ModelTensors needs of a loaded model: hparams and weight names/shapes/types."""
    E, H, Hkv, hd, V = hp.n_embd, hp.n_head, hp.n_head_kv[0], hp.head_dim_k, hp.n_vocab
    shapes = {"token_embd.weight": (E, V), "output_norm.weight": (E,)}
    if not tied:
        shapes["output.weight"] = (E, V)
    for il in range(hp.n_layer):
        p = f"blk.{il}."
        ff = hp.n_ff[il]
        shapes.update({p + "attn_norm.weight": (E,), p + "attn_q.weight": (E, H * hd), p + "attn_k.weight": (E, Hkv * hd),
                       p + "attn_v.weight": (E, Hkv * hd), p + "attn_output.weight": (H * hd, E),
                       p + "ffn_norm.weight": (E,), p + "ffn_gate.weight": (E, ff), p + "ffn_up.weight": (E, ff),
                       p + "ffn_down.weight": (ff, E)})
        if qkv_bias:
            shapes.update({p + "attn_q.bias": (H * hd,), p + "attn_k.bias": (Hkv * hd,), p + "attn_v.bias": (Hkv * hd,)})
        if qk_norm:
            shapes.update({p + "attn_q_norm.weight": (hd,), p + "attn_k_norm.weight": (hd,)})
    types = types or {}

    def typ(name):
        for suffix, t in types.items():
            if name.endswith(suffix):
                return t
        return F32
    weights = {n: SimpleNamespace(name=n, ne=ne, type=typ(n)) for n, ne in shapes.items()}
    return SimpleNamespace(hparams=hp, weights=weights, path=Path("fake.gguf"))


def llama_case(hp: HParams, T: int, n_ctx: int, n_past: int, n_outputs: int, seed: int = 0, **model_kw):
    """(graph, values, inputs, outputs) for one llama step after `n_past` cached tokens."""
    rng = np.random.default_rng(seed)
    mt = ModelTensors(fake_model(hp, **model_kw), n_ctx)
    g = build_graph(mt, BatchSpec(T, n_ctx, n_outputs))
    vals = values_for(g, rng)
    inp = graph_inputs(g)
    tokens = rng.integers(0, hp.n_vocab, T).astype(np.int32)
    feed = make_feed(inp, sequence_values(inp, tokens, n_past))     # the last n_outputs rows read out
    outs = [g.meta["logits"], mt.cache_k[0], mt.cache_v[hp.n_layer - 1]]
    return g, vals, feed, outs


# ---------------------------------------------------------------- hand-built fragments


def attn_hparams(n_embd, n_head, n_head_kv, hd, hd_v=None, n_layer=1) -> HParams:
    hp = llama_hparams(n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv, hd=hd)
    hp.head_dim_v = hd_v or hd
    return hp


def fused_qkv_case(n_embd, n_head, n_head_kv, hd, hd_v, T, seed=0, bias=False):
    """x -> attn_qkv -> Q/K/V views at offsets into the fused output -> rope -> attention -> attn_output (+x)."""
    rng = np.random.default_rng(seed)
    n_q, n_k, n_v = n_head * hd, n_head_kv * hd, n_head_kv * hd_v
    x = leaf("x", (n_embd, T), Flag.INPUT)
    pos = leaf("pos", (T,), Flag.INPUT, I32)
    mask = leaf("mask", (T, T), Flag.INPUT)
    qkv = ops.mul_mat(leaf("blk.0.attn_qkv.weight", (n_embd, n_q + n_k + n_v)), x, name="qkv")
    if bias:
        qkv = ops.add(qkv, leaf("blk.0.attn_qkv.bias", (n_q + n_k + n_v,)), name="qkv_b")
    es = 4
    Q = ops.view(qkv, (hd, n_head, T), (hd * es, qkv.nb[1]), 0, name="Q")
    K = ops.view(qkv, (hd, n_head_kv, T), (hd * es, qkv.nb[1]), n_q * es, name="K")
    V = ops.view(qkv, (hd_v, n_head_kv, T), (hd_v * es, qkv.nb[1]), (n_q + n_k) * es, name="V")
    Q = ops.rope(Q, pos, hd, RopeMode.NEOX, 10000.0, name="Qr")
    K = ops.rope(K, pos, hd, RopeMode.NEOX, 10000.0, name="Kr")
    att = ops.flash_attn_ext(ops.permute(Q, 0, 2, 1, 3), ops.permute(K, 0, 2, 1, 3), ops.permute(V, 0, 2, 1, 3),
                             mask, 1.0 / math.sqrt(hd), name="fattn")
    flat = ops.reshape(att, hd_v * n_head, T, name="flat")
    o = ops.mul_mat(leaf("blk.0.attn_output.weight", (hd_v * n_head, n_embd)), flat, name="attn_out")
    out = ops.add(o, x, name="res")
    g = Graph([out, qkv])          # intermediates are read back only if they are outputs (buffers are reused)
    m = np.triu(np.full((T, T), -np.inf, dtype=np.float32), 1)
    feed = {x: rand(rng, (T, n_embd)), pos: np.arange(T, dtype=np.int32), mask: m}
    return g, values_for(g, rng), feed, [out, qkv], attn_hparams(n_embd, n_head, n_head_kv, hd, hd_v)


def moe_case(n_embd, n_ff_exp, n_expert, n_used, T, seed=0, bias=True, fused=False):
    """Router -> top-k -> expert up/gate (A1) -> glu -> expert down (A0: PARTIAL) -> ADD_ID bias
    -> MUL by router weights -> expert sum (VIEW x n_used + ADD x (n_used-1)) -> residual."""
    rng = np.random.default_rng(seed)
    x = leaf("x", (n_embd, T), Flag.INPUT)
    logits = ops.mul_mat(leaf("blk.0.ffn_gate_inp.weight", (n_embd, n_expert)), x, name="router")
    probs = ops.soft_max(logits, name="probs")
    sel = ops.top_k(probs, n_used, name="sel")
    w = ops.get_rows(ops.reshape(probs, 1, n_expert, T), sel, name="w")
    xe = ops.reshape(x, n_embd, 1, T, name="xe")
    if fused:
        gu = ops.mul_mat_id(leaf("blk.0.ffn_gate_up_exps.weight", (n_embd, 2 * n_ff_exp, n_expert)), xe, sel, name="gu")
        act = ops.glu_fused(gu, GluOp.SWIGLU, name="act")
    else:
        up = ops.mul_mat_id(leaf("blk.0.ffn_up_exps.weight", (n_embd, n_ff_exp, n_expert)), xe, sel, name="up")
        gate = ops.mul_mat_id(leaf("blk.0.ffn_gate_exps.weight", (n_embd, n_ff_exp, n_expert)), xe, sel, name="gate")
        act = ops.glu_split(gate, up, GluOp.SWIGLU, name="act")
    down = ops.mul_mat_id(leaf("blk.0.ffn_down_exps.weight", (n_ff_exp, n_embd, n_expert)), act, sel, name="down")
    if bias:
        down = ops.add_id(down, leaf("blk.0.ffn_down_exps.bias", (n_embd, n_expert)), sel, name="down_b")
    down = ops.mul(down, w, name="weighted")
    views = [ops.view(down, (n_embd, T), (down.nb[2],), k * down.nb[1], name=f"e{k}") for k in range(n_used)]
    acc = views[0]
    for k in range(1, n_used):
        acc = ops.add(acc, views[k], name=f"esum{k}")
    out = ops.add(acc, x, name="res") if n_used > 1 else ops.add(ops.cont(acc, name="e0c"), x, name="res")
    g = Graph([out])
    return g, values_for(g, rng), {x: rand(rng, (T, n_embd))}, [out], None


def parallel_case(n_embd, n_head, n_head_kv, hd, n_ff, T, seed=0):
    """Parallel residual: x + attn(h) + ffn(h), h = norm(x); both branches PARTIAL, summed by ADD."""
    rng = np.random.default_rng(seed)
    x = leaf("x", (n_embd, T), Flag.INPUT)
    pos = leaf("pos", (T,), Flag.INPUT, I32)
    mask = leaf("mask", (T, T), Flag.INPUT)
    h = ops.mul(ops.rms_norm(x, 1e-5), leaf("blk.0.attn_norm.weight", (n_embd,)), name="h")
    q = ops.reshape(ops.mul_mat(leaf("blk.0.attn_q.weight", (n_embd, n_head * hd)), h), hd, n_head, T)
    k = ops.reshape(ops.mul_mat(leaf("blk.0.attn_k.weight", (n_embd, n_head_kv * hd)), h), hd, n_head_kv, T)
    v = ops.reshape(ops.mul_mat(leaf("blk.0.attn_v.weight", (n_embd, n_head_kv * hd)), h), hd, n_head_kv, T)
    q = ops.rope(q, pos, hd, RopeMode.NORMAL, 10000.0)
    k = ops.rope(k, pos, hd, RopeMode.NORMAL, 10000.0)
    att = ops.flash_attn_ext(ops.permute(q, 0, 2, 1, 3), ops.permute(k, 0, 2, 1, 3), ops.permute(v, 0, 2, 1, 3),
                             mask, 1.0 / math.sqrt(hd))
    attn_out = ops.mul_mat(leaf("blk.0.attn_output.weight", (n_head * hd, n_embd)),
                           ops.reshape(att, n_head * hd, T), name="attn_out")
    gate = ops.mul_mat(leaf("blk.0.ffn_gate.weight", (n_embd, n_ff)), h)
    up = ops.mul_mat(leaf("blk.0.ffn_up.weight", (n_embd, n_ff)), h)
    ffn_out = ops.mul_mat(leaf("blk.0.ffn_down.weight", (n_ff, n_embd)), ops.glu_split(gate, up), name="ffn_out")
    both = ops.add(attn_out, ffn_out, name="both")
    out = ops.add(both, x, name="res")
    g = Graph([out])
    m = np.triu(np.full((T, T), -np.inf, dtype=np.float32), 1)
    feed = {x: rand(rng, (T, n_embd)), pos: np.arange(T, dtype=np.int32), mask: m}
    return g, values_for(g, rng), feed, [out], attn_hparams(n_embd, n_head, n_head_kv, hd)


def chain_case(n_embd, n_ff, c, T, seed=0):
    """Column->row MLP whose intermediate goes through reshape / permute / cont / transpose /
    flatten (AXIS_0 with nr = T) / view chains before the row-parallel matmul."""
    rng = np.random.default_rng(seed)
    x = leaf("x", (n_embd, T), Flag.INPUT)
    up = ops.mul_mat(leaf("blk.0.ffn_up.weight", (n_embd, n_ff)), x, name="up")              # A0 [n_ff, T]
    a = ops.reshape(up, c, n_ff // c, T, name="a")                                             # A1
    p = ops.cont(ops.permute(a, 1, 0, 2, 3), name="p")                                         # A0 [n_ff/c, c, T]
    u = ops.unary(p, UnaryOp.SILU, name="u")
    back = ops.cont(ops.permute(u, 1, 0, 2, 3), name="back")                                   # A1 [c, n_ff/c, T]
    flat1d = ops.reshape(back, c * (n_ff // c) * T, name="flat1d")                             # A0, nr = T
    s = ops.scale(flat1d, 0.5, name="s")
    y = ops.reshape(s, n_ff, T, name="y")                                                      # A0
    tr = ops.cont(ops.transpose(y), name="tr")                                                 # A1 [T, n_ff]
    y2 = ops.cont(ops.transpose(tr), name="y2")                                                # A0
    row = ops.view(y2, (n_ff, T - 1), (y2.nb[1],), y2.nb[1], name="rows") if T > 1 else y2   # rows 1..T-1
    down = ops.mul_mat(leaf("blk.0.ffn_down.weight", (n_ff, n_embd)), row, name="down")
    xs = ops.view(x, (n_embd, T - 1), (x.nb[1],), x.nb[1], name="xs") if T > 1 else x
    out = ops.add(down, xs, name="res")
    g = Graph([out, y2])
    return g, values_for(g, rng), {x: rand(rng, (T, n_embd))}, [out, y2], None


# ---------------------------------------------------------------- the properties


def check_equivalent(case, layout: DeviceLayout, coalesce_both: bool = True, seed: int = 0):
    g, vals, feed, outs, hp = case
    want = run_single(g, vals, feed, outs)
    plan, got = run_split(g, layout, vals, feed, outs, hp, partial_rng=np.random.default_rng(seed))
    check_invariants(plan)
    for w, o, t in zip(want, got, outs):
        assert_close(o, w, f"{t.name} on {layout}")
    if coalesce_both:
        plan0, got0 = run_split(g, layout, vals, feed, outs, hp, coalesce=False)
        assert plan.stats["reductions_per_step"] <= plan0.stats["reductions_per_step"]
        for w, o, t in zip(want, got0, outs):
            assert_close(o, w, f"{t.name} on {layout} without coalescing")
    return plan


def mpi_missing() -> str | None:
    """Why the tests that start `mpiexec` cannot run here, or None."""
    import shutil

    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return 'mpi4py is not installed (pip install "metatp[mpi]")'
    if shutil.which("mpiexec") is None:
        return 'no mpiexec on PATH (pip install "metatp[mpi]" brings MPICH\'s)'
    return None
