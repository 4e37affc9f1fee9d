"""Mixture-of-experts graphs: qwen3moe, qwen2moe (with a shared expert) and mixtral (`llama` with experts).

The expert FFN follows llama.cpp's `build_moe_ffn` node for node, because the compiler's delayed-
reduction coalescing recognises exactly that pattern:

    logits   = mul_mat(ffn_gate_inp, cur)                      [n_expert, T]
    probs    = soft_max(logits)
    selected = top_k(probs, n_used)                             [n_used, T] I32
    weights  = get_rows(reshape(probs, 1, n_expert, T), selected)   [1, n_used, T]
    (normalise: sum_rows + div, for mixtral and qwen3moe; scale by `{arch}.expert_weights_scale` if set)
    up, gate = mul_mat_id(ffn_{up,gate}_exps, reshape(cur, n_embd, 1, T), selected)
    experts  = mul_mat_id(ffn_down_exps, glu_split(gate, up), selected)   [n_embd, n_used, T]
    (add_id with ffn_down_exps.bias when present: the PARTIAL expert bias)
    experts  = mul(experts, weights)
    out      = view_0 + view_1 + ... (view k: offset k*nb[1], shape [n_embd, T], stride nb[2])

Under tensor parallelism the expert weights are split along the expert FFN dim, so `experts` is a
partial sum on every device and the whole chain down to `out` is linear in it: one all-reduce.
llama.cpp clamps the weight sum to >= 6.1e-5 before dividing; that clamp is left out (a sum of
softmax probabilities is never that small for the expert counts these models use).
"""

from __future__ import annotations

import functools

from metatp.ir import ops
from metatp.ir.graph import Graph
from metatp.ir.models.common import ArchSpec, BatchSpec, ModelTensors
from metatp.ir.models.llama import build_llama
from metatp.ir.ops import GluOp, UnaryOp
from metatp.ir.tensor import Tensor

__all__ = ["build_moe", "build_moe_ffn", "moe_ffn"]

# ---------------------------------------------------------------- experts


def _expert_weights(probs: Tensor, selected: Tensor, normalise: bool, w_scale: float, il: int) -> Tensor:
    """The selected experts' router probabilities [1, n_used, T], optionally renormalised and scaled."""
    n_expert, n_tok = probs.ne[0], probs.ne[1]
    n_used = selected.ne[0]
    weights = ops.get_rows(ops.reshape(probs, 1, n_expert, n_tok), selected, name=f"ffn_moe_weights-{il}")
    if normalise:
        w2 = ops.reshape(weights, n_used, n_tok)
        total = ops.sum_rows(w2, name=f"ffn_moe_weights_sum-{il}")
        w2 = ops.div(w2, total, name=f"ffn_moe_weights_norm-{il}")
        weights = ops.reshape(w2, 1, n_used, n_tok)
    if w_scale not in (0.0, 1.0):
        weights = ops.scale(weights, w_scale, name=f"ffn_moe_weights_scaled-{il}")
    return weights


def _sum_experts(experts: Tensor, il: int) -> Tensor:
    """Σ_k experts[:, k, :] as n_used views and a chain of adds (the coalescing pattern)."""
    n_embd, n_used, n_tok = experts.ne[0], experts.ne[1], experts.ne[2]
    views = [ops.view(experts, (n_embd, n_tok), (experts.nb[2],), k * experts.nb[1], name=f"ffn_moe_view{k}-{il}")
             for k in range(n_used)]
    out = views[0]
    for k in range(1, n_used):
        out = ops.add(out, views[k], name=f"ffn_moe_sum{k}-{il}")
    if n_used == 1:
        out = ops.cont(out, name=f"ffn_moe_out-{il}")   # a lone view is not contiguous
    return out


