"""Everything the compiler knows about each op, in one row per op: `OP_RULES: dict[Op, OpRule]`.

A row holds the op's split rule (propagation), its linearity in un-reduced operands (what
coalescing may delay a reduction through) and, for view ops, its lowering (each device's
strides and offset into the source's or destination's local memory). `passes/propagate.py`,
`passes/coalesce.py` and `passes/lower.py` read this table; none keeps its own per-op switch.
A new op adds one row here (tests/test_op_coverage.py names any piece missing).

Split rules. Every rule sees its sources' states as consumers see them (llama.cpp's
`assume_sync=true`: a matmul's PARTIAL output looks MIRRORED, as if it had been reduced
already). It returns the node's own state; a node whose result is PARTIAL is a reduction point.

Where llama.cpp passes a PARTIAL input through unchecked, these rules are strict: a PARTIAL
input (only static PARTIAL leaves, e.g. an expert bias, can be seen here) is accepted by ops
linear in it (the result stays PARTIAL and is reduced later) and rejected by non-linear ones.
`ADD`/`ADD_ID` of a MIRRORED value and a PARTIAL leaf gives MIRRORED, as in llama.cpp: that is
the expert-bias pattern, exact only inside a delayed reduction; coalescing keeps that
promise or the compiler mirrors the leaf (see `passes/coalesce.py`).

Layouts are exact: a state's segments say where each device's chunks sit in the full tensor,
and reshape / view / copy rules move that layout through flat element order (the algebra of
`passes/layout.py`), so a view at an offset into a fused QKV output lands on [Q_j|K_j|V_j].
After each rule, llama.cpp's "take over ratio" invariant is checked for every split source:
device j's share of the result is proportional to its share of that source; a rule result
that breaks it (e.g. GQA heads out of step with their KV heads) is a SplitError.

Any combination not listed raises `SplitError` naming the op, the node and the input states.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Protocol, Sequence

from metatp.ir.errors import SplitError
from metatp.ir.ops import Op
from metatp.ir.tensor import Tensor
from metatp.passes.layout import (ViewError, ViewMode, analyze_view, base_offset, elements_to_bytes, from_rounds,
                                  inner_size, local_contiguous_nb, local_ne, local_start, owner_only,
                                  reshape_state, rounds, same_layout)
from metatp.passes.plan import Local
from metatp.passes.state import SplitState

__all__ = ["OpRule", "OP_RULES", "RULES", "Operands", "apply_rule", "check_ratio", "describe", "on_axis",
           "owner_only"]

M = SplitState.mirrored()
P = SplitState.partial()

# ---------------------------------------------------------------- errors


def describe(st: SplitState | None) -> str:
    return "none" if st is None else str(st)


def _fail(node: Tensor, srcs: Sequence[SplitState | None], reason: str) -> SplitError:
    ins = ", ".join(f"{s.name or '?'}={describe(st)}" for s, st in zip(node.src, srcs) if s is not None)
    return SplitError(f"{node.op.name} node {node.name or '#' + str(node.id)!r}: {reason} (inputs: {ins})")


def _reshape(node: Tensor, src: Tensor, st: SplitState, srcs: Sequence[SplitState | None]) -> SplitState:
    """Move a split through a change of shape with the same flat element order."""
    if not st.is_split:
        return st
    inner = inner_size(src.ne, st.axis)
    out = reshape_state(rounds(st, inner), node.ne, prefer_inner=inner)
    if out is None:
        raise _fail(node, srcs, f"cannot reshape {list(src.ne)} split as {st} to {list(node.ne)} without moving "
                                f"elements between devices")
    return out


# ---------------------------------------------------------------- rules

Rule = Callable[[Tensor, Sequence[SplitState | None]], SplitState]


def _need_mirrored(node: Tensor, srcs, idx: int, what: str) -> None:
    s = srcs[idx] if idx < len(srcs) else None
    if s is not None and not s.is_mirrored:
        raise _fail(node, srcs, f"{what} (src{idx}) must be MIRRORED")


def rule_leaf(node, srcs):
    raise _fail(node, srcs, "leaf states come from the split table, not from a rule")


def rule_per_row(node, srcs, linear: bool = False):
    """Ops that work on whole rows (norms, top-k, sums): rows must not be cut (no AXIS_0)."""
    s0 = srcs[0]
    if s0.is_split and s0.axis == 0:
        raise _fail(node, srcs, "rows split along AXIS_0 cannot feed a per-row op")
    if s0.is_partial and not linear:
        raise _fail(node, srcs, "a PARTIAL input to a non-linear op must be reduced first")
    return s0


def rule_sum_rows(node, srcs):
    return rule_per_row(node, srcs, linear=True)


def rule_binary(node, srcs):
    """ADD / MUL / DIV with ggml's broadcast of src1 over src0."""
    a, b = srcs[0], srcs[1]
    A, B = node.src[0], node.src[1]
    op = node.op
    if a.is_split and b.is_mirrored:
        if B.ne[a.axis] == 1:
            return a
        raise _fail(node, srcs, f"MIRRORED src1 must broadcast along the split axis {a.axis} (src1 ne={list(B.ne)})")
    if a.is_split and b.is_split:
        if same_layout(a, b) and A.ne[a.axis] == B.ne[b.axis]:
            return a
        raise _fail(node, srcs, "split operands must have the same layout")
    if a.is_mirrored and b.is_mirrored:
        return M
    if a.is_split or b.is_split:
        raise _fail(node, srcs, "a split operand with a non-split one is only supported as split src0 "
                                "with a broadcast MIRRORED src1")
    # from here on, at least one PARTIAL operand and the other MIRRORED or PARTIAL
    if op is Op.ADD:
        if a.is_partial and b.is_partial:
            return P
        return M   # MIRRORED + PARTIAL bias: exact once coalesced into the producer's delayed reduction
    if op is Op.MUL and (a.is_partial != b.is_partial):
        return P   # linear in the PARTIAL factor
    if op is Op.DIV and a.is_partial and b.is_mirrored:
        return P
    raise _fail(node, srcs, f"{op.name} is not linear in these PARTIAL operands")


