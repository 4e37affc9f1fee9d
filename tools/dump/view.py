"""The analysis `metatp dump` shows: per-tensor facts, a view of a Plan, the memory summary and the
communication bill (bytes the chosen all-reduce schedule moves per token)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

from metatp.backends.collectives.schedule import allreduce_bytes, resolve_mode
from metatp.backends.collectives.wire import wire_dtype
from metatp.ir.errors import ConfigError
from metatp.ir.graph import Graph
from metatp.ir.ops import OPS, Op
from metatp.ir.tensor import Flag, Tensor, block_size, type_size
from metatp.passes.memory import MemoryPlan, plan_memory
from metatp.passes.plan import Plan, Reduction
from metatp.passes.state import SplitState
from metatp.tools.logits_bill import logits_bill


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


def as_link(link: Link | str) -> Link:
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


def tensor_kind(t: Tensor) -> str:
    if t.op is not Op.NONE:
        return "node"
    if t.flags & Flag.WEIGHT:
        return "weight"
    if t.flags & Flag.KV_CACHE:
        return "kv_cache"
    if t.flags & Flag.INPUT:
        return "input"
    return "leaf"


def is_plain_view(t: Tensor) -> bool:
    """Views that only re-describe memory (drawn faintly); SET_ROWS / CPY write, so they count."""
    return OPS[t.op].is_view and t.op not in (Op.SET_ROWS, Op.CPY)


def shape_text(ne: Sequence[int]) -> str:
    return "[" + ",".join(str(x) for x in ne) + "]"


def flags_text(bits: Sequence[bool] | None) -> str:
    return "".join("1" if b else "0" for b in bits) if bits else ""


def state_data(st: SplitState | None) -> dict | None:
    if st is None:
        return None
    if not st.is_split:
        return {"kind": "mirrored" if st.is_mirrored else "partial", "axis": None, "text": str(st),
                "extents": None, "segments": []}
    return {"kind": "split", "axis": st.axis, "text": str(st), "extents": list(st.extents()),
            "segments": [{"per_device": list(seg), "repeats": r} for seg, r in zip(st.ne, st.nr)]}


# ---------------------------------------------------------------- the view of a plan


class PlanView:
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


def _mirrored_overhead(plan: Plan, mirrored: int) -> int:
    """What mirroring costs over one copy: (holders - 1) x each mirrored weight's bytes; the
    holders are every device but under -sm layer,tensor (a stage's group: its Locals say)."""
    if plan.layout.split_mode != "layer,tensor" or not plan.tensors:
        return mirrored * (plan.n_devices - 1)
    total = 0
    for t in plan.graph.leaves:
        tp = plan.tensors.get(t)
        if t.flags & Flag.WEIGHT and tp is not None and tp.state.is_mirrored:
            held = sum(1 for loc in tp.local if loc.nelements) if tp.local else plan.n_devices
            total += raw_weight_bytes(t, t.ne) * max(held - 1, 0)
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


def reduction_bytes(n_devices: int, nbytes: int, allreduce: str, wire: str) -> tuple[int, int]:
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
    link = as_link(link)
    mode = resolve_mode(allreduce).name
    wire_dtype(2, 0, wire)      # validates the wire mode
    p = plan.n_devices
    reductions = plan.reductions
    n_red = len(reductions)
    reduced = sum(r.nbytes for r in reductions)
    ring = 2 * (p - 1) / p if p > 1 else 0.0
    ring_bytes = ring * reduced
    counts = [reduction_bytes(p, r.nbytes, mode, wire) for r in reductions]
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


def plan_summary(view: PlanView, lowered: Plan | None, link: Link, n_tokens: int, hparams, n_ctx: int) -> dict:
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
        "mirrored_overhead_bytes": _mirrored_overhead(plan if plan.tensors else (lowered or plan), mirrored),
        "memory": mem.as_dict() if mem is not None else None,
        "communication": communication_bill(plan, link, n_tokens=n_tokens, hparams=hparams,
                                            allreduce=view.allreduce, wire=view.wire) if compiled else None,
        "logits_read": logits_bill(plan) if compiled else None,
    }


def layer_spans(layers: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    parts: list[tuple[int, int]] = []
    for il in layers:
        if parts and parts[-1][1] == il - 1:
            parts[-1] = (parts[-1][0], il)
        else:
            parts.append((il, il))
    return ", ".join(f"{a}-{b}" if a != b else f"{a}" for a, b in parts)