def build_moe_ffn(t: ModelTensors, il: int, cur: Tensor, normalise: bool) -> Tensor:
    """Routed SwiGLU experts for `cur` [n_embd, T] -> [n_embd, T] (llama.cpp's build_moe_ffn)."""
    hp = t.hp
    p = f"blk.{il}"
    n_embd, n_tok = cur.ne[0], cur.ne[1]
    n_expert, n_used = hp.n_expert, hp.n_expert_used
    n_ff = t.w(f"{p}.ffn_up_exps.weight").ne[1]
    up_w = t.w(f"{p}.ffn_up_exps.weight", (n_embd, n_ff, n_expert))
    logits = ops.mul_mat(t.w(f"{p}.ffn_gate_inp.weight", (n_embd, n_expert)), cur, name=f"ffn_moe_logits-{il}")
    probs = ops.soft_max(logits, name=f"ffn_moe_probs-{il}")
    selected = ops.top_k(probs, n_used, name=f"ffn_moe_topk-{il}")
    weights = _expert_weights(probs, selected, normalise, hp.expert_weights_scale, il)
    x = ops.reshape(cur, n_embd, 1, n_tok)
    up = ops.mul_mat_id(up_w, x, selected, name=f"ffn_moe_up-{il}")
    gate = ops.mul_mat_id(t.w(f"{p}.ffn_gate_exps.weight", (n_embd, n_ff, n_expert)), x, selected,
                          name=f"ffn_moe_gate-{il}")
    act = ops.glu_split(gate, up, GluOp.SWIGLU, name=f"ffn_moe_swiglu-{il}")
    experts = ops.mul_mat_id(t.w(f"{p}.ffn_down_exps.weight", (n_ff, n_embd, n_expert)), act, selected,
                             name=f"ffn_moe_down-{il}")
    if t.opt(f"{p}.ffn_down_exps.bias") is not None:   # PARTIAL in the split table: added once in the sum
        experts = ops.add_id(experts, t.w(f"{p}.ffn_down_exps.bias", (n_embd, n_expert)), selected,
                             name=f"ffn_moe_down_biased-{il}")
    experts = ops.mul(experts, weights, name=f"ffn_moe_weighted-{il}")
    return _sum_experts(experts, il)


def _shared_expert(t: ModelTensors, il: int, cur: Tensor) -> Tensor:
    """qwen2moe's always-on expert, gated by sigmoid(ffn_gate_inp_shexp . cur) written as silu(x)/x."""
    hp = t.hp
    p = f"blk.{il}"
    n_ff = t.w(f"{p}.ffn_up_shexp.weight").ne[1]
    gate_inp = ops.mul_mat(t.w(f"{p}.ffn_gate_inp_shexp.weight", (hp.n_embd,)), cur, name=f"ffn_shexp_gate_inp-{il}")
    gate_sig = ops.div(ops.unary(gate_inp, UnaryOp.SILU), gate_inp, name=f"ffn_shexp_gate-{il}")
    up = ops.mul_mat(t.w(f"{p}.ffn_up_shexp.weight", (hp.n_embd, n_ff)), cur)
    gate = ops.mul_mat(t.w(f"{p}.ffn_gate_shexp.weight", (hp.n_embd, n_ff)), cur)
    act = ops.glu_split(gate, up, GluOp.SWIGLU, name=f"ffn_shexp_swiglu-{il}")
    out = ops.mul_mat(t.w(f"{p}.ffn_down_shexp.weight", (n_ff, hp.n_embd)), act, name=f"ffn_shexp-{il}")
    return ops.mul(out, gate_sig, name=f"ffn_shexp_out-{il}")


def moe_ffn(t: ModelTensors, il: int, cur: Tensor, normalise: bool) -> Tensor:
    """The routed experts (+ the shared expert when the model has one) for layer il."""
    out = build_moe_ffn(t, il, cur, normalise)
    if t.opt(f"blk.{il}.ffn_up_shexp.weight") is not None:
        out = ops.add(out, _shared_expert(t, il, cur), name=f"ffn_out-{il}")
    return out


def build_moe(t: ModelTensors, spec: BatchSpec, arch: ArchSpec) -> Graph:
    """Pre-norm residual layers whose FFN is a routed mixture of experts (+ a shared expert if present)."""
    return build_llama(t, spec, arch, ffn=functools.partial(moe_ffn, normalise=arch.normalise_expert_weights))
