"""ROPE and FLASH_ATTN_EXT builders: compiled calls for few-token steps, numpy (float32) for long
prompts, reading the KV cache as stored (`kv.kv_load_rows`)."""

from __future__ import annotations

from typing import Callable

import numpy as np

from metatp.backends.numpy.kernels.common import F32, PACKED_MAX_TOKENS, Closure
from metatp.backends.numpy.kernels.kv import kv_load_rows
from metatp.backends.numpy.native import attention_usable, prepare_attention, prepare_rope, rope_usable
from metatp.ir.ops import RopeMode


def rope_cos_sin(pos: np.ndarray, n_dims: int, freq_base: float, freq_scale: float,
                 freq_factors: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin tables (T, n_dims/2) for positions `pos`."""
    inv = freq_base ** (-np.arange(0, n_dims, 2, dtype=np.float64) / n_dims)
    if freq_factors is not None:
        inv = inv / freq_factors.astype(np.float64).reshape(-1)[: n_dims // 2]
    theta = pos.astype(np.float64)[:, None] * freq_scale * inv[None, :]
    return np.cos(theta).astype(F32), np.sin(theta).astype(F32)


def _rope(node, out, src, ctx) -> Closure:
    x, pos = src[0], src[1]
    ff = src[2] if len(src) > 2 and src[2] is not None else None
    p = node.params
    n_dims, mode = p["n_dims"], p["mode"]
    h = n_dims // 2
    x3, o3, pos1 = x[0], out[0], pos[0, 0, 0]   # (T, H, D)
    if n_dims < x.shape[-1]:
        tail = (x3[..., n_dims:], o3[..., n_dims:])
    else:
        tail = None
    if mode == RopeMode.NEOX:
        xa, xb, oa, ob = x3[..., :h], x3[..., h:n_dims], o3[..., :h], o3[..., h:n_dims]
    else:
        xa, xb, oa, ob = x3[..., 0:n_dims:2], x3[..., 1:n_dims:2], o3[..., 0:n_dims:2], o3[..., 1:n_dims:2]

    key = ("rope", n_dims, p["freq_base"], p["freq_scale"], id(pos), id(ff))

    def tables() -> tuple[np.ndarray, np.ndarray]:
        cos, sin = rope_cos_sin(pos1, n_dims, p["freq_base"], p["freq_scale"], ff)
        return cos[:, None, :], sin[:, None, :]

    if ctx.use_kernels:
        if rope_usable(x3, o3):
            # one compiled call instead of six numpy ones; the tables live in one buffer per plan
            cs = ctx.persistent(key + ("rope-buf",), lambda: np.empty((2, x3.shape[0], h), F32))

            def fill() -> np.ndarray:
                cs[0], cs[1] = rope_cos_sin(pos1, n_dims, p["freq_base"], p["freq_scale"], ff)
                return cs
            kernel = prepare_rope(x3, o3, n_dims, mode == RopeMode.NEOX, cs, ctx.row_threads(x3.shape[0]))

            def make_fill_once() -> Callable[[], None]:
                def fill_once() -> None:
                    ctx.per_step(key + ("filled",), fill)
                return fill_once
            # one object for every rope of the plan reading these tables: a batch runs it once a step
            fill_once = ctx.persistent(key + ("fill-once",), make_fill_once)

            def run_kernel() -> None:
                fill_once()
                kernel()
            run_kernel.kernel, run_kernel.prepare = kernel, fill_once     # for cpu_kernels.batch
            return run_kernel

    def run() -> None:
        cos, sin = ctx.per_step(key, tables)     # every layer shares one table per step
        a_cos, b_sin = xa * cos, xb * sin
        np.subtract(a_cos, b_sin, out=oa)
        np.multiply(xa, sin, out=ob)
        np.add(ob, xb * cos, out=ob)
        if tail is not None:
            tail[1][...] = tail[0]
    return run


def attention_numpy(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None, scale: float,
                    softcap: float = 0.0, sinks: np.ndarray | None = None) -> np.ndarray:
    """q (H, T, D), k/v (Hkv, n_kv, D), mask (T, n_kv) additive -> (T, H, Dv). Consecutive q heads share a kv head.

    The float32 numpy attention `_flash_attn` falls back to (long prompts, no mask, no compiler);
    not a reference (that is `metatp.testing.oracles.ref_attention`)."""
    H, T, D = q.shape
    Hkv, n_kv, Dv = v.shape
    g = H // Hkv
    qg = np.ascontiguousarray(q).reshape(Hkv, g * T, D)
    s = np.matmul(qg, k.transpose(0, 2, 1))
    s *= F32(scale)
    if softcap:
        s = F32(softcap) * np.tanh(s / F32(softcap))
    s = s.reshape(Hkv, g, T, n_kv)
    if mask is not None:
        s += mask[:T]
    m = s.max(axis=-1, keepdims=True)
    if sinks is not None:
        sk = sinks.reshape(Hkv, g, 1, 1).astype(F32)
        m = np.maximum(m, sk)
    np.subtract(s, m, out=s)
    np.exp(s, out=s)
    denom = s.sum(axis=-1, keepdims=True)
    if sinks is not None:
        denom += np.exp(sk - m)
    s /= denom
    o = np.matmul(s.reshape(Hkv, g * T, n_kv), v)
    return o.reshape(H, T, Dv).transpose(1, 0, 2)


def _shared_scratch(ctx, n: int) -> np.ndarray:
    """One scratch buffer of at least n floats for every attention kernel of the plan on this
    device: they run one after another there, and a buffer per layer (a megabyte each at 16 tokens)
    left the parts the kernel writes cold in every layer (a decode step of 16 sequences: ~0.5 ms of
    its attention). One per device: with parallel devices their kernels run at the same time."""
    buf = ctx.persistent(("attention-scratch", ctx.d), lambda: [np.empty(0, np.float32)])
    if buf[0].size < n:
        buf[0] = np.empty(n, np.float32)
    return buf[0]


class _VisibleSetter:
    """The visible cache length of every attention kernel reading one mask: computed once a step
    and written into the one int64 cell they all read (`prepare_attention(n_kv_at=...)`), so a
    step's cost here does not grow with the kernels (under -sm tensor: every device's)."""

    def __init__(self, visible: Callable[[], int]) -> None:
        self.visible = visible
        self.cell = np.full(1, np.iinfo(np.int64).max, dtype=np.int64)     # unset: each kernel's whole cache

    def run(self) -> None:
        self.cell[0] = self.visible()


def _flash_attn(node, out, src, ctx) -> Closure:
    q, k, v = src[0][0], src[1][0], src[2][0]
    mask = src[3][0, 0] if len(src) > 3 and src[3] is not None else None
    sinks = src[4].reshape(-1) if len(src) > 4 and src[4] is not None else None
    scale, softcap = node.params["scale"], node.params.get("softcap", 0.0)
    k_type, v_type = node.src[1].type, node.src[2].type     # the cache types: K/V are read as stored
    o3 = out[0]
    if mask is None:
        def run_unmasked() -> None:
            o3[...] = attention_numpy(q, kv_load_rows(k, k_type), kv_load_rows(v, v_type), None, scale, softcap,
                                      sinks)
        return run_unmasked
    src_mask = node.src[3]

    def visible() -> int:
        # cache rows past the last one any query can see contribute exactly 0: skip them
        cols = np.flatnonzero(np.isfinite(mask[: q.shape[1]]).any(axis=0))
        return int(cols[-1]) + 1 if cols.size else 1

    # long passes too where the products run compiled at any length (weights in the row-group
    # layout: integer numerics, and exact numerics on 512-bit builds): a numpy attention between
    # them would hand the cores to BLAS's threads and back every layer
    integer = ctx.backend.numerics in ("llamacpp", "q8")
    long_ok = ctx.backend.groups_rows()
    if ctx.use_kernels and (q.shape[1] <= PACKED_MAX_TOKENS or long_ok):
        if (attention_usable(q, k, v, o3, int(k_type), int(v_type)) and mask.dtype == np.float32
                and mask.strides[1] == 4):
            # one setter for every attention of the plan reading this mask (a batch runs it once a
            # step): the visible length computed once, read by each kernel from the setter's cell
            setter = ctx.persistent(("visible-setter", id(src_mask), q.shape[1]), lambda: _VisibleSetter(
                lambda: ctx.per_step(("visible", id(src_mask)), visible)))
            kernel = prepare_attention(q, k, v, mask, scale, softcap, sinks, o3, ctx.kernel_threads, int(k_type),
                                       int(v_type), q8=integer,      # integer Q.K for a q8_0 K cache
                                       scratch=lambda n: _shared_scratch(ctx, n), n_kv_at=setter.cell)
            set_visible = setter.run

            def run_kernel() -> None:
                set_visible()
                kernel.call()
            run_kernel.kernel, run_kernel.prepare = kernel.call, set_visible     # for cpu_kernels.batch
            return run_kernel

    def run() -> None:
        # long prompts: the visible cache rows as float32 (dequantized), then attention_numpy
        n = ctx.per_step(("visible", id(src_mask)), visible)
        o3[...] = attention_numpy(q, kv_load_rows(k[:, :n], k_type), kv_load_rows(v[:, :n], v_type), mask[:, :n],
                                  scale, softcap, sinks)
    return run

