"""Fusions: several nodes of a Plan run as one launch, chosen once per plan, the same way for
every backend.

A backend's executable lists its finders (one per kind of fusion its kernels implement, in
priority order); `select` runs them over the graph and keeps the first fusion that claims a
node (a node joins one fusion at most). What is legal to fuse at all (same subgraph, same
devices, no buffer of its own needed) is `PlanFacts`'; what a kernel can take (weight
layouts, token counts, what must stay live) is the backend's, given as a predicate.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

from metatp.backends.analysis import PlanFacts
from metatp.ir.ops import Op
from metatp.ir.tensor import Flag, Tensor

__all__ = ["FusionKind", "Fusion", "Finder", "select", "norm_times_weight", "norm_weight_fusion", "matmuls_of_x",
           "matmul_group_fusion", "later_partners"]


class FusionKind(str, enum.Enum):
    """The fusions backends' kernels implement (a backend runs the kinds its table holds).

    Declared in priority order: the CUDA backend runs its finders in this order, and an earlier
    kind's fusion wins a node (a new kind goes where it should claim nodes)."""

    MATVEC_GLU = "matvec_glu"           # GLU(gate matvec, up matvec) (+ the folded RMS norm)
    MATVEC_ADD = "matvec_add"           # ADD(matvec, residual or bias): the add in the epilogue
    QKV_ROPE_KV = "qkv_rope_kv"         # one token: (RMS norm +) q/k/v matvecs + RoPE of q, k + K/V cache rows
    MATVEC_MULTI = "matvec_multi"       # up to three matvecs of one x (q, k, v) (+ the folded RMS norm)
    NORM = "norm"                       # MUL(RMS_NORM / NORM (x), w): one norm x weight kernel
    ROPE_PAIR = "rope_pair"             # ROPE of Q and K with the same positions
    SET_ROWS_PAIR = "set_rows_pair"     # SET_ROWS of K and V with the same rows
    MATMUL_GROUP = "matmul_group"       # the MUL_MATs of one x (q, k, v; gate, up) at any token count


@dataclass
class Fusion:
    """Nodes run as one launch at `at`'s position; `absorbed` nodes get no launch of their own.

    Memory rules that keep the arena allocator's view (computed from the unfused graph) true:
    an input read later than its last unfused reader is kept alive (`keep`), and an output
    written before its own node gets memory of its own (`detach`) or its arena buffer from `at`'s
    position on (`early`)."""

    kind: FusionKind
    at: Tensor
    absorbed: tuple[Tensor, ...]
    keep: tuple[Tensor, ...] = ()
    detach: tuple[Tensor, ...] = ()
    parts: dict = field(default_factory=dict)
    early: tuple[Tensor, ...] = ()

    @property
    def members(self) -> tuple[Tensor, ...]:
        return (self.at, *self.absorbed)


# A finder: (executable, node, nodes already taken) -> the fusions found at this node.
Finder = Callable[[Any, Tensor, set], Iterable[Fusion]]


def select(ex: Any, finders: Sequence[Finder]) -> list[Fusion]:
    """Every fusion the finders find on `ex.plan`, finder by finder, node by node; a node
    joins one fusion at most (earlier finders, and earlier nodes, win)."""
    found: list[Fusion] = []
    taken: set[Tensor] = set()
    for find in finders:
        for node in ex.plan.graph.nodes:
            for f in find(ex, node, taken) or ():
                if any(m in taken for m in f.members):
                    continue
                taken.update(f.members)
                found.append(f)
    return found


def norm_times_weight(facts: PlanFacts, node: Tensor, norms: tuple[Op, ...] = (Op.RMS_NORM,)) -> Tensor | None:
    """The norm node when `node` is MUL(norm(x), w), w a weight row [ne0], and the norm feeds
    only this MUL and may be computed inside its launch (`PlanFacts.sole_reader`); else None."""
    if node.op is not Op.MUL:
        return None
    norm, w = node.src[0], node.src[1]
    if norm.op not in norms or not (w.flags & Flag.WEIGHT) or w.ne != (norm.ne[0], 1, 1, 1):
        return None
    return norm if facts.sole_reader(norm, node) else None


def norm_weight_fusion(ex: Any, node: Tensor, norms: tuple[Op, ...],
                       keep_for: Callable[[Tensor, Tensor], tuple[Tensor, ...] | None]) -> list[Fusion]:
    """MUL(norm(x), w) as one norm x weight launch at the MUL (the norm's buffer is never
    written). `keep_for(mul, norm)`: the backend's word on it, None to refuse, else the tensors
    to keep alive up to the MUL (x, when nothing reads it later and the backend may keep it)."""
    norm = norm_times_weight(ex.facts, node, norms)
    if norm is None:
        return []
    keep = keep_for(node, norm)
    if keep is None:
        return []
    return [Fusion(FusionKind.NORM, node, (norm,), keep=keep, parts={"norm": norm})]


def matmuls_of_x(facts: PlanFacts, x: Tensor, taken: set, accept: Callable[[Tensor], bool]) -> list[Tensor]:
    """The MUL_MATs that multiply x (as src1) and `accept` takes, in graph order, keeping after
    the first only those that may run in a launch at its position (`PlanFacts.fusable`)."""
    idx = facts.graph.index
    mms = sorted((r for r in facts.readers.get(x, []) if r.op is Op.MUL_MAT and r.src[1] is x
                  and r not in taken and accept(r)), key=lambda r: idx[r])
    return mms[:1] + [r for r in mms[1:] if facts.fusable(r, mms[0])]


def matmul_group_fusion(facts: PlanFacts, x: Tensor, taken: set, accept: Callable[[Tensor], bool],
                        most: int) -> list[Fusion]:
    """The MUL_MATs of one x (`matmuls_of_x`) in groups of up to `most`, each run as one launch
    at its first member's position; the later members' outputs are written early, so their arena
    buffers live from there (`early`: memory of their own cost a 512-token pass 9x the
    activation memory, 123 against 13.5 MiB)."""
    mms = matmuls_of_x(facts, x, taken, accept)
    idx = facts.graph.index
    out = []
    for i in range(0, len(mms), most):
        g = mms[i:i + most]
        if len(g) > 1 and all(facts.uses_after(m, idx[g[0]]) for m in g[1:]):
            out.append(Fusion(FusionKind.MATMUL_GROUP, g[0], tuple(g[1:]), early=tuple(g[1:]),
                              parts={"members": tuple(g)}))
    return out


def later_partners(facts: PlanFacts, node: Tensor, taken: set) -> Iterable[Tensor]:
    """Later nodes of `node`'s op reading the same src[1] (positions, row indices) as `node`,
    not yet taken: the candidates to pair with it in one launch (Q and K ropes, K and V stores)."""
    idx = facts.graph.index
    for other in facts.readers.get(node.src[1], []):
        if other is not node and other.op is node.op and other not in taken and idx[other] > idx[node] \
                and other.src[1] is node.src[1]:
            yield other
