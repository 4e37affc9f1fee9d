"""Kernel checks of the ``norm`` family: RMS norm (with and without weight, in place, strided 4-D), layer norm, SUM_ROWS."""

from __future__ import annotations

import numpy as np

from metatp.testing.kernel_checks.harness import Checker

CHECKS = ('rms_norm', 'norm_sum_rows')


def check_rms_norm(c: Checker) -> None:
    ck = c.ck
    n_rows, ne0, eps = 5, 576, 1e-5
    x = c.rng.standard_normal((n_rows, 600)).astype(np.float32)
    w = c.rng.standard_normal(ne0).astype(np.float32)
    xs = x[:, :ne0].astype(np.float64)
    base = xs / np.sqrt((xs * xs).mean(axis=1, keepdims=True) + eps)
    dx, dw = c.dev(x), c.dev(w)
    for with_w in (True, False):
        y = c.nan((n_rows, ne0))
        ref = base * w if with_w else base
        c.case("rms_norm", "f32" + ("" if with_w else " no-weight"), (n_rows, ne0),
                  lambda y=y, with_w=with_w: ck.rms_norm(dx[:, :ne0], y, eps=eps,
                                                         weight=dw if with_w else None),
                  lambda y=y: c.host(y), ref, 1e-5)
    # in place, single long row
    x1 = c.rng.standard_normal((1, 8192)).astype(np.float32)
    d1 = c.dev(x1)
    x64 = x1.astype(np.float64)
    ref = x64 / np.sqrt((x64 * x64).mean() + eps)
    c.case("rms_norm", "f32 in-place", (1, 8192),
              lambda: ck.rms_norm(d1, d1, eps=eps), lambda: c.host(d1), ref, 1e-5)


def check_norm_sum_rows(c: Checker) -> None:
    """Layer norm, RMS norm on a strided 4-D view (per-head rows), SUM_ROWS."""
    ck = c.ck
    eps = 1e-5
    x = c.rng.standard_normal((2, 3, 5, 70)).astype(np.float32) + 0.5
    w = c.rng.standard_normal(64).astype(np.float32)
    xv = x[:, :, :, 3:67]
    x64 = xv.astype(np.float64)
    mu = x64.mean(axis=-1, keepdims=True)
    ref = (x64 - mu) / np.sqrt(((x64 - mu) ** 2).mean(axis=-1, keepdims=True) + eps) * w
    dx, dw = c.dev(x), c.dev(w)
    y = c.nan((2, 3, 5, 64))
    c.case("norm", "f32 strided 4-D", (64, 5, 3, 2),
              lambda: ck.norm.norm(dx[:, :, :, 3:67], y, eps=eps, weight=dw),
              lambda: c.host(y), ref, 1e-5)
    ref = x64 / np.sqrt((x64 * x64).mean(axis=-1, keepdims=True) + eps)
    y2 = c.nan((2, 3, 5, 64))
    c.case("rms_norm", "f32 strided 4-D", (64, 5, 3, 2),
              lambda: ck.rms_norm(dx[:, :, :, 3:67], y2, eps=eps),
              lambda: c.host(y2), ref, 1e-5)
    out = c.nan((2, 3, 5, 1))
    c.case("sum_rows", "f32 strided 4-D", (64, 5, 3, 2),
              lambda: ck.sum_rows(dx[:, :, :, 3:67], out), lambda: c.host(out),
              x64.sum(axis=-1, keepdims=True), 1e-5)