def rule_add_id(node, srcs):
    """src0[:, e, t] + bias[:, ids[e, t]]: llama.cpp's rule (b) for the PARTIAL expert bias."""
    _need_mirrored(node, srcs, 2, "ids")
    a, b = srcs[0], srcs[1]
    if a.is_mirrored and (b.is_mirrored or b.is_partial):
        return M
    if a.is_split and b.is_split and a.axis == 0 and same_layout(a, b):
        return a
    if a.is_partial and b.is_partial:
        return P
    raise _fail(node, srcs, "unsupported combination (a PARTIAL src0 would add the bias once per device)")


def rule_scale(node, srcs):
    s0 = srcs[0]
    if s0.is_partial and node.params.get("b", 0.0) != 0.0:
        raise _fail(node, srcs, "x*s+b with b != 0 is not linear in a PARTIAL x")
    return s0


def rule_mul_mat(node, srcs):
    """mul_mat(W [k, m], X [k, n]) -> [m, n]."""
    w, x = srcs[0], srcs[1]
    W, X = node.src[0], node.src[1]
    if w.is_mirrored and x.is_mirrored:
        return M
    if w.is_split and w.axis == 1 and x.is_mirrored:
        return from_rounds(0, rounds(w))           # column parallel: output rows follow W's columns
    if w.is_mirrored and x.is_split and x.axis >= 1:
        if x.axis == 1 or W.ne[x.axis] == 1:
            return x
        raise _fail(node, srcs, f"MIRRORED src0 with ne[{x.axis}]={W.ne[x.axis]} cannot broadcast over a split "
                                f"batch dim")
    if w.is_split and x.is_split and w.axis == 0 and x.axis == 0:
        if same_layout(w, x):
            return P                               # row parallel: partial sums
        raise _fail(node, srcs, "the contracted dim is split differently in the two operands")
    if w.is_split and x.is_split and w.axis == x.axis and w.axis in (2, 3):
        ok = len(w.ne) == 1 and len(x.ne) == 1 and w.nr[0] == 1 and x.nr[0] == 1 and all(
            w.extent(j) * X.ne[w.axis] == x.extent(j) * W.ne[w.axis] for j in range(w.n_devices))
        if ok:
            return x                               # batched (per head) matmul, broadcast ratio kept per device
        raise _fail(node, srcs, "batch dims split out of proportion")
    if (w.is_mirrored and x.is_partial) or (w.is_partial and x.is_mirrored):
        return P                                   # linear in the PARTIAL operand
    raise _fail(node, srcs, "unsupported combination")


