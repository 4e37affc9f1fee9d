"""The greedy pick of a block of logits rows as one compiled call (csrc/row_best.c): per row the
largest value, the first index holding it and whether every value is finite."""

from __future__ import annotations

import numpy as np

from metatp.backends.numpy.native.lib import _Call, _elems, available, default_threads

__all__ = ["row_best"]


def row_best(x2: np.ndarray, nthreads: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(value float32, index int64, finite bool) per row of the float32 (rows, n) view `x2` (rows
    contiguous, any row stride): numpy's `argmax` pick and its value where the row is finite;
    where it is not, the value and index are unspecified. None when the library is unavailable
    or the view is not one the kernel takes (the caller keeps numpy)."""
    if (not available() or x2.dtype != np.float32 or x2.ndim != 2 or x2.shape[0] < 1 or x2.shape[1] < 1
            or x2.strides[1] != 4 or x2.strides[0] % 4 or x2.strides[0] < 4 * x2.shape[1]):
        return None
    rows = x2.shape[0]
    val = np.empty(rows, np.float32)
    idx = np.empty(rows, np.int64)
    finite = np.empty(rows, np.int64)
    _Call("metatp_row_best", (x2, val, idx, finite), rows=rows, n=x2.shape[1], ld=_elems(x2, 0), x=x2.ctypes.data,
          val=val.ctypes.data, idx=idx.ctypes.data, finite=finite.ctypes.data,
          nthreads=nthreads or default_threads())()
    return val, idx, finite.astype(bool)
