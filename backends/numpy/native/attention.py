"""Rope and decode attention as compiled calls (csrc/rope.c, csrc/attention.c): each replaces a
dozen small numpy calls (their fixed cost, not their arithmetic, is what a one-token step pays)."""

from __future__ import annotations

import ctypes
from typing import Callable

import numpy as np

from metatp.backends.numpy.native.kv import _kv_view_ok
from metatp.backends.numpy.native.lib import ATTN_CHUNK, MAX_GROUP_ITEMS, _Call, _elems, available, default_threads

__all__ = ["rope_usable", "prepare_rope", "attention_usable", "prepare_attention", "is_attention",
           "group_attention"]


def rope_usable(x3: np.ndarray, o3: np.ndarray) -> bool:
    """Can `prepare_rope` take these (T, H, D) float32 views (last dim contiguous)?"""
    return (available() and x3.dtype == np.float32 and o3.dtype == np.float32 and x3.ndim == 3
            and x3.shape == o3.shape and x3.strides[2] == 4 and o3.strides[2] == 4)


def prepare_rope(x3: np.ndarray, o3: np.ndarray, n_dims: int, neox: bool, cos_sin: np.ndarray,
                 nthreads: int = 1) -> Callable[[], None]:
    """out = rope(x) for (T, H, D) views; cos_sin (2, T, n_dims/2) float32 holds the step's
    tables (refilled in place each step, so its address stays valid); the rows of a pass of many
    tokens are shared by `nthreads`."""
    T, H, D = x3.shape
    if not rope_usable(x3, o3) or cos_sin.shape != (2, T, n_dims // 2) or not cos_sin.flags.c_contiguous:
        raise ValueError(f"rope kernel: unsupported views x {x3.shape} {x3.strides}, tables {cos_sin.shape}")
    return _Call("metatp_rope", (x3, o3, cos_sin), T=T, H=H, D=D, n_dims=n_dims, neox=int(bool(neox)),
                 x=x3.ctypes.data, x_st=_elems(x3, 0), x_sh=_elems(x3, 1), out=o3.ctypes.data,
                 o_st=_elems(o3, 0), o_sh=_elems(o3, 1), cs=cos_sin.ctypes.data, nthreads=nthreads)


def attention_usable(q: np.ndarray, k: np.ndarray, v: np.ndarray, out3: np.ndarray, k_type: int = 0,
                     v_type: int = 0) -> bool:
    """q (H, T, D) and out (T, H, Dv) float32 with contiguous last dims; k/v (Hkv, n_kv, .) cache
    views of types k_type/v_type (GGML type ids of `KV_TYPES`; see `_kv_view_ok`)."""
    if not (available() and all(a.dtype == np.float32 and a.ndim == 3 and a.strides[2] == 4 for a in (q, out3))):
        return False
    H, T, D = q.shape
    Dv = out3.shape[2]
    return (_kv_view_ok(k, k_type, D) and _kv_view_ok(v, v_type, Dv) and k.shape[0] > 0 and H % k.shape[0] == 0
            and k.shape[:2] == v.shape[:2] and out3.shape == (T, H, Dv))


_ATTN_KV_BLOCK = 64     # KV_BLOCK in attention.c


def prepare_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None, scale: float,
                      softcap: float, sinks: np.ndarray | None, out3: np.ndarray, nthreads: int | None = None,
                      k_type: int = 0, v_type: int = 0, q8: bool = False,
                      scratch: Callable[[int], np.ndarray] | None = None,
                      n_kv_at: np.ndarray | None = None) -> Callable[[int], None]:
    """A closure `run(n_kv)`: out3 = softmax(q k[:, :n_kv]^T * scale (+ softcap, mask, sinks)) v[:, :n_kv],
    as `metatp.testing.oracles.ref_attention` computes it on the dequantized cache (the tests hold it
    to that) up to float rounding: K/V read once per KV head, online softmax, threads sharing (KV
    head, chunk of ATTN_CHUNK cells) units. k/v are cache views of types k_type/v_type. q8 (numerics
    "q8") with a q8_0 K cache: the queries are rounded to Q8_0 once a call and Q.K taken in integers,
    as llama.cpp's CPU flash attention does (the oracle then sees the rounded queries). scratch(n),
    when given, returns the float32 work buffer of at least n values (kernels run one after another
    may share one); else the closure owns its own. n_kv_at, when given, is a one-element int64
    array that the calls of a plan reading one mask share: the visible length written there once a
    step bounds every one of them (`run.call` then needs no `set_n_kv`)."""
    if not attention_usable(q, k, v, out3, k_type, v_type):
        raise ValueError("attention kernel: unsupported views")
    H, T, D = q.shape
    Hkv, n_max = v.shape[:2]
    Dv = out3.shape[2]
    if mask is not None and (mask.dtype != np.float32 or mask.strides[1] != 4 or mask.shape[1] < n_max):
        raise ValueError("attention kernel: unsupported mask view")
    sinks_c = None if sinks is None else np.ascontiguousarray(sinks, dtype=np.float32).reshape(-1)
    threads = nthreads or default_threads()
    # per (KV head, chunk): (m, l, output) for each of its query rows; per thread a block of scores
    max_chunks = max(1, -(-n_max // ATTN_CHUNK))
    G = (H // Hkv) * T
    # and with q8: the queries' Q8_0 codes (H*T*D bytes), scales (D/32 a row) and one row's sums
    q8_size = H * T * (-(-D // 4) + D // 32) + D // 16 + 1 if q8 else 0
    size = Hkv * max_chunks * G * (Dv + 2) + threads * G * _ATTN_KV_BLOCK + q8_size
    scratch = np.empty(size, dtype=np.float32) if scratch is None else scratch(size)
    if n_kv_at is not None and (n_kv_at.dtype != np.int64 or n_kv_at.size != 1):
        raise ValueError("attention kernel: n_kv_at must be one int64")
    call = _Call("metatp_attention", (q, k, v, mask, sinks_c, out3, scratch, n_kv_at), T=T, H=H, Hkv=Hkv, D=D, Dv=Dv,
                 n_kv=n_max, q=q.ctypes.data, q_sh=_elems(q, 0), q_st=_elems(q, 1), k=k.ctypes.data,
                 k_sh=k.strides[0], k_sj=k.strides[1], k_type=int(k_type), v=v.ctypes.data, v_sh=v.strides[0],
                 v_sj=v.strides[1], v_type=int(v_type), mask=None if mask is None else mask.ctypes.data,
                 m_st=0 if mask is None else _elems(mask, 0), scale=float(scale), softcap=float(softcap or 0.0),
                 sinks=None if sinks_c is None else sinks_c.ctypes.data, out=out3.ctypes.data,
                 o_st=_elems(out3, 0), o_sh=_elems(out3, 1), scratch=scratch.ctypes.data, max_chunks=max_chunks,
                 nthreads=threads, q8=int(bool(q8)), qq=None, qd=None,
                 n_kv_at=None if n_kv_at is None else n_kv_at.ctypes.data)
    args = call.args

    def run(n_kv: int) -> None:
        args.n_kv = min(int(n_kv), n_max)
        call()

    def set_n_kv(n_kv: int) -> None:
        args.n_kv = min(int(n_kv), n_max)
    run.keep = run.call = call
    run.set_n_kv = set_n_kv
    return run


def is_attention(f) -> bool:
    """Is `f` the prepared call of a `prepare_attention` closure (`run.call`), so that
    `group_attention` can merge it?"""
    return isinstance(f, _Call) and f.name == "metatp_attention"




def group_attention(calls: list[_Call]) -> _Call:
    """One call doing the work of several prepared attentions (`run.call`; independent: their own
    outputs and scratch), their units and merged rows shared by one parallel region, with the
    thread count of them all together. Bit-identical to calling them in turn."""
    if not calls or len(calls) > MAX_GROUP_ITEMS or not all(is_attention(c) for c in calls):
        raise ValueError("group_attention: 1 to 64 prepared attention calls")
    nthreads = min(int(c.args.nthreads) for c in calls)
    ptrs = (ctypes.c_void_p * len(calls))(*[ctypes.addressof(c.args) for c in calls])
    return _Call("metatp_attention_group", (calls, ptrs), n=len(calls), items=ctypes.addressof(ptrs),
                 nthreads=nthreads)
