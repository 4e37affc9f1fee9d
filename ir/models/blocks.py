"""Building blocks every architecture shares, written once: projections, norms, the attention
core (KV-cache writes + flash attention), the SwiGLU FFN and the lm head.

An architecture module composes these and adds only what differs (phi3's fused QKV views,
gemma3's sandwich norms, command-r's parallel residual, the MoE experts). Node names keep the
`-{layer}` suffix llama.cpp uses, which the dump tool reads.
"""

from __future__ import annotations

from typing import Callable

from metatp.ir import ops
from metatp.ir.models.common import BatchSpec, ModelTensors
from metatp.ir.models.inputs import StepInputs
from metatp.ir.ops import GluOp, RopeMode
from metatp.ir.tensor import Tensor, row_bytes

__all__ = ["linear", "embed", "rms_norm_weighted", "layer_norm_weighted", "project_qkv", "rope",
           "kv_store_and_attend", "ffn_swiglu", "lm_head", "FFN", "Attention"]

FFN = Callable[[ModelTensors, int, Tensor], Tensor]    # (tensors, layer, normed input) -> FFN output
Attention = Callable[[ModelTensors, int, Tensor, StepInputs[Tensor], BatchSpec], Tensor]   # (..., inputs, batch) -> attn output


def linear(t: ModelTensors, x: Tensor, name: str, ne: tuple[int, ...] | None = None, out_name: str = "") -> Tensor:
    """W x (+ b when the model has a bias for W); `ne` checks W's shape; `out_name` names the result."""
    b = t.opt(f"{name}.bias")
    y = ops.mul_mat(t.w(f"{name}.weight", ne), x, name="" if b is not None else out_name)
    return ops.add(y, b, name=out_name) if b is not None else y


def embed(t: ModelTensors, inp: StepInputs[Tensor]) -> Tensor:
    """The token embedding lookup [n_embd, T]."""
    return ops.get_rows(t.w("token_embd.weight", (t.hp.n_embd, t.hp.n_vocab)), inp.tokens, name="inp_embd")


def rms_norm_weighted(t: ModelTensors, x: Tensor, weight_name: str, name: str) -> Tensor:
    """rms_norm(x) * weight (the weight must be a row of x's width)."""
    return ops.mul(ops.rms_norm(x, t.hp.norm_eps), t.w(weight_name, (x.ne[0],)), name=name)


def layer_norm_weighted(t: ModelTensors, x: Tensor, weight: Tensor, name: str) -> Tensor:
    """LLM_NORM without a bias: (x - mean) / sqrt(var + eps) * w."""
    return ops.mul(ops.norm(x, t.hp.norm_eps), weight, name=name)


def project_qkv(t: ModelTensors, il: int, cur: Tensor, T: int) -> tuple[Tensor, Tensor, Tensor]:
    """Separate Q/K/V projections (+ biases when present) reshaped to [head_dim, heads, T]."""
    hp = t.hp
    p = f"blk.{il}"
    hd_k, hd_v, n_head, n_head_kv = hp.head_dim_k, hp.head_dim_v, hp.n_head, hp.n_head_kv[il]
    q = linear(t, cur, f"{p}.attn_q", (hp.n_embd, hd_k * n_head))
    k = linear(t, cur, f"{p}.attn_k", (hp.n_embd, hd_k * n_head_kv))
    v = linear(t, cur, f"{p}.attn_v", (hp.n_embd, hd_v * n_head_kv))
    return (ops.reshape(q, hd_k, n_head, T, name=f"Qcur-{il}"),
            ops.reshape(k, hd_k, n_head_kv, T, name=f"Kcur-{il}"),
            ops.reshape(v, hd_v, n_head_kv, T, name=f"Vcur-{il}"))


def rope(t: ModelTensors, x: Tensor, inp: StepInputs[Tensor], mode: RopeMode, name: str,
         freq_base: float | None = None, freq_scale: float | None = None) -> Tensor:
    """RoPE over the model's rope dims at the batch positions (base/scale default to the model's)."""
    hp = t.hp
    base = hp.rope_freq_base if freq_base is None else freq_base
    scale = hp.rope_freq_scale if freq_scale is None else freq_scale
    return ops.rope(x, inp.pos, hp.rope_dims, mode, base, scale, name=name)


def kv_store_and_attend(t: ModelTensors, il: int, q: Tensor, k: Tensor, v: Tensor, inp: StepInputs[Tensor],
                        spec: BatchSpec, kq_scale: float, mask: Tensor | None = None,
                        softcap: float = 0.0) -> Tensor:
    """Write this batch's K/V rows into the cache and attend over the first n_kv rows.

    q: [hd, n_head, T], k/v: [hd, n_head_kv, T] (roped). Returns [hd_v * n_head, T].
    """
    hp = t.hp
    T = spec.n_tokens
    hd_k, hd_v, n_head_kv = hp.head_dim_k, hp.head_dim_v, hp.n_head_kv[il]
    ck, cv = t.cache_k[il], t.cache_v[il]
    k_w = ops.set_rows(ck, ops.reshape(k, hd_k * n_head_kv, T), inp.kv_idxs, name=f"k_store-{il}")
    v_w = ops.set_rows(cv, ops.reshape(v, hd_v * n_head_kv, T), inp.kv_idxs, name=f"v_store-{il}")
    # one head's row of the cache: whole quant blocks for a quantized cache (the split table and
    # the cache-type check keep head_dim a multiple of the block)
    kview = ops.view(k_w, (hd_k, n_head_kv, spec.n_kv), (row_bytes(ck.type, hd_k), ck.nb[1]), 0, name=f"k_view-{il}")
    vview = ops.view(v_w, (hd_v, n_head_kv, spec.n_kv), (row_bytes(cv.type, hd_v), cv.nb[1]), 0, name=f"v_view-{il}")
    Q = ops.permute(q, 0, 2, 1, 3, name=f"q_perm-{il}")
    K = ops.permute(kview, 0, 2, 1, 3, name=f"k_perm-{il}")
    V = ops.permute(vview, 0, 2, 1, 3, name=f"v_perm-{il}")
    att = ops.flash_attn_ext(Q, K, V, mask if mask is not None else inp.kq_mask, kq_scale, softcap,
                             name=f"fattn-{il}")
    return ops.reshape(att, hd_v * hp.n_head, T, name=f"attn_flat-{il}")


def ffn_swiglu(t: ModelTensors, il: int, cur: Tensor) -> Tensor:
    """down(silu(gate x) * up x)."""
    hp = t.hp
    p = f"blk.{il}"
    gate = linear(t, cur, f"{p}.ffn_gate", (hp.n_embd, hp.n_ff[il]))
    up = linear(t, cur, f"{p}.ffn_up", (hp.n_embd, hp.n_ff[il]))
    act = ops.glu_split(gate, up, GluOp.SWIGLU, name=f"ffn_act-{il}")
    return linear(t, act, f"{p}.ffn_down", (hp.n_ff[il], hp.n_embd))


def lm_head(t: ModelTensors, x: Tensor) -> Tensor:
    """Logits = output.weight x (+ output.bias when the model has one)."""
    logits = ops.mul_mat(t.output_weight(), x, name="result_output")
    ob = t.opt("output.bias")
    return ops.add(logits, ob, name="result_output_b") if ob is not None else logits
