"""Kernel checks of the ``kv`` family: SET_ROWS into f16 / bf16 / f32 caches, K and V in one launch."""

from __future__ import annotations

import numpy as np

from metatp.backends.testing.kernel_checks.harness import Checker
from metatp.backends.testing.oracles import f32_to_bf16_bits, bf16_bits_to_f32

CHECKS = ('set_rows', 'set_rows_pair')


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
