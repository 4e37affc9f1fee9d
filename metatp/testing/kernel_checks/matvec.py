"""Kernel checks of the ``matvec`` family: matvec (every weight type, 1..11 tokens, ne0 slices), the add epilogue, q/k/v in one launch with the norm folded in, gate/up + GLU, MUL_MAT_ID, norm + q/k/v + RoPE + KV-cache write."""

from __future__ import annotations

import math

import numpy as np

from metatp.testing.kernel_checks.harness import Checker
from metatp.testing.oracles import bf16_bits_to_f32, kv_rows, make_weight, gelu, ref_rope, silu

CHECKS = ('matvec', 'matvec_fused', 'matvec_multi', 'matvec_id', 'qkv_rope_kv')


def check_matvec(c: Checker) -> None:
    ck = c.ck
    n_rows = 37
    for wt in ck.WEIGHT_TYPES:
        ne0 = 512
        raw, deq = make_weight(c.rng, wt, n_rows, ne0)
        d_raw = c.dev(raw)
        for nt in (1, 3, 8, 11):
            x = c.rng.standard_normal((nt, ne0)).astype(np.float32)
            ref = x.astype(np.float64) @ deq.astype(np.float64).T
            dx = c.dev(x)
            y = c.nan((nt, n_rows))
            c.case("matvec", wt, (n_rows, ne0, nt),
                      lambda d_raw=d_raw, dx=dx, y=y, wt=wt: ck.matvec.matvec(
                          d_raw, wt, dx, y, ne0=ne0, n_rows=n_rows),
                      lambda y=y: c.host(y), ref, 1e-5 * math.sqrt(ne0))
    # other block shapes: tiny rows (one warp per row), long rows (8 warps per row),
    # odd float rows
    for wt, ne0, rows, nt in (("q8_0", 64, 37, 1), ("q4_k", 4096, 5, 2), ("f32", 33, 7, 1),
                              ("bf16", 1000, 3, 5)):
        raw, deq = make_weight(c.rng, wt, rows, ne0)
        x = c.rng.standard_normal((nt, ne0)).astype(np.float32)
        ref = x.astype(np.float64) @ deq.astype(np.float64).T
        d_raw, dx, y = c.dev(raw), c.dev(x), c.nan((nt, rows))
        c.case("matvec", wt, (rows, ne0, nt),
                  lambda d_raw=d_raw, dx=dx, y=y, wt=wt, ne0=ne0, rows=rows: ck.matvec.matvec(
                      d_raw, wt, dx, y, ne0=ne0, n_rows=rows),
                  lambda y=y: c.host(y), ref, 1e-5 * math.sqrt(ne0))
    # per-device slice of a weight split along ne0 (row parallel): rows keep their
    # full stride, the pointer starts at the slice's first block.
    for wt in ("q4_0", "q6_k", "f16"):
        full, sl0, sl1 = 1024, 256, 768
        raw, deq = make_weight(c.rng, wt, n_rows, full)
        qk, nb = ck.WEIGHT_TYPES[wt]
        d_raw = c.dev(raw)
        b0 = sl0 // qk * nb
        x = c.rng.standard_normal((2, sl1 - sl0)).astype(np.float32)
        ref = x.astype(np.float64) @ deq[:, sl0:sl1].astype(np.float64).T
        dx = c.dev(x)
        y = c.nan((2, n_rows))
        c.case("matvec", f"{wt} ne0-slice", (n_rows, sl1 - sl0, 2),
                  lambda d_raw=d_raw, dx=dx, y=y, wt=wt, b0=b0: ck.matvec.matvec(
                      d_raw.reshape(-1)[b0:], wt, dx, y, ne0=sl1 - sl0, n_rows=n_rows,
                      w_row_bytes=raw.shape[1]),
                  lambda y=y: c.host(y), ref, 1e-5 * math.sqrt(full))
    # SmolLM2-like shape, Q4_1 (576 -> 1536)
    raw, deq = make_weight(c.rng, "q4_1", 1536, 576)
    x = c.rng.standard_normal((1, 576)).astype(np.float32)
    d_raw, dx, y = c.dev(raw), c.dev(x), c.nan((1, 1536))
    c.case("matvec", "q4_1", (1536, 576, 1),
              lambda: ck.matvec.matvec(d_raw, "q4_1", dx, y, ne0=576, n_rows=1536),
              lambda: c.host(y), x.astype(np.float64) @ deq.astype(np.float64).T, 1e-4)


