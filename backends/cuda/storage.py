"""What CUDA device memory holds, and in which types: the storage dtype of every graph type,
weights kept in their GGUF encoding (`RawWeight`), the per-GPU input block, host copies.

The graph's types are not always the storage's: an F32 KV cache is stored as f16 (or bf16 /
f32, `kv_dtype`), bf16 as uint16 bit patterns, a quantized KV cache (q8_0, q4_0, q4_1, q5_0,
q5_1) as its raw blocks (uint8 rows; SET_ROWS quantizes, attention dequantizes in registers).
Views are rescaled from the graph's element size to the storage's (see
`executable.CupyExecutable.view`); a view of a quantized cache is a byte view of whole blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from metatp.backends.cuda.launch import KV_QUANT_TYPES, WEIGHT_TYPES
from metatp.ir.dtypes import bf16_bits_to_f32, np_shape
from metatp.backends.slicing import local_raw_shape
from metatp.ir.errors import ConfigError, UnsupportedOpError
from metatp.ir.ops import Op
from metatp.ir.tensor import Flag, GGMLType, Tensor, block_size, type_size

__all__ = ["STORAGE", "KV_STORAGE", "RawWeight", "weight_type_name", "graph_itemsize", "raw_nb", "contig_strides",
           "input_layout", "attended_length", "to_float", "matmul_tokens", "cache_storage", "quant_cache_type",
           "is_quant_cache"]

STORAGE = {GGMLType.F32: np.float32, GGMLType.F16: np.float16, GGMLType.BF16: np.uint16, GGMLType.I32: np.int32}
KV_STORAGE = {"f16": np.float16, "bf16": np.uint16, "f32": np.float32}
#: graph types of a KV cache the cupy backend stores as raw blocks
QUANT_CACHE = {GGMLType[name.upper()]: name for name in KV_QUANT_TYPES}


def quant_cache_type(t: GGMLType) -> str | None:
    """The kernels' name of a quantized KV-cache type ("q8_0", ...), or None for a float type."""
    return QUANT_CACHE.get(GGMLType(t))


def is_quant_cache(t: Tensor) -> bool:
    return block_size(t.type) > 1 and quant_cache_type(t.type) is not None


def cache_storage(t: GGMLType, kv_dtype: str) -> tuple[str, Any]:
    """(storage type name, numpy dtype) of a KV cache of graph type `t`: an F32 cache is kept
    as `kv_dtype` (f16 by default, as before cache types existed), F16 as f16, BF16 as uint16
    bits, a quantized type as uint8 blocks. ConfigError for a type the kernels cannot hold."""
    t = GGMLType(t)
    if t == GGMLType.F32:
        return kv_dtype, KV_STORAGE[kv_dtype]
    if t == GGMLType.F16:
        return "f16", np.float16
    if t == GGMLType.BF16:
        return "bf16", np.uint16
    q = quant_cache_type(t)
    if q is not None:
        return q, np.uint8
    raise ConfigError(f"cupy backend: KV cache type {t.name.lower()} is not supported; supported: "
                      f"f32, f16, bf16, {', '.join(KV_QUANT_TYPES)}")


@dataclass
class RawWeight:
    """A weight slice kept in its GGUF encoding on one device: `data` uint8 rows."""

    data: Any
    wtype: str                      # kernel weight type name ("q4_1", "f16", ...)
    ne: tuple[int, int, int, int]   # local ggml shape
    nb: tuple[int, int, int, int]   # local byte strides (contiguous)

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)


def weight_type_name(t: GGMLType) -> str | None:
    """The kernels' name of a GGUF type they read raw, or None."""
    name = GGMLType(t).name.lower()
    return name if name in WEIGHT_TYPES else None


def graph_itemsize(t: Tensor) -> int:
    """Bytes per element of `t`'s graph type as an activation or view."""
    try:
        return np.dtype(STORAGE[t.type]).itemsize
    except KeyError:
        raise UnsupportedOpError(f"cupy backend: tensor {t.name!r} of type {t.type.name} "
                                 "cannot be an activation or a view") from None


def raw_nb(t: GGMLType, ne) -> tuple[int, int, int, int]:
    """Byte strides of a raw weight slice of local shape `ne` (whole blocks per row)."""
    rb = local_raw_shape(t, ne)[-1]
    return (type_size(t), rb, rb * ne[1], rb * ne[1] * ne[2])


def contig_strides(shape, dtype) -> tuple[int, ...]:
    isz = np.dtype(dtype).itemsize
    out, acc = [], isz
    for s in reversed(shape):
        out.append(acc)
        acc *= max(int(s), 1)
    return tuple(reversed(out))


def matmul_tokens(mm: Tensor) -> int:
    """Columns (tokens) of a MUL_MAT's activation operand."""
    return mm.src[1].ne[1] * mm.src[1].ne[2] * mm.src[1].ne[3]


def input_layout(graph) -> tuple[dict[Any, tuple[int, tuple, Any]], int]:
    """The per-GPU input block: every INPUT leaf (64-byte aligned) plus an int32 "attended
    length" per attention mask; key -> (offset, numpy shape, dtype), and the block's bytes."""
    inputs = [t for t in graph.leaves if t.flags & Flag.INPUT]
    masks = {n.src[3] for n in graph.nodes
             if n.op is Op.FLASH_ATTN_EXT and len(n.src) > 3 and n.src[3] is not None
             and n.src[3].flags & Flag.INPUT}
    layout: dict[Any, tuple[int, tuple, Any]] = {}
    off = 0
    for t in inputs:
        dtype = STORAGE.get(t.type)
        if dtype is None:
            raise UnsupportedOpError(f"cupy backend: input {t.name!r} of type {t.type.name}")
        layout[t] = (off, np_shape(t.ne), dtype)
        off += -(-t.nelements * np.dtype(dtype).itemsize // 64) * 64
    for m in sorted(masks, key=lambda t: t.id):
        layout[("kv_len", m)] = (off, (1,), np.int32)
        off += 64
    return layout, max(off, 64)


def attended_length(mask: np.ndarray) -> int:
    """1 + the last KV column some query can see (0 if none): the kernels skip the rest."""
    m = mask.reshape(-1, mask.shape[-1])
    cols = np.flatnonzero((m > -np.inf).any(axis=0))
    return int(cols[-1]) + 1 if cols.size else 0


def to_float(h: np.ndarray, dtype, t: Tensor) -> np.ndarray:
    """Host copy in the graph's type (an f16/bf16-stored F32 tensor comes back as f32; a quantized
    cache comes back dequantized, f32)."""
    if np.dtype(dtype) == np.uint8 and quant_cache_type(t.type) is not None:
        from gguf import quants  # noqa: PLC0415 - only for reading a quantized cache back

        return quants.dequantize(np.ascontiguousarray(h), t.type).astype(np.float32)
    if np.dtype(dtype) == np.uint16:
        return bf16_bits_to_f32(h)
    if t.type == GGMLType.F32 and h.dtype != np.float32:
        return h.astype(np.float32)
    return h
