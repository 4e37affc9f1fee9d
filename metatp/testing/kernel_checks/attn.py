"""Kernel checks of the ``attn`` family: split-KV decode attention, prefill attention, the device-side attended KV length;
float caches and quantized ones (q8_0 ... q5_1 blocks, compared with the float64 attention over the blocks' gguf.quants
dequantization)."""

from __future__ import annotations

import math

import numpy as np

from metatp.testing.kernel_checks.harness import Checker
from metatp.backends.cuda.launch import KV_QUANT_TYPES
from metatp.testing.oracles import f32_to_bf16_bits, bf16_bits_to_f32, kv_rows, ref_attention

CHECKS = ('attn_decode', 'attn_prefill', 'attn_kv_len', 'attn_quant')


def _kv(c: Checker, kvt, n_ctx, hkv, D):
    k = c.rng.standard_normal((n_ctx, hkv, D)).astype(np.float32)
    v = c.rng.standard_normal((n_ctx, hkv, D)).astype(np.float32)
    if kvt == "f16":
        ks, vs = k.astype(np.float16), v.astype(np.float16)
        return ks, vs, ks.astype(np.float64), vs.astype(np.float64)
    if kvt == "bf16":
        ks, vs = f32_to_bf16_bits(k), f32_to_bf16_bits(v)
        return (ks, vs, bf16_bits_to_f32(ks).astype(np.float64),
                bf16_bits_to_f32(vs).astype(np.float64))
    return k, v, k.astype(np.float64), v.astype(np.float64)


def check_attn_decode(c: Checker) -> None:
    ck = c.ck
    configs = [
        # (kv, D, H, Hkv, n_kv, T, splits, masked, softcap)
        ("f16", 64, 9, 3, 1, 1, 1, False, 0.0),
        ("f16", 64, 9, 3, 7, 1, None, False, 0.0),
        ("f16", 64, 9, 3, 300, 1, 1, False, 0.0),
        ("f16", 64, 9, 3, 300, 1, 3, False, 0.0),
        ("f16", 64, 9, 3, 300, 1, None, True, 0.0),
        ("f16", 128, 8, 8, 200, 1, 4, False, 0.0),
        ("f16", 128, 16, 1, 130, 1, 2, False, 0.0),
        ("bf16", 64, 4, 2, 150, 2, 2, False, 0.0),
        ("f32", 80, 6, 2, 100, 3, 2, False, 30.0),
        ("f16", 256, 4, 1, 70, 1, 2, False, 0.0),
    ]
    for kvt, D, H, hkv, n_kv, T, splits, masked, softcap in configs:
        n_ctx = n_kv + 5
        ks, vs, k64, v64 = _kv(c, kvt, n_ctx, hkv, D)
        q = c.rng.standard_normal((T, H, D)).astype(np.float32)
        scale = 1.0 / math.sqrt(D)
        mask = None
        if masked:
            mask = np.where(c.rng.random((T, n_kv)) < 0.3, -np.inf, 0.0).astype(np.float32)
            mask[:, -1] = 0.0
        ref = ref_attention(q.astype(np.float64), k64[:n_kv], v64[:n_kv], scale, mask,
                            softcap, True, n_kv - T)
        dq, dk, dv = c.dev(q), c.dev(ks), c.dev(vs)
        dm = c.dev(mask) if mask is not None else None
        out = c.nan((T, H, D))
        c.case("attn_decode",
                  f"{kvt} G={H // hkv} splits={splits or 'auto'}"
                  + (" mask" if masked else "") + (" softcap" if softcap else ""),
                  (D, H, hkv, n_kv, T),
                  lambda dq=dq, dk=dk, dv=dv, dm=dm, out=out, D=D, H=H, hkv=hkv, T=T,
                  n_kv=n_kv, scale=scale, splits=splits, softcap=softcap:
                  ck.flash_attn_decode(dq, dk, dv, out, n_head=H, n_head_kv=hkv,
                                       head_dim=D, n_tokens=T, n_kv=n_kv, scale=scale,
                                       mask=dm, softcap=softcap, n_splits=splits),
                  lambda out=out: c.host(out), ref, 1e-4)


def check_attn_prefill(c: Checker) -> None:
    ck = c.ck
    configs = [
        # (kv, D, H, Hkv, T, past, masked)
        ("f16", 64, 9, 3, 1, 0, False),
        ("f16", 64, 9, 3, 5, 0, False),
        ("f16", 64, 9, 3, 33, 4, False),
        ("bf16", 128, 4, 2, 20, 40, False),
        ("f32", 64, 2, 2, 17, 0, True),
        ("f16", 256, 2, 1, 9, 3, False),
    ]
    for kvt, D, H, hkv, T, past, masked in configs:
        n_kv = T + past
        ks, vs, k64, v64 = _kv(c, kvt, n_kv + 3, hkv, D)
        q = c.rng.standard_normal((T, H, D)).astype(np.float32)
        scale = 1.0 / math.sqrt(D)
        mask = None
        causal = not masked
        if masked:  # causal mask given explicitly instead of the causal flag
            j = np.arange(n_kv)[None, :]
            t = np.arange(T)[:, None]
            mask = np.where(j <= t + past, 0.0, -np.inf).astype(np.float32)
        ref = ref_attention(q.astype(np.float64), k64[:n_kv], v64[:n_kv], scale, mask,
                            0.0, causal, past)
        dq, dk, dv = c.dev(q), c.dev(ks), c.dev(vs)
        dm = c.dev(mask) if mask is not None else None
        out = c.nan((T, H, D))
        c.case("attn_prefill", f"{kvt} G={H // hkv}" + (" mask" if masked else " causal"),
                  (D, H, hkv, n_kv, T),
                  lambda dq=dq, dk=dk, dv=dv, dm=dm, out=out, D=D, H=H, hkv=hkv, T=T,
                  n_kv=n_kv, scale=scale, causal=causal:
                  ck.flash_attn_prefill(dq, dk, dv, out, n_head=H, n_head_kv=hkv,
                                        head_dim=D, n_tokens=T, n_kv=n_kv, scale=scale,
                                        mask=dm, causal=causal),
                  lambda out=out: c.host(out), ref, 1e-4)


