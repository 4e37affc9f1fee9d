"""Kernel checks of the ``kv`` family: SET_ROWS into f16 / bf16 / f32 caches and quantized
(q8_0 / q4_0 / q4_1 / q5_0 / q5_1) caches, K and V in one launch. Quantized rows must equal
``gguf.quants.quantize`` byte for byte."""

from __future__ import annotations

import numpy as np

from metatp.testing.kernel_checks.harness import Checker
from metatp.backends.cuda.launch import KV_QUANT_TYPES
from metatp.testing.oracles import f32_to_bf16_bits, bf16_bits_to_f32, kv_quantize

CHECKS = ('set_rows', 'set_rows_pair', 'set_rows_quant')


def check_set_rows(c: Checker) -> None:
    ck = c.ck
    ne0, n_slots = 96, 10
    src = c.rng.standard_normal((4, 128)).astype(np.float32)
    idx = np.array([7, 2, 9, 0], dtype=np.int32)
    dsrc, didx = c.dev(src), c.dev(idx)
    for name, dt in (("f16", np.float16), ("bf16", np.uint16), ("f32", np.float32)):
        init = c.rng.standard_normal((n_slots, ne0)).astype(np.float32)
        if name == "bf16":
            init_s = f32_to_bf16_bits(init)
            vals = f32_to_bf16_bits(src[:, :ne0])
        else:
            init_s = init.astype(dt)
            vals = src[:, :ne0].astype(dt)
        ref = init_s.copy()
        ref[idx] = vals
        dst = c.dev(init_s)

        def get(dst=dst, name=name):
            h = c.host(dst)
            return bf16_bits_to_f32(h) if name == "bf16" else h.astype(np.float64)

        ref_v = bf16_bits_to_f32(ref) if name == "bf16" else ref.astype(np.float64)
        c.case("set_rows", f"f32->{name}", (ne0, 4),
                  lambda dst=dst: ck.set_rows(dsrc[:, :ne0], dst, didx),
                  get, ref_v, 0.0)


def check_set_rows_pair(c: Checker) -> None:
    """K and V rows of a layer stored by one launch (different widths, strided source)."""
    ck = c.ck
    idx = np.array([5, 1], dtype=np.int32)
    k = c.rng.standard_normal((2, 100)).astype(np.float32)
    v = c.rng.standard_normal((2, 48)).astype(np.float32)
    ck_init = np.zeros((8, 64), np.float16)
    cv_init = np.zeros((8, 48), np.float16)
    ref_k, ref_v = ck_init.copy(), cv_init.copy()
    ref_k[idx] = k[:, :64].astype(np.float16)
    ref_v[idx] = v.astype(np.float16)
    dk, dv, didx = c.dev(k), c.dev(v), c.dev(idx)
    ck_d, cv_d = c.dev(ck_init), c.dev(cv_init)
    c.case("set_rows", "f32->f16 pair k+v", (64 + 48, 2),
              lambda: ck.set_rows(dk[:, :64], ck_d, didx, second=(dv, cv_d)),
              lambda: np.concatenate([c.host(ck_d).reshape(-1), c.host(cv_d).reshape(-1)]).astype(np.float64),
              np.concatenate([ref_k.reshape(-1), ref_v.reshape(-1)]).astype(np.float64), 0.0)


def bytes_differing(out, ref) -> float:
    """Number of bytes where out and ref differ (0 = bit-exact)."""
    out, ref = np.asarray(out), np.asarray(ref)
    if out.shape != ref.shape or out.dtype != ref.dtype:
        return float("inf")
    return float(np.count_nonzero(out.view(np.uint8) != ref.view(np.uint8)))


