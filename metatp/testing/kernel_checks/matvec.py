"""Kernel checks of the ``matvec`` family: matvec (every weight type, 1..11 tokens, ne0 slices), the add epilogue, q/k/v in one launch with the norm folded in, gate/up + GLU, MUL_MAT_ID (norm + q/k/v + RoPE + KV-cache write: ``qkv_rope``)."""

from __future__ import annotations

import math

import numpy as np

from metatp.testing.kernel_checks.harness import Checker
from metatp.testing.oracles import make_weight, gelu, silu

CHECKS = ('matvec', 'matvec_fused', 'matvec_multi', 'matvec_id')


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
