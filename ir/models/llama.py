"""Llama-family graph: llama (SmolLM2, mistral), qwen2 (QKV biases), qwen3 (per-head q/k norms).

Mirrors llama.cpp's `llm_build_llama` node for node, so the split-state compiler sees the same
op sequence the meta backend sees.
"""

from __future__ import annotations

import math
from typing import Callable

from metatp.ir import ops
from metatp.ir.graph import Graph
from metatp.ir.models.common import (BatchSpec, ModelTensors, embed, graph_inputs, linear, output_graph,
                                     rms_norm_weighted, select_outputs)
from metatp.ir.ops import GluOp, RopeMode
from metatp.ir.tensor import Tensor

__all__ = ["build_llama", "attention_block", "kv_store_and_attend", "ffn_swiglu", "rope_mode", "lm_head", "FFN", "Attention"]

FFN = Callable[[ModelTensors, int, Tensor], Tensor]    # (tensors, layer, normed input) -> FFN output
Attention = Callable[[ModelTensors, int, Tensor, dict, BatchSpec], Tensor]   # (..., inputs, batch) -> attn output


def kv_store_and_attend(t: ModelTensors, il: int, q: Tensor, k: Tensor, v: Tensor, inp: dict[str, Tensor],
                        spec: BatchSpec, kq_scale: float, mask: Tensor | None = None,
                        softcap: float = 0.0) -> Tensor:
    """Write this batch's K/V rows into the cache and attend over the first n_kv rows.

    q: [hd, n_head, T], k/v: [hd, n_head_kv, T] (roped). Returns [hd_v * n_head, T].
    """
    hp = t.hp
    T = spec.n_tokens
    hd_k, hd_v, n_head_kv = hp.head_dim_k, hp.head_dim_v, hp.n_head_kv[il]
    ck, cv = t.cache_k[il], t.cache_v[il]
    k_w = ops.set_rows(ck, ops.reshape(k, hd_k * n_head_kv, T), inp["kv_idxs"], name=f"k_store-{il}")
    v_w = ops.set_rows(cv, ops.reshape(v, hd_v * n_head_kv, T), inp["kv_idxs"], name=f"v_store-{il}")
    esz_k, esz_v = ck.nb[0], cv.nb[0]
    kview = ops.view(k_w, (hd_k, n_head_kv, spec.n_kv), (hd_k * esz_k, ck.nb[1]), 0, name=f"k_view-{il}")
    vview = ops.view(v_w, (hd_v, n_head_kv, spec.n_kv), (hd_v * esz_v, cv.nb[1]), 0, name=f"v_view-{il}")
    Q = ops.permute(q, 0, 2, 1, 3, name=f"q_perm-{il}")
    K = ops.permute(kview, 0, 2, 1, 3, name=f"k_perm-{il}")
    V = ops.permute(vview, 0, 2, 1, 3, name=f"v_perm-{il}")
    att = ops.flash_attn_ext(Q, K, V, mask if mask is not None else inp["kq_mask"], kq_scale, softcap,
                             name=f"fattn-{il}")
    return ops.reshape(att, hd_v * hp.n_head, T, name=f"attn_flat-{il}")


def rope_mode(arch: str) -> RopeMode:
    """llama.cpp's llama_model_rope_type: llama/mistral rotate adjacent pairs, the Qwen family halves."""
    return RopeMode.NORMAL if arch in ("llama", "mistral") else RopeMode.NEOX


def attention_block(t: ModelTensors, il: int, cur: Tensor, inp: dict[str, Tensor], spec: BatchSpec) -> Tensor:
    """Q/K/V projections (+biases), optional q/k norms, rope, cache, attention, output projection."""
    hp = t.hp
    T = spec.n_tokens
    p = f"blk.{il}"
    n_head, n_head_kv = hp.n_head, hp.n_head_kv[il]
    q = linear(t, cur, f"{p}.attn_q", (hp.n_embd, hp.head_dim_k * n_head))
    k = linear(t, cur, f"{p}.attn_k", (hp.n_embd, hp.head_dim_k * n_head_kv))
    v = linear(t, cur, f"{p}.attn_v", (hp.n_embd, hp.head_dim_v * n_head_kv))
    q = ops.reshape(q, hp.head_dim_k, n_head, T, name=f"Qcur-{il}")
    k = ops.reshape(k, hp.head_dim_k, n_head_kv, T, name=f"Kcur-{il}")
    v = ops.reshape(v, hp.head_dim_v, n_head_kv, T, name=f"Vcur-{il}")
    qn, kn = t.opt(f"{p}.attn_q_norm.weight"), t.opt(f"{p}.attn_k_norm.weight")
    if qn is not None:
        q = ops.mul(ops.rms_norm(q, hp.norm_eps), qn, name=f"Qnorm-{il}")
    if kn is not None:
        k = ops.mul(ops.rms_norm(k, hp.norm_eps), kn, name=f"Knorm-{il}")
    mode = rope_mode(hp.arch)
    q = ops.rope(q, inp["pos"], hp.rope_dims, mode, hp.rope_freq_base, hp.rope_freq_scale, name=f"Qrope-{il}")
    k = ops.rope(k, inp["pos"], hp.rope_dims, mode, hp.rope_freq_base, hp.rope_freq_scale, name=f"Krope-{il}")
    att = kv_store_and_attend(t, il, q, k, v, inp, spec, 1.0 / math.sqrt(hp.head_dim_k))
    return linear(t, att, f"{p}.attn_output", (hp.head_dim_v * n_head, hp.n_embd))


def ffn_swiglu(t: ModelTensors, il: int, cur: Tensor) -> Tensor:
    hp = t.hp
    p = f"blk.{il}"
    gate = linear(t, cur, f"{p}.ffn_gate", (hp.n_embd, hp.n_ff[il]))
    up = linear(t, cur, f"{p}.ffn_up", (hp.n_embd, hp.n_ff[il]))
    act = ops.glu_split(gate, up, GluOp.SWIGLU, name=f"ffn_act-{il}")
    return linear(t, act, f"{p}.ffn_down", (hp.n_ff[il], hp.n_embd))


def build_llama(t: ModelTensors, spec: BatchSpec, attention: Attention | None = None, ffn: FFN = ffn_swiglu) -> Graph:
    """Pre-norm residual layers: x += attn(norm(x)); x += ffn(norm(x)).

    The attention and FFN blocks vary by architecture (phi3's fused QKV, MoE experts)."""
    hp = t.hp
    attention = attention or attention_block
    inp = graph_inputs(spec)
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
    return output_graph(t, spec, inp, lm_head(t, x))


def lm_head(t: ModelTensors, x: Tensor) -> Tensor:
    """Logits = output.weight x (+ output.bias when the model has one)."""
    logits = ops.mul_mat(t.output_weight(), x, name="result_output")
    ob = t.opt("output.bias")
    return ops.add(logits, ob, name="result_output_b") if ob is not None else logits
