"""`metatp dump --format json`: the Plan as data (schema in docs/dump-format.md)."""

from __future__ import annotations

import json

from metatp.ir.ops import OPS, Op
from metatp.ir.tensor import Flag, Tensor
from metatp.tools.dump.view import (SCHEMA_VERSION, raw_weight_bytes, tensor_kind, state_data, PlanView, reduction_bytes)
from metatp.tools.dump.text import split_rules


# ---------------------------------------------------------------- json


def _tensor_data(view: PlanView, t: Tensor, why: dict[Tensor, str]) -> dict:
    tp = view.tp(t)
    g = view.graph
    is_node = t.op is not Op.NONE
    bytes_per_device = None
    if tp is not None and tp.local and t.flags & Flag.WEIGHT:
        bytes_per_device = [raw_weight_bytes(t, loc.ne) for loc in tp.local]
    return {
        "id": view.id[t],
        "index": g.index[t] if is_node else view.leaf_index[t],
        "kind": tensor_kind(t),
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
        "state": state_data(tp.state) if tp else None,
        "sync_state": state_data(tp.sync_state) if tp else None,
        "compute": list(tp.compute) if tp else None,
        "zero_fill": list(tp.zero_fill) if tp and tp.zero_fill is not None else None,
        "owner": tp.owner if tp else None,
        "local": [{"ne": list(loc.ne), "nb": list(loc.nb), "offs": loc.offs} for loc in tp.local] if tp else [],
        "subgraph": view.subgraph_of.get(g.index[t]) if is_node else None,
        "split_rule": why.get(t) if not is_node else None,
        "bytes_per_device": bytes_per_device,
    }


def _active(view: PlanView, node: int) -> list[bool] | None:
    """Which devices contribute to the all-reduce of node `node`: the node's compute flags."""
    tp = view.plan.tensors.get(view.graph.nodes[node])
    return list(tp.compute) if tp is not None else None


def _reductions_data(view: PlanView) -> list[dict]:
    out = []
    for node, (rid, k, r) in sorted(view.reduction_of.items(), key=lambda kv: kv[1][0]):
        p = view.plan.n_devices if r.devices is None else len(r.devices)     # layer,tensor: one group
        out.append({
            "id": rid, "subgraph": k, "node": r.node, "node_id": f"n{r.node}",
            "node_label": view.label(view.graph.nodes[r.node]),
            "covers": list(r.covers), "cover_labels": [view.label(view.graph.nodes[c]) for c in r.covers],
            "nbytes": r.nbytes, "ring_bytes_per_rank": round(2 * (p - 1) / p * r.nbytes) if p > 1 else 0,
            "bytes_per_rank": reduction_bytes(p, r.nbytes, view.allreduce, view.wire)[0],
            "active": _active(view, r.node),
            "devices": list(r.devices) if r.devices is not None else None,
        })
    return out


def format_json(view: PlanView, info: dict, summary: dict, hparams) -> str:
    why = split_rules(view, hparams)
    subgraphs = []
    for k, sg in enumerate(view.plan.subgraphs):
        rid = view.reduction_of[sg.reduction.node][0] if sg.reduction is not None else None
        subgraphs.append({"id": k, "start": sg.start, "end": sg.end, "n_nodes": sg.end - sg.start + 1,
                          "reduction": rid, "transfers": [{"node": x.node, "src": x.src, "dst": x.dst,
                                                           "nbytes": x.nbytes} for x in sg.transfers]})
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
