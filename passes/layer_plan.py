"""compile_layer_plan: a graph on N devices split by layers (llama.cpp's -sm layer) as a Plan.

Every node runs on one device (`layer_split.place_nodes`); a layer's weights and KV cache live
on its device only. Where a node reads a value computed on another device, the Plan copies that
value's whole buffer there once, right after the subgraph that computed it (`Transfer`): the
residual stream at each device boundary, nothing else in the models we build. No state is
PARTIAL and nothing is all-reduced.

How a Plan says where a tensor lives: a device holds a tensor when its Local is the whole
tensor (and an empty one, ne0 = 0, elsewhere). The state names the one device whose copy is
read back (`SplitState` split along ne0 with the whole extent there, so the slicing, upload and
gather code of the tensor split serve as they are), or MIRRORED where every device holds it.
A copied value is also held whole by the devices it is copied to (their Local is full: the
copy's destination), computed only by its own device (`compute`). Leaves: a weight read on
several devices is mirrored (the rope frequency factors every layer reads); inputs are mirrored.

Requires: a Graph that passes `Graph.check()`, a DeviceLayout with split_mode "layer".
Ensures: subgraphs cover the nodes in order, each run by one device, and every value a device
reads is computed there or copied there by an earlier subgraph's transfer.
"""

from __future__ import annotations

import time

from metatp.ir.errors import SplitError
from metatp.ir.graph import Graph
from metatp.ir.ops import OPS, Op
from metatp.ir.tensor import Flag, Tensor
from metatp.passes.layer_split import graph_n_layer, layer_devices, place_nodes
from metatp.passes.plan import DeviceLayout, Local, Plan, Subgraph, TensorPlan, Transfer
from metatp.passes.state import SplitState

__all__ = ["compile_layer_plan", "on_device"]


def on_device(t: Tensor, d: int, n: int) -> SplitState:
    """The state of a tensor device d holds whole and the others not at all."""
    return SplitState.split(0, [t.ne[0] if j == d else 0 for j in range(n)])


def _pure_view(t: Tensor) -> bool:
    return OPS[t.op].is_pure_view


class _Holders:
    """Which devices hold each tensor, and which node values must be copied where."""

    def __init__(self, graph: Graph, dev: dict[Tensor, int], n: int) -> None:
        self.dev = dev
        self.present: dict[Tensor, set[int]] = {t: set() for t in graph.tensors()}
        self.moves: dict[Tensor, set[int]] = {}
        for node in graph.nodes:
            if _pure_view(node):
                continue
            d = dev[node]
            self.present[node].add(d)
            if node.view_src is not None:            # CPY / SET_ROWS write into their destination
                self.present[node.view_src].add(d)
            for s in node.src:
                if s is not None:
                    self.read(s, d)
        for out in graph.outputs:
            self.read(out, dev[out.view_src] if out.view_src is not None and out.view_src in dev else dev[out])
        for t in graph.leaves:
            here = self.present[t]
            if t.flags & Flag.INPUT or (len(here) > 1 and not t.flags & Flag.KV_CACHE):
                here.update(range(n))                # inputs and shared weights: every device
            elif len(here) > 1:
                raise SplitError(f"layer split: KV cache {t.name!r} is used on devices {sorted(here)}; "
                                 "a layer's cache must live on that layer's device")
            elif not here:
                here.add(0)
        for node in graph.nodes:
            if not self.present[node]:
                self.present[node].add(dev[node])
        self._check_writes(graph)

    def read(self, t: Tensor, d: int) -> None:
        """Device d reads t: it needs t's memory (a view's source) there."""
        self.present[t].add(d)
        root = t.view_src
        if root is not None:
            if not _pure_view(t) and self.dev[t] != d:
                raise SplitError(f"layer split: {t.op.name} node {t.name!r} on device {self.dev[t]} is read on "
                                 f"device {d}; values written into another tensor cannot be copied across")
            self.read(root, d)
        elif t.op is not Op.NONE and self.dev[t] != d:
            self.moves.setdefault(t, set()).add(d)

    def _check_writes(self, graph: Graph) -> None:
        """A copied value must be final when its subgraph ends: nothing may write into it later."""
        for node in graph.nodes:
            if not _pure_view(node) and node.view_src in self.moves:
                raise SplitError(f"layer split: {node.name!r} writes into {node.view_src.name!r}, which is "
                                 "copied to another device before that write")


def _subgraphs(graph: Graph, dev: dict[Tensor, int], moves: dict[Tensor, set[int]]) -> list[Subgraph]:
    """Maximal runs of nodes computed on one device (views join the run they sit in), each
    followed by the copies of the values it computed that other devices read."""
    subs: list[Subgraph] = []
    start, cur = 0, None
    for i, node in enumerate(graph.nodes):
        if _pure_view(node):
            continue
        if cur is not None and dev[node] != cur:
            subs.append(Subgraph(start, i - 1, None))
            start = i
        cur = dev[node]
    if graph.nodes:
        subs.append(Subgraph(start, len(graph.nodes) - 1, None))
    for root, i, sub in copied_roots(graph, subs, moves):
        for d in sorted(moves[root]):
            sub.transfers.append(Transfer(i, dev[root], d, root.nbytes))
    return subs


def copied_roots(graph: Graph, subs: list[Subgraph], moves: dict[Tensor, set[int]]):
    """Each value another device reads (`moves`' keys), in graph order, with its node index and
    the subgraph that computes it (whose end its copies follow)."""
    index = graph.index
    k = 0
    for root in sorted(moves, key=index.__getitem__):
        i = index[root]
        while subs[k].end < i:
            k += 1
        yield root, i, subs[k]


def _tensor_plan(t: Tensor, home: int | None, here: set[int], n: int) -> TensorPlan:
    full = Local(t.ne, t.nb, t.view_offs)
    empty = Local((0,) + tuple(t.ne[1:]), t.nb, 0)
    if len(here) == n:
        st = SplitState.mirrored()
    else:
        st = on_device(t, home if home is not None else min(here), n)
    local = [full if d in here else empty for d in range(n)]
    compute = [d == home for d in range(n)] if home is not None else [d in here for d in range(n)]
    return TensorPlan(t, st, st, local, compute)


def compile_layer_plan(graph: Graph, layout: DeviceLayout, hparams=None) -> Plan:
    """The Plan for `graph` split by layers over `layout` (split_mode "layer")."""
    t0 = time.perf_counter()
    graph.check()
    n = layout.n_devices
    n_layer = graph_n_layer(graph, hparams)
    slots = layer_devices(n_layer, layout.ratios())
    dev = place_nodes(graph, n_layer, slots)
    holders = _Holders(graph, dev, n)
    tensors = {}
    for t in graph.tensors():
        home = dev[t] if t.op is not Op.NONE and not _pure_view(t) else None
        tensors[t] = _tensor_plan(t, home, holders.present[t], n)
    subs = _subgraphs(graph, dev, holders.moves)
    moved = [x for s in subs for x in s.transfers]
    stats = {"stage": "lowered", "reductions_before_coalescing": 0, "reductions_per_step": 0, "reductions_saved": 0,
             "bytes_reduced_per_step": 0, "partial_leaves_mirrored": [], "n_subgraphs": len(subs),
             "layer_devices": slots[:n_layer], "output_device": slots[n_layer], "input_device": 0,
             "transfers_per_step": len(moved), "bytes_transferred_per_step": sum(x.nbytes for x in moved),
             "compile_s": time.perf_counter() - t0}
    return Plan(graph, layout, tensors, subs, stats)
