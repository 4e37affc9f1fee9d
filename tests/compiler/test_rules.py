"""Per-op rule validation in the style of DTensor's strategy validator.

For every op, every combination of input states (MIRRORED, PARTIAL, and a split along each
dim that is not 1, with asymmetric shares and a zero slice) is compiled with the states pinned
on the leaves. A combination the rules accept is run on simulated devices and must equal the
single-device result, read back through the *claimed* output state; a combination they reject
must raise SplitError naming the op and the input states. PARTIAL inputs get random splits of
their value, not owner + zeros, so a linear-op claim cannot pass by coincidence.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from metatp.ir import ops
from metatp.ir.errors import SplitError
from metatp.ir.graph import Graph
from metatp.ir.ops import GluOp, Op, RopeMode, UnaryOp
from metatp.ir.tensor import Flag, GGMLType
from metatp.passes import DeviceLayout, compile_plan
from metatp.passes.layout import clip_rounds, local_start, merge_rounds, reshape_state, rounds
from metatp.passes.rules import OP_RULES, RULES
from metatp.passes.split_table import integer_weights, split_sizes
from metatp.passes.state import SplitState
from support.helpers import assert_close, run_single, upload_and_run

F32, I32 = GGMLType.F32, GGMLType.I32
LAYOUTS = [DeviceLayout(2, "tensor", (3, 1)), DeviceLayout(3, "tensor", (2, 0, 1))]


def W(name, ne, type=F32):
    return ops.new_tensor(name, ne, type, Flag.WEIGHT)


class Case:
    """One op under test: leaves, which states to try for each, how to build the node."""

    def __init__(self, name, leaves, kinds, build, values=None, granule=None):
        self.name = name
        self.leaves = leaves                     # list of Tensor
        self.kinds = kinds                       # per leaf: list of "M", "P", "A0".."A3", "A0s2"
        self.node = build(*leaves)
        self.graph = Graph([self.node])
        self.values = values or {}
        self.granule = granule or {}             # (leaf index, axis) -> granule


def state_of(kind: str, t, layout: DeviceLayout, g: int = 1) -> SplitState:
    if kind == "M":
        return SplitState.mirrored()
    if kind == "P":
        return SplitState.partial()
    w = integer_weights(layout.tensor_split, layout.n_devices)
    if kind == "A0s2":                          # fused halves [gate | up], each split the same way
        return SplitState.segmented(0, [(split_sizes(t.ne[0] // 2, g, w), 2)])
    axis = int(kind[1])
    return SplitState.split(axis, split_sizes(t.ne[axis], g, w))


def ids(rng, hi, shape):
    return rng.integers(0, hi, shape).astype(np.int32)


def distinct_rows(rng, hi, n_used, T):
    return np.stack([rng.permutation(hi)[:n_used] for _ in range(T)]).astype(np.int32)


def make_cases():
    rng = np.random.default_rng(0)
    MPA = ["M", "P", "A0", "A1"]
    MPA3 = ["M", "P", "A0", "A1", "A2"]
    cases = []

    a, i = W("a", (6, 5)), W("ids", (4,), I32)
    cases.append(Case("get_rows", [a, i], [MPA, ["M", "A0"]], lambda a, i: ops.get_rows(a, i),
                      {i: ids(rng, 5, (4,))}))
    for name, fn in (("rms_norm", ops.rms_norm), ("norm", ops.norm)):
        a = W("a", (8, 3, 2))
        cases.append(Case(name, [a], [MPA3], lambda a, fn=fn: fn(a, 1e-5)))
    for op, fn in (("add", ops.add), ("mul", ops.mul), ("div", ops.div)):
        for bshape, bk in (((8, 3), MPA), ((8, 1), ["M", "P", "A0"]), ((1, 3), ["M", "P", "A1"])):
            a, b = W("a", (8, 3)), W("b", bshape)
            vals = {b: (rng.random(tuple(reversed(bshape))) + 1.0).astype(np.float32)} if op == "div" else {}
            cases.append(Case(f"{op}{bshape}", [a, b], [MPA, bk], lambda a, b, fn=fn: fn(a, b), vals))
    a, b, i = W("a", (8, 3, 2)), W("b", (8, 4)), W("ids", (3, 2), I32)
    cases.append(Case("add_id", [a, b, i], [MPA3, MPA, ["M"]], lambda a, b, i: ops.add_id(a, b, i),
                      {i: distinct_rows(rng, 4, 3, 2)}))
    for off in (0.0, 0.5):
        a = W("a", (8, 3))
        cases.append(Case(f"scale_b{off}", [a], [MPA], lambda a, off=off: ops.scale(a, 0.7, off)))
    w, x = W("w", (8, 6)), W("x", (8, 5))
    cases.append(Case("mul_mat", [w, x], [MPA, MPA], lambda w, x: ops.mul_mat(w, x)))
    w, x = W("w", (4, 3, 2)), W("x", (4, 5, 4))
    cases.append(Case("mul_mat_batched", [w, x], [["M", "A2"], ["M", "A1", "A2"]], lambda w, x: ops.mul_mat(w, x),
                      granule={(1, 2): 2}))
    e, b, i = W("experts", (8, 6, 4)), W("b", (8, 2, 3)), W("ids", (2, 3), I32)
    cases.append(Case("mul_mat_id", [e, b, i], [MPA3, MPA, ["M"]], lambda e, b, i: ops.mul_mat_id(e, b, i),
                      {i: distinct_rows(rng, 4, 2, 3)}))
    for shape in ((4, 12), (48,), (8, 3, 2), (2, 4, 6)):
        a = W("a", (8, 6))
        cases.append(Case(f"reshape{shape}", [a], [MPA], lambda a, shape=shape: ops.reshape(a, *shape)))
    a = W("a", (8, 6))
    cases.append(Case("view_rows", [a], [MPA], lambda a: ops.view(a, (8, 3), (a.nb[1],), 2 * a.nb[1])))
    a = W("a", (8, 6))
    cases.append(Case("view_cols", [a], [MPA], lambda a: ops.view(a, (4, 6), (a.nb[1],), 2 * a.nb[0])))
    for axes in ((0, 2, 1, 3), (2, 0, 1, 3)):
        a = W("a", (4, 3, 2))
        cases.append(Case(f"permute{axes}", [a], [MPA3], lambda a, axes=axes: ops.cont(ops.permute(a, *axes))))
    a = W("a", (4, 3, 2))
    cases.append(Case("permute_view", [a], [MPA3], lambda a: ops.permute(a, 1, 0, 2, 3)))
    a = W("a", (4, 3))
    cases.append(Case("transpose", [a], [MPA], lambda a: ops.cont(ops.transpose(a))))
    a = W("a", (4, 3))
    cases.append(Case("cont", [a], [MPA], lambda a: ops.cont(a)))
    for dshape in ((48,), (8, 6), (6, 8)):
        a, d = W("a", (8, 6)), W("dst", dshape)
        cases.append(Case(f"cpy{dshape}", [a, d], [MPA, ["M", "A0", "A1"]], lambda a, d: ops.cpy(a, d)))
    rows, i, dest = W("rows", (8, 3)), W("ids", (3,), I32), W("dest", (8, 10))
    cases.append(Case("set_rows", [rows, i, dest], [MPA, ["M", "A0"], ["M", "A0", "A1"]],
                      lambda r, i, d: ops.set_rows(d, r, i), {i: rng.permutation(10)[:3].astype(np.int32)}))
    a, p = W("a", (8, 2, 3)), W("pos", (3,), I32)
    cases.append(Case("rope", [a, p], [MPA3, ["M", "A0"]],
                      lambda a, p: ops.rope(a, p, 8, RopeMode.NEOX, 10000.0), {p: np.arange(3, dtype=np.int32) + 2}))
    q, k, v, m = W("q", (8, 3, 4)), W("k", (8, 6, 2)), W("v", (8, 6, 2)), W("mask", (6, 3))
    hv = ["M", "A1", "A2"]
    cases.append(Case("flash_attn", [q, k, v, m], [hv, hv, hv, ["M", "A1"]],
                      lambda q, k, v, m: ops.flash_attn_ext(q, k, v, m, 0.3), granule={(0, 2): 2}))
    q, k, v, m, s = W("q", (8, 3, 4)), W("k", (8, 6, 2)), W("v", (8, 6, 2)), W("mask", (6, 3)), W("sinks", (4,))
    cases.append(Case("flash_attn_sinks", [q, k, v, m, s], [["M", "A2"], ["M", "A2"], ["M", "A2"], ["M"], ["M", "A0"]],
                      lambda q, k, v, m, s: ops.flash_attn_ext(q, k, v, m, 0.3, sinks=s),
                      granule={(0, 2): 2, (4, 0): 2}))
    a, m = W("a", (6, 3, 2)), W("mask", (6, 3))
    cases.append(Case("soft_max_mask", [a, m], [MPA3, ["M", "A1"]], lambda a, m: ops.soft_max(a, m, 0.5)))
    a = W("a", (6, 3, 2))
    cases.append(Case("soft_max", [a], [MPA3], lambda a: ops.soft_max(a)))
    a, b = W("a", (8, 3)), W("b", (8, 3))
    cases.append(Case("glu_split", [a, b], [MPA, MPA], lambda a, b: ops.glu_split(a, b, GluOp.SWIGLU)))
    a = W("a", (16, 3))
    cases.append(Case("glu_fused", [a], [MPA + ["A0s2"]], lambda a: ops.glu_fused(a, GluOp.GEGLU_TANH)))
    a = W("a", (8, 3))
    cases.append(Case("unary", [a], [MPA], lambda a: ops.unary(a, UnaryOp.SIGMOID)))
    a = W("a", (8, 3))
    cases.append(Case("top_k", [a], [MPA], lambda a: ops.top_k(a, 3)))
    a = W("a", (8, 3))
    cases.append(Case("sum_rows", [a], [MPA], lambda a: ops.sum_rows(a)))
    return cases


CASES = make_cases()


def _fill_values(case: Case, rng) -> dict:
    vals = dict(case.values)
    for t in case.leaves:
        if t not in vals:
            vals[t] = (rng.standard_normal(tuple(reversed(t.ne))) * 0.5).astype(np.float32)
    return vals


def _combos(case: Case, layout: DeviceLayout):
    per_leaf = []
    for li, (t, kinds) in enumerate(zip(case.leaves, case.kinds)):
        opts = []
        for kind in kinds:
            if kind[0] == "A" and t.ne[int(kind[1])] == 1:
                continue
            opts.append((kind, state_of(kind, t, layout, case.granule.get((li, int(kind[1])), 1) if kind[0] == "A" else 1)))
        per_leaf.append(opts)
    return itertools.product(*per_leaf)


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_rule_claims_hold_numerically(case: Case):
    rng = np.random.default_rng(1)
    vals = _fill_values(case, rng)
    want = run_single(case.graph, vals, {}, [case.node])[0]
    legal = rejected = 0
    for layout in LAYOUTS:
        for combo in _combos(case, layout):
            overrides = {t: s for t, (_, s) in zip(case.leaves, combo)}
            label = ", ".join(k for k, _ in combo)
            try:
                plan = compile_plan(case.graph, layout, overrides=overrides)
            except SplitError as e:
                rejected += 1
                msg = str(e)
                assert case.node.op.name in msg and "inputs:" in msg or "PARTIAL view" in msg, msg
                continue
            legal += 1
            got = upload_and_run(case.graph, plan, vals, {}, [case.node], np.random.default_rng(2))[0]
            if case.node.type == I32:
                assert np.array_equal(np.asarray(got).reshape(want.shape), want), (case.name, label)
            else:
                assert_close(got, want, f"{case.name} [{label}] on {layout} -> {plan.of(case.node).state}")
    assert legal > 0, case.name


def test_every_op_has_a_rule():
    assert set(RULES) == set(OP_RULES) == set(Op)


def test_layout_rounds_are_canonical():
    """rounds() drops empty repeats and merges equal consecutive rounds, like merge_rounds()."""
    st = SplitState.segmented(0, [((2, 1), 1), ((2, 1), 2), ((0, 0), 0), ((1, 1), 1)])
    assert rounds(st) == [((2, 1), 3), ((1, 1), 1)]
    assert rounds(st, 4) == [((8, 4), 3), ((4, 4), 1)]
    assert merge_rounds([((1,), 0), ((1,), 2), ((1,), 1)]) == [((1,), 3)]


def test_layout_fused_qkv_pattern_moves_through_a_reshape_and_a_window():
    """[Q_j | K_j | V_j] per device: flattening keeps the pattern, a window picks K's chunks."""
    q, kv = (4, 2), (2, 2)                             # per device: q heads' elements, k (and v) elements
    st = SplitState.segmented(0, [(q, 1), (kv, 2)])
    flat = reshape_state(rounds(st), (sum(q) + 2 * sum(kv), 3, 1, 1), prefer_inner=1)
    assert flat is not None and flat.axis == 0 and rounds(flat) == rounds(st)
    k_window = clip_rounds(rounds(st), sum(q), sum(kv))  # the K part of one row
    assert k_window == [(kv, 1)]
    assert [local_start(rounds(st), sum(q), j) for j in range(2)] == [4, 2]   # each device's Q before K