def rule_mul_mat_id(node, srcs):
    """mul_mat_id(experts [k, m, E], X [k, n_b, T], ids [n_used, T]) -> [m, n_used, T]."""
    _need_mirrored(node, srcs, 2, "ids")
    w, x = srcs[0], srcs[1]
    if w.is_mirrored and x.is_mirrored:
        return M
    if w.is_split and w.axis == 1 and x.is_mirrored:
        return from_rounds(0, rounds(w))
    if w.is_split and x.is_split and w.axis == 0 and x.axis == 0:
        if same_layout(w, x):
            return P
        raise _fail(node, srcs, "the contracted dim is split differently in the two operands")
    if w.is_mirrored and x.is_partial:
        return P
    raise _fail(node, srcs, "unsupported combination")


def rule_reshape(node, srcs):
    return _reshape(node, node.src[0], srcs[0], srcs)


def rule_view(node, srcs):
    try:
        return analyze_view(node, node.src[0], srcs[0]).state
    except ViewError as e:
        raise _fail(node, srcs, str(e)) from None


def rule_permute(node, srcs):
    s0 = srcs[0]
    if not s0.is_split:
        return s0
    axes = node.params["axes"]
    return SplitState(axes[s0.axis], s0.ne, s0.nr)


def rule_transpose(node, srcs):
    s0 = srcs[0]
    if not s0.is_split or s0.axis > 1:
        return s0
    return SplitState(1 - s0.axis, s0.ne, s0.nr)


def rule_cont(node, srcs):
    return srcs[0]          # same logical shape: the layout of every element is unchanged


def rule_cpy(node, srcs):
    """Copy src0 (flat logical order) into the destination src1; the result aliases src1."""
    s0, dst = srcs[0], srcs[1]
    if s0.is_partial:
        raise _fail(node, srcs, "copying a PARTIAL value into another tensor's memory is not supported")
    out = _reshape(node, node.src[0], s0, srcs)
    if not same_layout(out, dst):
        raise _fail(node, srcs, f"the copied layout {out} does not match the destination's")
    return dst


def rule_set_rows(node, srcs):
    """dest[ids[i]] = rows[i] (src = rows, ids, dest); the result aliases dest."""
    rows, dest = srcs[0], srcs[2]
    _need_mirrored(node, srcs, 1, "ids")
    if rows.is_partial:
        raise _fail(node, srcs, "storing a PARTIAL value is not supported")
    if rows.is_split and rows.axis == 1:
        raise _fail(node, srcs, "rows split along AXIS_1 (the row index) cannot be scattered")
    if same_layout(rows, dest):
        return dest
    raise _fail(node, srcs, "rows and destination must have the same layout")


def rule_rope(node, srcs):
    """x [head_dim, n_head, T]: heads may be split; tokens only together with their positions."""
    _need_mirrored(node, srcs, 2, "frequency factors")
    s0, pos = srcs[0], srcs[1]
    if s0.is_split and s0.axis == 0:
        raise _fail(node, srcs, "rotary pairs lie along ne[0], which must not be split")
    if s0.is_split and s0.axis == 2:
        if pos.is_split and pos.axis == 0 and rounds(pos) == rounds(s0):
            return s0
        raise _fail(node, srcs, "tokens (AXIS_2) may only be split together with their positions")
    _need_mirrored(node, srcs, 1, "positions")
    if s0.is_split and s0.axis == 3:
        raise _fail(node, srcs, "AXIS_3 is not supported")
    return s0               # PARTIAL passes: rope is linear in x


