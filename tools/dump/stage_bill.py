"""What `metatp dump` says about a -sm layer,tensor plan: the stages, their groups, and the bill.

Each stage's tensor group all-reduces among its T devices only (twice per layer, as -sm tensor
over T devices), and at each stage boundary every device of the group copies the residual to
its counterpart in the next group (one hidden vector per token per device pair). A rank's
traffic per step is its group's all-reduces (the busiest rank's bytes under the billed
schedule, over T devices) plus the copies it sends; the bill reports it per stage and for the
busiest rank, per step, per token and per prompt of DEFAULT_PREFILL_TOKENS tokens (the copies
as `layer_bill` counts them; the all-reduces of such a prompt scale with its tokens, since they
are the same tensors, one row per token).
"""

from __future__ import annotations

from metatp.backends.collectives.schedule import resolve_mode
from metatp.passes.plan import Plan
from metatp.tools.dump.layer_bill import transfer_bill
from metatp.passes.memory import format_bytes
from metatp.tools.dump.view import DEFAULT_PREFILL_TOKENS, Link, layer_spans, reduction_bytes

__all__ = ["stage_bill", "stage_text"]


def stage_bill(plan: Plan, link: Link, n_tokens: int, allreduce: str = "auto", wire: str = "f32") -> dict:
    """Stages, groups, layers, per-stage all-reduces, the copies, and the busiest rank's bytes."""
    lay, stats = plan.layout, plan.stats or {}
    p, t = lay.pp, lay.tp
    mode = resolve_mode(allreduce).name
    layers = list(stats.get("layer_stages", []))
    copies = transfer_bill(plan, link, n_tokens)
    tokens = max(n_tokens, 1)
    stages = []
    for s in range(p):
        group = lay.stage_devices(s)
        reds = [r for r in plan.reductions if (r.devices or tuple(range(lay.n_devices)))[0] in group]
        per_rank = sum(reduction_bytes(t, r.nbytes, mode, wire)[0] for r in reds)
        sent = [sum(m["nbytes"] for m in copies["transfers"] if m["src"] == d) for d in group]
        sent_token = [sum(m["bytes_per_token"] for m in copies["transfers"] if m["src"] == d) for d in group]
        stages.append({"stage": s, "devices": list(group), "layers": [il for il, x in enumerate(layers) if x == s],
                       "allreduces_per_step": len(reds), "allreduce_bytes_per_rank_per_step": per_rank,
                       "copy_bytes_sent_per_rank_per_step": max(sent), "copy_bytes_sent_per_rank_per_token":
                       max(sent_token)})
    busiest = max(stages, key=lambda x: x["allreduce_bytes_per_rank_per_step"] + x["copy_bytes_sent_per_rank_per_step"])
    step = busiest["allreduce_bytes_per_rank_per_step"] + busiest["copy_bytes_sent_per_rank_per_step"]
    token = round(busiest["allreduce_bytes_per_rank_per_step"] / tokens) + busiest["copy_bytes_sent_per_rank_per_token"]
    n_red = busiest["allreduces_per_step"]
    return {
        "pp": p, "tp": t, "allreduce": mode, "wire": wire,
        "link": copies["link"],
        "output_stage": stats.get("output_stage", p - 1),
        "stages": stages,
        "copies": copies,
        "n_tokens_per_step": n_tokens,
        "busiest_rank_bytes_per_step": step,
        "busiest_rank_bytes_per_token": token,
        "prompt_tokens": DEFAULT_PREFILL_TOKENS,
        "busiest_rank_bytes_per_prompt": round(busiest["allreduce_bytes_per_rank_per_step"] / tokens
                                               * DEFAULT_PREFILL_TOKENS)
        + busiest["copy_bytes_sent_per_rank_per_token"] * DEFAULT_PREFILL_TOKENS,
        "latency_per_step_us": (link.seconds(n_red, busiest["allreduce_bytes_per_rank_per_step"])
                                + link.seconds(copies["transfers_per_step"] // max(t, 1),
                                               busiest["copy_bytes_sent_per_rank_per_step"])) * 1e6,
    }


def stage_text(b: dict) -> list[str]:
    """The text section of `stage_bill`."""
    link = b["link"]
    out = ["", f"stages (-sm layer,tensor: --pp {b['pp']} stages of --tp {b['tp']} devices; layers by llama.cpp's "
               "rule over equal stage shares, -ts inside each group)"]
    for s in b["stages"]:
        devs = ",".join(f"dev{d}" for d in s["devices"])
        span = layer_spans(s["layers"])
        out.append(f"  stage {s['stage']} [{devs}]: {len(s['layers'])} layer(s){' ' + span if span else ''}"
                   f"{' + input layer' if s['stage'] == 0 else ''}{' + output layer' if s['stage'] == b['output_stage'] else ''};"
                   f" {s['allreduces_per_step']} all-reduce(s) per step within the group,"
                   f" {format_bytes(s['allreduce_bytes_per_rank_per_step'])} per rank ({b['allreduce']}, {b['wire']}),"
                   f" copies sent {format_bytes(s['copy_bytes_sent_per_rank_per_step'])} per rank")
    out += ["", f"stage copies (link {link['name']}: {link['latency_us']:g} us per copy, {link['bandwidth_gbs']:g} GB/s)"]
    for m in b["copies"]["transfers"]:
        out.append(f"  node {m['node']} {m['name'] or '(unnamed)'}: dev{m['src']} -> dev{m['dst']},"
                   f" {m['nbytes']} B per step, {m['bytes_per_token']} B per token")
    out.append(f"  busiest rank (its group's all-reduces + the copies it sends): "
               f"{format_bytes(b['busiest_rank_bytes_per_step'])} per step ({b['n_tokens_per_step']} token(s)), "
               f"{format_bytes(b['busiest_rank_bytes_per_token'])} per token, "
               f"{format_bytes(b['busiest_rank_bytes_per_prompt'])} per {b['prompt_tokens']}-token prompt")
    out.append(f"  est. latency: {b['latency_per_step_us']:.1f} us per step")
    return out
