"""Split-state propagation rules: one small function per op family, in one table keyed by Op.

Every rule sees its sources' states as consumers see them (llama.cpp's `assume_sync=true`: a
matmul's PARTIAL output looks MIRRORED, as if it had been reduced already). It returns the
node's own state; a node whose result is PARTIAL is a reduction point.

Where llama.cpp passes a PARTIAL input through unchecked, these rules are strict: a PARTIAL
input (only static PARTIAL leaves, e.g. an expert bias, can be seen here) is accepted by ops
linear in it (the result stays PARTIAL and is reduced later) and rejected by non-linear ones.
`ADD`/`ADD_ID` of a MIRRORED value and a PARTIAL leaf gives MIRRORED, as in llama.cpp: that is
the expert-bias pattern, exact only inside a delayed reduction; coalescing keeps that
promise or the compiler mirrors the leaf (see `passes/coalesce.py`).

Layouts are exact: a state's segments say where each device's chunks sit in the full tensor,
and reshape / view / copy rules move that layout through flat element order (the "pattern"
helpers below), so a view at an offset into a fused QKV output lands on [Q_j|K_j|V_j].
After each rule, llama.cpp's "take over ratio" invariant is checked for every split source:
device j's share of the result is proportional to its share of that source; a rule result
that breaks it (e.g. GQA heads out of step with their KV heads) is a SplitError.

Any combination not listed raises `SplitError` naming the op, the node and the input states.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

from metatp.ir.errors import SplitError
from metatp.ir.ops import Op
from metatp.ir.tensor import Tensor, block_size, contiguous_nb, type_size
from metatp.passes.state import SplitState

__all__ = ["RULES", "apply_rule", "rounds", "same_layout", "reshape_state", "analyze_view", "ViewAnalysis",
           "describe"]

M = SplitState.mirrored()
P = SplitState.partial()

Rounds = list[tuple[tuple[int, ...], int]]   # [(per-device chunk lengths, repeats)] in layout order


# ---------------------------------------------------------------- errors


def describe(st: SplitState | None) -> str:
    return "none" if st is None else str(st)


def _fail(node: Tensor, srcs: Sequence[SplitState | None], reason: str) -> SplitError:
    ins = ", ".join(f"{s.name or '?'}={describe(st)}" for s, st in zip(node.src, srcs) if s is not None)
    return SplitError(f"{node.op.name} node {node.name or '#' + str(node.id)!r}: {reason} (inputs: {ins})")


# ---------------------------------------------------------------- layouts


def rounds(st: SplitState, scale: int = 1) -> Rounds:
    """The state's chunk rounds, merged where consecutive rounds are equal; lengths times `scale`."""
    out: Rounds = []
    for seg, nr in zip(st.ne, st.nr):
        vec = tuple(x * scale for x in seg)
        if nr == 0:
            continue
        if out and out[-1][0] == vec:
            out[-1] = (vec, out[-1][1] + nr)
        else:
            out.append((vec, nr))
    return out


def _merge(rs: Rounds) -> Rounds:
    out: Rounds = []
    for vec, c in rs:
        if c == 0:
            continue
        if out and out[-1][0] == vec:
            out[-1] = (vec, out[-1][1] + c)
        else:
            out.append((vec, c))
    return out


def same_layout(a: SplitState, b: SplitState) -> bool:
    """Same axis and every device holds the same chunks (stronger than llama.cpp's `equal`)."""
    if a.axis != b.axis:
        return False
    return not a.is_split or rounds(a) == rounds(b)


def _from_rounds(axis: int, rs: Rounds) -> SplitState:
    return SplitState.segmented(axis, [(vec, c) for vec, c in rs])