def rule_flash_attn(node, srcs):
    """q [D, T, H], k/v [D, n_kv, Hkv] -> [Dv, H, T]: heads on AXIS_2 give the output AXIS_1."""
    q, k, v = srcs[0], srcs[1], srcs[2]
    sinks = srcs[4] if len(srcs) > 4 else None
    _need_mirrored(node, srcs, 3, "mask")
    if q.is_mirrored and k.is_mirrored and v.is_mirrored and (sinks is None or sinks.is_mirrored):
        return M
    if all(s.is_split and s.axis == 2 for s in (q, k, v)):
        if not same_layout(k, v):
            raise _fail(node, srcs, "K and V heads must be split identically")
        if len(q.ne) != 1 or q.nr[0] != 1 or len(k.ne) != 1 or k.nr[0] != 1:
            raise _fail(node, srcs, "segmented head splits are not supported")
        if sinks is not None and not (sinks.is_split and sinks.axis == 0 and sinks.extents() == q.extents()):
            raise _fail(node, srcs, "sinks must be split along their heads like q")
        return SplitState.segmented(1, [(q.ne[0], 1)])
    raise _fail(node, srcs, "q, k and v must all be split along heads (AXIS_2) or all be MIRRORED")


def rule_soft_max(node, srcs):
    s0 = srcs[0]
    mask = srcs[1] if len(srcs) > 1 else None
    if s0.is_partial:
        raise _fail(node, srcs, "a PARTIAL input to softmax must be reduced first")
    if s0.is_split and s0.axis == 0:
        raise _fail(node, srcs, "rows split along AXIS_0 cannot feed softmax")
    if mask is None or (mask.is_mirrored and (not s0.is_split or node.src[1].ne[s0.axis] == 1)):
        return s0
    if s0.is_split and same_layout(s0, mask):
        return s0
    raise _fail(node, srcs, "the mask must be MIRRORED and broadcast along the split axis, or split like the input")


def rule_glu(node, srcs):
    a = srcs[0]
    b = srcs[1] if len(srcs) > 1 else None
    if a.is_partial or (b is not None and b.is_partial):
        raise _fail(node, srcs, "a PARTIAL input to a GLU must be reduced first")
    if b is not None:
        if a.is_mirrored and b.is_mirrored:
            return M
        if a.is_split and b.is_split and same_layout(a, b):
            return a
        raise _fail(node, srcs, "gate and up must have the same layout")
    if a.is_split and a.axis == 0:
        if len(a.ne) == 1 and a.nr[0] == 2:
            return SplitState.segmented(0, [(a.ne[0], 1)])   # [gate_j | up_j] on each device
        raise _fail(node, srcs, "a fused GLU split along AXIS_0 needs the gate/up segments {(n_ff, 2)}")
    return a


def rule_unary(node, srcs):
    if srcs[0].is_partial:
        raise _fail(node, srcs, "a PARTIAL input to an activation must be reduced first")
    return srcs[0]


def rule_get_rows(node, srcs):
    _need_mirrored(node, srcs, 1, "row ids")
    s0 = srcs[0]
    if not s0.is_split or s0.axis == 0:
        return s0
    raise _fail(node, srcs, "rows can only be gathered from a table split along AXIS_0 or not split")


def rule_top_k(node, srcs):
    return rule_per_row(node, srcs)



# ---------------------------------------------------------------- linearity (coalescing)