def check_attn_kv_len(c: Checker) -> None:
    """kv_len in device memory: keys beyond it are never read (NaN there must not leak),
    and changing it needs no new launch arguments (what a CUDA graph replays)."""
    ck = c.ck
    D, H, hkv, n_kv = 64, 9, 3, 256
    ks, vs, k64, v64 = _kv(c, "f16", n_kv, hkv, D)
    ks[100:] = np.nan
    vs[100:] = np.nan
    for T, kernel in ((1, "decode"), (6, "prefill")):
        q = c.rng.standard_normal((T, H, D)).astype(np.float32)
        dq, dk, dv = c.dev(q), c.dev(ks), c.dev(vs)
        for used in (100, 37):
            mask = np.full((T, n_kv), -np.inf, dtype=np.float32)
            for t in range(T):
                mask[t, : used - T + t + 1] = 0.0
            ref = ref_attention(q.astype(np.float64), k64[:used], v64[:used], 1 / 8.0,
                                mask[:, :used], 0.0, False)
            dm = c.dev(mask)
            dlen = c.dev(np.array([used], dtype=np.int32))
            out = c.nan((T, H, D))
            fn = ck.flash_attn_decode if kernel == "decode" else ck.flash_attn_prefill
            c.case(f"attn_{kernel}", f"f16 kv_len={used}/{n_kv}", (D, H, hkv, n_kv, T),
                      lambda fn=fn, dq=dq, dk=dk, dv=dv, dm=dm, dlen=dlen, out=out, T=T: fn(
                          dq, dk, dv, out, n_head=H, n_head_kv=hkv, head_dim=D, n_tokens=T,
                          n_kv=n_kv, scale=1 / 8.0, mask=dm, causal=False, kv_len=dlen),
                      lambda out=out: c.host(out), ref, 1e-4)


def _quant_kv(c: Checker, qt: str, n_ctx: int, hkv: int, D: int, pad_heads: int = 0):
    """A quantized cache [n_ctx, hkv (+ pad_heads), row bytes] (uint8; padding heads make the row
    stride larger than the heads it holds, as a device's slice of a wider cache view) and its
    float64 value [n_ctx, hkv, D]; K and V. Returns (k, v, k64, v64, (head, row) byte strides)."""
    out = []
    for _ in range(2):
        x = c.rng.standard_normal((n_ctx, hkv + pad_heads, D)).astype(np.float32)
        raw, val = kv_rows(x, qt)
        out += [raw, val[:, :hkv]]
    rb = D // KV_QUANT_TYPES[qt][0] * KV_QUANT_TYPES[qt][1]
    return out[0], out[2], out[1], out[3], (rb, rb * (hkv + pad_heads))


def check_attn_quant(c: Checker) -> None:
    """Decode (split-KV, every NG) and prefill attention reading quantized K and V directly."""
    ck = c.ck
    configs = [
        # (kind, D, H, Hkv, n_kv, T, splits, masked, pad_heads)
        ("decode", 64, 9, 3, 300, 1, 3, False, 0),
        ("decode", 128, 8, 8, 130, 1, None, True, 1),
        ("decode", 64, 16, 2, 70, 2, 2, False, 0),
        ("decode", 32, 4, 1, 40, 3, 1, False, 0),
        ("prefill", 64, 9, 3, 37, 33, None, False, 0),
        ("prefill", 128, 4, 2, 60, 20, None, True, 1),
    ]
    for qt in KV_QUANT_TYPES:
        for kind, D, H, hkv, n_kv, T, splits, masked, pad in configs:
            ks, vs, k64, v64, strides = _quant_kv(c, qt, n_kv + 4, hkv, D, pad)
            q = c.rng.standard_normal((T, H, D)).astype(np.float32)
            scale = 1.0 / math.sqrt(D)
            mask = None
            if masked:
                mask = np.where(c.rng.random((T, n_kv)) < 0.3, -np.inf, 0.0).astype(np.float32)
                mask[:, -1] = 0.0
            ref = ref_attention(q.astype(np.float64), k64[:n_kv], v64[:n_kv], scale, mask, 0.0, True, n_kv - T)
            dq, dk, dv = c.dev(q), c.dev(ks), c.dev(vs)
            dm = c.dev(mask) if mask is not None else None
            out = c.nan((T, H, D))
            fn = ck.flash_attn_decode if kind == "decode" else ck.flash_attn_prefill
            extra = {"n_splits": splits} if kind == "decode" else {}
            c.case(f"attn_{kind}", f"{qt} G={H // hkv}" + (f" splits={splits or 'auto'}" if kind == "decode" else "")
                   + (" mask" if masked else "") + (" padded" if pad else ""), (D, H, hkv, n_kv, T),
                   lambda fn=fn, dq=dq, dk=dk, dv=dv, dm=dm, out=out, D=D, H=H, hkv=hkv, T=T, n_kv=n_kv,
                   scale=scale, extra=extra, strides=strides, qt=qt:
                   fn(dq, dk, dv, out, n_head=H, n_head_kv=hkv, head_dim=D, n_tokens=T, n_kv=n_kv, scale=scale,
                      mask=dm, k_strides=strides, v_strides=strides, kv_type=qt, **extra),
                   lambda out=out: c.host(out), ref, 1e-4)
