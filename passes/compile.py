"""compile_plan: graph + device layout -> Plan (split table, propagation, partition, coalescing, lowering).

Stages, each available as a Plan snapshot for the dump tool (`stop_after=`):
- "built":       the graph only (no tensor plans, no subgraphs);
- "propagated":  a state for every tensor (both assume_sync views); no subgraphs, locals empty;
- "partitioned": one reduction per PARTIAL node (no coalescing), compute flags;
- "coalesced":   delayed reductions merged (the final subgraphs and states), locals empty;
- "lowered":     the final plan with per-device shapes, strides and offsets (the default).

split_mode "layer" has none of these passes: `passes.layer_plan` places whole layers on devices
and copies the hidden state between them, so only "built" and "lowered" exist for it; nor has
"layer,tensor" (`passes.stage_plan`: the layer placement over stages, each stage the tensor
plan of its group).

`coalesce=False` gives the final plan of the "partitioned" stage, lowered (tests compare the
two). `overrides` pins leaf states (tests of the rules; the split table decides otherwise).

Requires: a `Graph` that passes `Graph.check()` (checked here first, it is O(nodes)) and a
valid `DeviceLayout`. Ensures: a Plan whose every tensor has a TensorPlan (states, per-device
locals, compute flags), whose subgraphs cover the nodes in order, each ending at a reduction's
sink (or the last node), and whose PARTIAL leaves have an owner. The graph is never mutated:
every pass returns a side table keyed by Tensor.
"""

from __future__ import annotations

import time
from typing import Mapping

from metatp.ir.errors import ConfigError
from metatp.ir.graph import Graph
from metatp.ir.tensor import Tensor
from metatp.passes.coalesce import coalesce as coalesce_chains
from metatp.passes.layer_plan import compile_layer_plan
from metatp.passes.lower import lower
from metatp.passes.partition import (Chain, choose_owners, make_subgraphs, mark_compute, minimal_chains,
                                     partial_leaf_fixups, partial_nodes)
from metatp.passes.plan import DeviceLayout, Plan, TensorPlan, single_device_plan
from metatp.passes.propagate import States, propagate
from metatp.passes.split_table import ModelDims, SplitTable
from metatp.passes.stage_plan import compile_stage_plan
from metatp.passes.state import SplitState

__all__ = ["compile_plan", "compile_stages", "STAGES", "make_table"]

STAGES = ("built", "propagated", "partitioned", "coalesced", "lowered")


def make_table(graph: Graph, layout: DeviceLayout, hparams=None) -> SplitTable:
    dims = ModelDims.from_hparams(hparams) if hparams is not None else ModelDims.from_graph(graph.leaves, graph.nodes)
    return SplitTable(layout, dims, graph.leaves)


def _chains(graph: Graph, table: SplitTable, overrides: dict[Tensor, SplitState], merge: bool
            ) -> tuple[States, list[Chain], list[str]]:
    """Propagate and place reductions; PARTIAL leaves whose consumers cannot stay exact are
    mirrored and everything is redone (at most once per such leaf)."""
    mirrored = []
    while True:
        st = propagate(graph, table, overrides)
        chains = coalesce_chains(graph, st) if merge else minimal_chains(graph, st)
        bad = partial_leaf_fixups(graph, st, chains)
        if not bad:
            return st, chains, mirrored
        for leaf in sorted(bad, key=lambda t: t.name):
            overrides[leaf] = SplitState.mirrored()
            mirrored.append(leaf.name)


def _final_states(graph: Graph, st: States, chains: list[Chain]) -> States:
    """Chain members hold un-reduced values (PARTIAL); consumers see the sink reduced."""
    state, sync = dict(st.state), dict(st.sync)
    p, m = SplitState.partial(), SplitState.mirrored()
    for ch in chains:
        for i in ch.members:
            node = graph.nodes[i]
            state[node] = p
            sync[node] = m if i == ch.sink else p
    return States(state, sync)


def _plan(graph: Graph, layout: DeviceLayout, st: States, stage: str, chains: list[Chain] | None = None,
          owners: dict | None = None, locals_: dict | None = None, stats: dict | None = None) -> Plan:
    n = layout.n_devices
    marks = mark_compute(graph, st, chains, owners or {}, n) if chains is not None else None
    tensors = {}
    for t in graph.tensors():
        tp = TensorPlan(t, st.state[t], st.sync[t], locals_[t] if locals_ else [],
                        marks.compute[t] if marks else [True] * n)
        if marks and t in marks.zero_fill:
            tp.zero_fill = marks.zero_fill[t]
        if owners and t in owners:
            tp.owner = owners[t]
        tensors[t] = tp
    subs = make_subgraphs(graph, chains, marks.compute) if chains is not None else []
    s = dict(stats or {})
    s["stage"] = stage
    s["n_subgraphs"] = len(subs)
    return Plan(graph, layout, tensors, subs, s)


