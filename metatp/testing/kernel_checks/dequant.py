"""Kernel checks of the ``dequant`` family: dequantization of every weight type to f32 and f16."""

from __future__ import annotations

import numpy as np

from metatp.testing.kernel_checks.harness import Checker
from metatp.testing.oracles import make_weight

CHECKS = ('dequant',)


def check_dequant(c: Checker) -> None:
    ck = c.ck
    n_rows, ne0 = 6, 512
    for wt in ck.WEIGHT_TYPES:
        raw, deq = make_weight(c.rng, wt, n_rows, ne0)
        d_raw = c.dev(raw)
        for odt, np_dt in (("f32", np.float32), ("f16", np.float16)):
            out = c.nan((n_rows, ne0), np_dt)
            ref = deq.astype(np_dt).astype(np.float64)
            c.case("dequant", f"{wt}->{odt}", (n_rows, ne0),
                      lambda d_raw=d_raw, out=out, wt=wt: ck.dequantize(
                          d_raw, wt, out, ne0=ne0, n_rows=n_rows),
                      lambda out=out: c.host(out), ref, 0.0)
    # padded destination rows (dst_row_stride > ne0)
    raw, deq = make_weight(c.rng, "q4_k", 3, 256)
    out = c.nan((3, 300))
    ref = np.full((3, 300), np.nan)
    ref[:, :256] = deq
    d_raw = c.dev(raw)
    c.case("dequant", "q4_k->f32 dst_stride=300", (3, 256),
              lambda: ck.dequantize(d_raw, "q4_k", out, ne0=256, n_rows=3,
                                    dst_row_stride=300),
              lambda: c.host(out), ref, 0.0)
