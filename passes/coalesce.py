"""Delayed-reduction coalescing: one all-reduce where several PARTIAL values meet.

Requires: propagated `States` (both views) for the graph; `partial_nodes` lists the roots.
Ensures: chains that cover every PARTIAL node exactly once, in ascending sink order, that do
not overlap, and whose sink is not a view; no node outside a chain reads a member's value.

Starting from a PARTIAL node, the pass walks forward and *adopts* every node that reads an
un-reduced (pending) value and is linear in it, with its other operands MIRRORED. Which ops are
linear in what is each op's `linear_in` in `passes.rules.OP_RULES`; today:
- ADD of pending values and PARTIAL leaves (expert bias; two partial branches, e.g. the
  parallel residual attn_out + ffn_out);
- ADD_ID with a PARTIAL (or pending) bias and MIRRORED ids;
- MUL by a MIRRORED tensor (chains of them), DIV by one, SCALE without offset;
- views (VIEW/RESHAPE/PERMUTE/TRANSPOSE), CONT, GET_ROWS with MIRRORED ids, SUM_ROWS,
  ROPE, MUL_MAT with a MIRRORED other operand.
That covers llama.cpp's get_i_delayed patterns (ADD_ID, MUL chains, the expert-sum VIEW x n +
ADD x (n-1)) and merges of separate PARTIAL branches: a PARTIAL node met on the way that does not
read a pending value is adopted as a further root, to be summed in later.

Safety, by construction rather than by pattern:
- a node that reads a pending value but is not adoptable ends the walk, so nothing outside the
  chain ever reads an un-reduced value (use counts are tracked per tensor, including views);
- the chain is cut back to the last point where exactly one pending value is still read later
  (or is a graph output) and that value is not a view: that is the sink, reduced in place;
- nodes in the range that do not read pending values are computed as usual on every device
  (see partition.py: they are never disabled by the chain, so MIRRORED values cannot go stale).
"""

from __future__ import annotations

from metatp.ir.errors import SplitError
from metatp.ir.graph import Graph
from metatp.ir.ops import Op
from metatp.ir.tensor import Tensor
from metatp.passes.partition import Chain, is_view_node, partial_nodes
from metatp.passes.propagate import States
from metatp.passes.rules import OP_RULES

__all__ = ["coalesce", "grow_chain", "adoptable"]


class _ChainOperands:
    """`rules.Operands` for a chain being grown: which sources are pending, mirrored, PARTIAL leaves."""

    def __init__(self, st: States, pending: set[Tensor]) -> None:
        self.st = st
        self.pending_set = pending

    def pending(self, s: Tensor | None) -> bool:
        return s is not None and s in self.pending_set

    def mirrored(self, s: Tensor | None) -> bool:
        return s is not None and s not in self.pending_set and self.st.sync[s].is_mirrored

    def partial_leaf(self, s: Tensor | None) -> bool:
        return s is not None and s.op is Op.NONE and self.st.state[s].is_partial


def adoptable(c: Tensor, st: States, pending: set[Tensor]) -> bool:
    """Can `c`, which reads at least one pending value, compute on un-reduced data?

    The op's `linear_in` row in `rules.OP_RULES` decides; an op without one ends the chain."""
    if not st.state[c].is_mirrored:       # consumers-view result must be MIRRORED (all inputs M / bias)
        return False
    rule = OP_RULES.get(c.op)
    if rule is None or rule.linear_in is None:
        return False
    return rule.linear_in(c, _ChainOperands(st, pending))


def grow_chain(graph: Graph, st: States, i: int, roots_left: set[int]) -> Chain:
    """The longest safe chain starting at PARTIAL node i (see the module docstring)."""
    nodes = graph.nodes
    uc = graph.use_count
    outputs = set(graph.outputs)
    root = nodes[i]
    pending: set[Tensor] = {root}
    remaining: dict[Tensor, int] = {root: uc.get(root, 0)}
    members = [i]
    roots = [i]
    best = (1, 1) if not is_view_node(root) else None   # (len(members), len(roots)) at the last safe sink

    def is_open(t: Tensor) -> bool:
        return remaining[t] > 0 or t in outputs or uc.get(t, 0) == 0

    n_open = 1
    live = 1 if remaining[root] > 0 else 0                 # pending values that still have readers
    k = i + 1
    while k < len(nodes) and live > 0:
        c = nodes[k]
        reads = [s for s in c.src if s is not None and s in pending]
        if not reads:
            if k in roots_left:                            # another PARTIAL branch: try to merge it in
                pending.add(c)
                remaining[c] = uc.get(c, 0)
                members.append(k)
                roots.append(k)
                n_open += 1
                live += remaining[c] > 0
            k += 1
            continue
        if not adoptable(c, st, pending):
            break
        for s in c.src:
            if s is not None and s in pending:
                was_open, was_live = is_open(s), remaining[s] > 0
                remaining[s] -= 1
                n_open -= was_open and not is_open(s)
                live -= was_live and remaining[s] == 0
        pending.add(c)
        remaining[c] = uc.get(c, 0)
        members.append(k)
        n_open += is_open(c)
        live += remaining[c] > 0
        if n_open == 1 and not is_view_node(c):
            best = (len(members), len(roots))
        k += 1
    if best is None:
        raise SplitError(f"{root.op.name} node {root.name!r}: a PARTIAL view cannot be reduced in place and no "
                         f"linear consumer makes a copy of it; add a cont")
    n_members, n_roots = best
    members = members[:n_members]
    return Chain(roots[:n_roots], members, members[-1])


def coalesce(graph: Graph, st: States) -> list[Chain]:
    """Chains covering every PARTIAL node, each as long as is safe."""
    roots_left = set(partial_nodes(graph, st))
    chains = []
    for i in sorted(roots_left):
        if i not in roots_left:
            continue
        ch = grow_chain(graph, st, i, roots_left - {i})
        for r in ch.roots:
            roots_left.discard(r)
        chains.append(ch)
    return chains