def _stats(graph: Graph, st_before: States, chains: list[Chain], mirrored: list[str]) -> dict:
    before = len(partial_nodes(graph, st_before))
    after = len(chains)
    return {
        "reductions_before_coalescing": before,
        "reductions_per_step": after,
        "reductions_saved": before - after,
        "bytes_reduced_per_step": sum(graph.nodes[c.sink].nbytes for c in chains),
        "partial_leaves_mirrored": mirrored,
    }


def _pipeline_plan(graph: Graph, layout: DeviceLayout, hparams) -> Plan:
    if layout.split_mode == "layer":
        return compile_layer_plan(graph, layout, hparams)
    return compile_stage_plan(graph, layout, hparams, compile_group=compile_plan)


def compile_stages(graph: Graph, layout: DeviceLayout, hparams=None, *, coalesce: bool = True,
                   overrides: Mapping[Tensor, SplitState] | None = None, stop_after: str = "lowered",
                   keep_all: bool = True) -> dict[str, Plan]:
    """Stage snapshots up to `stop_after` (all of them, or only that one with keep_all=False)."""
    if stop_after not in STAGES:
        raise ConfigError(f"stop_after must be one of {', '.join(STAGES)}, got {stop_after!r}")
    t0 = time.perf_counter()
    last = STAGES.index(stop_after)

    def wanted(stage: str) -> bool:
        i = STAGES.index(stage)
        return i <= last and (keep_all or i == last)

    out: dict[str, Plan] = {}
    if wanted("built"):
        out["built"] = Plan(graph, layout, {}, [], {"stage": "built", "n_subgraphs": 0})
    if last == 0:
        return out
    if layout.split_mode in ("layer", "layer,tensor"):
        if stop_after != "lowered":
            raise ConfigError(f"stage {stop_after!r} belongs to -sm tensor's passes; -sm {layout.split_mode} has the "
                              "stages built and lowered only")
        out["lowered"] = _pipeline_plan(graph, layout, hparams)
        return out
    graph.check()
    table = make_table(graph, layout, hparams)
    over = dict(overrides or {})
    n = layout.n_devices
    if wanted("propagated"):
        out["propagated"] = _plan(graph, layout, propagate(graph, table, over), "propagated")
    if wanted("partitioned"):
        st, chains, mirrored = _chains(graph, table, dict(over), merge=False)
        out["partitioned"] = _plan(graph, layout, _final_states(graph, st, chains), "partitioned", chains,
                                   choose_owners(graph, st, chains, n), stats=_stats(graph, st, chains, mirrored))
    if last < STAGES.index("coalesced"):
        return out
    st, chains, mirrored = _chains(graph, table, dict(over), merge=coalesce)
    final = _final_states(graph, st, chains)
    owners = choose_owners(graph, st, chains, n)
    stats = _stats(graph, st, chains, mirrored)
    if wanted("coalesced"):
        out["coalesced"] = _plan(graph, layout, final, "coalesced", chains, owners, stats=stats)
    if wanted("lowered"):
        locals_ = lower(graph, final.sync, n)
        stats["compile_s"] = time.perf_counter() - t0
        out["lowered"] = _plan(graph, layout, final, "lowered", chains, owners, locals_, stats)
    return out


def compile_plan(graph: Graph, layout: DeviceLayout, hparams=None, *, stop_after: str = "lowered",
                 coalesce: bool = True, overrides: Mapping[Tensor, SplitState] | None = None) -> Plan:
    """The Plan for running `graph` on `layout` (split_mode "none": the trivial one-device plan).

    hparams: the model's HParams (head geometry for the split table); without them the head
    geometry is read off the graph's FLASH_ATTN_EXT nodes. stop_after: return that stage's
    snapshot instead (see STAGES). coalesce=False: one reduction per PARTIAL node."""
    if layout.split_mode == "none":
        return single_device_plan(graph)
    if layout.split_mode in ("layer", "layer,tensor") and stop_after == "lowered":
        return _pipeline_plan(graph, layout, hparams)
    stages = compile_stages(graph, layout, hparams, coalesce=coalesce, overrides=overrides,
                            stop_after=stop_after, keep_all=False)
    return stages[stop_after]
