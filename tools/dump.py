"""`metatp dump`: show how a model's graph is split across devices, pass by pass.

The compiler's output (a Plan) is plain data; this tool prints it for a person (text), for a
program (json, schema in docs/dump-format.md) or as a picture (dot / svg, one cluster per
subgraph, nodes coloured by split state). Its summary adds what the Plan implies: per-device
weight and KV bytes, the mirrored overhead, and the communication bill of tensor parallelism
(bytes the chosen all-reduce schedule moves, reductions per token, tensor vs layer split,
latency per token).

The graph is built from the GGUF header only (tensor infos and scalar metadata); no weight is
read or dequantised, so dumping the default model takes well under two seconds.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from metatp.backends.collectives.schedule import allreduce_bytes, resolve_mode
from metatp.backends.collectives.wire import wire_dtype
from metatp.ir.errors import ConfigError, MetatpError, SplitError
from metatp.ir.graph import Graph
from metatp.ir.ops import OPS, Op
from metatp.ir.tensor import Flag, Tensor, block_size, type_size
from metatp.passes.memory import MemoryPlan, format_bytes, plan_memory
from metatp.passes.plan import Plan, Reduction
from metatp.passes.state import SplitState

__all__ = ["dump", "dump_model", "DumpRequest", "Link", "LINKS", "FORMATS", "PHASES",
           "communication_bill", "raw_weight_bytes", "node_layers", "add_parser"]

FORMATS = ("text", "json", "dot", "svg")
PHASES = ("decode", "prefill")
SCHEMA_VERSION = 1
DEFAULT_PREFILL_TOKENS = 512
DEFAULT_N_CTX = 2048          # as the LLM API: 2048, capped at the model's trained context


# ---------------------------------------------------------------- links


@dataclass(frozen=True)
class Link:
    """A device interconnect as the bill sees it: a fixed cost per all-reduce plus bytes/bandwidth.

    `latency_us` is the whole fixed cost of one all-reduce (synchronisation, kernel launch, the
    NCCL call): the seed puts it at 20-50 us on typical setups. `bandwidth_gbs` is GB/s (1e9 B/s)
    per rank and direction."""

    name: str
    latency_us: float
    bandwidth_gbs: float

    def seconds(self, n_allreduces: float, bytes_per_rank: float) -> float:
        return n_allreduces * self.latency_us * 1e-6 + bytes_per_rank / (self.bandwidth_gbs * 1e9)


# Rough presets, meant to be overridden with --latency-us / --bandwidth-gbs:
# NVLink (A100/H100 class): small all-reduces ~10 us, ~200 GB/s achievable per direction;
# PCIe 4.0 x16: 32 GB/s raw, ~24 GB/s achievable, ~30 us per small all-reduce (the seed's 20-50 us).
LINKS: dict[str, Link] = {
    "nvlink": Link("nvlink", 10.0, 200.0),
    "pcie4": Link("pcie4", 30.0, 24.0),
}


def _link(link: Link | str) -> Link:
    if isinstance(link, Link):
        return link
    if link not in LINKS:
        raise ConfigError(f"unknown link {link!r}; presets: {', '.join(LINKS)}")
    return LINKS[link]


# ---------------------------------------------------------------- per-tensor facts


_LAYER_SUFFIX = re.compile(r"-(\d+)$")


def _name_layer(t: Tensor) -> int | None:
    """The layer a name says (`blk.N.`, `_lN`, or the builders' `-N` suffix)."""
    if t.layer is not None:
        return t.layer
    m = _LAYER_SUFFIX.search(t.name)
    return int(m.group(1)) if m else None


def node_layers(graph: Graph) -> dict[Tensor, int | None]:
    """Layer of every tensor, for `--layer`.

    A node's own layer comes from its name (`-N` suffix, `blk.N.`), else from the layer weight it
    reads (the unnamed matmuls of `_linear`). A node with neither belongs to a layer when the
    nearest nodes before and after it that do have one agree (e.g. `attn_out_sel` inside the last
    layer, the rms_norm before `ffn_norm-N`); otherwise it is global (the final norm, the head)."""
    out: dict[Tensor, int | None] = {t: _name_layer(t) for t in graph.leaves}
    own: list[int | None] = []
    for n in graph.nodes:
        il = _name_layer(n)
        if il is None:
            weights = [out[s] for s in n.src if s is not None and s.op is Op.NONE and out.get(s) is not None]
            il = max(weights) if weights else None
        own.append(il)
    after: list[int | None] = [None] * len(own)
    nxt = None
    for i in range(len(own) - 1, -1, -1):
        after[i] = nxt
        if own[i] is not None:
            nxt = own[i]
    prev = None
    for i, n in enumerate(graph.nodes):
        il = own[i]
        if il is None and prev is not None and prev == after[i]:
            il = prev
        out[n] = il
        if own[i] is not None:
            prev = own[i]
    return out


def raw_weight_bytes(t: Tensor, local_ne: Sequence[int], plan: Plan | None = None) -> int:
    """GGUF bytes of a slice: whole quant blocks per row times the rows (what a device stores).
    Has the signature of `memory.WeightBytes`, so `plan_memory` can use it directly."""
    rows = local_ne[1] * local_ne[2] * local_ne[3]
    return rows * -(-local_ne[0] // block_size(t.type)) * type_size(t.type)


def _kind(t: Tensor) -> str:
    if t.op is not Op.NONE:
        return "node"
    if t.flags & Flag.WEIGHT:
        return "weight"
    if t.flags & Flag.KV_CACHE:
        return "kv_cache"
    if t.flags & Flag.INPUT:
        return "input"
    return "leaf"


def _is_plain_view(t: Tensor) -> bool:
    """Views that only re-describe memory (drawn faintly); SET_ROWS / CPY write, so they count."""
    return OPS[t.op].is_view and t.op not in (Op.SET_ROWS, Op.CPY)


def _shape(ne: Sequence[int]) -> str:
    return "[" + ",".join(str(x) for x in ne) + "]"


def _flags(bits: Sequence[bool] | None) -> str:
    return "".join("1" if b else "0" for b in bits) if bits else ""


def _state_data(st: SplitState | None) -> dict | None:
    if st is None:
        return None
    if not st.is_split:
        return {"kind": "mirrored" if st.is_mirrored else "partial", "axis": None, "text": str(st),
                "extents": None, "segments": []}
    return {"kind": "split", "axis": st.axis, "text": str(st), "extents": list(st.extents()),
            "segments": [{"per_device": list(seg), "repeats": r} for seg, r in zip(st.ne, st.nr)]}


# ---------------------------------------------------------------- the view of a plan


class _View:
    """Everything the three formats share: ids, labels, layers, subgraph of each node, filter."""

    def __init__(self, plan: Plan, layer: int | None, allreduce: str = "auto", wire: str = "f32") -> None:
        g = plan.graph
        self.plan = plan
        self.allreduce = allreduce
        self.wire = wire
        self.graph = g
        self.layers = node_layers(g)
        self.leaf_index = {t: k for k, t in enumerate(g.leaves)}
        self.id: dict[Tensor, str] = {t: f"l{k}" for t, k in self.leaf_index.items()}
        self.id.update({t: f"n{i}" for i, t in enumerate(g.nodes)})
        self.subgraph_of: dict[int, int] = {}
        for k, sg in enumerate(plan.subgraphs):
            for i in range(sg.start, sg.end + 1):
                self.subgraph_of[i] = k
        self.reduction_of: dict[int, tuple[int, int, Reduction]] = {}   # sink node -> (id, subgraph, r)
        rid = 0
        for k, sg in enumerate(plan.subgraphs):
            if sg.reduction is not None:
                self.reduction_of[sg.reduction.node] = (rid, k, sg.reduction)
                rid += 1
        self.layer = layer
        self.nodes = self._shown_nodes(layer)
        self.leaves = self._shown_leaves()

    def _shown_nodes(self, layer: int | None) -> list[int]:
        g = self.graph
        if layer is None:
            return list(range(len(g.nodes)))
        present = sorted({il for il in self.layers.values() if il is not None})
        if layer not in present:
            span = f"{present[0]}..{present[-1]}" if present else "none"
            raise ConfigError(f"--layer {layer}: no such layer in this graph (layers: {span})")
        return [i for i, n in enumerate(g.nodes) if self.layers[n] == layer]

    def _shown_leaves(self) -> list[Tensor]:
        """Leaves read by the shown nodes, in order of first use (the graph's own leaf order is
        depth-first from the output, which puts the lm head first)."""
        first_use: dict[Tensor, int] = {}
        for i in self.nodes:
            for s in self.graph.nodes[i].src:
                if s is not None and s.op is Op.NONE:
                    first_use.setdefault(s, i)
        unused = [] if self.layer is not None else [t for t in self.graph.leaves if t not in first_use]
        return sorted(first_use, key=first_use.__getitem__) + unused

    def label(self, t: Tensor) -> str:
        """The name, or for unnamed nodes what they compute: `mul_mat(blk.0.attn_q.weight, attn_norm-0)`."""
        if t.name:
            return t.name
        args = ", ".join(self._short(s) for s in t.src if s is not None)
        return f"{t.op.name.lower()}({args})"

    def _short(self, s: Tensor) -> str:
        if s.name:
            return s.name
        return f"#{self.graph.index[s]}" if s in self.graph.index else "?"

    def tp(self, t: Tensor):
        return self.plan.tensors.get(t)


# ---------------------------------------------------------------- summary and the bill


def _plan_memory(plan: Plan | None, n_ctx: int) -> MemoryPlan | None:
    """Per-device memory, from a lowered plan (earlier stages have no per-device shapes)."""
    if plan is None or not plan.tensors:
        return None
    any_leaf = next(iter(plan.graph.leaves), None)
    if any_leaf is None or not plan.of(any_leaf).local:
        return None
    return plan_memory(plan, raw_weight_bytes, n_ctx)


def _mirrored_weight_bytes(plan: Plan) -> int:
    """Bytes of weights every device holds in full (each extra device pays them again)."""
    total = 0
    for t in plan.graph.leaves:
        tp = plan.tensors.get(t)
        if t.flags & Flag.WEIGHT and tp is not None and tp.state.is_mirrored:
            total += raw_weight_bytes(t, t.ne)
    return total


def _n_layer(graph: Graph, hparams) -> int:
    if hparams is not None:
        return int(hparams.n_layer)
    layers = {t.layer for t in graph.leaves if t.layer is not None}
    return len(layers)


def _hop_bytes(plan: Plan, hparams, n_tokens: int) -> int:
    """What layer split sends at each device boundary: the residual stream of the batch
    (n_embd x n_tokens F32). Without hparams, the largest all-reduced tensor (the same thing
    for standard layers)."""
    if hparams is not None:
        return int(hparams.n_embd) * n_tokens * 4
    return max((r.nbytes for r in plan.reductions), default=0)


def _reduction_bytes(n_devices: int, nbytes: int, allreduce: str, wire: str) -> tuple[int, int]:
    """(busiest rank's bytes, bytes over all links) of one all-reduce of an F32 tensor of nbytes."""
    return allreduce_bytes(allreduce, n_devices, nbytes // 4, wire)


def communication_bill(plan: Plan, link: Link | str = "nvlink", *, n_tokens: int = 1,
                       hparams=None, allreduce: str = "auto", wire: str = "f32") -> dict:
    """The cost of the plan's all-reduces per step and per token, and tensor vs layer split.

    Formulas from the seed, section "归约的账单:每层两次,每 token 几十次" (the reduction bill:
    two per layer, dozens per token):
    - ring all-reduce moves 2(p-1)/p times the tensor's bytes per rank, so per step
      V_rank = 2(p-1)/p * sum(bytes of every all-reduced tensor) (= 4Lhb(p-1)/p per token for
      decode with two [h] reductions per layer);
    - reductions per token: 2 per standard layer (2L), here counted from the plan;
    - prefill, tensor vs layer split: layer split hands the hidden state [h, T] across each of
      the p-1 device boundaries once, tensor split all-reduces 2L tensors of that size:
      V_TP / V_PP ~= 2L / (p-1). We report the plan's exact ratio (bytes all-reduced / bytes
      of p-1 hops) next to the seed's formula.
    The time estimate charges `link.latency_us` per all-reduce (the seed: "latency, not
    bandwidth, dominates decode") plus the bytes the busiest rank moves under the schedule of
    `allreduce` (butterfly for "auto", as the numpy backend; `wire` "f32", "bf16" or "auto")
    over the link bandwidth. The ring_* keys keep the textbook ring's 2(p-1)/p for comparison."""
    link = _link(link)
    mode = resolve_mode(allreduce).name
    wire_dtype(2, 0, wire)      # validates the wire mode
    p = plan.n_devices
    reductions = plan.reductions
    n_red = len(reductions)
    reduced = sum(r.nbytes for r in reductions)
    ring = 2 * (p - 1) / p if p > 1 else 0.0
    ring_bytes = ring * reduced
    counts = [_reduction_bytes(p, r.nbytes, mode, wire) for r in reductions]
    rank_bytes = sum(c[0] for c in counts)
    hop = _hop_bytes(plan, hparams, n_tokens)
    layer_bytes = (p - 1) * hop
    n_layer = _n_layer(plan.graph, hparams)
    step_s = link.seconds(n_red, rank_bytes)
    layer_step_s = link.seconds(p - 1, layer_bytes) if p > 1 else 0.0
    t = max(n_tokens, 1)
    return {
        "link": {"name": link.name, "latency_us": link.latency_us, "bandwidth_gbs": link.bandwidth_gbs},
        "n_devices": p,
        "n_tokens_per_step": n_tokens,
        "reductions_per_step": n_red,
        "reductions_per_token": n_red / t,
        "bytes_reduced_per_step": reduced,
        "ring_factor": ring,
        "ring_bytes_per_rank_per_step": round(ring_bytes),
        "ring_bytes_per_rank_per_token": round(ring_bytes / t),
        "allreduce": mode,
        "wire": wire,
        "bytes_per_rank_per_step": rank_bytes,
        "bytes_per_rank_per_token": round(rank_bytes / t),
        "bytes_moved_per_step": sum(c[1] for c in counts),
        "layer_split_hop_bytes": hop,
        "layer_split_bytes_per_step": layer_bytes,
        "tensor_vs_layer_ratio": reduced / layer_bytes if layer_bytes else None,
        "tensor_vs_layer_ratio_formula": 2 * n_layer / (p - 1) if p > 1 else None,
        "n_layer": n_layer,
        "latency_per_step_us": step_s * 1e6,
        "latency_per_token_us": step_s * 1e6 / t,
        "layer_split_latency_per_token_us": layer_step_s * 1e6 / t,
    }


def _saved(stats: dict) -> int | None:
    if "reductions_saved" in stats:
        return stats["reductions_saved"]
    if "reductions_before_coalescing" in stats and "reductions_per_step" in stats:
        return stats["reductions_before_coalescing"] - stats["reductions_per_step"]
    return None


def _summary(view: _View, lowered: Plan | None, link: Link, n_tokens: int, hparams, n_ctx: int) -> dict:
    """Whole-plan totals: counts, memory, mirrored overhead and the communication bill."""
    plan = view.plan
    stats = plan.stats or {}
    compiled = bool(plan.subgraphs) or "reductions_per_step" in stats
    mem = _plan_memory(lowered if lowered is not None else plan, n_ctx)
    mirrored = _mirrored_weight_bytes(plan if plan.tensors else (lowered or plan))
    weights_total = sum(raw_weight_bytes(t, t.ne) for t in plan.graph.leaves if t.flags & Flag.WEIGHT)
    return {
        "n_nodes": len(plan.graph.nodes),
        "n_leaves": len(plan.graph.leaves),
        "n_nodes_shown": len(view.nodes),
        "n_subgraphs": stats.get("n_subgraphs", len(plan.subgraphs)),
        "reductions_before_coalescing": stats.get("reductions_before_coalescing"),
        "reductions_per_step": stats.get("reductions_per_step") if compiled else None,
        "reductions_saved": _saved(stats),
        "bytes_reduced_per_step": stats.get("bytes_reduced_per_step") if compiled else None,
        "weight_bytes": weights_total,
        "mirrored_weight_bytes": mirrored,
        "mirrored_overhead_bytes": mirrored * (plan.n_devices - 1),
        "memory": mem.as_dict() if mem is not None else None,
        "communication": communication_bill(plan, link, n_tokens=n_tokens, hparams=hparams,
                                            allreduce=view.allreduce, wire=view.wire) if compiled else None,
    }


# ---------------------------------------------------------------- text


def _bytes_exact(n: int) -> str:
    """`2.25 KiB (2304 B)`; plain `256 B` when the unit is bytes anyway."""
    short = format_bytes(n)
    return short if short.endswith(" B") else f"{short} ({n} B)"


def _per_device(values: Sequence[int]) -> str:
    return ", ".join(f"dev{j} {format_bytes(v)}" for j, v in enumerate(values))


def _state_text(tp) -> str:
    if tp is None:
        return "-"
    s = str(tp.state)
    if str(tp.sync_state) != s and not tp.state.is_partial:
        s += f" (sync {tp.sync_state})"
    return s


def _leaf_line(view: _View, t: Tensor, why: dict[Tensor, str]) -> str:
    tp = view.tp(t)
    kind = {"weight": "W", "kv_cache": "KV", "input": "IN"}.get(_kind(t), "-")
    line = f"  {kind:<3}{t.name:<34} {_shape(t.ne):<22} {t.type.name:<5} {_state_text(tp):<24}"
    if tp is not None and tp.local and t.flags & Flag.WEIGHT:
        line += " bytes=" + "|".join(format_bytes(raw_weight_bytes(t, loc.ne)) for loc in tp.local)
    if tp is not None and tp.owner is not None:
        line += f" owner={tp.owner}"
    if why.get(t):
        line += f"  ({why[t]})"
    return line.rstrip()


def _node_line(view: _View, i: int) -> str:
    n = view.graph.nodes[i]
    tp = view.tp(n)
    line = f"{i:>5}  {n.op.name:<14} {view.label(n):<40} {_shape(n.ne):<20} {n.type.name:<5} {_state_text(tp):<24}"
    if tp is not None:
        line += f" compute={_flags(tp.compute)}"
        if tp.zero_fill and any(tp.zero_fill):
            line += f" zero={_flags(tp.zero_fill)}"
        if tp.owner is not None:
            line += f" owner={tp.owner}"
    if i in view.subgraph_of:
        line += f" sg={view.subgraph_of[i]}"
    return line.rstrip()


def _reduction_line(view: _View, i: int) -> str:
    rid, k, r = view.reduction_of[i]
    p = view.plan.n_devices
    covers = ", ".join(f"{c} {view.label(view.graph.nodes[c])}" for c in r.covers)
    per_rank, _ = _reduction_bytes(p, r.nbytes, view.allreduce, view.wire)
    active = f" active={_flags(r.active)}" if r.active is not None else ""
    return (f"{'':5}  ==== all-reduce #{rid} of node {r.node} (end of subgraph {k}): {_bytes_exact(r.nbytes)},"
            f" {resolve_mode(view.allreduce).name} {format_bytes(per_rank)}/rank{active}; covers PARTIAL {covers}")


def _header_text(info: dict) -> list[str]:
    lay = info["layout"]
    ts = "/".join(f"{x:g}" for x in lay["tensor_split"]) if lay["tensor_split"] else "equal"
    head = [f"# metatp dump: {info['graph']}  stage={info['stage']}"]
    if info.get("model"):
        m = info["model"]
        head.append(f"# model: {m['name']} ({m['arch']}, {m['n_layer']} layers, n_embd {m['n_embd']},"
                    f" {format_bytes(m['tensor_data_bytes'])} of tensor data) {m['path']}")
    if info.get("batch"):
        b = info["batch"]
        head.append(f"# batch: {b['phase']} {b['n_tokens']} token(s), n_kv {b['n_kv']}, n_outputs {b['n_outputs']},"
                    f" n_ctx {b['n_ctx']}")
    head.append(f"# layout: {lay['n_devices']} device(s), -sm {lay['split_mode']}, -ts {ts}")
    if info.get("layer") is not None:
        head.append(f"# layer {info['layer']} only")
    return head


def _summary_text(s: dict) -> list[str]:
    out = ["", "summary",
           f"  nodes {s['n_nodes']} (shown {s['n_nodes_shown']}), leaves {s['n_leaves']}, subgraphs {s['n_subgraphs']}"]
    if s["reductions_per_step"] is not None:
        out.append(f"  reductions per step: {s['reductions_before_coalescing']} before coalescing,"
                   f" {s['reductions_per_step']} after ({s['reductions_saved']} saved)")
        out.append(f"  bytes reduced per step: {_bytes_exact(s['bytes_reduced_per_step'])}")
    else:
        out.append("  reductions: not placed yet at this stage")
    mem = s["memory"]
    if mem is not None:
        out.append(f"  weights per device (raw GGUF bytes): {_per_device(mem['weights'])}"
                   f"  [one copy of every weight leaf: {format_bytes(s['weight_bytes'])}]")
        per_token = ", ".join(f"dev{j} {b} B" for j, b in enumerate(mem["kv_per_token"]))
        out.append(f"  KV cache per context token: {per_token}  (n_ctx {mem['n_ctx']}: {_per_device(mem['kv'])})")
        out.append(f"  compute buffers: {_per_device(mem['compute'])}")
    out.append(f"  mirrored weights: {format_bytes(s['mirrored_weight_bytes'])} held in full by every device"
               f" (overhead {format_bytes(s['mirrored_overhead_bytes'])} over one copy)")
    c = s["communication"]
    if c is not None:
        out += _bill_text(c)
    return out


def _bill_text(c: dict) -> list[str]:
    link = c["link"]
    p = c["n_devices"]
    out = ["", f"communication bill ({c['allreduce']} all-reduce, {c['wire']} on the wire)",
           f"  link {link['name']}: {link['latency_us']:g} us per all-reduce, {link['bandwidth_gbs']:g} GB/s"]
    if p < 2:
        out.append("  one device: nothing to reduce")
        return out
    t = c["n_tokens_per_step"]
    out.append(f"  all-reduces per step: {c['reductions_per_step']} ({t} token(s) per step,"
               f" {c['reductions_per_token']:.3g} per token)")
    out.append(f"  {c['allreduce']} bytes on the busiest rank: {format_bytes(c['bytes_per_rank_per_step'])}"
               f" per step, {format_bytes(c['bytes_per_rank_per_token'])} per token"
               f" ({format_bytes(c['bytes_moved_per_step'])} over all links per step)")
    out.append(f"  a ring would move 2(p-1)/p = {c['ring_factor']:.3g}"
               f" x {format_bytes(c['bytes_reduced_per_step'])}"
               f" = {format_bytes(c['ring_bytes_per_rank_per_step'])} per rank per step")
    out.append(f"  est. latency: {c['latency_per_step_us']:.1f} us per step,"
               f" {c['latency_per_token_us']:.2f} us per token")
    out.append(f"  layer split instead: {p - 1} hop(s) of {format_bytes(c['layer_split_hop_bytes'])} per step,"
               f" {c['layer_split_latency_per_token_us']:.2f} us per token")
    ratio = c["tensor_vs_layer_ratio"]
    out.append(f"  prefill ratio tensor/layer split bytes: {ratio:.1f}x from the plan,"
               f" {c['tensor_vs_layer_ratio_formula']:.1f}x by the seed's 2L/(p-1) (L={c['n_layer']}, p={p})"
               if ratio is not None else "  prefill ratio tensor/layer split: n/a")
    return out


def _split_rules(view: _View, hparams) -> dict[Tensor, str]:
    """The split table's reason for each weight/KV leaf ("attn_output: row parallel, whole heads")."""
    plan = view.plan
    if plan.layout.split_mode != "tensor" or not plan.tensors:
        return {}
    from metatp.passes.compile import make_table

    table = make_table(plan.graph, plan.layout, hparams)
    out = {}
    for t in view.leaves:
        if t.flags & (Flag.WEIGHT | Flag.KV_CACHE):
            try:
                out[t] = table.row(t).why
            except SplitError:
                out[t] = ""
    return out


def _format_text(view: _View, info: dict, summary: dict, hparams) -> str:
    lines = _header_text(info)
    why = _split_rules(view, hparams)
    lines += ["", f"leaves ({len(view.leaves)}): kind name shape type state [bytes per device] (split rule)"]
    lines += [_leaf_line(view, t, why) for t in view.leaves]
    lines += ["", f"nodes ({len(view.nodes)}): index op name shape type state compute=<per device> sg=<subgraph>"]
    for i in view.nodes:
        lines.append(_node_line(view, i))
        if i in view.reduction_of:
            lines.append(_reduction_line(view, i))
    lines += _summary_text(summary)
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- json


def _tensor_data(view: _View, t: Tensor, why: dict[Tensor, str]) -> dict:
    tp = view.tp(t)
    g = view.graph
    is_node = t.op is not Op.NONE
    bytes_per_device = None
    if tp is not None and tp.local and t.flags & Flag.WEIGHT:
        bytes_per_device = [raw_weight_bytes(t, loc.ne) for loc in tp.local]
    return {
        "id": view.id[t],
        "index": g.index[t] if is_node else view.leaf_index[t],
        "kind": _kind(t),
        "name": t.name,
        "label": view.label(t),
        "op": t.op.name,
        "ne": list(t.ne),
        "nb": list(t.nb),
        "type": t.type.name,
        "flags": [f.name for f in Flag if f and f in t.flags],
        "layer": view.layers.get(t),
        "src": [view.id[s] if s is not None else None for s in t.src],
        "view_src": view.id.get(t.view_src) if t.view_src is not None else None,
        "view_offs": t.view_offs,
        "is_view": bool(OPS[t.op].is_view),
        "state": _state_data(tp.state) if tp else None,
        "sync_state": _state_data(tp.sync_state) if tp else None,
        "compute": list(tp.compute) if tp else None,
        "zero_fill": list(tp.zero_fill) if tp and tp.zero_fill is not None else None,
        "owner": tp.owner if tp else None,
        "local": [{"ne": list(loc.ne), "nb": list(loc.nb), "offs": loc.offs} for loc in tp.local] if tp else [],
        "subgraph": view.subgraph_of.get(g.index[t]) if is_node else None,
        "split_rule": why.get(t) if not is_node else None,
        "bytes_per_device": bytes_per_device,
    }


def _reductions_data(view: _View) -> list[dict]:
    p = view.plan.n_devices
    out = []
    for node, (rid, k, r) in sorted(view.reduction_of.items(), key=lambda kv: kv[1][0]):
        out.append({
            "id": rid, "subgraph": k, "node": r.node, "node_id": f"n{r.node}",
            "node_label": view.label(view.graph.nodes[r.node]),
            "covers": list(r.covers), "cover_labels": [view.label(view.graph.nodes[c]) for c in r.covers],
            "nbytes": r.nbytes, "ring_bytes_per_rank": round(2 * (p - 1) / p * r.nbytes) if p > 1 else 0,
            "bytes_per_rank": _reduction_bytes(p, r.nbytes, view.allreduce, view.wire)[0],
            "active": list(r.active) if r.active is not None else None,
        })
    return out


def _format_json(view: _View, info: dict, summary: dict, hparams) -> str:
    why = _split_rules(view, hparams)
    subgraphs = []
    for k, sg in enumerate(view.plan.subgraphs):
        rid = view.reduction_of[sg.reduction.node][0] if sg.reduction is not None else None
        subgraphs.append({"id": k, "start": sg.start, "end": sg.end, "n_nodes": sg.end - sg.start + 1,
                          "reduction": rid})
    data = {
        "format": "metatp-dump",
        "version": SCHEMA_VERSION,
        **info,
        "leaves": [_tensor_data(view, t, why) for t in view.leaves],
        "nodes": [_tensor_data(view, view.graph.nodes[i], why) for i in view.nodes],
        "subgraphs": subgraphs,
        "reductions": _reductions_data(view),
        "summary": summary,
    }
    return json.dumps(data, indent=1, ensure_ascii=False) + "\n"


# ---------------------------------------------------------------- dot / svg


STATE_COLOURS = {"MIRRORED": "#e6e6e6", "PARTIAL": "#f4a582", "AXIS_0": "#92c5de", "AXIS_1": "#a6dba0",
                 "AXIS_2": "#c2a5cf", "AXIS_3": "#fee08b", "-": "#ffffff"}


def _colour(tp) -> str:
    if tp is None:
        return STATE_COLOURS["-"]
    return STATE_COLOURS[str(tp.state).split("[", 1)[0].split("{", 1)[0]]


def _dot_attrs(view: _View, t: Tensor) -> dict[str, str]:
    """Weights small boxes, KV cache cylinders, inputs parallelograms, views faint, ops rounded."""
    tp = view.tp(t)
    state = _state_text(tp)
    fill = _colour(tp)
    kind = _kind(t)
    if kind != "node":
        shape = {"weight": "box", "kv_cache": "cylinder", "input": "parallelogram"}.get(kind, "box")
        return {"label": f"{t.name}\n{_shape(t.ne)} {t.type.name}\n{state}", "shape": shape, "style": "filled",
                "fillcolor": fill, "fontsize": "8", "height": "0.2", "margin": "0.04,0.02"}
    i = view.graph.index[t]
    label = f"#{i} {t.op.name}\n{view.label(t)}\n{_shape(t.ne)}\n{state}"
    if tp is not None and not all(tp.compute):
        label += f"\ncompute={_flags(tp.compute)}"
    if _is_plain_view(t):
        return {"label": f"#{i} {t.op.name}\n{view.label(t)}\n{state}", "shape": "ellipse",
                "style": "dashed,filled", "fillcolor": fill, "color": "gray60", "fontcolor": "gray40",
                "fontsize": "7", "height": "0.2"}
    attrs = {"label": label, "shape": "box", "style": "rounded,filled", "fillcolor": fill, "fontsize": "10"}
    if i in view.reduction_of:
        attrs.update({"color": "#b2182b", "penwidth": "3", "peripheries": "2"})
    return attrs


def _to_networkx(view: _View):
    """The shown part of the plan as a networkx DiGraph with Graphviz attributes; sources from
    outside the shown nodes appear as faint context nodes, each all-reduce as a red node."""
    import networkx as nx

    g = view.graph
    shown = {g.nodes[i] for i in view.nodes} | set(view.leaves)
    nxg = nx.DiGraph(name=g.name)
    for t in view.leaves:
        nxg.add_node(view.id[t], cluster=_leaf_cluster(view, t), **_dot_attrs(view, t))
    for i in view.nodes:
        n = g.nodes[i]
        nxg.add_node(view.id[n], cluster=view.subgraph_of.get(i), **_dot_attrs(view, n))
        for s in n.src:
            if s is None:
                continue
            if s not in shown:
                nxg.add_node(view.id[s], cluster=None, label=f"{view.label(s)}\n{_state_text(view.tp(s))}",
                             shape="plaintext", fontcolor="gray40", fontsize="8")
            style = "dashed" if _is_plain_view(n) else "solid"
            nxg.add_edge(view.id[s], view.id[n], style=style, color="gray50" if style == "dashed" else "black")
        if i in view.reduction_of:
            rid, k, r = view.reduction_of[i]
            rn = f"r{rid}"
            nxg.add_node(rn, cluster=k, label=f"all-reduce #{rid}\n{format_bytes(r.nbytes)}\ncovers {r.covers}",
                         shape="octagon", style="filled", fillcolor="#b2182b", fontcolor="white", fontsize="9")
            nxg.add_edge(view.id[n], rn, color="#b2182b", penwidth="2")
    return nxg


def _leaf_cluster(view: _View, t: Tensor) -> int | None:
    """A weight is drawn inside its consumers' subgraph when they all share one (tidier layout)."""
    if t.flags & Flag.INPUT:
        return None
    clusters = {view.subgraph_of.get(i) for i in view.nodes if t in view.graph.nodes[i].src}
    return clusters.pop() if len(clusters) == 1 else None


def _dot_quote(s: Any) -> str:
    return '"' + str(s).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _dot_attr_list(attrs: dict) -> str:
    return ", ".join(f"{k}={_dot_quote(v)}" for k, v in attrs.items() if k != "cluster" and v is not None)


_LEGEND = [("MIRRORED", "box", "rounded,filled"), ("PARTIAL", "box", "rounded,filled"),
           ("AXIS_0", "box", "rounded,filled"), ("AXIS_1", "box", "rounded,filled"),
           ("AXIS_2", "box", "rounded,filled"), ("AXIS_3", "box", "rounded,filled")]


def _legend_lines() -> list[str]:
    lines = ["  subgraph cluster_legend {", '    label="legend"; style="rounded"; color="gray70"; fontsize="10";']
    names = []
    for k, (state, shape, style) in enumerate(_LEGEND):
        names.append(f"legend{k}")
        lines.append(f"    legend{k} [label={_dot_quote(state)}, shape={shape}, style={_dot_quote(style)},"
                     f" fillcolor={_dot_quote(STATE_COLOURS[state])}, fontsize=9];")
    extras = [("weight (small box)", "box", "filled", "#ffffff", "8"),
              ("KV cache", "cylinder", "filled", "#ffffff", "8"),
              ("view (no compute)", "ellipse", "dashed,filled", "#ffffff", "7"),
              ("all-reduce", "octagon", "filled", "#b2182b", "9")]
    for k, (text, shape, style, fill, size) in enumerate(extras, start=len(_LEGEND)):
        names.append(f"legend{k}")
        font = ', fontcolor="white"' if fill == "#b2182b" else ""
        lines.append(f"    legend{k} [label={_dot_quote(text)}, shape={shape}, style={_dot_quote(style)},"
                     f" fillcolor={_dot_quote(fill)}, fontsize={size}{font}];")
    lines.append("    " + " -> ".join(names) + " [style=invis];")
    lines.append("  }")
    return lines


def _format_dot(view: _View, info: dict) -> str:
    nxg = _to_networkx(view)
    title = "\n".join(line.removeprefix("# ") for line in _header_text(info))
    lines = [f"digraph {_dot_quote(view.graph.name)} {{",
             f"  graph [rankdir=TB, label={_dot_quote(title)}, labelloc=t, labeljust=l, fontsize=11, nodesep=0.2,"
             f" ranksep=0.3, fontname=Helvetica];",
             '  node [fontname=Helvetica];', '  edge [arrowsize=0.6];']
    by_cluster: dict[int | None, list[str]] = {}
    for key, attrs in nxg.nodes(data=True):
        by_cluster.setdefault(attrs.get("cluster"), []).append(f"{_dot_quote(key)} [{_dot_attr_list(attrs)}];")
    for k in sorted(c for c in by_cluster if c is not None):
        sg = view.plan.subgraphs[k]
        red = " -> all-reduce" if sg.reduction is not None else ""
        lines.append(f"  subgraph cluster_sg{k} {{")
        lines.append(f"    label={_dot_quote(f'subgraph {k}: nodes {sg.start}..{sg.end}{red}')};"
                     ' style="dashed,rounded"; color="gray50"; fontsize=9;')
        lines += [f"    {s}" for s in by_cluster[k]]
        lines.append("  }")
    lines += [f"  {s}" for s in by_cluster.get(None, [])]
    for a, b, attrs in nxg.edges(data=True):
        lines.append(f"  {_dot_quote(a)} -> {_dot_quote(b)} [{_dot_attr_list(attrs)}];")
    lines += _legend_lines()
    lines.append("}")
    return "\n".join(lines) + "\n"


def render_svg(dot_text: str) -> str:
    """SVG through Graphviz's `dot`; a clear error when it is not installed."""
    exe = shutil.which("dot")
    if exe is None:
        raise MetatpError("--format svg needs Graphviz's `dot`: install it (apt-get install graphviz, "
                          "or brew install graphviz), or use --format dot")
    proc = subprocess.run([exe, "-Tsvg"], input=dot_text.encode("utf-8"), capture_output=True)
    if proc.returncode != 0:
        msg = proc.stderr.decode("utf-8", errors="replace").strip().splitlines()
        raise MetatpError(f"Graphviz dot failed: {msg[-1] if msg else 'exit status ' + str(proc.returncode)}")
    return proc.stdout.decode("utf-8")


# ---------------------------------------------------------------- public entry points


def _info(plan: Plan, layer: int | None, model: dict | None, batch: dict | None) -> dict:
    lay = plan.layout
    return {
        "graph": plan.graph.name,
        "stage": (plan.stats or {}).get("stage", "lowered"),
        "layer": layer,
        "model": model,
        "batch": batch,
        "layout": {"n_devices": lay.n_devices, "split_mode": lay.split_mode,
                   "tensor_split": list(lay.tensor_split) if lay.tensor_split is not None else None},
    }


def _batch_from_graph(graph: Graph, n_ctx: int | None) -> dict | None:
    spec = graph.meta.get("spec")
    if spec is None:
        return None
    phase = "decode" if spec.n_tokens == 1 else "prefill"
    return {"phase": phase, "n_tokens": spec.n_tokens, "n_kv": spec.n_kv, "n_outputs": spec.n_outputs,
            "n_ctx": n_ctx}


def _infer_n_ctx(graph: Graph) -> int:
    """The context size, from the KV cache leaves (0 for graphs without a cache)."""
    return max((t.ne[1] for t in graph.leaves if t.flags & Flag.KV_CACHE), default=0)


def dump(plan: Plan, fmt: str = "text", *, layer: int | None = None, link: Link | str = "nvlink",
         hparams=None, n_ctx: int | None = None, n_tokens: int | None = None, lowered: Plan | None = None,
         model: dict | None = None, batch: dict | None = None, allreduce: str = "auto", wire: str = "f32") -> str:
    """The plan as text, json, dot or svg.

    layer: only that layer's nodes (and the leaves they read); the summary stays whole-plan.
    link: a preset name or a Link, for the communication bill. hparams: the model's HParams
    (n_embd / n_layer for the bill; read off the graph when absent). lowered: the final plan,
    when `plan` is an earlier stage, so per-device memory can still be reported. allreduce / wire:
    the all-reduce mode and wire dtype the bill charges (a mode of collectives.ALLREDUCE_MODES)."""
    if fmt not in FORMATS:
        raise ConfigError(f"unknown format {fmt!r}; one of {', '.join(FORMATS)}")
    resolve_mode(allreduce)
    wire_dtype(2, 0, wire)
    view = _View(plan, layer, allreduce, wire)
    if n_ctx is None:
        n_ctx = _infer_n_ctx(plan.graph)
    if n_tokens is None:
        spec = plan.graph.meta.get("spec")
        n_tokens = spec.n_tokens if spec is not None else 1
    if batch is None:
        batch = _batch_from_graph(plan.graph, n_ctx)
    info = _info(plan, layer, model, batch)
    if fmt in ("dot", "svg"):
        dot_text = _format_dot(view, info)
        return dot_text if fmt == "dot" else render_svg(dot_text)
    summary = _summary(view, lowered, _link(link), n_tokens, hparams, n_ctx)
    if fmt == "json":
        return _format_json(view, info, summary, hparams)
    return _format_text(view, info, summary, hparams)


@dataclass
class DumpRequest:
    """What `metatp dump` was asked for (the CLI flags, as data)."""

    model: str | None = None
    n_devices: int | None = None
    split_mode: str | None = None
    tensor_split: tuple[float, ...] | None = None
    phase: str = "decode"
    n_tokens: int | None = None
    n_ctx: int | None = None
    stage: str = "lowered"
    layer: int | None = None
    fmt: str = "text"
    link: Link = LINKS["nvlink"]
    allreduce: str = "auto"
    wire: str = "f32"


def _layout(req: DumpRequest):
    from metatp.passes.plan import DeviceLayout

    ts = req.tensor_split
    n = req.n_devices if req.n_devices is not None else (len(ts) if ts else 1)
    mode = req.split_mode or ("tensor" if n > 1 or ts else "none")
    return DeviceLayout(n, mode, tuple(ts) if ts else None)


def _batch_spec(req: DumpRequest, n_ctx: int):
    """Decode: one token with the cache full (the largest decode step). Prefill: n_tokens into an
    empty cache, logits for the last one (as the engine runs a prompt)."""
    from metatp.engine import padded_kv
    from metatp.ir.models import BatchSpec

    if req.phase not in PHASES:
        raise ConfigError(f"--phase must be one of {', '.join(PHASES)}, got {req.phase!r}")
    if req.phase == "decode":
        if req.n_tokens not in (None, 1):
            raise ConfigError("--n-tokens sets the prefill batch; a decode step is always 1 token "
                              "(use --phase prefill)")
        return BatchSpec(1, padded_kv(n_ctx, n_ctx), 1)
    T = DEFAULT_PREFILL_TOKENS if req.n_tokens is None else req.n_tokens
    if T < 1:
        raise ConfigError(f"--n-tokens must be >= 1, got {T}")
    if T > n_ctx:
        raise ConfigError(f"--n-tokens {T} does not fit in the context of {n_ctx} (raise -c)")
    return BatchSpec(T, padded_kv(T, n_ctx), 1)


def _compile(graph: Graph, layout, hparams, stage: str) -> tuple[Plan, Plan]:
    """(the requested stage's plan, the lowered plan) -- memory needs the lowered one."""
    from metatp.passes.compile import STAGES, compile_stages
    from metatp.passes.plan import single_device_plan

    if stage not in STAGES:
        raise ConfigError(f"--stage must be one of {', '.join(STAGES)}, got {stage!r}")
    if layout.split_mode == "none":
        plan = single_device_plan(graph)
        return plan, plan
    stages = compile_stages(graph, layout, hparams, keep_all=stage != "lowered")
    return stages[stage], stages["lowered"]


def dump_model(req: DumpRequest) -> str:
    """Build the model's graph for the requested batch (no weights read), compile, dump."""
    from metatp.ir.models import ModelTensors, build_graph
    from metatp.models import resolve_model

    path = resolve_model(req.model)
    from metatp.ir.loader import load_model

    model = load_model(path, with_tokenizer=False)
    hp = model.hparams
    n_ctx = req.n_ctx if req.n_ctx is not None else min(DEFAULT_N_CTX, hp.n_ctx_train)
    if n_ctx < 1:
        raise ConfigError(f"-c must be >= 1, got {n_ctx}")
    layout = _layout(req)
    spec = _batch_spec(req, n_ctx)
    graph = build_graph(ModelTensors(model, n_ctx), spec)
    plan, lowered = _compile(graph, layout, hp, req.stage)
    model_info = {"path": str(path), "name": model.name, "arch": model.arch, "n_layer": hp.n_layer,
                  "n_embd": hp.n_embd, "n_head": hp.n_head, "n_head_kv": hp.n_head_kv[0] if hp.n_head_kv else None,
                  "n_vocab": hp.n_vocab, "tensor_data_bytes": model.weight_bytes()}
    batch = {"phase": req.phase, "n_tokens": spec.n_tokens, "n_kv": spec.n_kv, "n_outputs": spec.n_outputs,
             "n_ctx": n_ctx}
    return dump(plan, req.fmt, layer=req.layer, link=req.link, hparams=hp, n_ctx=n_ctx, n_tokens=spec.n_tokens,
                lowered=lowered, model=model_info, batch=batch, allreduce=req.allreduce, wire=req.wire)


# ---------------------------------------------------------------- CLI


def add_parser(sub) -> None:
    from metatp.backends.collectives.schedule import MODE_NAMES
    from metatp.backends.collectives.wire import WIRE_MODES
    from metatp.passes.compile import STAGES

    d = sub.add_parser("dump", help="show how the graph is split across devices (text, json, dot, svg)",
                       description="Compile the model's graph for a device layout and print the plan: split "
                                   "state of every tensor, subgraphs, all-reduces, memory and the communication bill.")
    d.add_argument("-m", "--model", default=None, help="GGUF path or known model name (default: smollm2-135m)")
    d.add_argument("--devices", type=int, default=None, help="number of devices to split across")
    d.add_argument("-sm", "--split-mode", default=None, choices=["none", "tensor"], help="none | tensor")
    d.add_argument("-ts", "--tensor-split", default=None, help="share per device, e.g. 3,1")
    d.add_argument("--phase", default="decode", choices=PHASES, help="decode (1 token, full cache) | prefill")
    d.add_argument("--n-tokens", type=int, default=None, help=f"prefill batch size (default {DEFAULT_PREFILL_TOKENS})")
    d.add_argument("-c", "--ctx-size", dest="n_ctx", type=int, default=None,
                   help="context size (default 2048, capped at the model's trained context)")
    d.add_argument("--stage", default="lowered", choices=STAGES, help="dump the plan after this pass (default lowered)")
    d.add_argument("--layer", type=int, default=None, help="only this layer's nodes")
    d.add_argument("--format", dest="fmt", default="text", choices=FORMATS, help="text | json | dot | svg")
    d.add_argument("-o", "--output", default=None, help="write to FILE instead of stdout")
    d.add_argument("--link", default="nvlink", choices=sorted(LINKS), help="interconnect preset for the bill")
    d.add_argument("--latency-us", type=float, default=None, help="override: fixed cost of one all-reduce (us)")
    d.add_argument("--bandwidth-gbs", type=float, default=None, help="override: link bandwidth (GB/s)")
    d.add_argument("--allreduce", default="auto", help=f"all-reduce the bill charges: {' | '.join(MODE_NAMES)} "
                   "(auto: the butterfly, as the numpy backend; nccl is billed as a ring)")
    d.add_argument("--wire", default="f32", help=f"all-reduce wire dtype for the bill: {' | '.join(WIRE_MODES)}")
    d.set_defaults(func=_cmd_dump)


def _link_from_args(args: argparse.Namespace) -> Link:
    base = LINKS[args.link]
    lat = base.latency_us if args.latency_us is None else args.latency_us
    bw = base.bandwidth_gbs if args.bandwidth_gbs is None else args.bandwidth_gbs
    if not lat >= 0:
        raise ConfigError(f"--latency-us must be >= 0, got {lat}")
    if not bw > 0:
        raise ConfigError(f"--bandwidth-gbs must be > 0, got {bw}")
    return Link(base.name, lat, bw)


def _cmd_dump(args: argparse.Namespace) -> int:
    from metatp.passes.plan import DeviceLayout

    req = DumpRequest(model=args.model, n_devices=args.devices, split_mode=args.split_mode,
                      tensor_split=DeviceLayout.parse_split(args.tensor_split) if args.tensor_split else None,
                      phase=args.phase, n_tokens=args.n_tokens, n_ctx=args.n_ctx, stage=args.stage,
                      layer=args.layer, fmt=args.fmt, link=_link_from_args(args), allreduce=args.allreduce,
                      wire=args.wire)
    text = dump_model(req)
    if args.output:
        try:
            Path(args.output).write_text(text, encoding="utf-8")
        except OSError as e:
            raise ConfigError(f"cannot write {args.output!r}: {e.strerror or e}") from None
    else:
        sys.stdout.write(text)
    return 0
