"""Kernel checks of the ``mmq`` family: the tiled many-token product for every weight type, with token and
row counts on both sides of the tiles (64 rows; 16, 32, 64 tokens), a row length that ends in a
partial step, strided x / y, and a per-device slice of a weight split along ne0."""

from __future__ import annotations

import math

import numpy as np

from metatp.testing.kernel_checks.harness import Checker
from metatp.testing.oracles import make_weight

CHECKS = ('mmq', 'mmq_tiles')

_TOL = 1e-5


def _case(c: Checker, label: str, wt: str, raw, deq, x, *, ne0: int, rows: int, w_row_bytes=None,
          x_pad: int = 0, y_pad: int = 0) -> None:
    """One launch: x (T, ne0) possibly inside wider rows (x_pad), y inside wider rows (y_pad)."""
    nt = x.shape[0]
    xs = np.zeros((nt, ne0 + x_pad), np.float32)
    xs[:, :ne0] = x
    ref = x.astype(np.float64) @ deq.astype(np.float64).T
    d_raw, dx = c.dev(raw), c.dev(xs)
    y = c.nan((nt, rows + y_pad))
    c.case(label, wt, (rows, ne0, nt),
           lambda: c.ck.mmq.mmq(d_raw, wt, dx[:, :ne0], y[:, :rows], ne0=ne0, n_rows=rows, w_row_bytes=w_row_bytes),
           lambda: c.host(y)[:, :rows], ref, _TOL * math.sqrt(ne0))
    if y_pad:       # the padding past n_rows is never written
        c.case(f"{label} (y padding untouched)", wt, (rows, ne0, nt), lambda: None,
               lambda: np.isnan(c.host(y)[:, rows:]).all().astype(np.float64), np.float64(1.0), 0.0)


def check_mmq(c: Checker) -> None:
    """Every weight type at one shape that crosses a row tile and a 16-token tile, plus one
    token (the smallest launch) and a 64-token tile with the remainder in the last step."""
    for wt in c.ck.WEIGHT_TYPES:
        ne0 = 512
        raw, deq = make_weight(c.rng, wt, 67, ne0)
        for nt in (1, 17):
            x = c.rng.standard_normal((nt, ne0)).astype(np.float32)
            _case(c, "mmq", wt, raw, deq, x, ne0=ne0, rows=67)
    # a row length that is not a whole number of 64-element steps (q4_0: 3 blocks of 32;
    # f16: 33 elements), and one row
    for wt, ne0, rows, nt in (("q4_0", 96, 5, 33), ("f16", 33, 1, 16), ("q8_0", 32, 130, 64)):
        raw, deq = make_weight(c.rng, wt, rows, ne0)
        x = c.rng.standard_normal((nt, ne0)).astype(np.float32)
        _case(c, "mmq", wt, raw, deq, x, ne0=ne0, rows=rows)


def check_mmq_tiles(c: Checker) -> None:
    """Token counts 1, tile-1, tile, tile+1 and 3*tile+5 for each token tile, row counts 63,
    64, 65 and 3*64+5; strided x and y (views of wider rows); a slice of a weight split
    along ne0 (rows keep their full byte stride)."""
    wt, ne0 = "q4_k", 256
    raw, deq = make_weight(c.rng, wt, 3 * 64 + 5, ne0)
    for nt in (15, 16, 31, 32, 33, 63, 64, 65, 3 * 64 + 5):
        x = c.rng.standard_normal((nt, ne0)).astype(np.float32)
        _case(c, "mmq tokens", wt, raw[:37], deq[:37], x, ne0=ne0, rows=37)
    for rows in (63, 64, 65, 3 * 64 + 5):
        x = c.rng.standard_normal((20, ne0)).astype(np.float32)
        _case(c, "mmq rows", wt, raw[:rows], deq[:rows], x, ne0=ne0, rows=rows)
    for wt in ("q6_k", "q4_1", "bf16"):
        raw, deq = make_weight(c.rng, wt, 70, 256)
        x = c.rng.standard_normal((40, 256)).astype(np.float32)
        _case(c, "mmq strided x/y", wt, raw, deq, x, ne0=256, rows=70, x_pad=32, y_pad=3)
    for wt in ("q5_k", "q8_0", "f32"):
        full, sl0, sl1 = 1024, 256, 768
        raw, deq = make_weight(c.rng, wt, 40, full)
        qk, nb = c.ck.WEIGHT_TYPES[wt]
        b0 = sl0 // qk * nb
        x = c.rng.standard_normal((24, sl1 - sl0)).astype(np.float32)
        sliced = np.ascontiguousarray(raw.reshape(-1)[b0:])
        _case(c, "mmq ne0-slice", f"{wt}", sliced, deq[:, sl0:sl1], x, ne0=sl1 - sl0, rows=40,
              w_row_bytes=raw.shape[1])
