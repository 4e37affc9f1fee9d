"""Dequantization of GGUF weight rows to f32 / f16 (``cuda/dequant.cu``): the first half of the prefill GEMM path.

No op of its own: the matvec family's MUL_MAT handler launches it on the GEMM path (and sizes
its scratch); its tables are empty.
"""

from __future__ import annotations

from metatp.backends.cuda.kernels.handler import no_workspace
from metatp.backends.cuda.launch import (WEIGHT_TYPES, CHUNK_ELEMS, BLOCK_1D, launch, i32, grid1d, wtype,
                                         act_type)

__all__ = ['ENTRY_POINTS', 'dequantize', 'HANDLERS', 'FUSIONS', 'workspace']

ENTRY_POINTS = [f"dequant_{t}_{o}" for t in WEIGHT_TYPES for o in ("f32", "f16")]


def dequantize(src, qtype, dst, *, ne0: int, n_rows: int, src_row_bytes: int | None = None,
               dst_row_stride: int | None = None) -> None:
    """Rows of a ggml weight -> f32 (``dst`` float32) or f16 (``dst`` float16).

    ``src``: the raw bytes (any dtype; only the pointer is used), row r at
    ``r * src_row_bytes``. ``dst`` row r at ``r * dst_row_stride`` elements.
    """
    t = wtype(qtype)
    qk, nbytes = WEIGHT_TYPES[t]
    if ne0 % qk:
        raise ValueError(f"ne0={ne0} is not a multiple of the {t} block size {qk}")
    out = act_type(dst)
    if out not in ("f32", "f16"):
        raise TypeError("dequantize writes float32 or float16")
    if src_row_bytes is None:
        src_row_bytes = ne0 // qk * nbytes
    if dst_row_stride is None:
        dst_row_stride = ne0
    units = ne0 // qk * (qk // CHUNK_ELEMS[t]) * n_rows
    if units == 0:
        return
    launch("dequant", f"dequant_{t}_{out}", grid1d(units), (BLOCK_1D,),
           (src, dst, i32(ne0), i32(n_rows), i32(src_row_bytes), i32(dst_row_stride)))


HANDLERS: dict = {}
FUSIONS = ()
workspace = no_workspace
