"""Matrix products over int8-coded weights (`AffineWeight`): the float kernel (`prepare_qmatmul`,
csrc/qmatmul.c), the integer kernel of numerics="llamacpp" (`prepare_q8_matmul`, csrc/q8.c,
repack.c, q8_gemm.c for steps of many tokens, q8_matmul.c; any token count), grouping several
products into one call, and the long-prompt path of exact mode that dequantizes slabs of rows for
BLAS (csrc/dequant.c).

numpy has no BLAS for int8 or f16, so the only way it can read a weight in a decode step is as
float32: 4 bytes a weight, which makes decode bound by memory bandwidth. These kernels read the
weights as 8- or 4-bit codes with a float32 scale/offset per block (see `codes`).
"""

from __future__ import annotations

import ctypes
from typing import Callable

import numpy as np

from metatp.backends.numpy.codes import AffineWeight
from metatp.backends.numpy.native import lib as _lib
from metatp.backends.numpy.native.lib import MAX_GROUP_ITEMS, _Call, _struct, default_threads

__all__ = ["prepare_qmatmul", "qmatmul", "float_row_groups", "is_qmatmul", "group_qmatmul", "Q8_0", "Q8_1", "Q8_K", "q8_kind",
           "prepare_q8_matmul", "q8_matmul", "q8_quantize", "round_half", "q8_isums", "DEQUANT_CHUNK",
           "prepare_dequant_matmul", "dequantize"]

_QMatmulArgs = _struct("QMatmulArgs", "rows:i k:i block:i bits:i bias:i q:p scale:p offset:p x:p ldx:i ntok:i y:p "
                                      "ldy:i group:i half_scales:i")
_Q8MatmulArgs = _struct("Q8MatmulArgs", "rows:i k:i block:i bits:i bias:i q:p scale:p offset:p x:p ldx:i ntok:i y:p "
                                        "ldy:i kind:i group:i half_scales:i")


def _code_format(aw: AffineWeight) -> dict:
    """The struct fields that say how codes are stored (bits 16: bias 1 means bfloat16)."""
    return {"bits": aw.bits, "bias": int(aw.bf16) if aw.bits == 16 else aw.bias}


def _half_scales(aw: AffineWeight) -> int:
    """1 when the weight keeps its scales (and offsets) as IEEE halves (row-group layout only)."""
    return int(aw.scale.dtype == np.float16)


def _check(aw: AffineWeight, x2: np.ndarray, y2: np.ndarray) -> None:
    rows, k = aw.rows, aw.k
    if x2.ndim != 2 or x2.shape[1] != k or x2.dtype != np.float32 or (k > 1 and x2.strides[1] != 4):
        raise ValueError(f"qmatmul: x must be float32 (n, {k}) with contiguous rows, got {x2.dtype} {x2.shape}")
    if y2.shape != (x2.shape[0], rows) or y2.dtype != np.float32 or (rows > 1 and y2.strides[1] != 4):
        raise ValueError(f"qmatmul: out must be float32 ({x2.shape[0]}, {rows}) with contiguous rows, got "
                         f"{y2.dtype} {y2.shape}")
    if not (aw.q.flags.c_contiguous and aw.scale.flags.c_contiguous
            and (aw.offset is None or aw.offset.flags.c_contiguous)):
        raise ValueError("qmatmul: weight arrays must be C-contiguous")


def prepare_qmatmul(aw: AffineWeight, x2: np.ndarray, y2: np.ndarray, nthreads: int | None = None
                    ) -> Callable[[], None]:
    """A closure computing y2 = x2 @ dequantize(aw).T in place, for these fixed arrays (their
    addresses are taken once, so a call costs one ctypes call). x2: (n, K), y2: (n, rows)."""
    _check(aw, x2, y2)
    if aw.group != 1 and not float_row_groups():
        raise ValueError("qmatmul: this build's float kernel reads row-major codes; this weight is in the row-group "
                         "layout (read by the integer kernel, prepare_q8_matmul, and by 512-bit builds' float one)")
    if x2.shape[0] == 0 or aw.rows == 0:
        return lambda: None
    rows, k = aw.rows, aw.k
    item = _QMatmulArgs(rows=rows, k=k, block=aw.block, **_code_format(aw), q=aw.q.ctypes.data,
                        scale=aw.scale.ctypes.data,
                        offset=None if aw.offset is None else aw.offset.ctypes.data, x=x2.ctypes.data,
                        ldx=x2.strides[0] // 4, ntok=x2.shape[0], y=y2.ctypes.data, ldy=y2.strides[0] // 4,
                        group=aw.group, half_scales=_half_scales(aw))
    return _qmatmul_group([(item, (aw, x2, y2))], nthreads or default_threads())


