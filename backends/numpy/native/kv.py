"""The KV cache's row types as the C kernels store and read them (csrc/kv.c): row sizes, the
views the kernels take, the KV write (`prepare_set_rows`) and, for the tests, rows converted one
way and back."""

from __future__ import annotations

from typing import Callable

import numpy as np

from metatp.backends.numpy.native.lib import _Call, _elems, available
from metatp.ir.tensor import GGMLType, row_bytes

__all__ = ["KV_TYPES", "kv_row_bytes", "kv_quantize", "kv_dequantize", "prepare_set_rows"]

# KV-cache types the kernels store and read, as GGML type ids (f32, f16, q4_0, q4_1, q5_0, q5_1,
# q8_0, bf16): T_* in kv.c.
KV_TYPES = (0, 1, 2, 3, 6, 7, 8, 30)


def kv_row_bytes(kv_type: int, n: int) -> int | None:
    """Bytes of a cache row of n values of a KV type, or None for a type or length the kernels
    do not take (quantized rows are whole blocks of 32)."""

    if int(kv_type) not in KV_TYPES:
        return None
    try:
        return row_bytes(GGMLType(int(kv_type)), n)
    except ValueError:
        return None


def _kv_view_ok(a: np.ndarray, kv_type: int, n: int) -> bool:
    """Is `a` (heads, rows, last) a cache view the attention kernel reads: float32 for f32, half
    for f16, bytes for the rest, each row `n` values of the type with contiguous last dim."""
    rb = kv_row_bytes(kv_type, n)
    want = {0: np.float32, 1: np.float16}.get(int(kv_type), np.uint8)
    return (rb is not None and a.ndim == 3 and a.dtype == want and a.shape[2] * a.itemsize == rb
            and (a.shape[2] <= 1 or a.strides[2] == a.itemsize))


def kv_quantize(x: np.ndarray, kv_type: int) -> np.ndarray:
    """Rows x (rows, n) float32 -> cache rows (rows, row bytes) uint8 of a 16-bit or quantized
    KV type, as the compiled KV write rounds them (the tests hold it to gguf.quants)."""
    x2 = np.ascontiguousarray(x, dtype=np.float32)
    rows, n = x2.shape
    rb = kv_row_bytes(kv_type, n)
    if rb is None or int(kv_type) == 0:
        raise ValueError(f"kv_quantize: type {kv_type} with rows of {n}")
    q = np.zeros((rows, rb), np.uint8)
    _Call("metatp_kv_convert", (x2, q), type=int(kv_type), rows=rows, n=n, x=x2.ctypes.data, q=q.ctypes.data,
          out=None)()
    return q


def kv_dequantize(q: np.ndarray, kv_type: int, n: int) -> np.ndarray:
    """Cache rows (rows, row bytes) uint8 -> float32 (rows, n), as the attention kernel reads them."""
    q2 = np.ascontiguousarray(q, dtype=np.uint8).reshape(-1, kv_row_bytes(kv_type, n) or 1)
    out = np.empty((q2.shape[0], n), np.float32)
    _Call("metatp_kv_convert", (q2, out), type=int(kv_type), rows=q2.shape[0], n=n, x=None, q=q2.ctypes.data,
          out=out.ctypes.data)()
    return out


def prepare_set_rows(rows2: np.ndarray, ids1: np.ndarray, dst2: np.ndarray, dst_type: int = 0
                     ) -> Callable[[], None] | None:
    """dst2[ids1] = rows2 (float32 rows of n, int32 ids) as one compiled call, stored as the KV
    type `dst_type` (dst2: float32 / float16 rows of n, or byte rows of a bf16 or quantized type,
    rounded as gguf.quants rounds); None when the arrays are not ones it takes (the caller keeps
    numpy)."""
    n = rows2.shape[1] if rows2.ndim == 2 else -1
    if (not available() or rows2.ndim != 2 or dst2.ndim != 2 or rows2.dtype != np.float32
            or not _kv_view_ok(dst2[None], dst_type, n) or ids1.dtype != np.int32 or ids1.ndim != 1
            or ids1.shape[0] != rows2.shape[0] or not ids1.flags.c_contiguous or rows2.strides[1] != 4):
        return None
    call = _Call("metatp_set_rows", (rows2, ids1, dst2), T=rows2.shape[0], n=n, src=rows2.ctypes.data,
                 src_st=_elems(rows2, 0), dst=dst2.ctypes.data, dst_st=dst2.strides[0], dst_rows=dst2.shape[0],
                 ids=ids1.ctypes.data, type=int(dst_type))

    def run() -> None:
        try:
            call()
        except RuntimeError:
            raise IndexError(f"set_rows: a row id is outside 0..{dst2.shape[0] - 1}: {ids1.tolist()}") from None
    run.keep = run.kernel = call
    run.prepare = None
    return run
