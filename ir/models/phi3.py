"""Phi-3 graph: fused QKV projection read through views, fused up+gate FFN.

Mirrors llama.cpp's `llama_model_phi3::graph` (non-SWA, no long-rope factors) node for node:
Q/K/V are `ggml_view_3d`s into the fused `attn_qkv` output (build_qkv's fused path), Q is scaled
by 1/sqrt(head_dim) before attention (kq_scale 1.0), the K/V cache writes take `ggml_view_2d`s
of K/V as llama.cpp's `cpy_k`/`cpy_v` do, and the FFN is `ggml_swiglu` of the fused [gate; up]
projection (LLM_FFN_SWIGLU, LLM_FFN_SEQ).
"""

from __future__ import annotations

import functools
import math

from metatp.ir import ops
from metatp.ir.errors import ModelFormatError
from metatp.ir.graph import Graph
from metatp.ir.models.blocks import linear, rope
from metatp.ir.models.common import ArchSpec, BatchSpec, ModelTensors
from metatp.ir.models.inputs import StepInputs
from metatp.ir.models.llama import build_llama
from metatp.ir.ops import GluOp, Op, RopeMode
from metatp.ir.tensor import Tensor, row_bytes

__all__ = ["build_phi3", "fused_qkv_views", "cache_rows", "store_kv_and_attend"]


def fused_qkv_views(t: ModelTensors, il: int, qkv: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Q, K, V as 3-d views into the fused projection [n_embd_q + 2*n_embd_kv, T] (ggml_view_3d)."""
    hp = t.hp
    hd, n_head, n_head_kv = hp.head_dim_k, hp.n_head, hp.n_head_kv[il]
    T = qkv.ne[1]
    esz = qkv.nb[0]
    n_q, n_kv = hd * n_head, hd * n_head_kv
    row = (hd * esz, qkv.nb[1])
    q = ops.view(qkv, (hd, n_head, T), row, 0, name=f"Qcur-{il}")
    k = ops.view(qkv, (hd, n_head_kv, T), row, n_q * esz, name=f"Kcur-{il}")
    v = ops.view(qkv, (hd, n_head_kv, T), row, (n_q + n_kv) * esz, name=f"Vcur-{il}")
    return q, k, v


def cache_rows(x: Tensor, name: str) -> Tensor:
    """[head_dim, n_head_kv, T] -> the [head_dim*n_head_kv, T] rows a cache write takes: llama.cpp's
    `ggml_view_2d(x, n, T, x->nb[2], 0)` in cpy_k/cpy_v.

    When `x` is itself a window into a contiguous tensor (V inside the fused QKV output), the 2-d
    window is taken from that tensor directly: the same bytes, but a view of a contiguous tensor,
    which is what the split compiler can cut per device (a view of a strided view it refuses)."""
    src, offs = x, 0
    if x.op is Op.VIEW and x.src[0].is_contiguous:
        src = x.src[0]
        offs = x.view_offs - (src.view_offs if src.view_src is not None else 0)
    return ops.view(src, (x.ne[0] * x.ne[1], x.ne[2]), (x.nb[2],), offs, name=name)


def store_kv_and_attend(t: ModelTensors, il: int, q: Tensor, k: Tensor, v: Tensor, inp: StepInputs[Tensor],
                        spec: BatchSpec, kq_scale: float) -> Tensor:
    """Cache writes through 2-d views of K/V (llama.cpp's cpy_k/cpy_v: V is a strided view of the
    fused QKV output, which a reshape cannot take), then attention over the first n_kv rows."""
    hp = t.hp
    hd_k, hd_v, n_head_kv = hp.head_dim_k, hp.head_dim_v, hp.n_head_kv[il]
    ck, cv = t.cache_k[il], t.cache_v[il]
    k2 = cache_rows(k, f"k_rows-{il}")
    v2 = cache_rows(v, f"v_rows-{il}")
    k_w = ops.set_rows(ck, k2, inp.kv_idxs, name=f"k_store-{il}")
    v_w = ops.set_rows(cv, v2, inp.kv_idxs, name=f"v_store-{il}")
    kview = ops.view(k_w, (hd_k, n_head_kv, spec.n_kv), (row_bytes(ck.type, hd_k), ck.nb[1]), 0, name=f"k_view-{il}")
    vview = ops.view(v_w, (hd_v, n_head_kv, spec.n_kv), (row_bytes(cv.type, hd_v), cv.nb[1]), 0, name=f"v_view-{il}")
    Q = ops.permute(q, 0, 2, 1, 3, name=f"q_perm-{il}")
    K = ops.permute(kview, 0, 2, 1, 3, name=f"k_perm-{il}")
    V = ops.permute(vview, 0, 2, 1, 3, name=f"v_perm-{il}")
    att = ops.flash_attn_ext(Q, K, V, inp.kq_mask, kq_scale, name=f"fattn-{il}")
    return ops.reshape(att, hd_v * hp.n_head, q.ne[2], name=f"attn_flat-{il}")


def _check_supported(t: ModelTensors) -> None:
    """Long-context Phi-3 (rope_factors_long/short, "longrope") needs per-context rope factors and an
    attention factor this builder does not model: refuse it instead of computing wrong logits."""
    if any("rope_factors" in name for name in t.weights):
        raise ModelFormatError(f"{t.model.path.name}: phi3 long-rope (128k context) models are not supported; "
                               "use a 4k-context Phi-3 model")
    if t.hp.head_dim_k != t.hp.head_dim_v:
        raise ModelFormatError(f"{t.model.path.name}: phi3 needs equal key and value head sizes")


def _attention(t: ModelTensors, il: int, cur: Tensor, inp: StepInputs[Tensor], spec: BatchSpec,
               rope_mode: RopeMode = RopeMode.NEOX) -> Tensor:
    hp = t.hp
    p = f"blk.{il}"
    n_qkv = hp.head_dim_k * (hp.n_head + 2 * hp.n_head_kv[il])
    qkv = linear(t, cur, f"{p}.attn_qkv", (hp.n_embd, n_qkv))
    q, k, v = fused_qkv_views(t, il, qkv)
    q = rope(t, q, inp, rope_mode, f"Qrope-{il}")
    k = rope(t, k, inp, rope_mode, f"Krope-{il}")
    q = ops.scale(q, 1.0 / math.sqrt(hp.head_dim_k), name=f"Qscaled-{il}")
    att = store_kv_and_attend(t, il, q, k, v, inp, spec, kq_scale=1.0)
    return linear(t, att, f"{p}.attn_output", (hp.head_dim_v * hp.n_head, hp.n_embd))


def _ffn_fused_swiglu(t: ModelTensors, il: int, cur: Tensor) -> Tensor:
    """ffn_up holds [gate; up] (2*n_ff rows): swiglu = silu(first half) * second half."""
    hp = t.hp
    p = f"blk.{il}"
    up = linear(t, cur, f"{p}.ffn_up", (hp.n_embd, 2 * hp.n_ff[il]))
    act = ops.glu_fused(up, GluOp.SWIGLU, name=f"ffn_swiglu-{il}")
    return linear(t, act, f"{p}.ffn_down", (hp.n_ff[il], hp.n_embd))


def build_phi3(t: ModelTensors, spec: BatchSpec, arch: ArchSpec) -> Graph:
    """Phi-3: pre-norm residual layers with fused QKV and fused up+gate."""
    _check_supported(t)
    return build_llama(t, spec, arch, attention=functools.partial(_attention, rope_mode=arch.rope),
                       ffn=_ffn_fused_swiglu)
