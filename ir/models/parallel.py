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
from metatp.ir.models.blocks import (embed, ffn_swiglu, kv_store_and_attend, layer_norm_weighted, linear, project_qkv,
                                     rope)
from metatp.ir.models.common import ArchSpec, BatchSpec, ModelTensors, output_graph, select_outputs
from metatp.ir.models.inputs import StepInputs, declare_inputs
from metatp.ir.ops import RopeMode
from metatp.ir.tensor import Tensor

__all__ = ["build_command_r"]


def _attention(t: ModelTensors, il: int, cur: Tensor, inp: StepInputs[Tensor], spec: BatchSpec,
               rope_mode: RopeMode) -> Tensor:
    """Separate q/k/v (+ biases), optional per-head LayerNorm q/k norms, rope, attention, wo."""
    hp = t.hp
    p = f"blk.{il}"
    q, k, v = project_qkv(t, il, cur, spec.n_tokens)
    qn = t.opt(f"{p}.attn_q_norm.weight")
    if qn is not None:
        q = layer_norm_weighted(t, q, qn, f"Qnorm-{il}")
    q = rope(t, q, inp, rope_mode, f"Qrope-{il}")
    kn = t.opt(f"{p}.attn_k_norm.weight")
    if kn is not None:
        k = layer_norm_weighted(t, k, kn, f"Knorm-{il}")
    k = rope(t, k, inp, rope_mode, f"Krope-{il}")
    att = kv_store_and_attend(t, il, q, k, v, inp, spec, 1.0 / math.sqrt(hp.head_dim_k))
    return linear(t, att, f"{p}.attn_output", (hp.head_dim_v * hp.n_head, hp.n_embd))


def build_command_r(t: ModelTensors, spec: BatchSpec, arch: ArchSpec) -> Graph:
    """Command-R: one LayerNorm per layer feeding attention and FFN in parallel."""
    hp = t.hp
    inp = declare_inputs(spec)
    x = embed(t, inp)
    for il in range(hp.n_layer):
        h = layer_norm_weighted(t, x, t.w(f"blk.{il}.attn_norm.weight", (hp.n_embd,)), f"attn_norm-{il}")
        attn_out = _attention(t, il, h, inp, spec, arch.rope)
        attn_out, x, ffn_inp = select_outputs(inp, il, hp.n_layer, attn_out, x, h)
        ffn_out = ffn_swiglu(t, il, ffn_inp)
        branches = ops.add(attn_out, ffn_out, name=f"attn_ffn-{il}")   # PARTIAL + PARTIAL: one reduction
        x = ops.add(branches, x, name=f"l_out-{il}")
    x = layer_norm_weighted(t, x, t.w("output_norm.weight", (hp.n_embd,)), "result_norm")
    logits = ops.mul_mat(t.output_weight(), x, name="result_output")
    s = hp.logit_scale
    if s:
        logits = ops.scale(logits, s, name="result_output_scaled")
    return output_graph(t, spec, inp, logits, hidden=x)
