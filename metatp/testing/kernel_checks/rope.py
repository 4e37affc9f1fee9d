"""Kernel checks of the ``rope`` family: RoPE NORMAL / NEOX, partial dims, strided in place with freq factors, Q and K in one launch."""

from __future__ import annotations

import numpy as np

from metatp.testing.kernel_checks.harness import Checker
from metatp.testing.oracles import ref_rope

CHECKS = ('rope', 'rope_pair')


def check_rope(c: Checker) -> None:
    ck = c.ck
    T, H, D = 5, 3, 64
    pos = c.rng.integers(0, 100, size=T).astype(np.int32)
    dpos = c.dev(pos)
    for neox in (False, True):
        for n_dims, fs in ((64, 1.0), (32, 0.5)):
            x = c.rng.standard_normal((T, H, D)).astype(np.float32)
            ref = ref_rope(x, pos, n_dims, 10000.0, fs, neox)
            dx = c.dev(x)
            y = c.nan((T, H, D))
            c.case("rope", f"{'neox' if neox else 'norm'} n_dims={n_dims} fs={fs}",
                      (D, H, T),
                      lambda dx=dx, y=y, neox=neox, n_dims=n_dims, fs=fs: ck.rope.rope(
                          dx, y, dpos, head_dim=D, n_head=H, n_tokens=T, n_dims=n_dims,
                          freq_base=10000.0, freq_scale=fs, neox=neox),
                      lambda y=y: c.host(y), ref, 1e-4)
    # strided input (Q part of a fused QKV row), freq_factors, in place
    fused = c.rng.standard_normal((T, 5 * H * D)).astype(np.float32)
    ff = c.rng.uniform(1.0, 4.0, D // 2).astype(np.float32)
    xq = fused[:, : H * D].reshape(T, H, D)
    ref_full = fused.astype(np.float64).copy()
    ref_full[:, : H * D] = ref_rope(xq, pos, D, 500000.0, 1.0, True, ff, 1.0).reshape(T, -1)
    dfused, dff = c.dev(fused), c.dev(ff)
    c.case("rope", "neox strided in-place freq_factors", (D, H, T),
              lambda: ck.rope.rope(dfused, dfused, dpos, head_dim=D, n_head=H, n_tokens=T,
                              n_dims=D, freq_base=500000.0, neox=True, freq_factors=dff,
                              x_strides=(D, 5 * H * D), y_strides=(D, 5 * H * D)),
              lambda: c.host(dfused), ref_full, 1e-4)


def check_rope_pair(c: Checker) -> None:
    """Q and K of a layer rotated in one launch (strided views of different head counts)."""
    ck = c.ck
    T, D = 3, 64
    pos = c.rng.integers(0, 500, size=T).astype(np.int32)
    dpos = c.dev(pos)
    for neox in (False, True):
        q = c.rng.standard_normal((T, 9, D)).astype(np.float32)
        k = c.rng.standard_normal((T, 5 * D)).astype(np.float32)   # 3 heads + padding
        kv = k[:, : 3 * D].reshape(T, 3, D)
        ref = np.concatenate([ref_rope(q, pos, D, 10000.0, 1.0, neox).reshape(-1),
                              ref_rope(kv, pos, D, 10000.0, 1.0, neox).reshape(-1)])
        dq, dk = c.dev(q), c.dev(k)
        yq, yk = c.nan((T, 9, D)), c.nan((T, 3, D))
        c.case("rope", f"{'neox' if neox else 'norm'} pair q+k", (D, 9 + 3, T),
                  lambda dq=dq, dk=dk, yq=yq, yk=yk, neox=neox: ck.rope.rope(
                      dq, yq, dpos, head_dim=D, n_head=9, n_tokens=T, n_dims=D, freq_base=10000.0,
                      neox=neox, second=(dk, yk, 3, (D, 5 * D), None)),
                  lambda yq=yq, yk=yk: np.concatenate([c.host(yq).reshape(-1),
                                                       c.host(yk).reshape(-1)]), ref, 1e-4)
