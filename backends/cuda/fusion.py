"""Which nodes of a Plan run as one CUDA launch, found once per plan in priority order.

A fusion runs several nodes as one launch at the position of one of them (`at`); the others
get no launch (`absorbed`). Two memory rules keep the arena allocator's view (computed from the
unfused graph) true: an input read later than its last unfused reader is kept alive (`keep`,
decode-sized tensors only), and an output written earlier than its own node gets memory of
its own (`detach`). Legality (same subgraph, same devices, no buffer of its own needed) is
`PlanFacts`'; what a kernel can take (weight layouts, token counts) is decided here. Together
they cut a llama decode layer to 8 launches.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from metatp.backends.cuda import kernels as ck
from metatp.backends.cuda.ops import weight_operand
from metatp.backends.cuda.storage import RawWeight, matmul_tokens
from metatp.backends.fusion import Fusion, FusionKind, matmuls_of_x, norm_weight_fusion, select
from metatp.ir.ops import Op
from metatp.ir.tensor import Flag, GGMLType, Tensor

if TYPE_CHECKING:
    from metatp.backends.cuda.executable import CupyExecutable

__all__ = ["NORM_FOLD_MAX_ROWS", "find_fusions"]

# Folding an RMS norm into a matvec makes every block recompute the norm of x: worth one
# launch for q/k/v or gate/up, not for a 49k-row lm head (thousands of blocks).
NORM_FOLD_MAX_ROWS = 8192


def find_fusions(ex: CupyExecutable) -> list[Fusion]:
    """Every fusion of the plan; a node joins one fusion at most (earlier finders win)."""
    return select(ex, (_glu_fusion, _add_fusion, _multi_fusions, _norm_fusion, _rope_pair_fusion,
                       _set_rows_pair_fusion))


def _norm_of(ex: CupyExecutable, x: Tensor, readers: set[Tensor]) -> tuple[Tensor, Tensor] | None:
    """(MUL node, RMS_NORM node) when x = RMS_NORM(x0) * w (w a weight row) and exactly
    `readers` read x: the norm can be folded into their matvec prologue."""
    if x.op is not Op.MUL or set(ex.facts.readers.get(x, [])) != readers:
        return None
    rms, w = x.src[0], x.src[1]
    if rms.op is not Op.RMS_NORM or not (w.flags & Flag.WEIGHT) or w.ne != (rms.ne[0], 1, 1, 1):
        return None
    if rms.ne[1] * rms.ne[2] * rms.ne[3] != 1 or not ex.facts.sole_reader(rms, x):
        return None
    if any(isinstance(ex.arrays[d][w], RawWeight) for d in ex.devices):
        return None
    if not all(ex.facts.fusable(x, r) for r in readers):
        return None
    return x, rms


def _is_matvec(ex: CupyExecutable, mm: Tensor) -> bool:
    if mm.op is not Op.MUL_MAT:
        return False
    w = mm.src[0]
    return (bool(w.flags & Flag.WEIGHT) and w.view_src is None
            and w.ne[2] == 1 and w.ne[3] == 1
            and matmul_tokens(mm) <= ck.MATVEC_MAX_TOKENS)


def _same_weight_layout(ex: CupyExecutable, weights: Sequence[Tensor]) -> bool:
    for d in ex.devices:
        ops_ = [weight_operand(ex, d, w) for w in weights]
        ne0 = {ex.plan.of(w).local[d].ne[0] for w in weights}
        if len({o[1] for o in ops_}) != 1 or len(ne0) != 1:
            return False
    return True


def _glu_fusion(ex: CupyExecutable, node: Tensor, taken) -> list[Fusion]:
    """GLU(MUL_MAT(Wg, x), MUL_MAT(Wu, x)) for one token -> one matvec_glu launch at the
    GLU (with x's RMS norm folded in when only gate and up read it)."""
    if node.op is not Op.GLU or len(node.src) != 2 or node.src[1] is None:
        return []
    gate, up = node.src
    if not (_is_matvec(ex, gate) and _is_matvec(ex, up)) or matmul_tokens(gate) != 1:
        return []
    if gate.src[1] is not up.src[1] or gate is up or gate.src[0].ne != up.src[0].ne:
        return []
    if not (ex.facts.sole_reader(gate, node) and ex.facts.sole_reader(up, node)):
        return []
    if not _same_weight_layout(ex, [gate.src[0], up.src[0]]):
        return []
    x = gate.src[1]
    norm = _norm_of(ex, x, {gate, up}) if _group_rows(ex, [gate]) <= NORM_FOLD_MAX_ROWS else None
    if norm is not None:
        return [Fusion(FusionKind.MATVEC_GLU, node, (gate, up, *norm), keep=(norm[1].src[0],),
                        parts={"gate": gate, "up": up, "norm": norm})]
    return [Fusion(FusionKind.MATVEC_GLU, node, (gate, up), keep=(x,), parts={"gate": gate, "up": up})]


def _add_fusion(ex: CupyExecutable, node: Tensor, taken) -> list[Fusion]:
    """ADD(mm, other) / ADD(other, mm) with other a residual of mm's shape or a bias row:
    the add rides in the matvec epilogue."""
    if node.op is not Op.ADD:
        return []
    for i in (0, 1):
        mm, other = node.src[i], node.src[1 - i]
        if mm is other or mm in taken or not _is_matvec(ex, mm) or not ex.facts.sole_reader(mm, node):
            continue
        if other.type == GGMLType.F32 and (other.ne == mm.ne or other.ne == (mm.ne[0], 1, 1, 1)):
            if not any(isinstance(ex.arrays[d].get(other), RawWeight) for d in ex.devices):
                return [Fusion(FusionKind.MATVEC_ADD, node, (mm,), keep=(mm.src[1],), parts={"mm": mm, "other": other})]
    return []


def _multi_fusions(ex: CupyExecutable, node: Tensor, taken) -> list[Fusion]:
    """The one-token MUL_MATs reading the same x (q, k, v) in groups of up to three, run at
    the first one's position (later ones' outputs detached); x's RMS norm folded in when
    only they read it. A lone matvec is fused only to fold a norm in (the lm head)."""
    idx = ex.plan.graph.index
    readers = matmuls_of_x(ex.facts, node, taken, lambda r: _is_matvec(ex, r) and matmul_tokens(r) == 1)
    if not readers:
        return []
    if not _same_weight_layout(ex, [r.src[0] for r in readers]):
        return []
    norm = _norm_of(ex, node, set(readers)) if len(readers) <= 3 else None
    if norm is not None and _group_rows(ex, readers) > NORM_FOLD_MAX_ROWS:
        norm = None
    groups = [readers[i:i + 3] for i in range(0, len(readers), 3)]
    out = []
    for g in groups:
        if len(g) == 1 and norm is None:
            continue
        if any(not ex.facts.uses_after(m, idx[g[0]]) for m in g[1:]):
            continue
        absorbed = tuple(g[1:]) + (tuple(norm) if norm is not None else ())
        keep = (norm[1].src[0],) if norm is not None else ()
        out.append(Fusion(FusionKind.MATVEC_MULTI, g[0], absorbed, keep=keep, detach=tuple(g[1:]),
                           parts={"members": tuple(g), "norm": norm}))
    return out


def _group_rows(ex: CupyExecutable, mms: Sequence[Tensor]) -> int:
    """Output rows of a group of matvecs on the busiest device."""
    return max(sum(ex.plan.of(mm.src[0]).local[d].ne[1] for mm in mms) for d in ex.devices)


def _norm_fusion(ex: CupyExecutable, node: Tensor, taken) -> list[Fusion]:
    """MUL(RMS_NORM(x) or NORM(x), w) with w a weight row [ne0] (as the numpy backend fuses)."""
    return norm_weight_fusion(ex, node, (Op.RMS_NORM, Op.NORM), lambda mul, norm: _norm_keep(ex, mul, norm))


def _norm_keep(ex: CupyExecutable, node: Tensor, norm_node: Tensor) -> tuple[Tensor, ...] | None:
    """What the norm x weight kernel needs kept alive: x, when nothing reads it after the MUL
    (not for a prefill-sized x); None when the kernel cannot take the weight (raw blocks)."""
    w = node.src[1]
    if any(isinstance(ex.arrays[d][w], RawWeight) for d in ex.devices):
        return None
    x = norm_node.src[0]
    x_root = x.view_src or x
    keep: tuple[Tensor, ...] = ()
    if x_root.op is not Op.NONE and not ex.facts.uses_after(x_root, ex.plan.graph.index[node]):
        keep = (x_root,)
        if norm_node.ne[1] * norm_node.ne[2] * norm_node.ne[3] > ck.MATVEC_MAX_TOKENS:
            return None          # keeping a prefill-sized tensor alive costs more than the launch
    return keep


def _later_partners(ex: CupyExecutable, node: Tensor, taken):
    """Later nodes of the same op reading the same src[1] (positions / row indices) as `node`."""
    idx = ex.plan.graph.index
    for other in ex.facts.readers.get(node.src[1], []):
        if other is not node and other.op is node.op and other not in taken and idx[other] > idx[node] \
                and other.src[1] is node.src[1]:
            yield other


def _rope_pair_fusion(ex: CupyExecutable, node: Tensor, taken) -> list[Fusion]:
    """Two ROPEs with the same positions and parameters (Q and K of a layer) -> one launch at
    the later one."""
    if node.op is not Op.ROPE or node in taken:
        return []
    idx = ex.plan.graph.index
    for other in _later_partners(ex, node, taken):
        if other.params != node.params or other.src[2:] != node.src[2:] or node.ne[0] != other.ne[0]:
            continue
        if node.ne[2] != other.ne[2] or node.ne[3] != 1 or other.ne[3] != 1:
            continue
        if not ex.facts.fusable(node, other) or not ex.facts.uses_after(node, idx[other]):
            continue
        if node.ne[2] > ck.MATVEC_MAX_TOKENS:
            continue
        return [Fusion(FusionKind.ROPE_PAIR, other, (node,), keep=(node.src[0],), parts={"first": node})]
    return []


def _set_rows_pair_fusion(ex: CupyExecutable, node: Tensor, taken) -> list[Fusion]:
    """Two SET_ROWS with the same row indices into caches of one storage type (K and V of a
    layer) -> one launch at the later one."""
    if node.op is not Op.SET_ROWS or node in taken:
        return []
    for other in _later_partners(ex, node, taken):
        if node.src[0].ne[1] > ck.MATVEC_MAX_TOKENS or node.type != other.type:
            continue
        if list(ex.plan.of(node).compute) != list(ex.plan.of(other).compute):
            continue
        if ex.facts.sub_of.get(node) != ex.facts.sub_of.get(other) or not ex.facts.uses_after(node, ex.plan.graph.index[other]):
            continue
        if any(node.view_src is r or other.view_src is r for r in (node.src[0], other.src[0])):
            continue
        return [Fusion(FusionKind.SET_ROWS_PAIR, other, (node,), keep=(node.src[0],), parts={"first": node})]
    return []
