"""Repack GGUF quantized weights into an "affine int8 block" form for CPU kernels.

Every supported GGUF type decodes, per small block of elements, as
``value = scale * q + offset`` with an integer code ``q``. Here the codes are
unpacked once (at model load) into a plain int8 matrix and the per-block
``scale``/``offset`` into float32 matrices, so a kernel needs no bit twiddling:

    value[r, i] == scale[r, i // block] * q[r, i] + offset[r, i // block]

Exactness against ``gguf.quants.dequantize`` (float32 arithmetic, no FMA):
every accepted type is **bit-exact**. Each type's own formula is at most one
float32 multiply of the code by a float32 per-block factor and one add/sub of
another float32 per-block factor, and those factors are computed here with the
same float32 operations as gguf (``d*sc``, ``dmin*m``; f16->f32 is exact):

* Q4_0, Q5_0, Q8_0, Q3_K, Q6_K: ``d*q`` (or ``(d*sc)*q``) -> ``offset=None``.
* Q4_1, Q5_1: ``d*q + m`` -> ``scale=d``, ``offset=m``.
* Q2_K, Q4_K, Q5_K: ``(d*sc)*q - dmin*m`` -> ``offset=-(dmin*m)``; negation is
  exact and ``x - y == x + (-y)`` in IEEE arithmetic, so still bit-exact.

All work is vectorized numpy over all blocks of the tensor at once.

`group_rows` reorders a weight of 4- or 8-bit codes into the row-group layout the integer
(numerics="llamacpp") kernel reads fastest: 8 rows interleaved a 32-bit word at a time, their
scales side by side (kept as halves when the file's are). `row_major` reads any layout back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from metatp.ir.dtypes import bf16_bits_to_f32
from metatp.ir.errors import ConfigError, UnsupportedOpError
from metatp.ir.tensor import GGMLType, block_size, type_size

__all__ = ["AFFINE_TYPES", "NIBBLE_BIAS", "FLOAT_CODES", "AffineWeight", "encodable", "affine_blocks",
           "affine_bytes", "dequantize_affine", "pack_nibbles", "unpack_nibbles", "GROUP", "HALF_SCALE_TYPES", "groupable", "group_rows", "grouped_affine_blocks",
           "row_major", "adjacent"]


@dataclass(frozen=True, eq=False)  # eq=False: ndarray fields make field-wise ==/hash meaningless
class AffineWeight:
    """A weight as integer codes plus per-block float32 scale and (optional) offset.

    bits 8: `q` is int8 (rows, K), one code a byte. bits 4 (types whose codes fit a nibble):
    `q` is uint8 (rows, K/2); in each 32-element group the 16 bytes hold elements 0..15 in their
    low nibbles and 16..31 in their high nibbles, and a code is nibble - `bias`. bits 16 (F16 and
    BF16 weights): `q` is uint16 (rows, K) holding the half floats themselves (`bf16` says
    which), with scale 1 and no offset, so the same kernels read them at 2 bytes a weight."""

    q: np.ndarray  # int8 (rows, K), uint8 (rows, K/2) with bits=4, uint16 (rows, K) with bits=16
    scale: np.ndarray  # float32 (rows, K // block)
    offset: np.ndarray | None  # float32 (rows, K // block); None for symmetric types
    block: int  # elements sharing one (scale, offset): 16 or 32
    bits: int = 8
    bias: int = 0  # bits=4: code = nibble - bias
    bf16: bool = False  # bits=16: bfloat16 instead of IEEE half
    ggml_type: GGMLType | None = None  # the GGUF type the codes came from (how llama.cpp rounds x for it)
    group: int = 1  # 8: the row-group layout of `group_rows` (same array shapes, contents reordered;
    #                 scale/offset may then be float16 holding the same values)

    @property
    def nbytes(self) -> int:
        return self.q.nbytes + self.scale.nbytes + (0 if self.offset is None else self.offset.nbytes)

    @property
    def rows(self) -> int:
        return self.q.shape[0]

    @property
    def k(self) -> int:
        return self.q.shape[1] * 2 if self.bits == 4 else self.q.shape[1]

    def codes(self, rows=slice(None)) -> np.ndarray:
        """Codes (rows, K) of the selected rows: int8 (unpacked from nibbles when bits=4), or the
        float32 values of half floats when bits=16."""
        return self.codes_of(row_major(self, rows)[0])

    def codes_of(self, q: np.ndarray) -> np.ndarray:
        """Codes (n, K) from row-major stored codes `q` (n, ...) of this weight's format."""
        if self.bits == 16:
            return bf16_bits_to_f32(q) if self.bf16 else q.view(np.float16).astype(np.float32)
        return q if self.bits == 8 else unpack_nibbles(q, self.bias)


