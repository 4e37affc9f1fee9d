"""Kernel checks of the ``elementwise`` family: binary broadcasting, in-place add, scale, fill, activations, unary, softmax, argmax, top-k, GET_ROWS, ADD_ID, strided copies, bf16 conversion."""

from __future__ import annotations

import math

import numpy as np

from metatp.testing.kernel_checks.harness import Checker
from metatp.testing.oracles import f32_to_bf16_bits, bf16_bits_to_f32, make_weight, gelu, silu

CHECKS = ('binary', 'inplace_scale_fill', 'activations', 'unary', 'soft_max', 'argmax', 'top_k', 'get_rows', 'add_id', 'copy', 'bf16')


def check_binary(c: Checker) -> None:
    ck = c.ck
    a = c.rng.standard_normal((2, 3, 4, 5)).astype(np.float32)
    da = c.dev(a)
    ops = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide}
    for bshape in ((5,), (4, 1), (1, 3, 1, 5), (2, 3, 4, 5), (1, 1, 2, 5)):
        b = c.rng.uniform(0.5, 2.0, bshape).astype(np.float32)
        db = c.dev(b)
        breps = tuple(s // bs for s, bs in zip(a.shape, (1,) * (4 - len(bshape)) + bshape))
        bfull = np.tile(b.reshape((1,) * (4 - len(bshape)) + bshape), breps)
        for op, fn in ops.items():
            out = c.nan(a.shape)
            ref = fn(a.astype(np.float64), bfull.astype(np.float64))
            c.case("binary", f"{op} b={bshape}", a.shape,
                      lambda op=op, db=db, out=out: ck.binary(op, da, db, out),
                      lambda out=out: c.host(out), ref, 1e-6)
    # non-contiguous a (transposed view), in place into a copy
    at = c.dev(a).transpose(0, 1, 3, 2)  # (2, 3, 5, 4) view
    b = c.rng.standard_normal(4).astype(np.float32)
    db = c.dev(b)
    out = c.nan(at.shape)
    ref = a.transpose(0, 1, 3, 2).astype(np.float64) * b
    c.case("binary", "mul strided-a", at.shape,
              lambda: ck.mul(at, db, out), lambda: c.host(out), ref, 1e-6)


def check_inplace_scale_fill(c: Checker) -> None:
    ck = c.ck
    n = 1000
    y0 = c.rng.standard_normal(n).astype(np.float32)
    x = c.rng.standard_normal(n).astype(np.float32)
    xb = f32_to_bf16_bits(x)
    yb = f32_to_bf16_bits(y0)
    dx, dxb = c.dev(x), c.dev(xb)
    dy0, dyb0 = c.dev(y0), c.dev(yb)
    cases = (
        ("f32+=f32", dy0, dx, lambda h: h, y0.astype(np.float64) + x, 1e-6),
        ("f32+=bf16", dy0, dxb, lambda h: h, y0.astype(np.float64) + bf16_bits_to_f32(xb),
         1e-6),
        ("bf16+=bf16", dyb0, dxb, bf16_bits_to_f32,
         bf16_bits_to_f32(f32_to_bf16_bits(bf16_bits_to_f32(yb) + bf16_bits_to_f32(xb))),
         0.0),
    )
    for label, y_init, xin, conv, ref, thr in cases:
        y = c.arrays.empty_like(y_init)

        def run(y=y, y_init=y_init, xin=xin):
            y[...] = y_init  # fresh accumulator for every launch (timing reruns it)
            ck.add_inplace(y, xin)

        c.case("add_inplace", label, (n,), run,
                  lambda y=y, conv=conv: conv(c.host(y)), ref, thr)
    out = c.nan(n)
    c.case("scale", "f32", (n,), lambda: ck.scale(dx, out, 0.125, 0.5),
              lambda: c.host(out), x.astype(np.float64) * 0.125 + 0.5, 1e-6)
    out2 = c.nan(n)
    c.case("fill", "f32", (n,), lambda: ck.fill(out2, 0.0), lambda: c.host(out2),
              np.zeros(n), 0.0)


def check_activations(c: Checker) -> None:
    ck = c.ck
    rows, ne0 = 7, 300
    fused = c.rng.standard_normal((rows, 2 * ne0)).astype(np.float32) * 3
    df = c.dev(fused)
    g64, u64 = fused[:, :ne0].astype(np.float64), fused[:, ne0:].astype(np.float64)
    for name, fn, act in (("swiglu", ck.swiglu, silu), ("geglu", ck.geglu, gelu)):
        out = c.nan((rows, ne0))
        c.case(name, "f32 fused-halves", (ne0, rows),
                  lambda fn=fn, out=out: fn(df[:, :ne0], df[:, ne0:], out),
                  lambda out=out: c.host(out), act(g64) * u64, 1e-5)
    x = c.rng.standard_normal(777).astype(np.float32) * 4
    dx = c.dev(x)
    for name, fn, act in (("silu", ck.silu, silu), ("gelu", ck.gelu, gelu)):
        out = c.nan(777)
        c.case(name, "f32", (777,), lambda fn=fn, out=out: fn(dx, out),
                  lambda out=out: c.host(out), act(x.astype(np.float64)), 1e-5)


def check_unary(c: Checker) -> None:
    ck = c.ck
    x = (c.rng.standard_normal((3, 4, 50)) * 4).astype(np.float32)
    x[0, 0, :3] = [-100.0, 100.0, 0.0]
    dx = c.dev(x)
    xv64 = x[:, :, 5:45].transpose(1, 0, 2).astype(np.float64)
    refs = {"sigmoid": 1.0 / (1.0 + np.exp(-xv64)), "softplus": np.logaddexp(0.0, xv64),
            "silu": silu(xv64), "gelu": gelu(xv64), "scale": xv64 * -0.5 + 2.0}
    for op, ref in refs.items():
        out = c.nan(xv64.shape)
        c.case("unary", f"{op} strided", xv64.shape,
                  lambda op=op, out=out: ck.unary(op, dx[:, :, 5:45].transpose(1, 0, 2), out,
                                                  -0.5, 2.0),
                  lambda out=out: c.host(out), ref, 1e-5)


def check_soft_max(c: Checker) -> None:
    ck = c.ck
    rows, ne0 = 6, 333
    x = c.rng.standard_normal((rows, ne0)).astype(np.float32) * 3
    mask = np.where(c.rng.random((3, ne0)) < 0.2, -np.inf, 0.0).astype(np.float32)
    dx, dm = c.dev(x), c.dev(mask)
    for masked, sc in ((False, 1.0), (True, 0.5)):
        z = x.astype(np.float64) * sc
        if masked:
            z = z + np.tile(mask, (2, 1))
        e = np.exp(z - z.max(axis=1, keepdims=True))
        ref = e / e.sum(axis=1, keepdims=True)
        out = c.nan((rows, ne0))
        c.case("soft_max", f"f32 mask={masked} scale={sc}", (ne0, rows),
                  lambda out=out, masked=masked, sc=sc: ck.soft_max(
                      dx, out, mask=dm if masked else None, scale=sc),
                  lambda out=out: c.host(out), ref, 1e-5)


def check_argmax(c: Checker) -> None:
    ck = c.ck
    rows, ne0 = 9, 5000
    x = c.rng.standard_normal((rows, ne0)).astype(np.float32)
    x[1, 10] = x[1, 4000] = 50.0  # tie: first index wins
    x[2, :] = 1.0
    x[3, 4999] = 99.0
    dx = c.dev(x)
    out = c.arrays.full(rows, -1, np.int32)
    c.case("argmax", "f32", (ne0, rows), lambda: ck.argmax(dx, out),
              lambda: c.host(out).astype(np.float64),
              np.argmax(x, axis=1).astype(np.float64), 0.0,
              err_fn=lambda o, r: 0.0 if np.array_equal(o, r) else math.inf)


def check_top_k(c: Checker) -> None:
    ck = c.ck
    rows, ne0, k = 5, 60, 6
    x = c.rng.standard_normal((rows, ne0)).astype(np.float32)
    x[1, [3, 7, 50]] = 9.0                     # ties: lower index first
    x[2, :] = -np.inf                         # all -inf: indices in order
    x[3, [0, 1]] = np.nan                     # NaN goes last
    x[4, :10] = 0.0
    x[4, 10:] = -1.0
    ref = np.argsort(-x, axis=-1, kind="stable")[:, :k].astype(np.float64)
    dx = c.dev(x)
    out = c.arrays.full((rows, k), -1, np.int32)
    c.case("top_k", "f32", (ne0, rows), lambda: ck.top_k(dx, out, k),
              lambda: c.host(out).astype(np.float64), ref, 0.0,
              err_fn=lambda o, r: 0.0 if np.array_equal(o, r) else math.inf)


def check_get_rows(c: Checker) -> None:
    ck = c.ck
    n_src = 10
    idx = np.array([3, 0, 9, 3], dtype=np.int32)
    didx = c.dev(idx)
    for wt in ck.WEIGHT_TYPES:
        ne0 = 512
        raw, deq = make_weight(c.rng, wt, n_src, ne0)
        d_raw = c.dev(raw)
        out = c.nan((len(idx), ne0))
        c.case("get_rows", wt, (ne0, len(idx)),
                  lambda d_raw=d_raw, out=out, wt=wt: ck.get_rows(d_raw, wt, didx, out,
                                                                 ne0=ne0),
                  lambda out=out: c.host(out), deq[idx].astype(np.float64), 0.0)


def check_add_id(c: Checker) -> None:
    ck = c.ck
    T, n_used, ne0, n_exp = 3, 2, 40, 4
    a = c.rng.standard_normal((T, n_used, ne0)).astype(np.float32)
    b = c.rng.standard_normal((n_exp, ne0)).astype(np.float32)
    ids = np.array([[3, 0], [1, 1], [2, 3]], dtype=np.int32)
    ref = a.astype(np.float64) + b.astype(np.float64)[ids]
    da, db, dids = c.dev(a), c.dev(b), c.dev(ids)
    out = c.nan(a.shape)
    c.case("add_id", "f32", (ne0, n_used, T), lambda: ck.add_id(da, db, dids, out),
              lambda: c.host(out), ref, 1e-6)


def check_copy(c: Checker) -> None:
    ck = c.ck
    x = c.rng.standard_normal((3, 4, 5, 6)).astype(np.float32)
    conv = {
        "f32": (lambda a: a.astype(np.float32), lambda a: a.astype(np.float64)),
        "f16": (lambda a: a.astype(np.float16), lambda a: a.astype(np.float64)),
        "bf16": (f32_to_bf16_bits, lambda a: bf16_bits_to_f32(a).astype(np.float64)),
    }
    dt = {"f32": np.float32, "f16": np.float16, "bf16": np.uint16}
    for s, d in (("f32", "f32"), ("f32", "f16"), ("f16", "f32"), ("f16", "f16"),
                 ("f32", "bf16"), ("bf16", "f32")):
        xs = conv[s][0](x)
        src = c.dev(xs).transpose(2, 0, 3, 1)  # strided view
        ref_src = conv[s][1](xs).transpose(2, 0, 3, 1)
        ref = conv[d][1](conv[d][0](ref_src.astype(np.float32)))
        dst = c.arrays.zeros(src.shape, dt[d])
        c.case("copy", f"{s}->{d} strided", src.shape,
                  lambda src=src, dst=dst: ck.copy(src, dst),
                  lambda dst=dst, d=d: conv[d][1](c.host(dst)), ref, 0.0)


def check_bf16(c: Checker) -> None:
    ck = c.ck
    n = 4099
    x = (c.rng.standard_normal(n) * 10).astype(np.float32)
    x[:4] = [np.inf, -np.inf, 0.0, -0.0]
    dx = c.dev(x)
    out = c.arrays.zeros(n, np.uint16)
    c.case("f32_to_bf16", "f32->bf16", (n,), lambda: ck.f32_to_bf16(dx, out),
              lambda: c.host(out).astype(np.float64),
              f32_to_bf16_bits(x).astype(np.float64), 0.0)
    bits = f32_to_bf16_bits(x)
    db = c.dev(bits)
    outf = c.nan(n)
    c.case("bf16_to_f32", "bf16->f32", (n,), lambda: ck.bf16_to_f32(db, outf),
              lambda: c.host(outf), bf16_bits_to_f32(bits).astype(np.float64), 0.0)

# ------------------------------------------------------------------ fused / new kernels