def float_row_groups() -> bool:
    """Does the build in use read the row-group layout (`codes.group_rows`) in the float product?
    Its 512-bit builds do (csrc/qmatmul_groups.c: each weight block is dequantized once for up to
    8 tokens), and exact numerics then keeps 4- and 8-bit codes in that layout too."""
    lib = _lib._library()[0]
    return lib is not None and bool(lib.metatp_qmatmul_groups())


def _qmatmul_group(items: list, nthreads: int) -> "_Call":
    ptrs = (ctypes.c_void_p * len(items))(*[ctypes.addressof(it) for it, _ in items])
    call = _Call("metatp_qmatmul", (items, ptrs), n=len(items), items=ctypes.addressof(ptrs), nthreads=nthreads)
    call.items = items
    return call


_MATMULS = ("metatp_qmatmul", "metatp_q8_matmul")


def is_qmatmul(f) -> bool:
    """Is `f` a closure made by `prepare_qmatmul` or `prepare_q8_matmul` (so `group_qmatmul`
    can merge it)?"""
    return isinstance(f, _Call) and f.name in _MATMULS


def group_qmatmul(calls: list) -> Callable[[], None]:
    """One call doing the work of several `prepare_qmatmul` (or several `prepare_q8_matmul`)
    closures (independent products): one parallel region instead of one each. Results are
    bit-identical to calling them in turn."""
    items = [it for c in calls for it in c.items]
    if len(calls) == 1 or len(items) > MAX_GROUP_ITEMS or len({c.name for c in calls}) > 1:
        return calls[0] if len(calls) == 1 else _run_in_turn(calls)
    if calls[0].name == "metatp_q8_matmul":
        return _q8_group(items, int(calls[0].args.nthreads))
    return _qmatmul_group(items, int(calls[0].args.nthreads))




def _run_in_turn(calls: list) -> Callable[[], None]:
    def run() -> None:
        for c in calls:
            c()
    return run


def qmatmul(x: np.ndarray, aw: AffineWeight, out: np.ndarray | None = None, nthreads: int | None = None
            ) -> np.ndarray:
    """x (n, K) float32 @ dequantize(aw).T -> (n, rows): the one-off form of `prepare_qmatmul`."""
    x2 = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, aw.k)
    y2 = np.empty((x2.shape[0], aw.rows), dtype=np.float32) if out is None else out
    prepare_qmatmul(aw, x2, y2, nthreads)()
    return y2


# ------------------------------------------------------------------ Q8 activations (numerics="llamacpp")
Q8_0, Q8_1, Q8_K = 0, 1, 2       # how activations are rounded: llama.cpp's vec_dot_type of the weight
_Q8_KIND_OF_TYPE = {"Q4_0": Q8_0, "Q5_0": Q8_0, "Q8_0": Q8_0, "Q4_1": Q8_1, "Q5_1": Q8_1,
                    "Q2_K": Q8_K, "Q3_K": Q8_K, "Q4_K": Q8_K, "Q5_K": Q8_K, "Q6_K": Q8_K}


def q8_kind(aw: AffineWeight) -> int | None:
    """How llama.cpp's CPU backend rounds the activations multiplied with this weight (Q8_0, Q8_1
    or Q8_K blocks), or None where the integer kernel does not take it (half-float codes, a
    K-quant whose rows are not whole 256-blocks, codes of unknown origin)."""
    if aw.bits == 16 or aw.ggml_type is None:
        return None
    kind = _Q8_KIND_OF_TYPE.get(aw.ggml_type.name)
    if kind is None or aw.k % (256 if kind == Q8_K else 32):
        return None
    return kind