def pack_nibbles(q: np.ndarray, bias: int) -> np.ndarray:
    """int8 codes (rows, K), K % 32 == 0, each in [-bias, 15-bias] -> uint8 (rows, K/2)."""
    rows, k = q.shape
    u = (q.astype(np.int16) + bias).astype(np.uint8).reshape(rows, k // 32, 2, 16)
    return (u[:, :, 0] | (u[:, :, 1] << 4)).reshape(rows, k // 2)


def unpack_nibbles(p: np.ndarray, bias: int) -> np.ndarray:
    """The inverse of pack_nibbles: uint8 (rows, K/2) -> int8 codes (rows, K)."""
    rows, half = p.shape
    g = p.reshape(rows, half // 16, 1, 16)
    u = np.concatenate([g & 0x0F, g >> 4], axis=2).reshape(rows, half * 2)
    return (u.astype(np.int16) - bias).astype(np.int8)


# --- small vectorized bit helpers ------------------------------------------------------------


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    """The little-endian f16 at byte ``at`` of every block, as float32 of shape (N, 1)."""
    return np.ascontiguousarray(blocks[:, at : at + 2]).view("<f2").astype(np.float32)


def _fields(x: np.ndarray, width: int) -> np.ndarray:
    """Split each byte of x (..., L) into its 8/width bit fields, lowest first: (..., 8/width, L)."""
    shifts = np.arange(0, 8, width, dtype=np.uint8).reshape(-1, 1)
    return (x[..., None, :] >> shifts) & np.uint8((1 << width) - 1)


def _nibbles_32(qs: np.ndarray) -> np.ndarray:
    """Legacy 32-element blocks: element j is qs[j] low nibble, element j+16 its high nibble."""
    return _fields(qs, 4).reshape(qs.shape[0], 32)


def _k_scale_min(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unpack Q4_K/Q5_K's 12 bytes of 6-bit (scale, min) pairs for 8 sub-blocks -> two (N, 8)."""
    lo, mid, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([lo & 63, (hi & 15) | ((lo >> 6) << 4)], axis=1)
    mn = np.concatenate([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], axis=1)
    return sc.astype(np.float32), mn.astype(np.float32)


# --- per-type unpackers: blocks (N, type_size) uint8 -> q (N, block_size), scale, offset --------
# scale/offset have shape (N, block_size // block).

_Unpacked = tuple[np.ndarray, np.ndarray, "np.ndarray | None"]


def _q4_0(b: np.ndarray) -> _Unpacked:
    return _nibbles_32(b[:, 2:]).view(np.int8) - np.int8(8), _f16(b, 0), None


def _q4_1(b: np.ndarray) -> _Unpacked:
    return _nibbles_32(b[:, 4:]).view(np.int8), _f16(b, 0), _f16(b, 2)


def _q5(b: np.ndarray, qh_at: int) -> np.ndarray:
    """5-bit codes 0..31: low nibbles as Q4_x, bit i of the little-endian u32 qh is element i's bit 4."""
    high = np.unpackbits(b[:, qh_at : qh_at + 4], axis=1, bitorder="little")
    return (_nibbles_32(b[:, qh_at + 4 :]) | (high << 4)).view(np.int8)


def _q5_0(b: np.ndarray) -> _Unpacked:
    return _q5(b, 2) - np.int8(16), _f16(b, 0), None


def _q5_1(b: np.ndarray) -> _Unpacked:
    return _q5(b, 4), _f16(b, 0), _f16(b, 2)


def _q8_0(b: np.ndarray) -> _Unpacked:
    return b[:, 2:].view(np.int8), _f16(b, 0), None


def _q2_k(b: np.ndarray) -> _Unpacked:
    # scales[16] | qs[64] | d | dmin; sub-block of 16; code = 2-bit field
    n = b.shape[0]
    sc = b[:, 0:16]
    q = _fields(b[:, 16:80].reshape(n, 2, 32), 2).reshape(n, 256).view(np.int8)
    scale = _f16(b, 80) * (sc & 15).astype(np.float32)
    offset = -(_f16(b, 82) * (sc >> 4).astype(np.float32))
    return q, scale, offset


def _q3_k(b: np.ndarray) -> _Unpacked:
    # hmask[32] | qs[64] | scales[12] | d; code = 2-bit field - 4 unless its hmask bit is set
    n = b.shape[0]
    low = _fields(b[:, 32:96].reshape(n, 2, 32), 2).reshape(n, 256)
    hbit = _fields(b[:, 0:32], 1).reshape(n, 256)
    q = low.view(np.int8) - ((hbit ^ np.uint8(1)) << 2).view(np.int8)
    s = b[:, 96:108]
    sc6 = _fields(s[:, 0:8], 4).reshape(n, 16) | (_fields(s[:, 8:12], 2).reshape(n, 16) << 4)
    scale = _f16(b, 108) * (sc6.view(np.int8) - np.int8(32)).astype(np.float32)
    return q, scale, None


def _q4_k(b: np.ndarray) -> _Unpacked:
    # d | dmin | scales[12] | qs[128]; each 32-byte run holds two 32-element sub-blocks (lo, hi)
    n = b.shape[0]
    sc, mn = _k_scale_min(b[:, 4:16])
    q = _fields(b[:, 16:144].reshape(n, 4, 32), 4).reshape(n, 256).view(np.int8)
    return q, _f16(b, 0) * sc, -(_f16(b, 2) * mn)


def _q5_k(b: np.ndarray) -> _Unpacked:
    # d | dmin | scales[12] | qh[32] | qs[128]; bit k of qh[j] is bit 4 of element 32k+j
    n = b.shape[0]
    sc, mn = _k_scale_min(b[:, 4:16])
    low = _fields(b[:, 48:176].reshape(n, 4, 32), 4).reshape(n, 256)
    high = _fields(b[:, 16:48], 1).reshape(n, 256)
    q = (low | (high << 4)).view(np.int8)
    return q, _f16(b, 0) * sc, -(_f16(b, 2) * mn)


def _q6_k(b: np.ndarray) -> _Unpacked:
    # ql[128] | qh[64] | scales int8[16] | d; code = (4 low | 2 high bits) - 32, sub-block of 16
    n = b.shape[0]
    low = _fields(b[:, 0:128].reshape(n, 2, 64), 4).reshape(n, 256)
    high = _fields(b[:, 128:192].reshape(n, 2, 32), 2).reshape(n, 256)
    q = (low | (high << 4)).view(np.int8) - np.int8(32)
    scale = _f16(b, 208) * b[:, 192:208].view(np.int8).astype(np.float32)
    return q, scale, None


# type -> (elements per (scale, offset) block, has an offset, unpacker)
_TYPES: dict[GGMLType, tuple[int, bool, Callable[[np.ndarray], _Unpacked]]] = {
    GGMLType.Q4_0: (32, False, _q4_0),
    GGMLType.Q4_1: (32, True, _q4_1),
    GGMLType.Q5_0: (32, False, _q5_0),
    GGMLType.Q5_1: (32, True, _q5_1),
    GGMLType.Q8_0: (32, False, _q8_0),
    GGMLType.Q2_K: (16, True, _q2_k),
    GGMLType.Q3_K: (16, False, _q3_k),
    GGMLType.Q4_K: (32, True, _q4_k),
    GGMLType.Q5_K: (32, True, _q5_k),
    GGMLType.Q6_K: (16, False, _q6_k),
}

# Half-float weights: kept as they are (2 bytes a weight), read by the same kernels with scale 1.
FLOAT_CODES: dict[GGMLType, bool] = {GGMLType.F16: False, GGMLType.BF16: True}   # type -> is bfloat16
FLOAT_BLOCK = 32     # the (unit) scales of float codes come one per 32 elements

AFFINE_TYPES: frozenset[GGMLType] = frozenset(_TYPES) | frozenset(FLOAT_CODES)

# Types whose codes fit a nibble -> the bias that makes them 0..15 (stored 4 bits a code: decode
# streams 0.75 instead of 1.25 bytes a weight).
NIBBLE_BIAS: dict[GGMLType, int] = {GGMLType.Q4_0: 8, GGMLType.Q4_1: 0, GGMLType.Q4_K: 0,
                                    GGMLType.Q2_K: 0, GGMLType.Q3_K: 8}


def encodable(ggml_type, k: int) -> bool:
    """Can a weight of this type with rows of K elements be repacked (and read by the kernels)?"""
    try:
        t = GGMLType(ggml_type)
    except ValueError:
        return False
    if t in FLOAT_CODES:
        return k > 0 and k % FLOAT_BLOCK == 0
    return t in _TYPES and k > 0 and k % block_size(t) == 0


def _spec(ggml_type, k: int) -> tuple[GGMLType, int, bool, Callable[[np.ndarray], _Unpacked]]:
    """Validate (type, K) and return the type and its table entry."""
    try:
        t = GGMLType(ggml_type)
    except ValueError:
        raise UnsupportedOpError(f"affine repacking: unknown GGML type {ggml_type!r}") from None
    if t in FLOAT_CODES:
        if not isinstance(k, (int, np.integer)) or k <= 0 or k % FLOAT_BLOCK:
            raise ConfigError(f"K={k} is not a positive multiple of {FLOAT_BLOCK} ({t.name} weights as codes)")
        return (t, FLOAT_BLOCK, False, None)
    if t not in _TYPES:
        raise UnsupportedOpError(
            f"affine repacking does not support GGML type {t.name}; supported: "
            + ", ".join(sorted(x.name for x in AFFINE_TYPES))
        )
    bs = block_size(t)
    if not isinstance(k, (int, np.integer)) or k <= 0 or k % bs:
        raise ConfigError(f"K={k} is not a positive multiple of the {t.name} block size {bs}")
    return (t, *_TYPES[t])


# types whose block scales (and offsets) are halves in the file: `group_rows` keeps them so
HALF_SCALE_TYPES = frozenset({GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.Q8_0})


def affine_bytes(ggml_type, rows: int, k: int, grouped: bool = False) -> int:
    """Bytes of the AffineWeight affine_blocks would build for a (rows, K) weight (for memory
    planning); `grouped`: after `group_rows` where it applies (halves for HALF_SCALE_TYPES)."""
    t, block, has_offset, _ = _spec(ggml_type, k)
    code_bytes = k // 2 if t in NIBBLE_BIAS and k % 32 == 0 else 2 * k if t in FLOAT_CODES else k
    half = grouped and t in HALF_SCALE_TYPES and block == 32 and rows % GROUP == 0 and rows > 0
    return rows * code_bytes + rows * (k // block) * (2 if half else 4) * (2 if has_offset else 1)


def affine_blocks(raw: np.ndarray, ggml_type, k: int) -> AffineWeight:
    """Repack raw GGUF rows into an AffineWeight.

    raw: uint8 array of shape (rows, row_bytes), each row exactly the GGUF encoding of K
    elements (as ``GGUFReader`` exposes a quantized 2-D tensor's ``data``).
    """
    t, block, _, unpack = _spec(ggml_type, k)
    raw = np.asarray(raw)
    want = k // block_size(t) * type_size(t)
    if raw.dtype != np.uint8 or raw.ndim != 2 or raw.shape[1] != want:
        raise ConfigError(
            f"{t.name} raw data for K={k} must be uint8 of shape (rows, {want}); "
            f"got {raw.dtype} of shape {raw.shape}"
        )
    rows = raw.shape[0]
    if t in FLOAT_CODES:
        return AffineWeight(q=np.ascontiguousarray(raw).view(np.uint16).reshape(rows, k),
                            scale=np.ones((rows, k // block), np.float32), offset=None, block=block, bits=16,
                            bf16=FLOAT_CODES[t], ggml_type=t)
    blocks = np.ascontiguousarray(raw).reshape(-1, type_size(t))
    q, scale, offset = unpack(blocks)
    q = np.ascontiguousarray(q, dtype=np.int8).reshape(rows, k)
    bits, bias = 8, 0
    if t in NIBBLE_BIAS and k % 32 == 0:
        bits, bias = 4, NIBBLE_BIAS[t]
        q = pack_nibbles(q, bias)
    return AffineWeight(
        q=q,
        scale=np.ascontiguousarray(scale, dtype=np.float32).reshape(rows, k // block),
        offset=None if offset is None else np.ascontiguousarray(offset, dtype=np.float32).reshape(rows, k // block),
        block=block, bits=bits, bias=bias, ggml_type=t,
    )


def dequantize_affine(aw: AffineWeight) -> np.ndarray:
    """Reference decode: float32 (rows, K) = scale * q + offset per block (multiply, then add)."""
    rows, k = aw.rows, aw.k
    q = aw.codes().reshape(rows, k // aw.block, aw.block).astype(np.float32)
    _, scale, offset = row_major(aw)
    out = scale[:, :, None] * q
    if offset is not None:
        out = out + offset[:, :, None]
    return out.reshape(rows, k)


GROUP = 8  # rows per group of the row-group layout


def groupable(aw: AffineWeight) -> bool:
    """Can `group_rows` reorder this weight: 4- or 8-bit codes in blocks of 32, whole groups of rows."""
    return aw.group == 1 and aw.bits in (4, 8) and aw.block == 32 and aw.rows % GROUP == 0 and aw.rows > 0


def _words(aw: AffineWeight) -> int:
    """32-bit words a row has in a block of the row-group layout (16 nibble bytes or 32 codes)."""
    return 4 if aw.bits == 4 else 8


def grouped_affine_blocks(raw: np.ndarray, ggml_type, k: int, chunk_rows: int = 1024) -> AffineWeight:
    """`affine_blocks` then `group_rows` where the weight is groupable, a chunk of rows at a time:
    loading then holds one chunk's row-major codes beside the result instead of a second copy of
    the whole weight (the largest weight's copy stayed in the process's heap after loading). Scales
    are halves for HALF_SCALE_TYPES, as `affine_bytes(grouped=True)` plans (float32 where a file's
    halves are not finite: infinities and NaNs are kept as they are, in float32)."""
    raw = np.asarray(raw)
    half = GGMLType(ggml_type) in HALF_SCALE_TYPES
    try:
        return _grouped_blocks(raw, ggml_type, k, chunk_rows, half)
    except _NotHalf:
        return _grouped_blocks(raw, ggml_type, k, chunk_rows, False)


class _NotHalf(ValueError):
    """A chunk's scales or offsets are not exact in f16 (non-finite values in the file)."""


def _grouped_blocks(raw: np.ndarray, ggml_type, k: int, chunk_rows: int, half: bool) -> AffineWeight:
    rows = raw.shape[0] if raw.ndim == 2 else 0
    chunk_rows = max(GROUP, chunk_rows // GROUP * GROUP)
    first = affine_blocks(raw[:min(rows, chunk_rows)], ggml_type, k)
    if rows <= chunk_rows or not groupable(first) or rows % GROUP:
        whole = first if rows <= chunk_rows else affine_blocks(raw, ggml_type, k)
        return group_rows(whole, half=half) if groupable(whole) else whole
    scale_type = np.float16 if half else np.float32
    q = np.empty((rows,) + first.q.shape[1:], first.q.dtype)
    scale = np.empty((rows, first.scale.shape[1]), scale_type)
    offset = None if first.offset is None else np.empty_like(scale)
    for r0 in range(0, rows, chunk_rows):
        part = first if r0 == 0 else affine_blocks(raw[r0:r0 + chunk_rows], ggml_type, k)
        g = group_rows(part, half=half)
        r1 = r0 + part.rows
        q[r0:r1], scale[r0:r1] = g.q, g.scale
        if offset is not None:
            offset[r0:r1] = g.offset
    return AffineWeight(q=q, scale=scale, offset=offset, block=first.block, bits=first.bits, bias=first.bias,
                        bf16=first.bf16, ggml_type=first.ggml_type, group=GROUP)


def group_rows(aw: AffineWeight, half: bool | None = None) -> AffineWeight:
    """The same weight in the row-group layout the integer kernel reads fastest (see
    cpu_kernels.c): rows in groups of 8; a group's block b is 128 bytes, word j (32 bytes) holding
    nibble bytes 4j..4j+3 of each of the 8 rows in turn; scales and offsets 8 a (group, block).
    8-bit codes: 256 bytes a block, word j holding codes 4j..4j+3 of each row. The arrays keep
    their shapes (rows, ...); only the order of their contents changes."""
    if not groupable(aw):
        raise ValueError(f"group_rows: needs 4- or 8-bit codes in blocks of 32 and rows a multiple of {GROUP}; got "
                         f"bits {aw.bits}, block {aw.block}, {aw.rows} rows, group {aw.group}")
    g, nb = aw.rows // GROUP, aw.k // 32
    q = aw.q.reshape(g, GROUP, nb, _words(aw), 4).transpose(0, 2, 3, 1, 4)
    # scales that are halves in the GGUF file (Q4_0, Q4_1, Q8_0) stay halves: the same values, and a
    # decode step, bound by memory bandwidth, reads 20 bytes a block instead of 24 (`half`: decided
    # by the caller, who must pass exact halves; None: wherever every value is one)
    exact = _exact_in_half(aw.scale) and (aw.offset is None or _exact_in_half(aw.offset))
    if half is None:
        half = exact
    elif half and not exact:
        raise _NotHalf("group_rows: half scales asked for, but these scales or offsets are not exact in f16")
    return AffineWeight(q=np.ascontiguousarray(q).reshape(aw.q.shape), scale=_group_blocks(aw.scale, half),
                        offset=None if aw.offset is None else _group_blocks(aw.offset, half), block=aw.block,
                        bits=aw.bits, bias=aw.bias, bf16=aw.bf16, ggml_type=aw.ggml_type, group=GROUP)


def _exact_in_half(a: np.ndarray) -> bool:
    with np.errstate(over="ignore"):
        h = a.astype(np.float16)
    return bool(np.all(np.isfinite(h)) and np.array_equal(h.astype(np.float32), a))


def _group_blocks(a: np.ndarray, half: bool) -> np.ndarray:
    rows, nb = a.shape
    g = a.reshape(rows // GROUP, GROUP, nb).transpose(0, 2, 1).astype(np.float16 if half else np.float32)
    return np.ascontiguousarray(g).reshape(rows, nb)


def row_major(aw: AffineWeight, rows=slice(None)) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(q, scale, offset) of the selected rows in the row-major layout, whatever the weight's."""
    if aw.group == 1:
        return aw.q[rows], aw.scale[rows], None if aw.offset is None else aw.offset[rows]
    idx = np.arange(aw.rows)[rows] if isinstance(rows, slice) else np.asarray(rows, dtype=np.intp).reshape(-1)
    g, lane, nb = idx // GROUP, idx % GROUP, aw.k // 32
    q = aw.q.reshape(-1, nb, _words(aw), GROUP, 4)[g, :, :, lane, :].reshape(len(idx), -1)

    def blocks(a: np.ndarray) -> np.ndarray:
        return a.reshape(-1, nb, GROUP)[g, :, lane].astype(np.float32)
    return q, blocks(aw.scale), None if aw.offset is None else blocks(aw.offset)


def adjacent(weights: list[AffineWeight], align: int = 64) -> list[AffineWeight]:
    """The same weights, each field's arrays end to end in one buffer (list order, each start on
    `align` bytes): one process's device slices of a weight, which a grouped kernel reads in
    turn, then stream through memory as the whole weight's would."""
    with_offset = {w.offset is not None for w in weights}
    if len(weights) < 2 or len(with_offset) > 1:
        return list(weights)
    fields = ("q", "scale", "offset") if with_offset == {True} else ("q", "scale")
    placed = {name: _end_to_end([getattr(w, name) for w in weights], align) for name in fields}
    return [replace(w, **{name: placed[name][i] for name in fields}) for i, w in enumerate(weights)]


def _end_to_end(parts: list[np.ndarray], align: int) -> list[np.ndarray]:
    """Copies of `parts` in one buffer, in order, each starting on `align` bytes."""
    sizes = [-(-p.nbytes // align) * align for p in parts]
    buf = np.empty(sum(sizes) + align, np.uint8)
    at = -buf.ctypes.data % align
    out = []
    for p, size in zip(parts, sizes):
        v = buf[at:at + p.nbytes].view(p.dtype).reshape(p.shape)
        v[...] = p
        out.append(v)
        at += size
    return out
