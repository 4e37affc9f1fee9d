"""What `metatp dump` says about a -sm layer plan: the layer assignment and the copy bill.

A layer split moves, at each device boundary, one hidden vector per token (n_embd float32):
the bill is the plan's transfers, counted per step (exact, from the plan), per token (the
bytes of one row of every transferred tensor) and per prompt of DEFAULT_PREFILL_TOKENS tokens
(that many rows per boundary between layers; the hop into the output layer, when the last
layer sits elsewhere, carries only the row whose logits a prompt wants). Time charges the
link's fixed cost once per copy plus the bytes over its bandwidth (the same Link as the
all-reduce bill).
"""

from __future__ import annotations

from metatp.passes.plan import Plan
from metatp.tools.dump.view import DEFAULT_PREFILL_TOKENS, Link

__all__ = ["layer_assignment", "transfer_bill"]


def layer_assignment(plan: Plan) -> dict:
    """Input layer, each layer and the output layer -> device, and the layers each device runs."""
    stats = plan.stats or {}
    layers = list(stats.get("layer_devices", []))
    per_device = [[il for il, d in enumerate(layers) if d == k] for k in range(plan.n_devices)]
    return {"input_device": stats.get("input_device", 0), "layer_devices": layers,
            "output_device": stats.get("output_device", 0), "layers_per_device": per_device}


def _row_bytes(plan: Plan, node: int, nbytes: int) -> int:
    t = plan.graph.nodes[node]
    rows = t.ne[1] * t.ne[2] * t.ne[3]
    return nbytes // rows if rows else nbytes


def _output_hop(plan: Plan, moves: list[dict]) -> dict | None:
    """The copy into the output layer (the last one to its device), when the last layer runs on
    another device; None otherwise."""
    a = layer_assignment(plan)
    if not a["layer_devices"] or a["layer_devices"][-1] == a["output_device"]:
        return None
    into = [m for m in moves if m["dst"] == a["output_device"]]
    return into[-1] if into else None


def transfer_bill(plan: Plan, link: Link, n_tokens: int) -> dict:
    """The copies of a layer plan: each one, and bytes / estimated time per step, token and prompt."""
    nodes = plan.graph.nodes
    moves = [{"node": x.node, "name": nodes[x.node].name, "src": x.src, "dst": x.dst, "nbytes": x.nbytes,
              "bytes_per_token": _row_bytes(plan, x.node, x.nbytes)} for x in plan.transfers]
    step = sum(m["nbytes"] for m in moves)
    per_token = sum(m["bytes_per_token"] for m in moves)
    prompt = DEFAULT_PREFILL_TOKENS
    head = _output_hop(plan, moves)
    per_prompt = sum(m["bytes_per_token"] * (1 if m is head else prompt) for m in moves)
    return {
        **layer_assignment(plan),
        "link": {"name": link.name, "latency_us": link.latency_us, "bandwidth_gbs": link.bandwidth_gbs},
        "transfers": moves,
        "transfers_per_step": len(moves),
        "n_tokens_per_step": n_tokens,
        "bytes_per_step": step,
        "bytes_per_token": per_token,
        "prompt_tokens": prompt,
        "bytes_per_prompt": per_prompt,
        "latency_per_step_us": link.seconds(len(moves), step) * 1e6,
        "latency_per_token_us": link.seconds(len(moves), per_token) * 1e6,
    }