def _q8_group(items: list, nthreads: int) -> "_Call":
    ptrs = (ctypes.c_void_p * len(items))(*[ctypes.addressof(it) for it, _ in items])
    call = _Call("metatp_q8_matmul", (items, ptrs), n=len(items), items=ctypes.addressof(ptrs), nthreads=nthreads)
    call.items = items
    return call


def _q8_item(aw: AffineWeight, x2: np.ndarray, y2: np.ndarray, kind: int) -> ctypes.Structure:
    return _Q8MatmulArgs(rows=aw.rows, k=aw.k, block=aw.block, bits=aw.bits, bias=aw.bias, q=aw.q.ctypes.data,
                         scale=aw.scale.ctypes.data, offset=None if aw.offset is None else aw.offset.ctypes.data,
                         x=x2.ctypes.data, ldx=x2.strides[0] // 4, ntok=x2.shape[0], y=y2.ctypes.data,
                         ldy=y2.strides[0] // 4, kind=kind, group=aw.group, half_scales=_half_scales(aw))


def prepare_q8_matmul(aw: AffineWeight, x2: np.ndarray, y2: np.ndarray, nthreads: int | None = None,
                      kind: int | None = None) -> Callable[[], None]:
    """A closure computing y2 = x2 @ W.T the way llama.cpp's CPU backend does: each row of x2
    rounded to Q8 blocks (`kind`, default `q8_kind(aw)`), integer dot products with the codes,
    float scales after. x2: (n, K), y2: (n, rows) float32, rows contiguous."""
    _check(aw, x2, y2)
    kind = q8_kind(aw) if kind is None else kind
    if kind not in (Q8_0, Q8_1, Q8_K) or aw.bits == 16 or (aw.block == 16 and kind != Q8_K):
        raise ValueError(f"q8 matmul: weight (bits {aw.bits}, block {aw.block}, {aw.ggml_type}) with kind {kind}")
    if aw.k % (256 if kind == Q8_K else 32):
        raise ValueError(f"q8 matmul: K={aw.k} is not a whole number of activation blocks")
    if x2.shape[0] == 0 or aw.rows == 0:
        return lambda: None
    return _q8_group([(_q8_item(aw, x2, y2, kind), (aw, x2, y2))], nthreads or default_threads())


def q8_matmul(x: np.ndarray, aw: AffineWeight, kind: int | None = None, nthreads: int | None = None) -> np.ndarray:
    """The one-off form of `prepare_q8_matmul`: x (n, K) -> (n, rows)."""
    x2 = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, aw.k)
    y2 = np.empty((x2.shape[0], aw.rows), dtype=np.float32)
    prepare_q8_matmul(aw, x2, y2, nthreads, kind)()
    return y2