def quant_rows(rng, n_rows: int, ne0: int) -> np.ndarray:
    """Rows that exercise the rounding: Gaussian blocks, exact ties of the largest magnitude with
    both signs, a zero block, +-0 and values on .5 boundaries, a negative maximum, wide ranges,
    tiny and large magnitudes, one constant block."""
    x = rng.standard_normal((n_rows, ne0)).astype(np.float32)
    b = x.reshape(-1, 32)
    nb = b.shape[0]
    special = [
        np.zeros(32, np.float32),
        np.where(np.arange(32) % 2 == 0, 1.5, -1.5).astype(np.float32),          # tie |max|, first +
        np.where(np.arange(32) % 2 == 0, -2.0, 2.0).astype(np.float32),          # tie |max|, first -
        (np.arange(32, dtype=np.float32) - 16.0) / 2.0,                          # halves: .5 rounding
        np.linspace(-127.0, 127.0, 32, dtype=np.float32),
        -np.abs(rng.standard_normal(32)).astype(np.float32) * 3.0,               # all negative
        (rng.standard_normal(32) * 1e-4).astype(np.float32),
        (rng.standard_normal(32) * 5e3).astype(np.float32),
        np.full(32, 0.37, np.float32),
        np.concatenate([np.full(31, 0.0, np.float32), np.array([-0.25], np.float32)]),
    ]
    for i, row in enumerate(special[:nb]):
        b[(i * 7) % nb] = row
    return x


def check_set_rows_quant(c: Checker) -> None:
    """Quantized caches: rows written at scattered indices (others untouched), the K and V pair
    in one launch (different widths, a strided source), every type bit-exact vs gguf.quants."""
    ck = c.ck
    n_slots = 12
    idx = np.array([9, 0, 4, 11, 2], dtype=np.int32)
    didx = c.dev(idx)
    for qt, (qk, nbytes) in KV_QUANT_TYPES.items():
        ne0, ne0_2 = 128, 64
        k = quant_rows(c.rng, len(idx), ne0)
        v_wide = quant_rows(c.rng, len(idx), 96)                       # the V source is strided: 64 of 96
        v = np.ascontiguousarray(v_wide[:, :ne0_2])
        init_k = kv_quantize(c.rng.standard_normal((n_slots, ne0)).astype(np.float32), qt)
        init_v = kv_quantize(c.rng.standard_normal((n_slots, ne0_2)).astype(np.float32), qt)
        ref_k, ref_v = init_k.copy(), init_v.copy()
        ref_k[idx] = kv_quantize(k, qt)
        ref_v[idx] = kv_quantize(v, qt)
        dk, dvw = c.dev(k), c.dev(v_wide)
        ck_d, cv_d = c.dev(init_k), c.dev(init_v)
        c.case("set_rows", f"f32->{qt} k", (ne0, len(idx)),
               lambda dk=dk, ck_d=ck_d, qt=qt: ck.set_rows(dk, ck_d, didx, cache_type=qt),
               lambda ck_d=ck_d: c.host(ck_d), ref_k, 0.0, err_fn=bytes_differing)
        ck_d2, cv_d2 = c.dev(init_k), c.dev(init_v)
        c.case("set_rows", f"f32->{qt} pair k+v", (ne0 + ne0_2, len(idx)),
               lambda dk=dk, dvw=dvw, ck_d2=ck_d2, cv_d2=cv_d2, qt=qt:
               ck.set_rows(dk, ck_d2, didx, second=(dvw[:, :ne0_2], cv_d2), cache_type=qt),
               lambda ck_d2=ck_d2, cv_d2=cv_d2: np.concatenate([c.host(ck_d2).reshape(-1), c.host(cv_d2).reshape(-1)]),
               np.concatenate([ref_k.reshape(-1), ref_v.reshape(-1)]), 0.0, err_fn=bytes_differing)
        # a single-token store (decode), one row of a 3-D cache view [n_ctx, heads * row bytes]
        one = quant_rows(c.rng, 1, ne0)
        d_one, d_i = c.dev(one), c.dev(np.array([7], np.int32))
        cd = c.dev(init_k)
        ref1 = init_k.copy()
        ref1[7] = kv_quantize(one, qt)[0]
        c.case("set_rows", f"f32->{qt} one token", (ne0, 1),
               lambda d_one=d_one, d_i=d_i, cd=cd, qt=qt: ck.set_rows(d_one, cd, d_i, cache_type=qt),
               lambda cd=cd: c.host(cd), ref1, 0.0, err_fn=bytes_differing)
