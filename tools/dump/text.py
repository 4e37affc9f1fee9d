"""`metatp dump` as text, for a person."""

from __future__ import annotations

from typing import Sequence

from metatp.backends.collectives.schedule import resolve_mode
from metatp.ir.errors import SplitError
from metatp.ir.tensor import Flag, Tensor
from metatp.passes.memory import format_bytes
from metatp.tools.dump.view import (layer_spans, raw_weight_bytes, tensor_kind, shape_text, flags_text, PlanView, reduction_bytes)


# ---------------------------------------------------------------- text


def _bytes_exact(n: int) -> str:
    """`2.25 KiB (2304 B)`; plain `256 B` when the unit is bytes anyway."""
    short = format_bytes(n)
    return short if short.endswith(" B") else f"{short} ({n} B)"


def _per_device(values: Sequence[int]) -> str:
    return ", ".join(f"dev{j} {format_bytes(v)}" for j, v in enumerate(values))


def state_text(tp) -> str:
    if tp is None:
        return "-"
    s = str(tp.state)
    if str(tp.sync_state) != s and not tp.state.is_partial:
        s += f" (sync {tp.sync_state})"
    return s


def _leaf_line(view: PlanView, t: Tensor, why: dict[Tensor, str]) -> str:
    tp = view.tp(t)
    kind = {"weight": "W", "kv_cache": "KV", "input": "IN"}.get(tensor_kind(t), "-")
    line = f"  {kind:<3}{t.name:<34} {shape_text(t.ne):<22} {t.type.name:<5} {state_text(tp):<24}"
    if tp is not None and tp.local and t.flags & Flag.WEIGHT:
        line += " bytes=" + "|".join(format_bytes(raw_weight_bytes(t, loc.ne)) for loc in tp.local)
    if tp is not None and tp.owner is not None:
        line += f" owner={tp.owner}"
    if why.get(t):
        line += f"  ({why[t]})"
    return line.rstrip()


def _node_line(view: PlanView, i: int) -> str:
    n = view.graph.nodes[i]
    tp = view.tp(n)
    line = f"{i:>5}  {n.op.name:<14} {view.label(n):<40} {shape_text(n.ne):<20} {n.type.name:<5} {state_text(tp):<24}"
    if tp is not None:
        line += f" compute={flags_text(tp.compute)}"
        if tp.zero_fill and any(tp.zero_fill):
            line += f" zero={flags_text(tp.zero_fill)}"
        if tp.owner is not None:
            line += f" owner={tp.owner}"
    if i in view.subgraph_of:
        line += f" sg={view.subgraph_of[i]}"
    return line.rstrip()


def _reduction_line(view: PlanView, i: int) -> str:
    rid, k, r = view.reduction_of[i]
    p = view.plan.n_devices if r.devices is None else len(r.devices)
    covers = ", ".join(f"{c} {view.label(view.graph.nodes[c])}" for c in r.covers)
    per_rank, _ = reduction_bytes(p, r.nbytes, view.allreduce, view.wire)
    group = f" within [{','.join(f'dev{d}' for d in r.devices)}]" if r.devices is not None else ""
    tp = view.plan.tensors.get(view.graph.nodes[r.node])
    active = f" active={flags_text(tp.compute)}" if tp is not None else ""
    return (f"{'':5}  ==== all-reduce #{rid}{group} of node {r.node} (end of subgraph {k}): {_bytes_exact(r.nbytes)},"
            f" {resolve_mode(view.allreduce).name} {format_bytes(per_rank)}/rank{active}; covers PARTIAL {covers}")


def header_text(info: dict) -> list[str]:
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
    every = "every device of its stage's group" if s.get("stages") else "every device"
    out.append(f"  mirrored weights: {format_bytes(s['mirrored_weight_bytes'])} held in full by {every}"
               f" (overhead {format_bytes(s['mirrored_overhead_bytes'])} over one copy)")
    c = s["communication"]
    if c is not None:
        out += _bill_text(c)
    if s.get("logits_read"):
        from metatp.tools.logits_bill import bill_lines
        out += bill_lines(s["logits_read"])
    if s.get("transfers"):
        out += _transfer_text(s["transfers"])
    if s.get("stages"):
        from metatp.tools.dump.stage_bill import stage_text

        out += stage_text(s["stages"])
    return out


def _transfer_text(b: dict) -> list[str]:
    """-sm layer: which device runs which layers, and the copies at the boundaries."""
    link = b["link"]
    out = ["", "layer assignment (llama.cpp's rule: layers in proportion to -ts, output layer as slot n_layer)",
           f"  input layer (token embeddings): dev{b['input_device']}"]
    for d, layers in enumerate(b["layers_per_device"]):
        span = layer_spans(layers)
        out.append(f"  dev{d}: {len(layers)} layer(s){' ' + span if span else ''}")
    out.append(f"  output layer (final norm, lm head): dev{b['output_device']}")
    out += ["", f"copy bill (point-to-point, no all-reduce; link {link['name']}: {link['latency_us']:g} us per copy,"
                f" {link['bandwidth_gbs']:g} GB/s)"]
    for m in b["transfers"]:
        out.append(f"  node {m['node']} {m['name'] or '(unnamed)'}: dev{m['src']} -> dev{m['dst']},"
                   f" {_bytes_exact(m['nbytes'])} per step, {m['bytes_per_token']} B per token")
    out.append(f"  copies per step: {b['transfers_per_step']} ({b['n_tokens_per_step']} token(s) per step),"
               f" {_bytes_exact(b['bytes_per_step'])} per step")
    out.append(f"  per token: {_bytes_exact(b['bytes_per_token'])} (one hidden vector per boundary);"
               f" per {b['prompt_tokens']}-token prompt: {_bytes_exact(b['bytes_per_prompt'])}")
    out.append(f"  est. latency: {b['latency_per_step_us']:.1f} us per step,"
               f" {b['latency_per_token_us']:.2f} us per token")
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


def split_rules(view: PlanView, hparams) -> dict[Tensor, str]:
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


def format_text(view: PlanView, info: dict, summary: dict, hparams) -> str:
    lines = header_text(info)
    why = split_rules(view, hparams)
    lines += ["", f"leaves ({len(view.leaves)}): kind name shape type state [bytes per device] (split rule)"]
    lines += [_leaf_line(view, t, why) for t in view.leaves]
    lines += ["", f"nodes ({len(view.nodes)}): index op name shape type state compute=<per device> sg=<subgraph>"]
    copies = {sub.end: sub.transfers for sub in view.plan.subgraphs if sub.transfers}
    for i in view.nodes:
        lines.append(_node_line(view, i))
        if i in view.reduction_of:
            lines.append(_reduction_line(view, i))
        for x in copies.get(i, ()):
            lines.append(f"{'':5}  ==== copy of node {x.node} {view.label(view.graph.nodes[x.node])}: dev{x.src} -> "
                         f"dev{x.dst}, {_bytes_exact(x.nbytes)}")
    lines += _summary_text(summary)
    return "\n".join(lines) + "\n"
