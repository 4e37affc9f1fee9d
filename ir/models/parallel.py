"""Parallel-residual graph: Cohere Command-R (`command-r`).

Attention and the SwiGLU FFN both read the same LayerNorm'd input, and the layer output is
`x + attn(h) + ffn(h)`. Mirrors llama.cpp's `llm_build_command_r` node for node, with one
deliberate difference in the order of the two final adds: llama.cpp computes `(ffn + x) + attn`;
this builder emits `add(attn_out, ffn_out)` first and then adds the residual, so the two
row-parallel (PARTIAL) branch outputs meet before anything mirrored is added and the compiler
can merge them into a single all-reduce per layer instead of two.

LayerNorm here is `ggml_norm` times the weight (no bias, as Command-R stores none); optional
per-head q/k norms (Command-R+) are LayerNorms too; embeddings are tied and the logits are
multiplied by `{arch}.logit_scale`.
"""

from __future__ import annotations

import math

from metatp.ir import ops
from metatp.ir.graph import Graph
from metatp.ir.models.common import BatchSpec, ModelTensors, embed, graph_inputs, linear, output_graph, select_outputs
from metatp.ir.models.llama import ffn_swiglu, kv_store_and_attend
from metatp.ir.ops import RopeMode
from metatp.ir.tensor import Tensor

__all__ = ["build_command_r", "logit_scale"]


def _layer_norm(t: ModelTensors, x: Tensor, weight: Tensor, name: str) -> Tensor:
    """LLM_NORM: (x - mean) / sqrt(var + eps) * w."""
    return ops.mul(ops.norm(x, t.hp.norm_eps), weight, name=name)


def logit_scale(t: ModelTensors) -> float:
    """`{arch}.logit_scale` from the metadata (0 or absent: no scaling)."""
    return float(t.model.metadata.get(f"{t.hp.arch}.logit_scale", 0.0) or 0.0)


def _attention(t: ModelTensors, il: int, cur: Tensor, inp: dict[str, Tensor], spec: BatchSpec) -> Tensor:
    """Separate q/k/v (+ biases), optional per-head LayerNorm q/k norms, normal rope, attention, wo."""
    hp = t.hp
    T = spec.n_tokens
    p = f"blk.{il}"
    hd, n_head, n_head_kv = hp.head_dim_k, hp.n_head, hp.n_head_kv[il]
    q = linear(t, cur, f"{p}.attn_q", (hp.n_embd, hd * n_head))
    k = linear(t, cur, f"{p}.attn_k", (hp.n_embd, hd * n_head_kv))
    v = linear(t, cur, f"{p}.attn_v", (hp.n_embd, hp.head_dim_v * n_head_kv))
    q = ops.reshape(q, hd, n_head, T, name=f"Qcur-{il}")
    k = ops.reshape(k, hd, n_head_kv, T, name=f"Kcur-{il}")
    v = ops.reshape(v, hp.head_dim_v, n_head_kv, T, name=f"Vcur-{il}")
    qn = t.opt(f"{p}.attn_q_norm.weight")
    if qn is not None:
        q = _layer_norm(t, q, qn, f"Qnorm-{il}")
    q = ops.rope(q, inp["pos"], hp.rope_dims, RopeMode.NORMAL, hp.rope_freq_base, hp.rope_freq_scale,
                 name=f"Qrope-{il}")
    kn = t.opt(f"{p}.attn_k_norm.weight")
    if kn is not None:
        k = _layer_norm(t, k, kn, f"Knorm-{il}")
    k = ops.rope(k, inp["pos"], hp.rope_dims, RopeMode.NORMAL, hp.rope_freq_base, hp.rope_freq_scale,
                 name=f"Krope-{il}")
    att = kv_store_and_attend(t, il, q, k, v, inp, spec, 1.0 / math.sqrt(hd))
    return linear(t, att, f"{p}.attn_output", (hp.head_dim_v * n_head, hp.n_embd))


def build_command_r(t: ModelTensors, spec: BatchSpec) -> Graph:
    """Command-R: one LayerNorm per layer feeding attention and FFN in parallel."""
    hp = t.hp
    inp = graph_inputs(spec)
    x = embed(t, inp)
    for il in range(hp.n_layer):
        h = _layer_norm(t, x, t.w(f"blk.{il}.attn_norm.weight", (hp.n_embd,)), f"attn_norm-{il}")
        attn_out = _attention(t, il, h, inp, spec)
        attn_out, x, ffn_inp = select_outputs(inp, il, hp.n_layer, attn_out, x, h)
        ffn_out = ffn_swiglu(t, il, ffn_inp)
        branches = ops.add(attn_out, ffn_out, name=f"attn_ffn-{il}")   # PARTIAL + PARTIAL: one reduction
        x = ops.add(branches, x, name=f"l_out-{il}")
    x = _layer_norm(t, x, t.w("output_norm.weight", (hp.n_embd,)), "result_norm")
    logits = ops.mul_mat(t.output_weight(), x, name="result_output")
    s = logit_scale(t)
    if s:
        logits = ops.scale(logits, s, name="result_output_scaled")
    return output_graph(t, spec, inp, logits)
