"""Kernel checks of the ``qkv_rope`` family: norm + q/k/v + RoPE + K/V cache write in one launch."""

from __future__ import annotations

import math

import numpy as np

from metatp.testing.kernel_checks.harness import Checker
from metatp.testing.oracles import bf16_bits_to_f32, kv_rows, make_weight, ref_rope

CHECKS = ('qkv_rope_kv',)


def _cache_values(host: np.ndarray, cache_type: str) -> np.ndarray:
    """A float cache array as float64 (bf16 kept as uint16 bits)."""
    return bf16_bits_to_f32(host).astype(np.float64) if cache_type == "bf16" else host.astype(np.float64)


def _ref_qkv_rope_kv(c: Checker, ws, x, nw, eps, pos, head_dim, n_dims, neox, ff, init_k, init_v, row, cache_type):
    """float64 reference composed of the oracles: RMS norm x weight, dequantized products,
    ref_rope of q and k, the caches' row `row` as the cache type stores k and v."""
    x64 = x.astype(np.float64)
    xn = x64 / np.sqrt((x64 * x64).mean() + eps) * nw if eps is not None else x64
    q, k, v = (deq.astype(np.float64) @ xn for _, deq in ws)
    p = np.array([pos], np.int32)
    q = ref_rope(q.reshape(1, -1, head_dim), p, n_dims, 10000.0, 1.0, neox, ff).reshape(-1)
    k = ref_rope(k.reshape(1, -1, head_dim), p, n_dims, 10000.0, 1.0, neox, ff).reshape(-1)
    ck_ref, cv_ref = _cache_values(init_k, cache_type), _cache_values(init_v, cache_type)
    ck_ref[row] = kv_rows(k.astype(np.float32), cache_type)[1]
    cv_ref[row] = kv_rows(v.astype(np.float32), cache_type)[1]
    return np.concatenate([q, ck_ref.reshape(-1), cv_ref.reshape(-1)])


def check_qkv_rope_kv(c: Checker) -> None:
    """Norm + q/k/v + RoPE + K/V cache write in one launch against the composed float64
    reference: every weight type, NORMAL and NEOX, n_dims < head_dim, GQA (and MQA) head
    counts, freq factors, f32 / f16 / bf16 caches, a row in the middle of the cache (the
    other rows must stay as they were), with and without the folded norm."""
    ck = c.ck
    eps, n_cells, row, pos = 1e-5, 7, 4, 37
    # (weight type, ne0, n_head, n_head_kv, head_dim, n_dims, neox, cache, norm, freq factors)
    cases = [(wt, 256, 4, 2, 32, 32, False, "f32", True, False) for wt in ck.WEIGHT_TYPES]
    cases += [("q4_1", 256, 4, 2, 32, 16, True, "f16", True, True),
              ("q8_0", 256, 4, 2, 32, 32, True, "f32", True, False),
              ("q8_0", 256, 6, 1, 32, 16, False, "bf16", True, False),
              ("q4_k", 256, 2, 2, 64, 48, True, "bf16", False, False),
              ("f16", 64, 3, 3, 16, 8, False, "f16", False, True)]
    for wt, ne0, nh, nkv, hd, nd, neox, ct, norm, use_ff in cases:
        ws = [make_weight(c.rng, wt, r, ne0) for r in (nh * hd, nkv * hd, nkv * hd)]
        x = (2 * c.rng.standard_normal(ne0)).astype(np.float32)
        nw = (1.0 + 0.1 * c.rng.standard_normal(ne0)).astype(np.float32)
        ff = c.rng.uniform(1.0, 4.0, nd // 2).astype(np.float32) if use_ff else None
        init_k = kv_rows(c.rng.standard_normal((n_cells, nkv * hd)).astype(np.float32), ct)[0]
        init_v = kv_rows(c.rng.standard_normal((n_cells, nkv * hd)).astype(np.float32), ct)[0]
        ref = _ref_qkv_rope_kv(c, ws, x, nw, eps if norm else None, pos, hd, nd, neox, ff, init_k, init_v, row, ct)
        dws = [(c.dev(raw), raw.shape[1]) for raw, _ in ws]
        dx, dnw, dk, dv = c.dev(x), c.dev(nw), c.dev(init_k), c.dev(init_v)
        dff = c.dev(ff) if ff is not None else None
        drow, dpos = c.dev(np.array([row], np.int32)), c.dev(np.array([pos], np.int32))
        q = c.nan((nh, hd))
        tol = {"f32": 1e-5 * math.sqrt(ne0), "f16": 2e-3, "bf16": 1.6e-2}[ct]
        name = (f"{wt} {'neox' if neox else 'norm'} n_dims={nd}/{hd} heads={nh}/{nkv} {ct} cache"
                + (" +rms_norm" if norm else "") + (" +freq_factors" if use_ff else ""))
        c.case("qkv_rope_kv", name, (ne0, nh, nkv, hd),
               lambda dws=dws, wt=wt, dx=dx, q=q, dk=dk, dv=dv, drow=drow, dpos=dpos, ne0=ne0, nh=nh, nkv=nkv,
               hd=hd, nd=nd, neox=neox, dff=dff, norm=norm, dnw=dnw: ck.qkv_rope.qkv_rope_kv(
                   dws, wt, dx, q, dk, dv, drow, dpos, ne0=ne0, n_head=nh, n_head_kv=nkv, head_dim=hd,
                   n_dims=nd, neox=neox, freq_base=10000.0, freq_factors=dff,
                   norm_weight=dnw if norm else None, eps=eps if norm else None),
               lambda q=q, dk=dk, dv=dv, ct=ct: np.concatenate(
                   [c.host(q).reshape(-1).astype(np.float64), _cache_values(c.host(dk), ct).reshape(-1),
                    _cache_values(c.host(dv), ct).reshape(-1)]),
               ref, tol)