def reshape_state(rs: Rounds, dst_ne: Sequence[int], max_dim: int = 3, prefer_inner: int | None = None) -> SplitState | None:
    """Express a flat chunk pattern along the dims of a new shape.

    `rs` describes one block of the source in flat elements; the whole tensor is that block
    repeated. Returns the state along the first dst dim b (<= max_dim) whose inner product
    divides every chunk and whose block is a whole number of pattern periods; None if none.
    `prefer_inner`: try first the dim whose inner product equals it (keeps the axis of a
    reshape that does not touch the split dims)."""
    block = sum(sum(vec) * c for vec, c in rs)
    period = sum(rs[0][0]) if len(rs) == 1 else block
    if period == 0:
        return None
    cands = list(range(max_dim + 1))
    if prefer_inner is not None:
        inner = 1
        for b in range(max_dim + 1):
            if inner == prefer_inner:
                cands.remove(b)
                cands.insert(0, b)
                break
            inner *= dst_ne[b]
    for b in cands:
        C = 1
        for k in range(b):
            C *= dst_ne[k]
        Pd = C * dst_ne[b]
        if Pd == 0 or Pd % period:
            continue
        if any(x % C for vec, _ in rs for x in vec):
            continue
        if len(rs) == 1:
            segs: Rounds = [(tuple(x // C for x in rs[0][0]), Pd // period)]
        else:
            segs = _merge([(tuple(x // C for x in vec), c) for vec, c in rs] * (Pd // block))
        return _from_rounds(b, segs)
    return None


def _inner(ne: Sequence[int], axis: int) -> int:
    n = 1
    for k in range(axis):
        n *= ne[k]
    return n


def _reshape(node: Tensor, src: Tensor, st: SplitState, srcs: Sequence[SplitState | None]) -> SplitState:
    """Move a split through a change of shape with the same flat element order."""
    if not st.is_split:
        return st
    inner = _inner(src.ne, st.axis)
    out = reshape_state(rounds(st, inner), node.ne, prefer_inner=inner)
    if out is None:
        raise _fail(node, srcs, f"cannot reshape {list(src.ne)} split as {st} to {list(node.ne)} without moving "
                                f"elements between devices")
    return out


# ---------------------------------------------------------------- views


@dataclass
class ViewAnalysis:
    """Where a VIEW sits in its split source (shared by the VIEW rule and lowering).

    mode "window": view dims 0..inner_dims are contiguous and cover a flat range of one source
    row (the source's dims 0..src_axis); "direct": view dim `dim` walks the source's split axis
    with its stride (dims below stay inside one position, dims above step whole rows)."""

    state: SplitState
    mode: str = "same"         # "same" (not split / identical), "window", "direct"
    src_axis: int = 0          # split axis of the source
    dim: int = 0               # split dim of the view
    inner_dims: int = 0        # window: view dims 0..inner_dims are contiguous
    row_bytes: int = 0         # bytes of one source row at level src_axis (src.nb[src_axis+1])
    outer_rows: int = 0        # whole source rows skipped by the offset
    start: int = 0             # window: flat element offset in the row; direct: first position
    within: int = 0            # direct: bytes into the first position
    row_rounds: Rounds | None = None   # the row's chunk pattern (window: flat elements; direct: positions)
    identical: bool = False    # same shape/strides/offset as the source


class ViewError(SplitError):
    """A view window that cannot be expressed per device (the reason, without the node context)."""


def _elements_to_bytes(t: Tensor, n: int) -> int:
    bs = block_size(t.type)
    if n % bs:
        raise ViewError(f"an offset of {n} elements is not a whole number of {t.type.name} blocks")
    return n // bs * type_size(t.type)


def _bytes_to_elements(t: Tensor, nbytes: int) -> int | None:
    ts = type_size(t.type)
    if nbytes % ts:
        return None
    return nbytes // ts * block_size(t.type)


def _base_offs(t: Tensor) -> int:
    return t.view_offs if t.view_src is not None else 0


def _clip(rs: Rounds, start: int, length: int) -> Rounds:
    """The rounds of the flat window [start, start+length) of one block."""
    out: Rounds = []
    pos = 0
    end = start + length
    for vec, c in rs:
        width = sum(vec)
        for _ in range(c):
            if pos + width <= start:
                pos += width
                continue
            if pos >= end:
                break
            clipped = []
            p = pos
            for x in vec:
                lo, hi = max(p, start), min(p + x, end)
                clipped.append(max(0, hi - lo))
                p += x
            out.append((tuple(clipped), 1))
            pos += width
        if pos >= end:
            break
    return _merge(out)


def _contiguous_prefix(node: Tensor) -> int:
    """The last dim d such that view dims 0..d are laid out contiguously (size-1 dims pass)."""
    try:
        cnb = contiguous_nb(node.type, node.ne)
    except ValueError:
        return -1
    d = -1
    for i in range(4):
        if node.ne[i] == 1 or node.nb[i] == cnb[i]:
            d = i
        else:
            break
    return d


def _outer_dims_step_rows(node: Tensor, first: int, row_bytes: int) -> bool:
    return all(node.ne[i] == 1 or (row_bytes and node.nb[i] % row_bytes == 0) for i in range(first, 4))


def _window_view(node, src, st, rel) -> ViewAnalysis:
    a = st.axis
    row_bytes = src.nb[a + 1] if a < 3 else src.nb[3] * src.ne[3]
    inner = _inner(src.ne, a)
    rowlen = inner * src.ne[a]
    outer_rows, w = divmod(rel, row_bytes)
    start = _bytes_to_elements(src, w)
    if start is None:
        raise ViewError(f"offset {rel} is not on an element boundary")
    d = _contiguous_prefix(node)
    if d < 0:
        raise ViewError("the view's inner dims are not contiguous")
    length = math.prod(node.ne[: d + 1])
    if not _outer_dims_step_rows(node, d + 1, row_bytes):
        raise ViewError("the view's outer dims do not step whole rows of the split source")
    row_rounds = rounds(st, inner)
    if length <= rowlen:
        if start + length > rowlen:
            raise ViewError("the window crosses a row of the split source")
        rs = _clip(row_rounds, start, length)
    else:
        if start or length % rowlen:
            raise ViewError("the window spans a partial row of the split source")
        rs = _merge(row_rounds * (length // rowlen))
    out = reshape_state(rs, node.ne, max_dim=d) if rs else None
    if out is None:
        raise ViewError(f"the window cannot be split along a dim of {list(node.ne)} without cutting a device's chunk")
    return ViewAnalysis(out, "window", a, out.axis, d, row_bytes, outer_rows, start, 0, row_rounds)


def _direct_view(node, src, st, rel) -> ViewAnalysis:
    a = st.axis
    step = src.nb[a]
    row_bytes = src.nb[a + 1] if a < 3 else src.nb[3] * src.ne[3]
    dims = [i for i in range(4) if node.ne[i] > 1 and node.nb[i] == step]
    if len(dims) != 1:
        raise ViewError("no view dim walks the split axis")
    i = dims[0]
    if any(node.ne[k] > 1 and node.nb[k] >= step for k in range(i)):
        raise ViewError("the view's inner dims leave one position of the split axis")
    if not _outer_dims_step_rows(node, i + 1, row_bytes):
        raise ViewError("the view's outer dims do not step whole rows of the split source")
    outer_rows, w = divmod(rel, row_bytes)
    p0, within = divmod(w, step)
    span = sum((node.ne[k] - 1) * node.nb[k] for k in range(i)) + type_size(node.type)
    if within + span > step or p0 + node.ne[i] > src.ne[a]:
        raise ViewError("the view leaves the split source")
    pos_rounds = rounds(st)
    rs = _clip(pos_rounds, p0, node.ne[i])
    out = _from_rounds(i, rs)
    return ViewAnalysis(out, "direct", a, i, i, row_bytes, outer_rows, p0, within, pos_rounds)


def analyze_view(node: Tensor, src: Tensor, st: SplitState) -> ViewAnalysis:
    """The view's state and the numbers lowering needs; raises ViewError for windows that
    cannot be expressed per device."""
    if not st.is_split:
        return ViewAnalysis(st)
    rel = node.view_offs - _base_offs(src)
    if node.ne == src.ne and node.nb == src.nb and rel == 0:
        return ViewAnalysis(st, identical=True)
    if src.nb != contiguous_nb(src.type, src.ne):
        raise ViewError(f"views into the non-contiguous split tensor {src.name!r} are not supported; "
                        f"make it contiguous first")
    try:
        return _window_view(node, src, st, rel)
    except ViewError as first:
        try:
            return _direct_view(node, src, st, rel)
        except ViewError:
            raise first from None


def local_start(row_rounds: Rounds, start: int, j: int) -> int:
    """How many of device j's elements precede flat position `start` in a source row."""
    n = 0
    pos = 0
    for vec, c in row_rounds:
        for _ in range(c):
            for k, x in enumerate(vec):
                if pos >= start:
                    return n
                if k == j:
                    n += max(0, min(x, start - pos))
                pos += x
    return n


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
        return _from_rounds(0, rounds(w))           # column parallel: output rows follow W's columns
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
        return _from_rounds(0, rounds(w))
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


RULES: dict[Op, Rule] = {
    Op.NONE: rule_leaf,
    Op.GET_ROWS: rule_get_rows,
    Op.RMS_NORM: rule_per_row,
    Op.NORM: rule_per_row,
    Op.ADD: rule_binary,
    Op.MUL: rule_binary,
    Op.DIV: rule_binary,
    Op.ADD_ID: rule_add_id,
    Op.SCALE: rule_scale,
    Op.MUL_MAT: rule_mul_mat,
    Op.MUL_MAT_ID: rule_mul_mat_id,
    Op.RESHAPE: rule_reshape,
    Op.VIEW: rule_view,
    Op.PERMUTE: rule_permute,
    Op.TRANSPOSE: rule_transpose,
    Op.CONT: rule_cont,
    Op.CPY: rule_cpy,
    Op.SET_ROWS: rule_set_rows,
    Op.ROPE: rule_rope,
    Op.FLASH_ATTN_EXT: rule_flash_attn,
    Op.SOFT_MAX: rule_soft_max,
    Op.GLU: rule_glu,
    Op.UNARY: rule_unary,
    Op.ARGSORT_TOP_K: rule_top_k,
    Op.SUM_ROWS: rule_sum_rows,
}


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


def owner_only(st: SplitState | None) -> int | None:
    """The device holding a split tensor entirely (all others hold nothing), else None."""
    if st is None or not st.is_split:
        return None
    holders = [j for j, e in enumerate(st.extents()) if e]
    return holders[0] if len(holders) == 1 else None


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