def q8_quantize(x: np.ndarray, kind: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray]:
    """x (n, K) float32 rounded as the kernel rounds it: (codes int8 (n, K), scales float32
    (n, K/32) or (n, K/256) for Q8_K, Q8_1's s (n, K/32) or None, int32 sums of 16 codes)."""
    x2 = np.ascontiguousarray(x, dtype=np.float32)
    n, k = x2.shape
    q = np.empty((n, k), np.int8)
    d = np.empty((n, k // 256 if kind == Q8_K else k // 32), np.float32)
    s = np.empty((n, k // 32), np.float32) if kind == Q8_1 else None
    isum = np.empty((n, k // 16), np.int32)
    _Call("metatp_q8_quantize", (x2, q, d, s, isum), kind=kind, ntok=n, k=k, x=x2.ctypes.data, ldx=k,
          q=q.ctypes.data, d=d.ctypes.data, s=None if s is None else s.ctypes.data, isum=isum.ctypes.data)()
    return q, d, s, isum


def round_half(x: np.ndarray) -> np.ndarray:
    """float32 -> IEEE half -> float32 as the kernels round Q8 scales (for the tests)."""
    x1 = np.ascontiguousarray(x, dtype=np.float32).reshape(-1)
    out = np.empty_like(x1)
    _Call("metatp_round_half", (x1, out), n=x1.size, x=x1.ctypes.data, out=out.ctypes.data)()
    return out.reshape(np.shape(x))


def q8_isums(aw: AffineWeight, xq: np.ndarray) -> np.ndarray:
    """The kernel's exact integer sums (n, rows, K/16) of weight codes times activation codes
    `xq` (n, K) int8 over each 16 elements (what the float scales then multiply); over each 32,
    (n, rows, K/32), for a weight in the row-group layout (its kernel sums whole blocks)."""
    xq = np.ascontiguousarray(xq, dtype=np.int8)
    n, k = xq.shape
    out = np.empty((n, aw.rows, k // (32 if aw.group > 1 else 16)), np.int32)
    x_dummy = np.zeros((n, k), np.float32)
    item = _q8_item(aw, x_dummy, np.empty((n, aw.rows), np.float32), Q8_0)
    _Call("metatp_q8_isums", (item, xq, out, aw, x_dummy), w=ctypes.addressof(item), xq=xq.ctypes.data,
          out=out.ctypes.data)()
    return out


# Long prompts multiply with BLAS on float32 weights made from the codes a slab of rows at a time
# (8 MiB per device: a slab stays in the last-level cache between the dequantize and the GEMM),
# so a weight kept as int8 codes needs no float32 copy.
DEQUANT_CHUNK = 1 << 21       # float32 elements of the per-device slab


def prepare_dequant_matmul(aw: AffineWeight, x2: np.ndarray, y2: np.ndarray, slab: np.ndarray,
                           nthreads: int | None = None) -> Callable[[], None]:
    """y2 = x2 @ dequantize(aw).T with BLAS, dequantizing `slab.size // K` rows at a time into
    `slab` (bit-identical to gguf's dequantized values). x2 (n, K), y2 (n, rows) float32."""
    rows, k = aw.rows, aw.k
    if x2.shape[-1] != k or y2.shape != (x2.shape[0], rows) or slab.dtype != np.float32:
        raise ValueError(f"dequant matmul: x {x2.shape}, out {y2.shape} do not fit weight {aw.q.shape}")
    step = max(1, min(rows, slab.size // k))
    if aw.group > 1:
        step = max(aw.group, step - step % aw.group)    # whole row groups a slab
    if step * k > slab.size:
        raise ValueError(f"dequant matmul: a row of {k} does not fit the {slab.size}-element slab")
    calls = []
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        w = slab[: (r1 - r0) * k].reshape(r1 - r0, k)
        deq = _Call("metatp_dequant", (aw, slab), rows=r1 - r0, k=k, block=aw.block, **_code_format(aw),
                    q=aw.q[r0:r1].ctypes.data, scale=aw.scale[r0:r1].ctypes.data,
                    offset=None if aw.offset is None else aw.offset[r0:r1].ctypes.data, out=w.ctypes.data,
                    ldo=k, nthreads=1, group=aw.group, half_scales=_half_scales(aw))
        calls.append((deq, w.T, y2[:, r0:r1]))

    def run() -> None:
        for deq, wt, out in calls:
            deq()
            np.matmul(x2, wt, out=out)
    run.keep = (calls, x2, y2)
    return run


def dequantize(aw: AffineWeight, nthreads: int | None = None) -> np.ndarray:
    """The float32 weight (rows, K) from its codes, with the compiled kernel (tests compare it
    with `codes.dequantize_affine`)."""
    rows, k = aw.rows, aw.k
    out = np.empty((rows, k), np.float32)
    if rows:
        _Call("metatp_dequant", (aw, out), rows=rows, k=k, block=aw.block, **_code_format(aw),
              q=aw.q.ctypes.data,
              scale=aw.scale.ctypes.data, offset=None if aw.offset is None else aw.offset.ctypes.data,
              out=out.ctypes.data, ldo=k, nthreads=nthreads or default_threads(), group=aw.group,
              half_scales=_half_scales(aw))()
    return out
