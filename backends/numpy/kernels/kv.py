"""Copies and the KV cache: CONT / CPY, SET_ROWS (rows rounded to the cache's type as they are
stored, a compiled call for few-token steps) and the row quantization they store with."""

from __future__ import annotations

import numpy as np

from metatp.backends.numpy.kernels.common import F32, Closure
from metatp.backends.numpy.native import prepare_set_rows
from metatp.ir.tensor import GGMLType


def _copy(node, out, src, ctx) -> Closure:
    x = src[0]
    if x.shape == out.shape:
        return lambda: np.copyto(out, x, casting="unsafe")
    return lambda: np.copyto(out, np.ascontiguousarray(x).reshape(out.shape), casting="unsafe")


def kv_store_rows(rows: np.ndarray, ggml_type: GGMLType) -> np.ndarray:
    """float32 rows (.., n) as a KV cache of `ggml_type` stores them: float32 / float16 values, or
    the bytes of bf16 / quantized blocks, rounded by gguf.quants (llama.cpp's reference rounding)."""
    if ggml_type == GGMLType.F32:
        return rows
    if ggml_type == GGMLType.F16:
        return rows.astype(np.float16)
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    return quantize(np.ascontiguousarray(rows, dtype=F32), GGMLQuantizationType(int(ggml_type)))


def kv_load_rows(stored: np.ndarray, ggml_type: GGMLType) -> np.ndarray:
    """The float32 values of KV cache rows as stored (`kv_store_rows`' inverse up to rounding;
    gguf's dequantization, which the compiled attention reproduces bit for bit)."""
    if ggml_type == GGMLType.F32:
        return stored
    if ggml_type == GGMLType.F16:
        return stored.astype(F32)
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    return dequantize(np.ascontiguousarray(stored), GGMLQuantizationType(int(ggml_type))).astype(F32, copy=False)


def _set_rows(node, out, src, ctx) -> Closure:
    rows, ids = src[0], src[1]   # rows (ne3, ne2, T, ne0); ids (1, ne12, ne11, T); out = the destination view
    ty = node.type               # the cache's type: rows are rounded to it as they are stored
    if out.shape[:2] == (1, 1) and rows.shape[:2] == (1, 1):
        o2, r2, i1 = out[0, 0], rows[0, 0], ids[0, 0, 0]
        if ctx.use_kernels:
            kernel = prepare_set_rows(r2, i1, o2, int(ty))
            if kernel is not None:
                return kernel

        def run() -> None:
            o2[i1] = kv_store_rows(r2, ty)
        return run

    def run_nd() -> None:
        for i3 in range(rows.shape[0]):
            for i2 in range(rows.shape[1]):
                idx = ids[0, i3 % ids.shape[1], i2 % ids.shape[2]]
                out[i3 % out.shape[0], i2 % out.shape[1]][idx] = kv_store_rows(rows[i3, i2], ty)
    return run_nd
