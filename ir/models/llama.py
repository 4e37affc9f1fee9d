"""Llama-family graph: llama (SmolLM2, mistral), qwen2 (QKV biases), qwen3 (per-head q/k norms).

Mirrors llama.cpp's `llm_build_llama` node for node, so the split-state compiler sees the same
op sequence the meta backend sees.
"""

from __future__ import annotations

import math

from metatp.ir import ops
from metatp.ir.graph import Graph
from metatp.ir.models.common import BatchSpec, ModelTensors, graph_inputs
from metatp.ir.ops import GluOp, RopeMode
from metatp.ir.tensor import Tensor

__all__ = ["build_llama", "attention_block", "kv_store_and_attend"]


def _linear(t: ModelTensors, x: Tensor, name: str, ne: tuple[int, int] | None = None) -> Tensor:
    """W x (+ b if the model has a bias for W)."""
    y = ops.mul_mat(t.w(f"{name}.weight", ne), x)
    b = t.opt(f"{name}.bias")
    if b is not None:
        y = ops.add(y, b)
    return y


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


def attention_block(t: ModelTensors, il: int, cur: Tensor, inp: dict[str, Tensor], spec: BatchSpec) -> Tensor:
    """Q/K/V projections (+biases), optional q/k norms, rope, cache, attention, output projection."""
    hp = t.hp
    T = spec.n_tokens
    p = f"blk.{il}"
    n_head, n_head_kv = hp.n_head, hp.n_head_kv[il]
    q = _linear(t, cur, f"{p}.attn_q", (hp.n_embd, hp.head_dim_k * n_head))
    k = _linear(t, cur, f"{p}.attn_k", (hp.n_embd, hp.head_dim_k * n_head_kv))
    v = _linear(t, cur, f"{p}.attn_v", (hp.n_embd, hp.head_dim_v * n_head_kv))
    q = ops.reshape(q, hp.head_dim_k, n_head, T, name=f"Qcur-{il}")
    k = ops.reshape(k, hp.head_dim_k, n_head_kv, T, name=f"Kcur-{il}")
    v = ops.reshape(v, hp.head_dim_v, n_head_kv, T, name=f"Vcur-{il}")
    qn, kn = t.opt(f"{p}.attn_q_norm.weight"), t.opt(f"{p}.attn_k_norm.weight")
    if qn is not None:
        q = ops.mul(ops.rms_norm(q, hp.norm_eps), qn, name=f"Qnorm-{il}")
    if kn is not None:
        k = ops.mul(ops.rms_norm(k, hp.norm_eps), kn, name=f"Knorm-{il}")
    mode = RopeMode.NEOX if hp.arch in ("qwen2", "qwen3") else RopeMode.NORMAL
    q = ops.rope(q, inp["pos"], hp.rope_dims, mode, hp.rope_freq_base, hp.rope_freq_scale, name=f"Qrope-{il}")
    k = ops.rope(k, inp["pos"], hp.rope_dims, mode, hp.rope_freq_base, hp.rope_freq_scale, name=f"Krope-{il}")
    att = kv_store_and_attend(t, il, q, k, v, inp, spec, 1.0 / math.sqrt(hp.head_dim_k))
    return _linear(t, att, f"{p}.attn_output", (hp.head_dim_v * n_head, hp.n_embd))


def ffn_swiglu(t: ModelTensors, il: int, cur: Tensor) -> Tensor:
    hp = t.hp
    p = f"blk.{il}"
    gate = _linear(t, cur, f"{p}.ffn_gate", (hp.n_embd, hp.n_ff[il]))
    up = _linear(t, cur, f"{p}.ffn_up", (hp.n_embd, hp.n_ff[il]))
    act = ops.glu_split(gate, up, GluOp.SWIGLU, name=f"ffn_act-{il}")
    return _linear(t, act, f"{p}.ffn_down", (hp.n_ff[il], hp.n_embd))


def build_llama(t: ModelTensors, spec: BatchSpec) -> Graph:
    hp = t.hp
    inp = graph_inputs(spec)
    x = ops.get_rows(t.w("token_embd.weight", (hp.n_embd, hp.n_vocab)), inp["tokens"], name="inp_embd")
    for il in range(hp.n_layer):
        p = f"blk.{il}"
        cur = ops.mul(ops.rms_norm(x, hp.norm_eps, name=f"norm-{il}"), t.w(f"{p}.attn_norm.weight", (hp.n_embd,)),
                      name=f"attn_norm-{il}")
        cur = attention_block(t, il, cur, inp, spec)
        if il == hp.n_layer - 1 and "out_ids" in inp:
            cur = ops.get_rows(cur, inp["out_ids"], name="attn_out_sel")
            x = ops.get_rows(x, inp["out_ids"], name="inp_sel")
        x = ops.add(cur, x, name=f"ffn_inp-{il}")
        cur = ops.mul(ops.rms_norm(x, hp.norm_eps), t.w(f"{p}.ffn_norm.weight", (hp.n_embd,)), name=f"ffn_norm-{il}")
        cur = ffn_swiglu(t, il, cur)
        x = ops.add(cur, x, name=f"l_out-{il}")
    x = ops.mul(ops.rms_norm(x, hp.norm_eps), t.w("output_norm.weight", (hp.n_embd,)), name="result_norm")
    logits = ops.mul_mat(t.output_weight(), x, name="result_output")
    return Graph([logits], name=f"{hp.arch}-T{spec.n_tokens}-kv{spec.n_kv}",
                 meta={"inputs": inp, "logits": logits, "spec": spec})
