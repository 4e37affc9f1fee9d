"""Partition: where the all-reduces go, and which device computes which node.

A *chain* is what one all-reduce stands for: one or more PARTIAL nodes (its roots), the nodes
that compute on their un-reduced values (coalescing adds those; without it a chain is just its
root), and the sink, the chain's last node, whose buffer is all-reduced in place. The graph is
cut after every sink, so subgraph k ends with chain k's sink. Unlike llama.cpp, a PARTIAL
final node is reduced too.

Zero slices: a device whose slice of any split source (or of its own split result) is empty
does not compute the node. For chain values the device's contribution is then an exact zero:
a chain node whose un-reduced operands are all zero on a device is skipped there too, the
all-reduce fills zeros for a skipped sink (its `TensorPlan.compute`), and a skipped chain value that
a computing node on the same device still reads (two branches merged by an ADD, a bias owner)
is zero-filled by the backend (`TensorPlan.zero_fill`). Nodes in a chain's range that do not
read its un-reduced values are never disabled by the chain, so no MIRRORED value goes stale
(llama.cpp's skip_unrelated bug).

PARTIAL leaves (the expert down-projection bias): the full value lives on one owner device,
zeros elsewhere, so the reduced sum is exact whichever devices have empty slices. The owner is
the first device that computes every consumer anyway. A PARTIAL leaf read by a node that is
not linear in it inside a chain (the bias-add could not be delayed) is mirrored instead,
which is exact too (`partial_leaf_fixups`).

Requires: propagated `States` and chains (from `minimal_chains` or `passes.coalesce`) that do
not overlap. Ensures (`mark_compute`, `make_subgraphs`): a compute flag per tensor and device;
no non-chain node that is not split is skipped on any device (checked: `_check_no_stale_mirrors`);
contiguous subgraphs covering every node, each ending at a chain's sink with its Reduction.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from metatp.ir.errors import SplitError
from metatp.ir.graph import Graph
from metatp.ir.ops import OPS, Op
from metatp.ir.tensor import Tensor
from metatp.passes.plan import Reduction, Subgraph
from metatp.passes.propagate import States

__all__ = ["Chain", "Marks", "partial_nodes", "minimal_chains", "partial_leaves", "partial_leaf_fixups",
           "choose_owners", "mark_compute", "make_subgraphs", "is_view_node"]


@dataclass
class Chain:
    roots: list[int]                      # PARTIAL nodes this one reduction stands for
    members: list[int]                    # nodes computed on un-reduced values (roots included), ascending
    sink: int                             # the node whose buffer is all-reduced (== members[-1])

    @property
    def start(self) -> int:
        return self.members[0]


@dataclass
class Marks:
    compute: dict[Tensor, list[bool]]
    zero_fill: dict[Tensor, list[bool]] = field(default_factory=dict)


def is_view_node(t: Tensor) -> bool:
    return OPS[t.op].is_view


def partial_nodes(graph: Graph, st: States) -> list[int]:
    return [i for i, n in enumerate(graph.nodes) if st.state[n].is_partial]


def minimal_chains(graph: Graph, st: States) -> list[Chain]:
    """One chain per PARTIAL node, reduced right after it (no coalescing)."""
    chains = []
    for i in partial_nodes(graph, st):
        node = graph.nodes[i]
        if is_view_node(node):
            raise SplitError(f"{node.op.name} node {node.name!r}: a PARTIAL view cannot be reduced in place "
                             f"(it aliases {node.view_src.name!r}); copy it with cont first")
        chains.append(Chain([i], [i], i))
    return chains


def partial_leaves(graph: Graph, st: States) -> list[Tensor]:
    return [t for t in graph.leaves if st.state[t].is_partial]


def partial_leaf_fixups(graph: Graph, st: States, chains: list[Chain]) -> set[Tensor]:
    """PARTIAL leaves with a consumer that is neither in a chain nor itself PARTIAL (and so
    reduced): those must be mirrored for the result to stay exact."""
    members = {graph.nodes[i] for c in chains for i in c.members}
    bad = set()
    consumers = graph.consumers()
    for leaf in partial_leaves(graph, st):
        for c in consumers.get(leaf, []):
            if c not in members and not st.state[c].is_partial:
                bad.add(leaf)
                break
    return bad


def _zero_slice_compute(graph: Graph, st: States, n: int) -> dict[Tensor, list[bool]]:
    compute: dict[Tensor, list[bool]] = {}
    for t in graph.leaves:
        s = st.state[t]
        compute[t] = [s.extent(j) > 0 for j in range(n)] if s.is_split else [True] * n
    for node in graph.nodes:
        c = [True] * n
        for s in (*node.src, node):
            if s is None:
                continue
            ss = st.sync[s] if s is not node else st.state[s]
            if ss.is_split:
                for j in range(n):
                    if ss.extent(j) == 0:
                        c[j] = False
        compute[node] = c
    return compute


def _chain_zeros(graph: Graph, st: States, chain: Chain, compute, owners: dict[Tensor, int], n: int):
    """Per member and device: is the un-reduced value an exact zero there (nothing computed)?"""
    nodes = graph.nodes
    members = {nodes[i] for i in chain.members}
    roots = set(chain.roots)
    zero: dict[Tensor, list[bool]] = {}
    for i in chain.members:
        node = nodes[i]
        if i in roots:
            zero[node] = [not x for x in compute[node]]
            continue
        pend = [s for s in node.src if s is not None and s in members]
        leaves = [s for s in node.src if s is not None and s.op is Op.NONE and st.state[s].is_partial]
        z = [all(zero[s][j] for s in pend) and all(owners.get(lf, 0) != j for lf in leaves) for j in range(n)]
        zero[node] = z
        compute[node] = [not x for x in z]
    return zero


def choose_owners(graph: Graph, st: States, chains: list[Chain], n: int) -> dict[Tensor, int]:
    """For each PARTIAL leaf, the first device that computes all its consumers without it."""
    leaves = partial_leaves(graph, st)
    if not leaves:
        return {}
    compute = _zero_slice_compute(graph, st, n)
    no_owner = {lf: -1 for lf in leaves}
    for ch in chains:
        _chain_zeros(graph, st, ch, compute, no_owner, n)
    consumers = graph.consumers()
    owners = {}
    for lf in leaves:
        cons = consumers.get(lf, [])
        ok = [j for j in range(n) if all(compute[c][j] for c in cons)]
        owners[lf] = ok[0] if ok else 0
    return owners


def mark_compute(graph: Graph, st: States, chains: list[Chain], owners: dict[Tensor, int], n: int) -> Marks:
    """compute / zero_fill flags for every tensor and device (see the module docstring)."""
    compute = _zero_slice_compute(graph, st, n)
    zero_fill: dict[Tensor, list[bool]] = {}
    nodes = graph.nodes
    for ch in chains:
        zero = _chain_zeros(graph, st, ch, compute, owners, n)
        members = {nodes[i] for i in ch.members}
        needed = {nodes[i]: [False] * n for i in ch.members}
        for i in reversed(ch.members):
            node = nodes[i]
            if is_view_node(node):
                compute[node] = [not zero[node][j] or needed[node][j] for j in range(n)]
            elif any(needed[node][j] and not compute[node][j] for j in range(n)):
                zero_fill[node] = [needed[node][j] and not compute[node][j] for j in range(n)]
            for s in node.src:
                if s is not None and s in members:
                    for j in range(n):
                        if compute[node][j]:
                            needed[s][j] = True
    _check_no_stale_mirrors(graph, st, chains, compute)
    return Marks(compute, zero_fill)


def _check_no_stale_mirrors(graph: Graph, st: States, chains: list[Chain], compute) -> None:
    members = {graph.nodes[i] for ch in chains for i in ch.members}
    for node in graph.nodes:
        if node in members or st.state[node].is_split:
            continue
        if not all(compute[node]):
            raise SplitError(f"internal: {node.op.name} node {node.name!r} is {st.state[node]} but some device would "
                             f"skip it (compute={compute[node]}); its value there would be stale")


def make_subgraphs(graph: Graph, chains: list[Chain], compute: dict[Tensor, list[bool]]) -> list[Subgraph]:
    """Contiguous node ranges, each ending with a chain's sink and its all-reduce."""
    subs = []
    start = 0
    for ch in sorted(chains, key=lambda c: c.sink):
        if ch.start < start:
            raise SplitError(f"internal: overlapping reduction chains at node {ch.start}")
        sink = graph.nodes[ch.sink]
        red = Reduction(ch.sink, list(ch.roots), sink.nbytes)
        subs.append(Subgraph(start, ch.sink, red))
        start = ch.sink + 1
    if start < len(graph.nodes):
        subs.append(Subgraph(start, len(graph.nodes) - 1, None))
    return subs