def _claim(build, leaves_states, layout=LAYOUTS[0]):
    leaves = [t for t, _ in leaves_states]
    node = build(*leaves)
    g = Graph([node])
    plan = compile_plan(g, layout, overrides={t: state_of(k, t, layout) for t, k in leaves_states},
                        stop_after="propagated")
    return plan.of(node).state


def test_canonical_claims():
    """The rules of digest §3 as the brief states them."""
    w, x = W("w", (8, 6)), W("x", (8, 5))
    assert _claim(ops.mul_mat, [(w, "A1"), (x, "M")]).axis == 0
    assert _claim(ops.mul_mat, [(w, "A0"), (x, "A0")]).is_partial
    assert _claim(ops.mul_mat, [(w, "M"), (x, "A1")]).axis == 1
    assert _claim(ops.mul_mat, [(w, "M"), (x, "M")]).is_mirrored
    a = W("a", (8, 3))
    with pytest.raises(SplitError, match=r"RMS_NORM.*AXIS_0"):
        _claim(lambda a: ops.rms_norm(a, 1e-5), [(a, "A0")])
    q, k, v, m = W("q", (8, 3, 4)), W("k", (8, 6, 2)), W("v", (8, 6, 2)), W("mask", (6, 3))
    layout = LAYOUTS[0]
    wts = integer_weights(layout.tensor_split, 2)
    node = ops.flash_attn_ext(q, k, v, m, 0.3)
    g = Graph([node])
    over = {q: SplitState.split(2, split_sizes(4, 2, wts)), k: SplitState.split(2, split_sizes(2, 1, wts)),
            v: SplitState.split(2, split_sizes(2, 1, wts)), m: SplitState.mirrored()}
    st = compile_plan(g, layout, overrides=over, stop_after="propagated").of(node).state
    assert st.axis == 1 and st.extents() == over[q].extents()


def test_error_names_op_node_and_states():
    a, b = W("a", (8, 3)), W("b", (8, 3))
    node = ops.mul(a, b, name="the_mul")
    g = Graph([node])
    with pytest.raises(SplitError) as e:
        compile_plan(g, LAYOUTS[0], overrides={a: state_of("A0", a, LAYOUTS[0]), b: SplitState.partial()})
    msg = str(e.value)
    assert "MUL" in msg and "the_mul" in msg and "a=AXIS_0" in msg and "b=PARTIAL" in msg


def test_single_owner_split_is_reexpressed():
    """A tensor held whole by one device (one KV head on two devices) may have its split land on
    ne[0] after a reshape; per-row ops and rope accept it by re-expressing it along the head dim."""
    k = W("k", (8, 3))
    node = ops.rope(ops.reshape(k, 8, 1, 3), W("pos", (3,), I32), 8, RopeMode.NORMAL, 1e4)
    g = Graph([node])
    plan = compile_plan(g, LAYOUTS[0], overrides={k: SplitState.split(0, (8, 0)), node.src[1]: SplitState.mirrored()},
                        stop_after="propagated")
    assert plan.of(node).state.extents() == (1, 0)
