"""Kernel checks of the ``mmq`` family: the tiled many-token product for every weight type, with token and
row counts on both sides of the tiles (64 rows; 16, 32, 64 tokens), a row length that ends in a
partial step, strided x / y, and a per-device slice of a weight split along ne0; the same on the
tensor cores (`tensor_cores=True`, f16 tiles) against the f16-rounded operands' product.

The int8 path (numerics "q8"): `q8_quantize` bit for bit against `oracles.ref_q8_quantize` (codes,
scales, Q8_1's s, 16-code sums), and `mmq_q8` for every type it takes against a float64 product of the
reference's rounded activations with the dequantized weight (plus, for q4_1 / q5_1, the offset through
Q8_1's f16 s, as llama.cpp takes it), tokens and rows across its tiles."""

from __future__ import annotations

import math

import numpy as np

from metatp.testing.kernel_checks.harness import Checker
from metatp.testing.oracles import make_weight, ref_q8_quantize

CHECKS = ('mmq', 'mmq_tiles', 'mmq_h', 'mmq_q8_quantize', 'mmq_q8', 'mmq_q8_tiles')

_TOL = 1e-5


def _case(c: Checker, label: str, wt: str, raw, deq, x, *, ne0: int, rows: int, w_row_bytes=None,
          x_pad: int = 0, y_pad: int = 0, tensor_cores: bool = False) -> None:
    """One launch: x (T, ne0) possibly inside wider rows (x_pad), y inside wider rows (y_pad).
    `tensor_cores`: the f16 tiles (mmq_h_*), against the float64 product of the f16-rounded weight
    and activations (the rounding is the kernel's contract; its f32 sums are what is checked)."""
    nt = x.shape[0]
    xs = np.zeros((nt, ne0 + x_pad), np.float32)
    xs[:, :ne0] = x
    if tensor_cores:
        ref = (x.astype(np.float16).astype(np.float64)
               @ np.asarray(deq, np.float32).astype(np.float16).astype(np.float64).T)
    else:
        ref = x.astype(np.float64) @ deq.astype(np.float64).T
    d_raw, dx = c.dev(raw), c.dev(xs)
    y = c.nan((nt, rows + y_pad))
    c.case(label, wt, (rows, ne0, nt),
           lambda: c.ck.mmq.mmq(d_raw, wt, dx[:, :ne0], y[:, :rows], ne0=ne0, n_rows=rows, w_row_bytes=w_row_bytes,
                                tensor_cores=tensor_cores),
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
        _strided_case(c, "mmq strided x/y", wt)
    for wt in ("q5_k", "q8_0", "f32"):
        _ne0_slice_case(c, "mmq ne0-slice", wt)


def _strided_case(c: Checker, label: str, wt: str, tensor_cores: bool = False) -> None:
    """x and y as views of wider rows (70 rows of 256, 40 tokens; y's padding must stay untouched)."""
    raw, deq = make_weight(c.rng, wt, 70, 256)
    x = c.rng.standard_normal((40, 256)).astype(np.float32)
    _case(c, label, wt, raw, deq, x, ne0=256, rows=70, x_pad=32, y_pad=3, tensor_cores=tensor_cores)


def _ne0_slice_case(c: Checker, label: str, wt: str, tensor_cores: bool = False) -> None:
    """A per-device slice of a weight split along ne0 (elements 256..768 of 1,024): a pointer into the
    rows, which keep their full byte stride."""
    full, sl0, sl1 = 1024, 256, 768
    raw, deq = make_weight(c.rng, wt, 40, full)
    qk, nb = c.ck.WEIGHT_TYPES[wt]
    x = c.rng.standard_normal((24, sl1 - sl0)).astype(np.float32)
    sliced = np.ascontiguousarray(raw.reshape(-1)[sl0 // qk * nb:])
    _case(c, label, wt, sliced, deq[:, sl0:sl1], x, ne0=sl1 - sl0, rows=40, w_row_bytes=raw.shape[1],
          tensor_cores=tensor_cores)


def check_mmq_h(c: Checker) -> None:
    """The tensor-core tiles (mmq_h_*): every weight type across a row tile and a 16-token tile;
    token counts around each tile (16, 32, 64), rows around 64, a row length ending in a partial
    step (q4_0, and f16's one-element units), strided x / y, and a slice of a weight split along ne0."""
    for wt in c.ck.WEIGHT_TYPES:
        raw, deq = make_weight(c.rng, wt, 67, 512)
        x = c.rng.standard_normal((17, 512)).astype(np.float32)
        _case(c, "mmq_h", wt, raw, deq, x, ne0=512, rows=67, tensor_cores=True)
    wt, ne0 = "q4_k", 256
    raw, deq = make_weight(c.rng, wt, 3 * 64 + 5, ne0)
    for nt, rows in ((1, 37), (15, 64), (32, 65), (33, 63), (64, 37), (65, 3 * 64 + 5)):
        x = c.rng.standard_normal((nt, ne0)).astype(np.float32)
        _case(c, "mmq_h tiles", wt, raw[:rows], deq[:rows], x, ne0=ne0, rows=rows, tensor_cores=True)
    for wt, ne0, rows, nt in (("q4_0", 96, 5, 33), ("f16", 33, 1, 16)):
        raw, deq = make_weight(c.rng, wt, rows, ne0)
        x = c.rng.standard_normal((nt, ne0)).astype(np.float32)
        _case(c, "mmq_h", wt, raw, deq, x, ne0=ne0, rows=rows, tensor_cores=True)
    _strided_case(c, "mmq_h strided x/y", "q6_k", tensor_cores=True)
    _ne0_slice_case(c, "mmq_h ne0-slice", "q8_0", tensor_cores=True)


# ------------------------------------------------------------------ the int8 path
def _bits_mismatch(out, ref) -> float:
    """How many values differ bit for bit (NaN patterns included): 0 passes."""
    return float(np.count_nonzero(out != ref))


def _acts_bits(acts) -> np.ndarray:
    """All fields of a Q8Acts as one int64 vector of their bits (codes, f32 bit patterns, sums)."""
    parts = [np.asarray(acts.q, np.int8).astype(np.int64).ravel(),
             np.asarray(acts.d, np.float32).view(np.int32).astype(np.int64).ravel(),
             np.asarray(acts.isum, np.int32).astype(np.int64).ravel()]
    if acts.s is not None:
        parts.append(np.asarray(acts.s, np.float32).view(np.int32).astype(np.int64).ravel())
    return np.concatenate(parts)


def _awkward_rows(rng: np.random.Generator, n: int, k: int) -> np.ndarray:
    """Activation rows with what the rounding must get right: scales 1e-3..1e3, a zero block, a
    block whose largest |x| appears with both signs (Q8_K takes the first), a single nonzero, values
    on half-integer codes (x * 127/amax = m + 0.5, ties to even)."""
    x = rng.standard_normal((n, k)).astype(np.float32) * np.float32(10.0) ** rng.integers(-3, 4, (n, 1))
    x[0, :256] = 0.0
    if n > 1:
        x[1, 0:256] = rng.uniform(-1, 1, 256).astype(np.float32)
        x[1, 5], x[1, 77] = -2.0, 2.0          # the first of equal |x| is negative
        x[1, 256:288] = 0.0
        x[1, 300] = -0.25
    if n > 2:       # amax 127: the scale is 1 (Q8_K: -1), so x.5 lands exactly on a tie
        x[2, :256] = np.arange(-64, 64, 0.5, dtype=np.float32)[:256] + 0.5
        x[2, 0] = 127.0
    return x


def _sentinel_acts(c: Checker, kind: int, nt: int, k: int):
    """Q8Acts device arrays filled with values the kernel must overwrite (codes -77, NaN scales)."""
    shapes = c.ck.mmq.q8_acts_shapes(kind, nt, k)
    fill = {"q": -77, "d": np.nan, "s": np.nan, "isum": -123456}
    arrays = {f: c.arrays.full(shape, fill[f], dt) for f, (shape, dt) in shapes.items()}
    return c.ck.mmq.Q8Acts(arrays["q"], arrays["d"], arrays.get("s"), arrays["isum"])


def check_mmq_q8_quantize(c: Checker) -> None:
    """Each kind (Q8_0, Q8_1, Q8_K) bit for bit against ref_q8_quantize: token counts 1, 3, 9, 37;
    rows of 1.5, 3 and 8+ warp blocks; x inside wider rows."""
    mm = c.ck.mmq
    for kind in (mm.Q8_0, mm.Q8_1, mm.Q8_K):
        for nt, k, pad in ((1, 256, 0), (3, 768, 0), (9, 2304, 32), (37, 512, 0)):
            x = _awkward_rows(c.rng, nt, k)
            xs = np.zeros((nt, k + pad), np.float32)
            xs[:, :k] = x
            dx = c.dev(xs)
            acts = _sentinel_acts(c, kind, nt, k)
            ref = _acts_bits(mm.Q8Acts(*ref_q8_quantize(x, kind)))
            c.case("q8_quantize", f"kind{kind}", (nt, k),
                   lambda: mm.q8_quantize(dx[:, :k], kind, acts, k=k),
                   lambda: _acts_bits(mm.Q8Acts(*(None if a is None else c.host(a) for a in acts))),
                   ref, 0.0, err_fn=_bits_mismatch)


#: bytes per block of the types whose offsets multiply Q8_1's s (f16 m at bytes 2..3)
_Q8_1_BLOCK_BYTES = {"q4_1": 20, "q5_1": 24}


def _q_1_offsets(raw: np.ndarray, wt: str, rows: int, ne0: int) -> np.ndarray:
    """The f16 offsets m of a q4_1 / q5_1 weight's blocks, float64 (rows, ne0/32)."""
    nb = _Q8_1_BLOCK_BYTES[wt]
    return raw.reshape(rows, ne0 // 32, nb)[:, :, 2:4].copy().view(np.float16)[..., 0].astype(np.float64)


def ref_mmq_q8(wt: str, kind: int, raw, deq, x, xp=np):
    """float64 y = W . q8(x) as llama.cpp forms it: x (host) rounded by ref_q8_quantize, times the
    dequantized weight `deq` (an `xp` array: numpy, or CuPy for the GPU script's big shapes); q4_1's
    and q5_1's offsets (from the host `raw` blocks) multiply Q8_1's s (f16(d * sum q)), not d * sum q."""
    q, d, s, _ = ref_q8_quantize(x, kind)
    nt, ne0 = x.shape
    qb = 256 if kind == 2 else 32
    xd = q.astype(np.float64) * np.repeat(d.astype(np.float64), qb, axis=1)
    y = xp.asarray(xd) @ deq.astype(np.float64).T
    if wt in _Q8_1_BLOCK_BYTES:
        m = _q_1_offsets(np.asarray(raw), wt, deq.shape[0], ne0)
        exact_sums = d.astype(np.float64) * q.reshape(nt, ne0 // 32, 32).astype(np.float64).sum(axis=-1)
        y += xp.asarray((s.astype(np.float64) - exact_sums) @ m.T)
    return y


def _case_q8(c: Checker, label: str, wt: str, raw, deq, x, *, ne0: int, rows: int, w_row_bytes=None,
             x_pad: int = 0, y_pad: int = 0, full_raw=None) -> None:
    """One quantize + int8 mmq: x (T, ne0) possibly inside wider rows, y inside wider rows."""
    mm = c.ck.mmq
    nt = x.shape[0]
    kind = mm.MMQ_Q8_KIND[wt]
    xs = np.zeros((nt, ne0 + x_pad), np.float32)
    xs[:, :ne0] = x
    ref = ref_mmq_q8(wt, kind, raw if full_raw is None else full_raw, deq, x)
    d_raw, dx = c.dev(raw), c.dev(xs)
    y = c.nan((nt, rows + y_pad))
    acts = mm.q8_acts_empty(kind, nt, ne0)
    c.case(label, wt, (rows, ne0, nt),
           lambda: mm.mmq_q8(d_raw, wt, dx[:, :ne0], y[:, :rows], acts, ne0=ne0, n_rows=rows, w_row_bytes=w_row_bytes),
           lambda: c.host(y)[:, :rows], ref, _TOL * math.sqrt(ne0))
    if y_pad:
        c.case(f"{label} (y padding untouched)", wt, (rows, ne0, nt), lambda: None,
               lambda: np.isnan(c.host(y)[:, rows:]).all().astype(np.float64), np.float64(1.0), 0.0)


def check_mmq_q8(c: Checker) -> None:
    """Every int8 type at 9 and 17 tokens across a row tile; row lengths of 1, 3 and 4+1 units
    (a partial step); x and y inside wider rows; a slice of a weight split along ne0."""
    for wt in c.ck.mmq.MMQ_Q8_KIND:
        ne0 = 512
        raw, deq = make_weight(c.rng, wt, 67, ne0)
        for nt in (9, 17):
            x = c.rng.standard_normal((nt, ne0)).astype(np.float32)
            _case_q8(c, "mmq_q8", wt, raw, deq, x, ne0=ne0, rows=67)
    for wt, ne0, rows, nt in (("q8_0", 32, 130, 12), ("q4_0", 96, 5, 33), ("q4_1", 160, 9, 10)):
        raw, deq = make_weight(c.rng, wt, rows, ne0)
        x = c.rng.standard_normal((nt, ne0)).astype(np.float32)
        _case_q8(c, "mmq_q8 short rows", wt, raw, deq, x, ne0=ne0, rows=rows)
    for wt in ("q6_k", "q4_1"):
        raw, deq = make_weight(c.rng, wt, 70, 256)
        x = c.rng.standard_normal((40, 256)).astype(np.float32)
        _case_q8(c, "mmq_q8 strided x/y", wt, raw, deq, x, ne0=256, rows=70, x_pad=32, y_pad=3)
    for wt in ("q5_k", "q4_1"):
        full, sl0, sl1 = 1024, 256, 768
        raw, deq = make_weight(c.rng, wt, 40, full)
        qk, nb = c.ck.WEIGHT_TYPES[wt]
        b0, b1 = sl0 // qk * nb, sl1 // qk * nb
        x = c.rng.standard_normal((24, sl1 - sl0)).astype(np.float32)
        sliced = np.ascontiguousarray(raw.reshape(-1)[b0:])
        _case_q8(c, "mmq_q8 ne0-slice", wt, sliced, deq[:, sl0:sl1], x, ne0=sl1 - sl0, rows=40,
                 w_row_bytes=raw.shape[1], full_raw=np.ascontiguousarray(raw[:, b0:b1]))


def check_mmq_q8_tiles(c: Checker) -> None:
    """Token counts on both sides of each int8 token tile (16, 32, 64, 128) up to 256, row counts
    63, 64, 65 and 197, on the Q4_K and Q8_0 weights of the GPU check's model shapes."""
    for wt in ("q4_k", "q8_0"):
        ne0 = 256
        raw, deq = make_weight(c.rng, wt, 197, ne0)
        for nt in ((15, 16, 31, 33, 63, 65, 127, 129, 256) if wt == "q4_k" else (16, 32, 64, 128, 200)):
            x = c.rng.standard_normal((nt, ne0)).astype(np.float32)
            _case_q8(c, "mmq_q8 tokens", wt, raw[:37], deq[:37], x, ne0=ne0, rows=37)
        for rows in (63, 64, 65, 197):
            x = c.rng.standard_normal((20, ne0)).astype(np.float32)
            _case_q8(c, "mmq_q8 rows", wt, raw[:rows], deq[:rows], x, ne0=ne0, rows=rows)
    _case_q8_same_bits(c, "q6_k", 70, 512, 150)


def _case_q8_same_bits(c: Checker, wt: str, rows: int, ne0: int, nt: int) -> None:
    """Batch invariance: each token's outputs are the same bits in a launch of 1, 17, 40 or `nt`
    tokens (other tiles, other places in them), what batch_invariant relies on."""
    mm = c.ck.mmq
    raw, _ = make_weight(c.rng, wt, rows, ne0)
    x = c.rng.standard_normal((nt, ne0)).astype(np.float32)
    d_raw = c.dev(raw)

    def run(n: int, start: int) -> np.ndarray:
        y = c.nan((n, rows))
        acts = mm.q8_acts_empty(mm.MMQ_Q8_KIND[wt], n, ne0)
        mm.mmq_q8(d_raw, wt, c.dev(x[start:start + n]), y, acts, ne0=ne0, n_rows=rows)
        return c.host(y).view(np.int32)

    full = run(nt, 0)
    for n, start in ((1, nt - 1), (17, 5), (40, 100)):
        c.case("mmq_q8 same bits in any batch", wt, (rows, ne0, n), lambda: None,
               lambda n=n, start=start: run(n, start), full[start:start + n], 0.0, err_fn=_bits_mismatch)
