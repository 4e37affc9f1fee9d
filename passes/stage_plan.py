"""compile_stage_plan: split_mode "layer,tensor" -- pipeline stages that are tensor-parallel groups.

P stages (vLLM's --pp), each a group of T devices (--tp), device d = stage * T + t. The layers
go to stages by llama.cpp's rule with equal stage shares (`layer_split`, as -sm layer places them
on P devices); inside a stage every node is split over the group's T devices exactly as -sm
tensor splits it over T devices (the tensor compiler's plan for T devices, -ts its shares), so a
stage's all-reduces sum over its own group only (`Reduction.devices`). Where a node reads a
value computed on another stage (the residual stream at a boundary, mirrored in its group),
device s*T+t copies its buffer of the value to device e*T+t, one copy per t (`Transfer`).

How the two plans become one: a tensor lives on the stages the layer placement gives it (`_Holders`
of `layer_plan`, with stages as its devices); on those stages' devices its Local, compute flags
and zero fills are the T-device plan's, elsewhere it is empty (ne0 = 0). Its state is the
T-device state over the devices of its own stage (zeros elsewhere); a node mirrored in its
group names the group's first device (the copy that is read back, as under -sm layer). A leaf
mirrored in the groups that read it stays MIRRORED with empty Locals on the other stages. The
T-device plan's subgraphs are cut where the stage changes; a reduction stays with its sink.

Requires: a Graph that passes `Graph.check()`, a DeviceLayout with split_mode "layer,tensor".
Ensures: every subgraph runs on one stage's devices; every reduction's members and sink are on
that stage; every value a device reads is computed in its group or copied there.
"""

from __future__ import annotations

import time
from typing import Callable

from metatp.ir.errors import SplitError
from metatp.ir.graph import Graph
from metatp.ir.ops import OPS, Op
from metatp.ir.tensor import Tensor
from metatp.passes.layer_plan import _Holders, copied_roots
from metatp.passes.layer_split import graph_n_layer, layer_devices, place_nodes
from metatp.passes.plan import (DeviceLayout, Local, Plan, Reduction, Subgraph, TensorPlan, Transfer,
                                single_device_plan)
from metatp.passes.state import SplitState

__all__ = ["compile_stage_plan"]


def _pure_view(t: Tensor) -> bool:
    return OPS[t.op].is_pure_view


def _inner_plan(graph: Graph, layout: DeviceLayout, hparams, compile_group: Callable[..., Plan]) -> Plan:
    """The plan of one tensor group: -sm tensor over T devices by `compile_group` (one device:
    the trivial plan)."""
    if layout.tp == 1:
        return single_device_plan(graph)
    return compile_group(graph, DeviceLayout(layout.tp, "tensor", layout.tensor_split), hparams)


def _lift(st: SplitState, stage: int, p: int, t: int) -> SplitState:
    """A T-device split state as the state of the same chunks on stage `stage` of P x T devices."""
    segs = []
    for seg, r in zip(st.ne, st.nr):
        row = [0] * (p * t)
        row[stage * t:stage * t + t] = seg
        segs.append((row, r))
    return SplitState.segmented(st.axis, segs)


def _group_lead(tensor: Tensor, stage: int, p: int, t: int) -> SplitState:
    """A value mirrored in stage `stage`'s group: the group's first device is the copy read back."""
    per = [0] * (p * t)
    per[stage * t] = tensor.ne[0]
    return SplitState.split(0, per)


class _Composer:
    """The P x T plan's TensorPlans from the stage placement and the T-device plan."""

    def __init__(self, inner: Plan, stage: dict[Tensor, int], holders: _Holders, p: int, t: int) -> None:
        self.inner, self.stage, self.holders, self.p, self.t = inner, stage, holders, p, t

    def tensor_plan(self, x: Tensor) -> TensorPlan:
        p, t = self.p, self.t
        ip = self.inner.of(x)
        here = self.holders.present[x]
        node = x.op is not Op.NONE and not _pure_view(x)
        home = self.stage[x] if x.op is not Op.NONE else min(here)      # a view: its source's stage
        empty = Local((0,) + tuple(x.ne[1:]), x.nb, 0)
        local, compute = [], []
        for s in range(p):
            for j in range(t):
                local.append(ip.local[j] if s in here else empty)
                compute.append(bool(ip.compute[j]) and (s == home if node else s in here))
        if x.op is not Op.NONE:
            state, sync = self._state(x, ip.state, home), self._state(x, ip.sync_state, home)
        elif ip.state.is_mirrored:
            state = sync = ip.state                # a leaf its groups hold whole: the Locals say which
        elif len(here) == 1:
            state, sync = self._state(x, ip.state, home), self._state(x, ip.sync_state, home)
        else:
            raise SplitError(f"layer,tensor: leaf {x.name!r} is split ({ip.state}) in the tensor groups of "
                             f"stages {sorted(here)}; a leaf split within a group must belong to one stage")
        tp = TensorPlan(x, state, sync, local, compute)
        if ip.zero_fill is not None:
            tp.zero_fill = [bool(ip.zero_fill[j]) and s == home for s in range(p) for j in range(t)]
        if ip.owner is not None:
            tp.owner = home * t + ip.owner
        return tp

    def _state(self, x: Tensor, st: SplitState, home: int) -> SplitState:
        if self.p == 1:
            return st
        if st.is_mirrored:
            return _group_lead(x, home, self.p, self.t)
        if st.is_partial:
            return st
        return _lift(st, home, self.p, self.t)


