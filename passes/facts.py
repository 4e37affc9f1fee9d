"""Facts about a Plan that every backend needs and none may re-derive on its own.

Which subgraph a node runs in, who reads a tensor (directly or through views), whether a
weight is read only as a matmul's weight, which nodes hold the same value on every device,
and when one node may run inside another's launch. Computed once per Plan, read-only.
This is analysis of a Plan (data), so it lives with the passes; backends read it from here
(`Plan.facts`), and passes never import backends.
"""

from __future__ import annotations

from functools import cached_property
from typing import TYPE_CHECKING

from metatp.ir.ops import OPS, Op
from metatp.ir.tensor import Flag, Tensor

if TYPE_CHECKING:                   # plan.py builds PlanFacts: a runtime import would be a cycle
    from metatp.passes.plan import Plan

__all__ = ["PlanFacts", "is_pure_view"]


def is_pure_view(node: Tensor) -> bool:
    """A node that only re-interprets memory (no launch); CPY and SET_ROWS write, so they run."""
    return OPS[node.op].is_pure_view


class PlanFacts:
    """Graph facts of one Plan (lazily computed, cached)."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.graph = plan.graph

    # ---------------------------------------------------------------- structure
    @cached_property
    def sub_of(self) -> dict[Tensor, int]:
        """Node -> index of the subgraph that runs it."""
        nodes = self.graph.nodes
        return {nodes[i]: k for k, sub in enumerate(self.plan.subgraphs) for i in range(sub.start, sub.end + 1)}

    @cached_property
    def readers(self) -> dict[Tensor, list[Tensor]]:
        """Tensor -> the nodes that take it as a source (not counting views of it)."""
        return self.graph.consumers()

    @cached_property
    def readers_with_views(self) -> dict[Tensor, list[Tensor]]:
        """Tensor -> the nodes that read it, as a source or as the memory of a view."""
        out = {t: list(rs) for t, rs in self.readers.items()}
        for n in self.graph.nodes:
            if n.view_src is not None and n not in out.get(n.view_src, []):
                out.setdefault(n.view_src, []).append(n)
        return out

    @cached_property
    def reduced(self) -> set[Tensor]:
        """Nodes all-reduced in place at the end of their subgraph."""
        nodes = self.graph.nodes
        return {nodes[r.node] for r in self.plan.reductions}

    # ---------------------------------------------------------------- weights
    def only_src0_of(self, t: Tensor, ops: tuple[Op, ...], matrix_ops: tuple[Op, ...] | None = None) -> bool:
        """Is weight `t` read only, unviewed, as src0 of one of `ops` (and nowhere else by those
        nodes)? `matrix_ops`: the ops that need `t` 2-D (default: all of `ops`). Such a weight
        may be stored in a form only those kernels read (codes, raw blocks, a transposed copy)."""
        if not (t.flags & Flag.WEIGHT):
            return False
        matrix_ops = ops if matrix_ops is None else matrix_ops
        readers = self.readers_with_views.get(t, [])
        if not readers:
            return False
        flat = t.ne[2] == 1 and t.ne[3] == 1
        for n in readers:
            if n.view_src is t or n.op not in ops or n.src[0] is not t or any(s is t for s in n.src[1:]):
                return False
            if n.op in matrix_ops and not flat:
                return False
        return True

    # ---------------------------------------------------------------- fusion legality
    def fusable(self, t: Tensor, other: Tensor) -> bool:
        """May `t` be computed inside a launch placed at `other`'s position? Same subgraph, the
        same devices compute both, and `t` needs no buffer of its own (not an output, not
        reduced, not a partial sum, not zero-filled)."""
        tp, op = self.plan.of(t), self.plan.of(other)
        return (not (t.flags & Flag.OUTPUT) and t.op is not Op.NONE and t not in self.reduced
                and self.sub_of.get(t) == self.sub_of.get(other)
                and not tp.state.is_partial and list(tp.compute) == list(op.compute)
                and not (tp.zero_fill and any(tp.zero_fill)))

    def sole_reader(self, t: Tensor, consumer: Tensor) -> bool:
        """`t` feeds only `consumer` and may be fused into it."""
        return self.readers.get(t) == [consumer] and self.fusable(t, consumer)

    def uses_after(self, t: Tensor, index: int) -> bool:
        """Every reader of `t` (following views) comes after graph position `index`."""
        idx = self.graph.index
        todo, seen = [t], set()
        while todo:
            cur = todo.pop()
            for r in self.readers.get(cur, []):
                if r in seen:
                    continue
                seen.add(r)
                if is_pure_view(r):
                    todo.append(r)
                elif idx[r] <= index:
                    return False
        return True

    def read_after(self, x: Tensor, node: Tensor) -> bool:
        """Is `x` (or the memory it views) read by a node after `node`? Then its buffer is
        still live at `node`, and a launch there may read it."""
        root = x.view_src or x
        if root.op is Op.NONE:
            return True                   # leaves live for the whole step
        idx = self.graph.index
        return any(idx[r] > idx[node] for r in self.readers.get(x, []) + self.readers.get(root, []))

    # ---------------------------------------------------------------- mirrored values
    def shared_mirrored(self) -> set[Tensor]:
        """Nodes whose value is bit-identical on every device: mirrored, computed everywhere, and
        reading only such values, mirrored leaves (not the KV cache) or all-reduced nodes. One
        device may compute them for all devices that share memory."""
        plan = self.plan
        same: set[Tensor] = {t for t in self.graph.leaves
                             if plan.of(t).state.is_mirrored and not (t.flags & Flag.KV_CACHE)}
        shared: set[Tensor] = set()
        for node in self.graph.nodes:
            tp = plan.of(node)
            if node.op in (Op.SET_ROWS, Op.CPY) or not (tp.state.is_mirrored and tp.sync_state.is_mirrored):
                continue
            if not all(tp.compute) or (node.view_src is not None and node.view_src not in same):
                continue
            if all(s is None or s in same or s in self.reduced for s in node.src):
                same.add(node)
                shared.add(node)
        return shared

    def late_reads(self, shared: set[Tensor]) -> dict[Tensor, int]:
        """Shared node -> the last node index of the subgraph of its last reader: the device
        that computes it for the others must keep it until they have run that subgraph."""
        end_of = {}
        for sub in self.plan.subgraphs:
            for i in range(sub.start, sub.end + 1):
                end_of[i] = sub.end
        late: dict[Tensor, int] = {}
        for i, node in enumerate(self.graph.nodes):
            for s in node.src:
                root = (s.view_src or s) if s is not None else None
                if root in shared:
                    late[root] = max(late.get(root, -1), end_of[i])
        return late