class Operands(Protocol):
    """How coalescing classifies a node's sources while it grows a chain (passes/coalesce.py)."""

    def pending(self, s: Tensor | None) -> bool:
        """An un-reduced chain value (a partial sum on every device)."""

    def mirrored(self, s: Tensor | None) -> bool:
        """Not pending, and the same full value on every device."""

    def partial_leaf(self, s: Tensor | None) -> bool:
        """A static PARTIAL leaf (the expert bias: the value on its owner, zeros elsewhere)."""


# May the node compute on its pending operands and stay an un-reduced partial sum? (Only asked
# for nodes that read a pending value and whose consumer-view state is MIRRORED.)
LinearIn = Callable[[Tensor, Operands], bool]


def linear_add(node: Tensor, o: Operands) -> bool:
    """Sums of pending values and PARTIAL leaves (expert bias, two partial branches)."""
    return all(o.pending(s) or o.partial_leaf(s) for s in node.src)


def linear_add_id(node: Tensor, o: Operands) -> bool:
    s = node.src
    return o.pending(s[0]) and (o.pending(s[1]) or o.partial_leaf(s[1])) and o.mirrored(s[2])


def linear_one_factor(node: Tensor, o: Operands) -> bool:
    """Bilinear ops (MUL, MUL_MAT): one pending operand, the other MIRRORED."""
    s = node.src
    return (o.pending(s[0]) and o.mirrored(s[1])) or (o.mirrored(s[0]) and o.pending(s[1]))


def linear_src0_by_mirrored_src1(node: Tensor, o: Operands) -> bool:
    """DIV by a MIRRORED divisor; GET_ROWS with MIRRORED ids."""
    return o.pending(node.src[0]) and o.mirrored(node.src[1])


def linear_scale(node: Tensor, o: Operands) -> bool:
    return o.pending(node.src[0]) and node.params.get("b", 0.0) == 0.0


def linear_src0(node: Tensor, o: Operands) -> bool:
    """Views, CONT and SUM_ROWS move or sum elements of their one source."""
    return o.pending(node.src[0])


def linear_rope(node: Tensor, o: Operands) -> bool:
    return o.pending(node.src[0]) and all(o.mirrored(s) for s in node.src[1:] if s is not None)


# ---------------------------------------------------------------- view lowering

# Per-device Local of a view node from the already-lowered tensors and the consumer-view states
# (passes/lower.py). The result aliases a source's (or the destination's) local memory.
LowerView = Callable[[Tensor, Mapping[Tensor, list[Local]], Mapping[Tensor, SplitState], int], list[Local]]


def lower_reshape(node: Tensor, local: Mapping[Tensor, list[Local]], sync: Mapping[Tensor, SplitState],
                  n: int) -> list[Local]:
    """Contiguous, at the source's local offset."""
    src_loc = local[node.src[0]]
    nes = [local_ne(node, sync[node], j) for j in range(n)]
    return [Local(ne, local_contiguous_nb(node, ne), src_loc[j].offs) for j, ne in enumerate(nes)]


def _permuted(axes: Sequence[int], src_loc: list[Local]) -> list[Local]:
    out = []
    for loc in src_loc:
        ne, nb = [0] * 4, [0] * 4
        for i, ax in enumerate(axes):
            ne[ax] = loc.ne[i]
            nb[ax] = loc.nb[i]
        out.append(Local(tuple(ne), tuple(nb), loc.offs))
    return out


def lower_permute(node: Tensor, local: Mapping[Tensor, list[Local]], sync: Mapping[Tensor, SplitState],
                  n: int) -> list[Local]:
    """The source's local strides, permuted."""
    return _permuted(node.params["axes"], local[node.src[0]])


def lower_transpose(node: Tensor, local: Mapping[Tensor, list[Local]], sync: Mapping[Tensor, SplitState],
                    n: int) -> list[Local]:
    return _permuted((1, 0, 2, 3), local[node.src[0]])


def lower_alias_dest(dest_index: int) -> LowerView:
    """CPY / SET_ROWS: the result aliases the destination operand, so it takes its layout."""
    def lower(node: Tensor, local: Mapping[Tensor, list[Local]], sync: Mapping[Tensor, SplitState],
              n: int) -> list[Local]:
        return list(local[node.src[dest_index]])
    return lower


