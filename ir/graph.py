"""A computation graph: nodes in topological order (like `ggml_cgraph`), leaves, use counts."""

from __future__ import annotations

from typing import Iterable, Sequence

from metatp.ir.ops import OPS, Op
from metatp.ir.tensor import Flag, Tensor

__all__ = ["Graph"]


class Graph:
    """Nodes reachable from `outputs`, sources before consumers, in build order.

    Invariants: every source of a node is either a leaf or an earlier node; `use_count[t]`
    is how many node source slots read `t` (views count as readers of their source).
    """

    def __init__(self, outputs: Sequence[Tensor], name: str = "graph", meta: dict | None = None) -> None:
        self.name = name
        self.meta = dict(meta or {})
        self.outputs = list(outputs)
        self.nodes: list[Tensor] = []
        self.leaves: list[Tensor] = []
        seen: set[int] = set()
        for out in self.outputs:
            self._visit(out, seen)
        self.index = {t: i for i, t in enumerate(self.nodes)}
        self.use_count: dict[Tensor, int] = {}
        for n in self.nodes:
            for s in n.src:
                if s is not None:
                    self.use_count[s] = self.use_count.get(s, 0) + 1
        for out in self.outputs:
            out.flags |= Flag.OUTPUT

    def _visit(self, root: Tensor, seen: set[int]) -> None:
        # iterative post-order DFS: sources in order, then the node (ggml_visit_parents)
        stack: list[tuple[Tensor, int]] = [(root, 0)]
        while stack:
            t, i = stack.pop()
            if t.id in seen:
                continue
            deps = [s for s in t.src if s is not None]
            if t.view_src is not None and t.view_src not in deps:
                deps.append(t.view_src)
            if i < len(deps):
                stack.append((t, i + 1))
                if deps[i].id not in seen:
                    stack.append((deps[i], 0))
                continue
            seen.add(t.id)
            if t.op is Op.NONE:
                self.leaves.append(t)
            else:
                self.nodes.append(t)

    def __len__(self) -> int:
        return len(self.nodes)

    def __iter__(self):
        return iter(self.nodes)

    def tensors(self) -> Iterable[Tensor]:
        yield from self.leaves
        yield from self.nodes

    def consumers(self) -> dict[Tensor, list[Tensor]]:
        """For each tensor, the nodes that read it (in graph order)."""
        out: dict[Tensor, list[Tensor]] = {}
        for n in self.nodes:
            for s in n.src:
                if s is not None:
                    out.setdefault(s, []).append(n)
        return out

    def ops_used(self) -> set[Op]:
        return {n.op for n in self.nodes}

    def to_networkx(self):
        """A networkx DiGraph: one node per tensor (keyed by name or id), edges source -> consumer."""
        import networkx as nx

        g = nx.DiGraph(name=self.name)
        key = {t: (t.name or f"#{t.id}") for t in self.tensors()}
        for t in self.tensors():
            g.add_node(key[t], op=t.op.name, ne=list(t.ne), type=t.type.name, leaf=t.op is Op.NONE,
                       view=OPS[t.op].is_view)
        for n in self.nodes:
            for s in n.src:
                if s is not None:
                    g.add_edge(key[s], key[n])
        return g

    def check(self) -> None:
        """Assert the invariants above (compile_stages runs it before the passes; O(nodes)):
        sources come before their readers, leaves are Op.NONE and nodes are not, and
        `use_count` counts every source slot."""
        pos = {t: i for i, t in enumerate(self.nodes)}
        leaves = set(self.leaves)
        uses: dict[Tensor, int] = {}
        for i, n in enumerate(self.nodes):
            if n.op is Op.NONE:
                raise AssertionError(f"leaf {n.name!r} is listed as a node")
            for s in n.src:
                if s is None:
                    continue
                uses[s] = uses.get(s, 0) + 1
                if s.op is Op.NONE:
                    if s not in leaves:
                        raise AssertionError(f"node {n.name!r} reads {s.name!r}, which is not a leaf of the graph")
                elif pos.get(s, len(self.nodes)) >= i:
                    raise AssertionError(f"node {n.name} reads {s.name} before it is computed")
        if any(t.op is not Op.NONE for t in self.leaves):
            raise AssertionError("a computed tensor is listed as a leaf")
        if uses != self.use_count:
            raise AssertionError("use_count does not match the nodes' sources")