def check_matvec_fused(c: Checker) -> None:
    """matvec + residual add (per token, and a broadcast bias), gate/up + GLU."""
    ck = c.ck
    n_rows, ne0 = 45, 512
    for wt in ("q4_1", "q8_0", "q6_k", "f32"):
        raw, deq = make_weight(c.rng, wt, n_rows, ne0)
        d_raw = c.dev(raw)
        for nt in (1, 3):
            x = c.rng.standard_normal((nt, ne0)).astype(np.float32)
            res = c.rng.standard_normal((nt, n_rows)).astype(np.float32)
            ref = x.astype(np.float64) @ deq.astype(np.float64).T + res
            dx, dres = c.dev(x), c.dev(res)
            y = c.nan((nt, n_rows))
            c.case("matvec+add", wt, (n_rows, ne0, nt),
                      lambda d_raw=d_raw, dx=dx, y=y, dres=dres, wt=wt: ck.matvec.matvec(
                          d_raw, wt, dx, y, ne0=ne0, n_rows=n_rows, add=dres),
                      lambda y=y: c.host(y), ref, 1e-5 * math.sqrt(ne0))
        bias = c.rng.standard_normal(n_rows).astype(np.float32)
        x = c.rng.standard_normal((2, ne0)).astype(np.float32)
        ref = x.astype(np.float64) @ deq.astype(np.float64).T + bias
        dx, db = c.dev(x), c.dev(bias)
        y = c.nan((2, n_rows))
        c.case("matvec+bias", wt, (n_rows, ne0, 2),
                  lambda d_raw=d_raw, dx=dx, y=y, db=db, wt=wt: ck.matvec.matvec(
                      d_raw, wt, dx, y, ne0=ne0, n_rows=n_rows, add=db, add_stride=0),
                  lambda y=y: c.host(y), ref, 1e-5 * math.sqrt(ne0))
    for wt, act, fn in (("q4_1", "swiglu", silu), ("q4_k", "geglu", gelu),
                        ("f16", "swiglu", silu)):
        ne0 = 256 if wt == "q4_k" else 576
        rg, dg = make_weight(c.rng, wt, n_rows, ne0)
        ru, du = make_weight(c.rng, wt, n_rows, ne0)
        x = c.rng.standard_normal(ne0).astype(np.float32)
        x64 = x.astype(np.float64)
        ref = fn(dg.astype(np.float64) @ x64) * (du.astype(np.float64) @ x64)
        drg, dru, dx = c.dev(rg), c.dev(ru), c.dev(x)
        y = c.nan(n_rows)
        c.case("matvec_glu", f"{wt} {act}", (n_rows, ne0),
                  lambda drg=drg, dru=dru, dx=dx, y=y, wt=wt, ne0=ne0, act=act: ck.matvec_glu(
                      drg, dru, wt, dx, y, ne0=ne0, n_rows=n_rows, act=act),
                  lambda y=y: c.host(y), ref, 1e-4)