def _row_bytes(loc: Local, axis: int) -> int:
    return loc.nb[axis + 1] if axis < 3 else loc.nb[3] * loc.ne[3]


def lower_view(node: Tensor, local: Mapping[Tensor, list[Local]], sync: Mapping[Tensor, SplitState],
               n: int) -> list[Local]:
    """The window's inner dims contiguous locally, dims that step whole source rows at the
    source's local row stride, offset = the source's local offset plus the device's own
    elements before the window start (exact for segmented layouts such as fused QKV)."""
    src, st = node.src[0], sync[node]
    src_state, src_loc = sync[src], local[src]
    rel = node.view_offs - base_offset(src)
    if not src_state.is_split:
        return [Local(node.ne, node.nb, src_loc[j].offs + rel) for j in range(n)]
    owner = owner_only(src_state)
    if owner is not None and owner_only(st) == owner:
        # one device holds everything: it sees the view exactly as a single device would
        return [Local(node.ne, node.nb, src_loc[j].offs + rel) if j == owner else
                Local(local_ne(node, st, j), node.nb, src_loc[j].offs) for j in range(n)]
    va = analyze_view(node, src, src_state)
    if va.identical:
        return list(src_loc)
    out = []
    for j in range(n):
        ne = local_ne(node, st, j)
        row_j = _row_bytes(src_loc[j], va.src_axis)
        if va.mode is ViewMode.WINDOW:   # inner dims contiguous, outer dims step local rows
            cnb = local_contiguous_nb(node, ne)
            nb = [cnb[i] if i <= va.inner_dims else node.nb[i] // va.row_bytes * row_j for i in range(4)]
            inside = elements_to_bytes(src, local_start(va.row_rounds, va.start, j))
        else:                            # DIRECT: strides below the row are unchanged
            nb = [node.nb[i] if i <= va.dim else node.nb[i] // va.row_bytes * row_j for i in range(4)]
            inside = local_start(va.row_rounds, va.start, j) * src.nb[va.src_axis] + va.within
        out.append(Local(ne, tuple(nb), src_loc[j].offs + va.outer_rows * row_j + inside))
    return out


# ---------------------------------------------------------------- the table


@dataclass(frozen=True)
class OpRule:
    """One op's row: how a split moves through it, and what coalescing and lowering need."""

    split: Rule                          # source states (consumer view) -> the node's state
    linear_in: LinearIn | None = None    # None: a reduction cannot be delayed through this op
    lower_view: LowerView | None = None  # view ops only (OpInfo.is_view): per-device Local


OP_RULES: dict[Op, OpRule] = {
    Op.NONE: OpRule(rule_leaf),
    Op.GET_ROWS: OpRule(rule_get_rows, linear_src0_by_mirrored_src1),
    Op.RMS_NORM: OpRule(rule_per_row),
    Op.NORM: OpRule(rule_per_row),
    Op.ADD: OpRule(rule_binary, linear_add),
    Op.MUL: OpRule(rule_binary, linear_one_factor),
    Op.DIV: OpRule(rule_binary, linear_src0_by_mirrored_src1),
    Op.ADD_ID: OpRule(rule_add_id, linear_add_id),
    Op.SCALE: OpRule(rule_scale, linear_scale),
    Op.MUL_MAT: OpRule(rule_mul_mat, linear_one_factor),
    Op.MUL_MAT_ID: OpRule(rule_mul_mat_id),
    Op.RESHAPE: OpRule(rule_reshape, linear_src0, lower_reshape),
    Op.VIEW: OpRule(rule_view, linear_src0, lower_view),
    Op.PERMUTE: OpRule(rule_permute, linear_src0, lower_permute),
    Op.TRANSPOSE: OpRule(rule_transpose, linear_src0, lower_transpose),
    Op.CONT: OpRule(rule_cont, linear_src0),
    Op.CPY: OpRule(rule_cpy, lower_view=lower_alias_dest(1)),
    Op.SET_ROWS: OpRule(rule_set_rows, lower_view=lower_alias_dest(2)),
    Op.ROPE: OpRule(rule_rope, linear_rope),
    Op.FLASH_ATTN_EXT: OpRule(rule_flash_attn),
    Op.SOFT_MAX: OpRule(rule_soft_max),
    Op.GLU: OpRule(rule_glu),
    Op.UNARY: OpRule(rule_unary),
    Op.ARGSORT_TOP_K: OpRule(rule_top_k),
    Op.SUM_ROWS: OpRule(rule_sum_rows, linear_src0),
}

# The split rules alone (tests and tools that only need propagation).
RULES: dict[Op, Rule] = {op: r.split for op, r in OP_RULES.items()}


def check_ratio(node: Tensor, out: SplitState, srcs: Sequence[SplitState | None]) -> None:
    """llama.cpp's take-over-ratio invariant: every split source is cut in proportion to the result."""
    if not out.is_split:
        return
    total = node.ne[out.axis]
    if out.total() != total:
        raise _fail(node, srcs, f"result state {out} covers {out.total()} of {total} elements along axis {out.axis}")
    ext = out.extents()
    for s, st in zip(node.src, srcs):
        if s is None or st is None or not st.is_split:
            continue
        n_src = s.ne[st.axis]
        for j in range(len(ext)):
            if ext[j] * n_src != st.extent(j) * total:
                raise _fail(node, srcs, f"device {j}'s share of the result ({ext[j]}/{total}) is not proportional to "
                                        f"its share of {s.name or 'a source'} ({st.extent(j)}/{n_src})")



def on_axis(st: SplitState, t: Tensor, axis: int) -> SplitState:
    """A single-owner split re-expressed along another dim: physically the same (the owner holds
    the whole tensor, the others nothing), so any axis describes it."""
    k = owner_only(st)
    ext = [0] * st.n_devices
    ext[k] = t.ne[axis]
    return SplitState.split(axis, ext)


def _owner_variants(node: Tensor, srcs: Sequence[SplitState | None]):
    """Re-expressions of single-owner sources along other dims, most plausible first."""
    import itertools

    idx = [i for i, st in enumerate(srcs) if owner_only(st) is not None and node.src[i].ne[srcs[i].axis] > 0]
    if not idx:
        return
    others = [st.axis for i, st in enumerate(srcs) if st is not None and st.is_split and i not in idx]
    choices = []
    for i in idx:
        order = others + [0, 1, 2, 3]
        axes = [a for k, a in enumerate(order) if a not in order[:k] and node.src[i].ne[a] > 0]
        choices.append(axes)
    for combo in itertools.islice(itertools.product(*choices), 256):
        cand = list(srcs)
        for i, a in zip(idx, combo):
            cand[i] = srcs[i] if a == srcs[i].axis else on_axis(srcs[i], node.src[i], a)
        yield cand


def apply_rule(node: Tensor, srcs: Sequence[SplitState | None]) -> SplitState:
    """The node's state (assume_sync=False) from its sources' consumer-view states.

    If the rule rejects the inputs as given but some of them are held entirely by one device,
    the rule is retried with those re-expressed along other dims (e.g. a single KV head whose
    reshape put the split on ne[0] instead of the head dim): same memory, so the result is
    as exact as the rule itself."""
    rule = RULES.get(node.op)
    if rule is None:
        raise _fail(node, srcs, "no split rule for this op")
    for s, st in zip(node.src, srcs):
        if s is not None and st is None:
            raise _fail(node, srcs, f"source {s.name!r} has no state")
    try:
        out = rule(node, srcs)
        check_ratio(node, out, srcs)
        return out
    except SplitError as first:
        for cand in _owner_variants(node, srcs):
            try:
                out = rule(node, cand)
                check_ratio(node, out, cand)
                return out
            except SplitError:
                continue
        raise first
