"""Row kernels as compiled calls (csrc/elementwise.c, csrc/allreduce.c): gated activations, RMS
norm and add, and the simulated all-reduce. Between a step's compiled calls, numpy spent ~10 us
per norm and per residual add; as compiled calls they join the step's batch."""

from __future__ import annotations

import ctypes
from typing import Callable

import numpy as np

from metatp.backends.numpy.native.lib import _Call, _elems, available

__all__ = ["GLU_ACTS", "prepare_glu", "prepare_rms_norm", "prepare_add", "prepare_allreduce"]

GLU_ACTS = {"silu": 0, "gelu_tanh": 1}


def _row_views_ok(*arrs: np.ndarray) -> bool:
    """float32 (T, n) row views of one shape with contiguous rows: what the row kernels take."""
    return all(x.dtype == np.float32 and x.ndim == 2 and x.shape == arrs[0].shape and x.strides[1] == 4
               for x in arrs)


def prepare_glu(a2: np.ndarray, b2: np.ndarray, o2: np.ndarray, act: str, nthreads: int = 1
                ) -> Callable[[], None] | None:
    """out = act(a) * b over (T, n) row views with contiguous rows (rows shared by `nthreads` in a
    pass of many tokens); None when the views or the activation are not ones the kernel takes
    (the caller keeps numpy)."""
    if not available() or act not in GLU_ACTS or not _row_views_ok(a2, b2, o2):
        return None
    return _Call("metatp_glu", (a2, b2, o2), T=a2.shape[0], n=a2.shape[1], act=GLU_ACTS[act], a=a2.ctypes.data,
                 a_st=_elems(a2, 0), b=b2.ctypes.data, b_st=_elems(b2, 0), out=o2.ctypes.data, o_st=_elems(o2, 0), nthreads=nthreads)


def prepare_rms_norm(x2: np.ndarray, w: np.ndarray | None, o2: np.ndarray, eps: float, nthreads: int = 1
                     ) -> Callable[[], None] | None:
    """out = rms_norm(x) [* w] over (T, n) row views with contiguous rows, rounded as
    `kernels.rms_norm_mul`; None when the views are not ones the kernel takes."""
    if not available() or not _row_views_ok(x2, o2) or x2.shape[1] == 0:
        return None
    if w is not None and (w.dtype != np.float32 or w.size != x2.shape[1] or not w.flags.c_contiguous):
        return None
    return _Call("metatp_rms_norm", (x2, w, o2), T=x2.shape[0], n=x2.shape[1], x=x2.ctypes.data, x_st=_elems(x2, 0),
                 w=None if w is None else w.ctypes.data, out=o2.ctypes.data, o_st=_elems(o2, 0), eps=eps,
                 nthreads=nthreads)


def prepare_add(a2: np.ndarray, b2: np.ndarray, o2: np.ndarray, nthreads: int = 1) -> Callable[[], None] | None:
    """out = a + b over (T, n) row views with contiguous rows; None when the kernel does not take them."""
    if not available() or not _row_views_ok(a2, b2, o2):
        return None
    return _Call("metatp_add", (a2, b2, o2), T=a2.shape[0], n=a2.shape[1], a=a2.ctypes.data, a_st=_elems(a2, 0),
                 b=b2.ctypes.data, b_st=_elems(b2, 0), out=o2.ctypes.data, o_st=_elems(o2, 0), nthreads=nthreads)


def prepare_allreduce(bufs: list[np.ndarray], active: list[bool]) -> Callable[[], None] | None:
    """The butterfly of `collectives.schedule.butterfly_schedule`, compiled (the same bits: it
    sums only the lower half of each doubling round, and a + b == b + a), over these float32
    C-contiguous buffers; None when they are not such buffers. `collectives.host.HOST_KERNELS`
    registers it for mode "butterfly"."""
    if (not available() or len(bufs) != len(active)
            or any(b.dtype != np.float32 or not b.flags.c_contiguous or b.size != bufs[0].size for b in bufs)):
        return None
    ptrs = (ctypes.c_void_p * len(bufs))(*[b.ctypes.data for b in bufs])
    flags = np.array([1 if a else 0 for a in active], dtype=np.uint8)
    return _Call("metatp_allreduce", (bufs, ptrs, flags), n=len(bufs), count=bufs[0].size,
                 bufs=ctypes.addressof(ptrs), active=flags.ctypes.data)