def check_matvec_multi(c: Checker) -> None:
    """q/k/v in one launch (3 weights, different row counts), with and without the RMS
    norm of x folded in; a single weight with the norm (the lm head after the final norm);
    gate/up + GLU with the norm."""
    ck = c.ck
    eps = 1e-5
    ne0 = 576
    x = c.rng.standard_normal(ne0).astype(np.float32) * 2
    nw = (1.0 + 0.1 * c.rng.standard_normal(ne0)).astype(np.float32)
    x64 = x.astype(np.float64)
    xn = x64 / np.sqrt((x64 * x64).mean() + eps) * nw
    dx, dnw = c.dev(x), c.dev(nw)
    for wt in ("q4_1", "q8_0", "f16"):
        rows = (576, 192, 192)
        ws = [make_weight(c.rng, wt, r, ne0) for r in rows]
        dws = [c.dev(raw) for raw, _ in ws]
        for norm in (False, True):
            xin = xn if norm else x64
            refs = [deq.astype(np.float64) @ xin for _, deq in ws]
            ys = [c.nan(r) for r in rows]
            jobs = [(dw, y, r, raw.shape[1]) for dw, y, r, (raw, _) in zip(dws, ys, rows, ws)]
            c.case("matvec_multi", f"{wt} qkv" + (" +rms_norm" if norm else ""), (ne0, rows),
                      lambda jobs=jobs, wt=wt, norm=norm: ck.matvec_multi(
                          jobs, wt, dx, ne0=ne0, norm_weight=dnw if norm else None,
                          eps=eps if norm else None),
                      lambda ys=ys: np.concatenate([c.host(y) for y in ys]),
                      np.concatenate(refs), 1e-5 * math.sqrt(ne0))
    raw, deq = make_weight(c.rng, "q8_0", 999, ne0)
    d_raw, y = c.dev(raw), c.nan(999)
    c.case("matvec_multi", "q8_0 one weight +rms_norm (lm head)", (ne0, 999),
              lambda: ck.matvec_multi([(d_raw, y, 999, raw.shape[1])], "q8_0", dx, ne0=ne0,
                                      norm_weight=dnw, eps=eps),
              lambda: c.host(y), deq.astype(np.float64) @ xn, 1e-5 * math.sqrt(ne0))
    rg, dg = make_weight(c.rng, "q4_1", 300, ne0)
    ru, du = make_weight(c.rng, "q4_1", 300, ne0)
    ref = silu(dg.astype(np.float64) @ xn) * (du.astype(np.float64) @ xn)
    drg, dru, y = c.dev(rg), c.dev(ru), c.nan(300)
    c.case("matvec_glu", "q4_1 swiglu +rms_norm", (300, ne0),
              lambda: ck.matvec_glu(drg, dru, "q4_1", dx, y, ne0=ne0, n_rows=300, act="swiglu",
                                    norm_weight=dnw, eps=eps),
              lambda: c.host(y), ref, 1e-4)


def check_matvec_id(c: Checker) -> None:
    """MUL_MAT_ID: per-token expert selection, x shared (n_b = 1) or per slot."""
    ck = c.ck
    n_exp, n_rows, ne0, n_used, T = 5, 24, 256, 2, 3
    for wt in ("q4_0", "q8_0", "f32"):
        raws, deqs = zip(*(make_weight(c.rng, wt, n_rows, ne0) for _ in range(n_exp)))
        raw = np.ascontiguousarray(np.stack(raws))
        expert_bytes = raw.shape[1] * raw.shape[2]
        ids = np.array([[0, 4], [2, 2], [3, 1]], dtype=np.int32)
        for n_b in (1, n_used):
            x = c.rng.standard_normal((T, n_b, ne0)).astype(np.float32)
            ref = np.zeros((T, n_used, n_rows))
            for t in range(T):
                for u in range(n_used):
                    ref[t, u] = deqs[ids[t, u]].astype(np.float64) @ x[t, u % n_b].astype(np.float64)
            d_raw, dx, dids = c.dev(raw), c.dev(x), c.dev(ids)
            y = c.nan((T, n_used, n_rows))
            c.case("matvec_id", f"{wt} n_b={n_b}", (n_rows, ne0, n_used, T),
                      lambda d_raw=d_raw, dx=dx, y=y, dids=dids, wt=wt: ck.matvec_id(
                          d_raw, wt, dx, y, dids, ne0=ne0, n_rows=n_rows,
                          expert_bytes=expert_bytes),
                      lambda y=y: c.host(y), ref, 1e-5 * math.sqrt(ne0))


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
               hd=hd, nd=nd, neox=neox, dff=dff, norm=norm, dnw=dnw: ck.matvec.qkv_rope_kv(
                   dws, wt, dx, q, dk, dv, drow, dpos, ne0=ne0, n_head=nh, n_head_kv=nkv, head_dim=hd,
                   n_dims=nd, neox=neox, freq_base=10000.0, freq_factors=dff,
                   norm_weight=dnw if norm else None, eps=eps if norm else None),
               lambda q=q, dk=dk, dv=dv, ct=ct: np.concatenate(
                   [c.host(q).reshape(-1).astype(np.float64), _cache_values(c.host(dk), ct).reshape(-1),
                    _cache_values(c.host(dv), ct).reshape(-1)]),
               ref, tol)
