"""Llama-family graph: llama (SmolLM2, mistral), qwen2 (QKV biases), qwen3 (per-head q/k norms).

Mirrors llama.cpp's `llm_build_llama` node for node, so the split-state compiler sees the same
op sequence the meta backend sees. The layer loop is shared with phi3 and the MoE models, which
pass their own attention or FFN block.
"""

from __future__ import annotations

import functools
import math

from metatp.ir import ops
from metatp.ir.graph import Graph
from metatp.ir.models.blocks import (FFN, Attention, embed, ffn_swiglu, kv_store_and_attend, linear, lm_head,
                                     project_qkv, rms_norm_weighted, rope)
from metatp.ir.models.common import ArchSpec, BatchSpec, ModelTensors, output_graph, select_outputs
from metatp.ir.models.inputs import StepInputs, declare_inputs
from metatp.ir.ops import RopeMode
from metatp.ir.tensor import Tensor

__all__ = ["build_llama", "attention_block"]


def attention_block(t: ModelTensors, il: int, cur: Tensor, inp: StepInputs[Tensor], spec: BatchSpec,
                    rope_mode: RopeMode = RopeMode.NORMAL) -> Tensor:
    """Q/K/V projections (+biases), optional q/k norms, rope, cache, attention, output projection."""
    hp = t.hp
    p = f"blk.{il}"
    q, k, v = project_qkv(t, il, cur, spec.n_tokens)
    qn, kn = t.opt(f"{p}.attn_q_norm.weight"), t.opt(f"{p}.attn_k_norm.weight")
    if qn is not None:
        q = ops.mul(ops.rms_norm(q, hp.norm_eps), qn, name=f"Qnorm-{il}")
    if kn is not None:
        k = ops.mul(ops.rms_norm(k, hp.norm_eps), kn, name=f"Knorm-{il}")
    q = rope(t, q, inp, rope_mode, f"Qrope-{il}")
    k = rope(t, k, inp, rope_mode, f"Krope-{il}")
    att = kv_store_and_attend(t, il, q, k, v, inp, spec, 1.0 / math.sqrt(hp.head_dim_k))
    return linear(t, att, f"{p}.attn_output", (hp.head_dim_v * hp.n_head, hp.n_embd))


def build_llama(t: ModelTensors, spec: BatchSpec, arch: ArchSpec, attention: Attention | None = None,
                ffn: FFN = ffn_swiglu) -> Graph:
    """Pre-norm residual layers: x += attn(norm(x)); x += ffn(norm(x)).

    The attention and FFN blocks vary by architecture (phi3's fused QKV, MoE experts)."""
    hp = t.hp
    attention = attention or functools.partial(attention_block, rope_mode=arch.rope)
    inp = declare_inputs(spec)
    x = embed(t, inp)
    for il in range(hp.n_layer):
        p = f"blk.{il}"
        cur = rms_norm_weighted(t, x, f"{p}.attn_norm.weight", f"attn_norm-{il}")
        cur = attention(t, il, cur, inp, spec)
        cur, x = select_outputs(inp, il, hp.n_layer, cur, x)
        x = ops.add(cur, x, name=f"ffn_inp-{il}")
        cur = rms_norm_weighted(t, x, f"{p}.ffn_norm.weight", f"ffn_norm-{il}")
        cur = ffn(t, il, cur)
        x = ops.add(cur, x, name=f"l_out-{il}")
    x = rms_norm_weighted(t, x, "output_norm.weight", "result_norm")
    return output_graph(t, spec, inp, lm_head(t, x), hidden=x)
