"""Kernel checks of the ``qkv_rope`` family: norm + q/k/v + RoPE + K/V cache write in one launch,
into float caches and quantized ones, with q/k and v weights of one type or a mixed pair."""

from __future__ import annotations

import math

import numpy as np

from metatp.testing.kernel_checks.attn import _block_order
from metatp.testing.kernel_checks.harness import Checker
from metatp.testing.kernel_checks.kv import bytes_differing
from metatp.testing.oracles import bf16_bits_to_f32, kv_rows, make_weight, ref_rope

CHECKS = ('qkv_rope_kv', 'qkv_rope_kv_quant')

_EPS, _CELLS, _ROW, _POS = 1e-5, 7, 4, 37


def _cache_values(host: np.ndarray, cache_type: str) -> np.ndarray:
    """A float cache array as float64 (bf16 kept as uint16 bits)."""
    return bf16_bits_to_f32(host).astype(np.float64) if cache_type == "bf16" else host.astype(np.float64)


def _ref_qkv(ws, x, nw, eps, head_dim, n_dims, neox, ff) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """float64 q, k (roped) and v composed of the oracles: RMS norm x weight, dequantized products,
    ref_rope of q and k at position _POS."""
    x64 = x.astype(np.float64)
    xn = x64 / np.sqrt((x64 * x64).mean() + eps) * nw if eps is not None else x64
    q, k, v = (deq.astype(np.float64) @ xn for _, deq in ws)
    p = np.array([_POS], np.int32)
    q = ref_rope(q.reshape(1, -1, head_dim), p, n_dims, 10000.0, 1.0, neox, ff).reshape(-1)
    k = ref_rope(k.reshape(1, -1, head_dim), p, n_dims, 10000.0, 1.0, neox, ff).reshape(-1)
    return q, k, v


def _ref_qkv_rope_kv(ws, x, nw, eps, head_dim, n_dims, neox, ff, init_k, init_v, cache_type):
    """The float reference: q, then the caches with row _ROW as the cache type stores k and v."""
    q, k, v = _ref_qkv(ws, x, nw, eps, head_dim, n_dims, neox, ff)
    ck_ref, cv_ref = _cache_values(init_k, cache_type), _cache_values(init_v, cache_type)
    ck_ref[_ROW] = kv_rows(k.astype(np.float32), cache_type)[1]
    cv_ref[_ROW] = kv_rows(v.astype(np.float32), cache_type)[1]
    return np.concatenate([q, ck_ref.reshape(-1), cv_ref.reshape(-1)])


def _weights(c: Checker, wt: str, vt: str, ne0: int, nh: int, nkv: int, hd: int) -> list:
    return [make_weight(c.rng, t, r, ne0) for t, r in ((wt, nh * hd), (wt, nkv * hd), (vt, nkv * hd))]


