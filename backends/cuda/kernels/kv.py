"""KV-cache row stores (``cuda/kv.cu``): SET_ROWS with f32 -> f16 / bf16 / f32 conversion, K and V in one launch.
"""

from __future__ import annotations

from metatp.backends.cuda.launch import (BLOCK_1D, KV_TYPES, launch, i32, grid1d, act_type, rows2d, check_f32,
                                         check_i32)

__all__ = ['ENTRY_POINTS', 'set_rows']

ENTRY_POINTS = [f"set_rows_f32_{t}" for t in KV_TYPES]


def set_rows(src, dst, idx, *, ne0: int | None = None, n_rows: int | None = None,
             src_row_stride: int | None = None, dst_row_stride: int | None = None,
             second=None) -> None:
    """``dst[idx[r], :ne0] = src[r, :ne0]`` converting f32 to dst's type (f16/bf16/f32).
    ``idx`` is read from device memory (a captured graph writes new rows each replay).
    ``second``: optional (src2, dst2) stored with the same indices in the same launch
    (the K and V rows of a layer; dst2 of dst's type)."""
    check_f32(src)
    check_i32(idx)
    ne0, n_src_rows, src_row_stride = rows2d(src, ne0, None, src_row_stride)
    if n_rows is None:
        n_rows = int(idx.size)
    if n_rows > idx.size or (src.ndim > 1 and n_rows > n_src_rows):
        raise ValueError(f"n_rows={n_rows} exceeds idx ({idx.size}) or src rows ({n_src_rows})")
    if dst_row_stride is None:
        dst_row_stride = rows2d(dst)[2] if dst.ndim > 1 else ne0
    out = act_type(dst)
    src2 = dst2 = None
    ne0_2, s2, d2 = 0, 0, 0
    if second is not None:
        src2, dst2 = second
        check_f32(src2)
        if act_type(dst2) != out:
            raise TypeError("both destinations must have the same type")
        ne0_2, rows2, s2 = rows2d(src2)
        d2 = rows2d(dst2)[2] if dst2.ndim > 1 else ne0_2
        if src2.ndim > 1 and rows2 < n_rows:
            raise ValueError(f"second source has {rows2} rows, need {n_rows}")
    if n_rows == 0 or ne0 + ne0_2 == 0:
        return
    launch("kv", f"set_rows_f32_{out}", grid1d((ne0 + ne0_2) * n_rows), (BLOCK_1D,),
           (src, dst, idx, i32(ne0), i32(n_rows), i32(src_row_stride),
            i32(dst_row_stride), src2, dst2, i32(ne0_2), i32(s2), i32(d2)))
