"""Float64 references the kernel checks compare against (one set, for every test and tool).

Weights come from ``gguf.quants`` (quantize / dequantize, the format's own reference); rope,
attention, GELU, SiLU and the bf16 conversion are written out in float64 here. The numpy
backend's float32 kernels are not references: they are another implementation under test.
"""

from __future__ import annotations

import math

import numpy as np

from metatp.ir.dtypes import bf16_bits_to_f32, f32_to_bf16_bits  # noqa: F401 - re-exported for the checks

__all__ = ["rel_err", "f32_to_bf16_bits", "bf16_bits_to_f32", "make_weight", "kv_quantize", "kv_dequantize",
           "kv_rows", "ref_rope", "ref_attention", "ref_mask_cells", "ref_q8_quantize",
           "ref_q8_matmul", "Q8_KIND_OF_WEIGHT", "gelu", "silu"]


def _gguf():
    import gguf  # noqa: PLC0415

    return gguf


def _qtype(name: str):
    return _gguf().GGMLQuantizationType[name.upper()]


def rel_err(out, ref) -> float:
    """max|out - ref| / max|ref| (inf when out has NaN/inf where ref is finite)."""
    out = np.asarray(out, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    if out.shape != ref.shape:
        raise ValueError(f"shape {out.shape} != reference {ref.shape}")
    fin = np.isfinite(ref)
    if not np.array_equal(np.isfinite(out), fin):
        return math.inf
    if not np.array_equal(out[~fin], ref[~fin], equal_nan=True):
        return math.inf
    if not fin.any():
        return 0.0
    denom = max(float(np.abs(ref[fin]).max()), 1e-30)
    return float(np.abs(out[fin] - ref[fin]).max() / denom)


def make_weight(rng: np.random.Generator, wtype: str, n_rows: int, ne0: int):
    """Random weight of a ggml type: (raw uint8 [n_rows, row_bytes], dequantized f32 [n_rows, ne0]).

    Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/BF16 go through ``gguf.quants.quantize``; K-quants (which gguf cannot
    quantize) are random raw blocks with sane f16 d / dmin; the oracle is
    ``gguf.quants.dequantize``.
    """
    gguf = _gguf()
    quants = gguf.quants
    w = rng.standard_normal((n_rows, ne0)).astype(np.float32)
    if wtype == "f32":
        return w.view(np.uint8).copy(), w.copy()
    if wtype == "f16":
        w16 = w.astype(np.float16)
        return w16.view(np.uint8).copy(), w16.astype(np.float32)
    if wtype == "bf16":
        bits = f32_to_bf16_bits(w)
        return bits.view(np.uint8).copy(), bf16_bits_to_f32(bits)
    qt = _qtype(wtype)
    if wtype in ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1"):
        raw = np.ascontiguousarray(quants.quantize(w, qt))
        return raw, quants.dequantize(raw, qt).astype(np.float32)
    bs, ts = gguf.GGML_QUANT_SIZES[qt]
    nb = n_rows * ne0 // bs
    raw = rng.integers(0, 256, size=(nb, ts), dtype=np.uint8)

    def f16col(scale):
        return (rng.uniform(0.5, 1.5, nb) * scale).astype(np.float16).view(np.uint8).reshape(nb, 2)

    if wtype in ("q4_k", "q5_k"):
        raw[:, 0:2] = f16col(0.01)
        raw[:, 2:4] = f16col(0.005)
    elif wtype == "q6_k":
        raw[:, 208:210] = f16col(0.01)
    elif wtype == "q2_k":
        raw[:, 80:82] = f16col(0.01)
        raw[:, 82:84] = f16col(0.005)
    elif wtype == "q3_k":
        raw[:, 108:110] = f16col(0.01)
    else:
        raise ValueError(wtype)
    raw = raw.reshape(n_rows, ne0 // bs * ts)
    return raw, quants.dequantize(raw, qt).astype(np.float32)


def kv_quantize(x: np.ndarray, qtype: str) -> np.ndarray:
    """f32 rows [..., ne0] -> their quantized blocks [..., row bytes] (gguf.quants, ggml's rounding)."""
    return np.ascontiguousarray(_gguf().quants.quantize(np.ascontiguousarray(x, dtype=np.float32), _qtype(qtype)))


def kv_dequantize(raw: np.ndarray, qtype: str) -> np.ndarray:
    """Quantized blocks [..., row bytes] -> f32 rows [..., ne0] (gguf.quants)."""
    return _gguf().quants.dequantize(np.ascontiguousarray(raw), _qtype(qtype)).astype(np.float32)


def kv_rows(x: np.ndarray, cache_type: str) -> tuple[np.ndarray, np.ndarray]:
    """f32 values [..., ne0] as a KV cache of `cache_type` holds them: (stored array, its value in
    float64). f16 as float16, bf16 as uint16 bits, a quantized type as uint8 blocks."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    if cache_type == "f32":
        return x.copy(), x.astype(np.float64)
    if cache_type == "f16":
        s = x.astype(np.float16)
        return s, s.astype(np.float64)
    if cache_type == "bf16":
        s = f32_to_bf16_bits(x)
        return s, bf16_bits_to_f32(s).astype(np.float64)
    raw = kv_quantize(x, cache_type)
    return raw, kv_dequantize(raw, cache_type).astype(np.float64)


# ------------------------------------------------------------------- references
def ref_rope(x, pos, n_dims, freq_base, freq_scale, neox, freq_factors=None, attn_factor=1.0):
    """x float64 [T, H, D] -> rotated copy (ggml ROPE, mode NORMAL or NEOX)."""
    x = np.asarray(x, dtype=np.float64)
    y = x.copy()
    i0 = np.arange(0, n_dims, 2)
    theta = pos[:, None].astype(np.float64) * freq_base ** (-i0[None, :] / n_dims)
    if freq_factors is not None:
        theta = theta / np.asarray(freq_factors, np.float64)[None, :]
    theta = theta * freq_scale
    c = (np.cos(theta) * attn_factor)[:, None, :]
    s = (np.sin(theta) * attn_factor)[:, None, :]
    if neox:
        a, b = i0 // 2, i0 // 2 + n_dims // 2
    else:
        a, b = i0, i0 + 1
    x0, x1 = x[:, :, a], x[:, :, b]
    y[:, :, a] = x0 * c - x1 * s
    y[:, :, b] = x0 * s + x1 * c
    return y


def ref_mask_cells(mask: np.ndarray, n_used: int) -> tuple[np.ndarray, np.ndarray]:
    """The cell lists a dense attention mask [rows, n_kv] stands for: row r sees key j < n_used
    whose entry is not -inf. Returns (cells, cell_off): row r's keys, increasing, at
    cells[cell_off[r]:cell_off[r + 1]] (int32)."""
    lists = [np.flatnonzero(row[:n_used] != -np.inf) for row in np.asarray(mask)]
    off = np.concatenate([[0], np.cumsum([len(x) for x in lists])]).astype(np.int32)
    cells = np.concatenate(lists).astype(np.int32) if lists else np.zeros(0, np.int32)
    return cells, off


def ref_attention(q, k, v, scale, mask=None, softcap=0.0, causal=True, causal_offset=0, sinks=None):
    """q [T, H, D], k/v [n_kv, Hkv, D] (float64) -> [T, H, D]; empty rows give 0. sinks [H] (or
    None): one logit per query head that joins every row's softmax denominator only."""
    T, H, D = q.shape
    n_kv, hkv, _ = k.shape
    g = H // hkv
    out = np.zeros((T, H, D))
    for h in range(H):
        kh = k[:, h // g, :]
        vh = v[:, h // g, :]
        s = (q[:, h, :] @ kh.T) * scale  # [T, n_kv]
        if softcap > 0:
            s = softcap * np.tanh(s / softcap)
        if mask is not None:
            s = s + mask[:, :n_kv]
        if causal:
            j = np.arange(n_kv)[None, :]
            t = np.arange(T)[:, None]
            s = np.where(j <= t + causal_offset, s, -np.inf)
        m = s.max(axis=1, keepdims=True)
        if sinks is not None:
            m = np.maximum(m, float(sinks[h]))
        ok = np.isfinite(m[:, 0])
        p = np.where(ok[:, None], np.exp(s - np.where(ok[:, None], m, 0.0)), 0.0)
        den = p.sum(axis=1, keepdims=True)
        if sinks is not None:
            den = den + np.exp(float(sinks[h]) - m)
        o = p @ vh
        out[:, h, :] = np.where(den > 0, o / np.where(den > 0, den, 1.0), 0.0)
    return out


def ref_q8_quantize(x, kind: int):
    """llama.cpp's rounding of activation rows x [n, K] before its integer dot products (ggml-cpu's
    x86 quantize_row_q8_0 / q8_1, quantize_row_q8_K_ref), computed in float64 and rounded to float32
    exactly where llama.cpp's float32 arithmetic rounds (a float32 product, or quotient, is the
    float64 one rounded once), so codes and scales are llama.cpp's bit for bit.

    kind 0 (Q8_0) / 1 (Q8_1): blocks of 32, d = amax/127 kept as f16, q = rint(x * (127/amax)) (ties
    to even); Q8_1 adds s = f16(d * sum q) with d before its f16 rounding. kind 2 (Q8_K): blocks of
    256, max = the first element of largest |x|, iscale = -127/max, q = min(127, rint(iscale * x)),
    d = 1/iscale. Returns (codes int8 [n, K], scales float32 [n, K/32 or K/256], s float32 [n, K/32]
    or None, int32 sums of each 16 codes [n, K/16])."""
    def f32(v):
        return np.asarray(v, np.float64).astype(np.float32).astype(np.float64)

    x = np.asarray(x, np.float32).astype(np.float64)
    n, k = x.shape
    s = None
    if kind == 2:
        xb = x.reshape(n, k // 256, 256)
        mx = np.take_along_axis(xb, np.abs(xb).argmax(axis=-1)[..., None], axis=-1)[..., 0]
        zero = mx == 0
        iscale = f32(-127.0 / np.where(zero, 1.0, mx))
        q = np.where(zero[..., None], 0.0, np.minimum(127.0, np.rint(f32(iscale[..., None] * xb))))
        d = np.where(zero, 0.0, f32(1.0 / iscale))
    else:
        xb = x.reshape(n, k // 32, 32)
        amax = np.abs(xb).max(axis=-1)
        zero = amax == 0
        db = f32(amax / 127.0)
        inv = np.where(zero, 0.0, f32(127.0 / np.where(zero, 1.0, amax)))
        q = np.rint(f32(xb * inv[..., None]))
        d = db.astype(np.float32).astype(np.float16)
        if kind == 1:
            s = f32(db * q.sum(axis=-1)).astype(np.float32).astype(np.float16).astype(np.float32)
    q = q.astype(np.int8).reshape(n, k)
    isum = q.reshape(n, k // 16, 16).astype(np.int32).sum(axis=-1, dtype=np.int32)
    return q, np.asarray(d, np.float32), s, isum


#: weight type -> the ref_q8_quantize kind its activations are rounded to (llama.cpp's vec_dot_type)
Q8_KIND_OF_WEIGHT = {"q8_0": 0, "q4_0": 0, "q5_0": 0, "q4_1": 1, "q5_1": 1, "q2_k": 2, "q3_k": 2, "q4_k": 2, "q5_k": 2,
                     "q6_k": 2}


def ref_q8_matmul(raw, wtype: str, ne0: int, x):
    """y [n, rows] = x [n, ne0] times the weight `raw` (uint8 [rows, row_bytes] of a quantized ggml
    type) as llama.cpp's CPU vec_dot kernels compute it: x rounded by `ref_q8_quantize` (the type's
    kind), exact integer sums of weight codes times activation codes per weight block (16 or 32
    elements), then in float64 sum_b scale[r, b] * d_x[b] * isum + offset[r, b] * s_x[b], with s_x
    Q8_1's s, or d * (sum of the block's codes) for Q8_K. Codes, scales and offsets are the weight's
    integer decomposition (`backends.numpy.codes.affine_blocks`: scale = f32(d * sc), offset =
    -f32(dmin * m))."""
    from metatp.backends.numpy.codes import affine_blocks  # noqa: PLC0415
    from metatp.ir.tensor import GGMLType  # noqa: PLC0415

    kind = Q8_KIND_OF_WEIGHT[wtype]
    aw = affine_blocks(np.asarray(raw, np.uint8), GGMLType[wtype.upper()], ne0)
    blk = aw.block
    codes = aw.codes().astype(np.int64)
    rows, nb = codes.shape[0], ne0 // blk
    q, d, s, _ = ref_q8_quantize(np.asarray(x, np.float32).reshape(-1, ne0), kind)
    n = q.shape[0]
    qb = q.astype(np.int64).reshape(n, nb, blk)
    isum = np.einsum("rbk,nbk->nrb", codes.reshape(rows, nb, blk), qb)          # exact integers
    d64 = d.astype(np.float64)
    dx = np.repeat(d64, ne0 // d.shape[1] // blk, axis=1)                          # per weight block
    y = np.einsum("rb,nb,nrb->nr", aw.scale.astype(np.float64), dx, isum.astype(np.float64))
    if aw.offset is not None:
        xs = s.astype(np.float64) if kind == 1 else dx * qb.sum(axis=-1).astype(np.float64)
        y += xs @ aw.offset.astype(np.float64).T
    return y


def gelu(x):
    c = math.sqrt(2.0 / math.pi)
    return 0.5 * x * (1.0 + np.tanh(c * x * (1.0 + 0.044715 * x * x)))


def silu(x):
    return x / (1.0 + np.exp(-x))