def _inputs(c: Checker, ne0: int, nd: int, use_ff: bool):
    x = (2 * c.rng.standard_normal(ne0)).astype(np.float32)
    nw = (1.0 + 0.1 * c.rng.standard_normal(ne0)).astype(np.float32)
    ff = c.rng.uniform(1.0, 4.0, nd // 2).astype(np.float32) if use_ff else None
    return x, nw, ff


def check_qkv_rope_kv(c: Checker) -> None:
    """Norm + q/k/v + RoPE + K/V cache write in one launch against the composed float64
    reference: every weight type, NORMAL and NEOX, n_dims < head_dim, GQA (and MQA) head
    counts, freq factors, f32 / f16 / bf16 caches, a row in the middle of the cache (the
    other rows must stay as they were), with and without the folded norm; every mixed q/k + v pair
    (float caches in turn). One kernel per weight type or pair: the cache type is its code argument."""
    ck = c.ck
    # (q/k weight type, v weight type, ne0, n_head, n_head_kv, head_dim, n_dims, neox, cache, norm, freq factors)
    cases = [(wt, wt, 256, 4, 2, 32, 32, False, "f32", True, False) for wt in ck.WEIGHT_TYPES]
    cases += [("q4_1", "q4_1", 256, 4, 2, 32, 16, True, "f16", True, True),
              ("q8_0", "q8_0", 256, 4, 2, 32, 32, True, "f32", True, False),
              ("q8_0", "q8_0", 256, 6, 1, 32, 16, False, "bf16", True, False),
              ("q4_k", "q4_k", 256, 2, 2, 64, 48, True, "bf16", False, False),
              ("f16", "f16", 64, 3, 3, 16, 8, False, "f16", False, True)]
    cases += [(a, b, 256, 4, 2, 32, 32, i % 2 == 1, ("f32", "f16", "bf16")[i % 3], True, False)
              for i, (a, b) in enumerate(ck.qkv_rope.MIXED_PAIRS)]
    for wt, vt, ne0, nh, nkv, hd, nd, neox, ct, norm, use_ff in cases:
        ws = _weights(c, wt, vt, ne0, nh, nkv, hd)
        x, nw, ff = _inputs(c, ne0, nd, use_ff)
        init_k = kv_rows(c.rng.standard_normal((_CELLS, nkv * hd)).astype(np.float32), ct)[0]
        init_v = kv_rows(c.rng.standard_normal((_CELLS, nkv * hd)).astype(np.float32), ct)[0]
        ref = _ref_qkv_rope_kv(ws, x, nw, _EPS if norm else None, hd, nd, neox, ff, init_k, init_v, ct)
        dws = [(c.dev(raw), raw.shape[1]) for raw, _ in ws]
        dx, dnw, dk, dv = c.dev(x), c.dev(nw), c.dev(init_k), c.dev(init_v)
        dff = c.dev(ff) if ff is not None else None
        drow, dpos = c.dev(np.array([_ROW], np.int32)), c.dev(np.array([_POS], np.int32))
        q = c.nan((nh, hd))
        tol = {"f32": 1e-5 * math.sqrt(ne0), "f16": 2e-3, "bf16": 1.6e-2}[ct]
        name = (f"{wt}{'' if vt == wt else '+v ' + vt} {'neox' if neox else 'norm'} n_dims={nd}/{hd} "
                f"heads={nh}/{nkv} {ct} cache" + (" +rms_norm" if norm else "") + (" +freq_factors" if use_ff else ""))
        c.case("qkv_rope_kv", name, (ne0, nh, nkv, hd),
               lambda dws=dws, wt=wt, vt=vt, dx=dx, q=q, dk=dk, dv=dv, drow=drow, dpos=dpos, ne0=ne0, nh=nh, nkv=nkv,
               hd=hd, nd=nd, neox=neox, dff=dff, norm=norm, dnw=dnw: ck.qkv_rope.qkv_rope_kv(
                   dws, wt, dx, q, dk, dv, drow, dpos, ne0=ne0, n_head=nh, n_head_kv=nkv, head_dim=hd,
                   n_dims=nd, neox=neox, freq_base=10000.0, freq_factors=dff,
                   norm_weight=dnw if norm else None, eps=_EPS if norm else None, v_qtype=vt),
               lambda q=q, dk=dk, dv=dv, ct=ct: np.concatenate(
                   [c.host(q).reshape(-1).astype(np.float64), _cache_values(c.host(dk), ct).reshape(-1),
                    _cache_values(c.host(dv), ct).reshape(-1)]),
               ref, tol)


def check_qkv_rope_kv_quant(c: Checker) -> None:
    """Quantized caches (q8_0, q4_0, q4_1, q5_0, q5_1): q and the token's f32 k/v row (the staging
    row) against the float64 reference, then the cache bytes against set_rows' quantization of
    those f32 values, bit for bit: row _ROW written, every other row as it was. Blocks run forward,
    reversed and shuffled (the warp drawing a group's last ticket quantizes it, whichever it is);
    three launches reuse the counters (each leaves them 0). NORMAL and NEOX, n_dims < head_dim, GQA,
    a v row of 3 heads of 64 (6 blocks), freq factors, mixed q/k + v pairs."""
    ck = c.ck
    # (q/k type, v type, ne0, n_head, n_head_kv, head_dim, n_dims, neox, cache, norm, freq factors)
    cases = [("q8_0", "q8_0", 256, 4, 2, 32, 32, False, "q8_0", True, False),
             ("q4_k", "q4_k", 256, 6, 3, 64, 48, True, "q4_0", True, True),
             ("q4_1", "q4_1", 128, 4, 1, 64, 64, True, "q4_1", False, False),
             ("f16", "f16", 96, 2, 2, 32, 16, False, "q5_0", True, False),
             (*ck.qkv_rope.MIXED_PAIRS[0], 256, 8, 2, 32, 32, True, "q5_1", True, False),
             ("q2_k", "q4_k", 256, 4, 4, 32, 32, False, "q8_0", True, False)]
    tickets = None
    for wt, vt, ne0, nh, nkv, hd, nd, neox, ct, norm, use_ff in cases:
        ws = _weights(c, wt, vt, ne0, nh, nkv, hd)
        x, nw, ff = _inputs(c, ne0, nd, use_ff)
        q_ref, k_ref, v_ref = _ref_qkv(ws, x, nw, _EPS if norm else None, hd, nd, neox, ff)
        init_k = kv_rows(c.rng.standard_normal((_CELLS, nkv * hd)).astype(np.float32), ct)[0]
        init_v = kv_rows(c.rng.standard_normal((_CELLS, nkv * hd)).astype(np.float32), ct)[0]
        dws = [(c.dev(raw), raw.shape[1]) for raw, _ in ws]
        dx, dnw = c.dev(x), c.dev(nw)
        dff = c.dev(ff) if ff is not None else None
        drow, dpos = c.dev(np.array([_ROW], np.int32)), c.dev(np.array([_POS], np.int32))
        n_tick = ck.qkv_rope.stage_tickets_ints(nkv, nkv * hd)
        if tickets is None or tickets.size < n_tick:
            tickets = c.arrays.zeros((n_tick,), np.int32)
        for order in ("forward", "reverse", "shuffle"):
            q, dk, dv = c.nan((nh, hd)), c.dev(init_k), c.dev(init_v)
            stage = c.nan((ck.qkv_rope.stage_floats(nkv, hd, nkv * hd),))
            name = (f"{wt}{'' if vt == wt else '+v ' + vt} {'neox' if neox else 'norm'} n_dims={nd}/{hd} "
                    f"heads={nh}/{nkv} {ct} cache, blocks {order}")

            def run(dws=dws, wt=wt, vt=vt, dx=dx, q=q, dk=dk, dv=dv, drow=drow, dpos=dpos, ne0=ne0, nh=nh, nkv=nkv,
                    hd=hd, nd=nd, neox=neox, dff=dff, norm=norm, dnw=dnw, ct=ct, stage=stage, order=order):
                with _block_order(order):
                    ck.qkv_rope.qkv_rope_kv(
                        dws, wt, dx, q, dk, dv, drow, dpos, ne0=ne0, n_head=nh, n_head_kv=nkv, head_dim=hd,
                        n_dims=nd, neox=neox, freq_base=10000.0, freq_factors=dff,
                        norm_weight=dnw if norm else None, eps=_EPS if norm else None, v_qtype=vt,
                        cache_type=ct, stage=stage, tickets=tickets)
            c.case("qkv_rope_kv_quant", name + ": q, k, v", (ne0, nh, nkv, hd), run,
                   lambda q=q, stage=stage: np.concatenate([c.host(q).reshape(-1), c.host(stage)]).astype(np.float64),
                   np.concatenate([q_ref, k_ref, v_ref]), 1e-5 * math.sqrt(ne0))

            def cache_bytes_err(out, _ref, stage=stage, nkv=nkv, hd=hd, ct=ct, init_k=init_k, init_v=init_v):
                st = c.host(stage)
                want_k, want_v = init_k.copy(), init_v.copy()
                want_k[_ROW] = kv_rows(st[:nkv * hd], ct)[0]
                want_v[_ROW] = kv_rows(st[nkv * hd:], ct)[0]
                return bytes_differing(out, np.concatenate([want_k.reshape(-1), want_v.reshape(-1)]))
            c.case("qkv_rope_kv_quant", name + ": cache bytes as set_rows", (ne0, nh, nkv, hd), lambda: None,
                   lambda dk=dk, dv=dv: np.concatenate([c.host(dk).reshape(-1), c.host(dv).reshape(-1)]),
                   None, 0.0, err_fn=cache_bytes_err)
            c.case("qkv_rope_kv_quant", name + ": counters back to 0", (n_tick,), lambda: None,
                   lambda: c.host(tickets).astype(np.float64), np.zeros(tickets.size), 0.0,
                   err_fn=lambda out, ref: float(np.abs(out - ref).max()))