def _run_stage(graph: Graph, stage: dict[Tensor, int], i: int) -> int | None:
    node = graph.nodes[i]
    return None if _pure_view(node) else stage[node]


def _subgraphs(graph: Graph, inner: Plan, stage: dict[Tensor, int], moves: dict[Tensor, set[int]],
               layout: DeviceLayout) -> list[Subgraph]:
    """The T-device subgraphs cut where the stage changes (views join the run they sit in); a
    reduction ends the piece holding its sink, spanning that stage's group; each piece is then
    followed by the copies of the values it computed that other stages read."""
    t = layout.tp
    nodes = graph.nodes
    subs: list[Subgraph] = []
    home: list[int] = []
    for sub in inner.subgraphs:
        start, cur = sub.start, None
        for i in range(sub.start, sub.end + 1):
            s = _run_stage(graph, stage, i)
            if s is None:
                continue
            if cur is not None and s != cur:
                subs.append(Subgraph(start, i - 1, None))
                home.append(cur)
                start = i
            cur = s
        red = sub.reduction
        last = cur if cur is not None else (home[-1] if home else 0)
        if red is not None:
            for i in red.covers + [red.node]:
                if stage[nodes[i]] != last:
                    raise SplitError(f"layer,tensor: the all-reduce of {nodes[red.node].name!r} (stage {last}) "
                                     f"covers {nodes[i].name!r} on stage {stage[nodes[i]]}")
            group = layout.stage_devices(last) if layout.pp > 1 else None     # one stage: every device
            red = Reduction(red.node, list(red.covers), red.nbytes, group)
        subs.append(Subgraph(start, sub.end, red))
        home.append(last)
    for root, i, sub in copied_roots(graph, subs, moves):
        ip = inner.of(root)
        if ip.sync_state.is_partial:
            raise SplitError(f"layer,tensor: {root.name!r} crosses a stage boundary as an un-reduced partial sum")
        src = stage[root]
        for e in sorted(moves[root]):
            for j in range(t):
                loc = ip.local[j]
                if loc.nelements:
                    nbytes = root.nbytes * loc.nelements // max(root.nelements, 1)
                    sub.transfers.append(Transfer(i, src * t + j, e * t + j, nbytes))
    return subs


def compile_stage_plan(graph: Graph, layout: DeviceLayout, hparams=None, *, compile_group: Callable[..., Plan]) -> Plan:
    """The Plan for `graph` over `layout` (split_mode "layer,tensor": layout.pp stages of layout.tp);
    `compile_group(graph, layout, hparams)` compiles one stage's -sm tensor plan (`compile.compile_plan`,
    handed in by its caller so that this module does not import it back)."""
    t0 = time.perf_counter()
    graph.check()
    p, t = layout.pp, layout.tp
    n_layer = graph_n_layer(graph, hparams)
    slots = layer_devices(n_layer, (1.0,) * p)
    stage = place_nodes(graph, n_layer, slots)
    holders = _Holders(graph, stage, p)
    inner = _inner_plan(graph, layout, hparams, compile_group)
    composer = _Composer(inner, stage, holders, p, t)
    tensors = {x: composer.tensor_plan(x) for x in graph.tensors()}
    subs = _subgraphs(graph, inner, stage, holders.moves, layout)
    moved = [x for s in subs for x in s.transfers]
    reds = [s.reduction for s in subs if s.reduction is not None]
    stats = {"stage": "lowered", "reductions_before_coalescing": inner.stats.get("reductions_before_coalescing", 0),
             "reductions_per_step": len(reds), "reductions_saved": inner.stats.get("reductions_saved", 0),
             "bytes_reduced_per_step": sum(r.nbytes for r in reds),
             "partial_leaves_mirrored": inner.stats.get("partial_leaves_mirrored", []), "n_subgraphs": len(subs),
             "pp": p, "tp": t, "layer_stages": slots[:n_layer], "output_stage": slots[n_layer], "input_stage": 0,
             "stage_groups": [list(layout.stage_devices(s)) for s in range(p)],
             "transfers_per_step": len(moved), "bytes_transferred_per_step": sum(x.nbytes for x in moved),
             "compile_s": time.perf_counter() - t0}
    return Plan(graph, layout, tensors, subs, stats)
