"""MUL_MAT and MUL_MAT_ID builders: the integer (Q8) kernels, the int8-code matmul, BLAS on
dequantized slabs or on a transposed float32 copy, and the llama.cpp activation rounding
(Q8 blocks, f16) that numerics="llamacpp" applies before a product."""

from __future__ import annotations

import numpy as np

from metatp.backends.numpy.kernels.common import F32, PACKED_MAX_TOKENS, Closure
from metatp.backends.numpy.native import prepare_dequant_matmul, prepare_q8_matmul, prepare_qmatmul, q8_kind
from metatp.ir.tensor import Tensor


def q8_quantize_numpy(x: np.ndarray, kind: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray]:
    """llama.cpp's rounding of activation rows x (n, K) before an integer dot product (the x86
    quantize_row_q8_0 / q8_1 and quantize_row_q8_K_ref), in numpy: what `quantize_q8_blocks`
    rounds with (the compiled `native.q8_quantize` rounds the same, bit for bit). kind 0 (Q8_0) / 1 (Q8_1): blocks of 32, d = amax/127 kept as f16,
    q = rint(x * (127/amax)) (ties to even); Q8_1 adds s = f16(d * sum q) with the unrounded d.
    kind 2 (Q8_K): blocks of 256, max = the first element of largest |x|, iscale = -127/max,
    q = min(127, rint(iscale * x)), d = 1/iscale (float32). Returns (codes int8 (n, K),
    scales float32 (n, K/32 or K/256), s float32 (n, K/32) or None, int32 sums of 16 codes)."""
    x2 = np.ascontiguousarray(x, dtype=F32).reshape(-1, x.shape[-1])
    n, k = x2.shape
    if kind == 2:
        xb = x2.reshape(n, k // 256, 256)
        first = np.abs(xb).argmax(axis=-1)[..., None]                 # argmax: the first of equal |x|
        mx = np.take_along_axis(xb, first, axis=-1)
        zero = mx == 0
        with np.errstate(divide="ignore", invalid="ignore"):
            iscale = np.where(zero, F32(0), F32(-127) / np.where(zero, F32(1), mx)).astype(F32)
            q = np.minimum(np.rint(iscale * xb), F32(127)).astype(np.int8)
            d = np.where(zero, F32(0), F32(1) / np.where(zero, F32(1), iscale)).astype(F32)[..., 0]
        s = None
    else:
        xb = x2.reshape(n, k // 32, 32)
        amax = np.abs(xb).max(axis=-1, keepdims=True)
        dd = (amax / F32(127)).astype(F32)
        with np.errstate(divide="ignore"):
            inv = np.where(amax == 0, F32(0), F32(127) / np.where(amax == 0, F32(1), amax)).astype(F32)
        q = np.rint(xb * inv).astype(np.int8)
        d = dd[..., 0].astype(np.float16).astype(F32)
        s = None
        if kind == 1:
            s = (dd[..., 0] * q.astype(np.int32).sum(-1).astype(F32)).astype(np.float16).astype(F32)
    q = q.reshape(n, k)
    isum = q.reshape(n, k // 16, 16).astype(np.int32).sum(-1).astype(np.int32)
    return q, d, s, isum


def quantize_q8_blocks(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Round activations as ggml's CPU matmul does before a quantized dot product (Q8_0/Q8_1
    blocks of 32 with an f16 scale, `q8_quantize_numpy`), then back to float32: the float
    emulation of numerics="llamacpp" where the integer kernels do not run (long prompts, no
    compiler)."""
    q, d, _, _ = q8_quantize_numpy(x.reshape(-1, x.shape[-1]), 0)
    res = (q.reshape(-1, 32).astype(F32) * d.reshape(-1, 1)).reshape(x.shape)
    if out is None:
        return res
    out[...] = res
    return out


def round_f16(x: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Round activations to f16 and back into `out`: llama.cpp's rounding before a product with an
    f16 / bf16 weight (numerics="llamacpp")."""
    out[...] = x.astype(np.float16)
    return out


def _mul_mat(node, out, src, ctx) -> Closure:
    a, b = src
    w = node.src[0]
    rounding = ctx.activation_rounding(w)
    if rounding is not None and b.shape[-1] % 32 == 0:
        # llama.cpp numerics: the activation is quantized (or made f16) before the dot product;
        # products with int8 codes take the integer kernels at any token count, the rest (f16
        # weights, no compiler) the float emulation
        integer = _q8_mul_mat(w, a, b, out, ctx)
        if integer is not None:
            return integer
        bq = np.empty(b.shape, dtype=F32)
        inner = _mul_mat(node, out, [a, bq], _ExactContext(ctx))

        def run_rounded() -> None:
            rounding(b, bq)
            inner()
        return run_rounded
    aw = ctx.packed(w) if a.shape[0] == 1 and a.shape[1] == 1 else None
    if (aw is not None and b.shape[0] == 1 and b.shape[1] == 1 and (b.shape[2] <= PACKED_MAX_TOKENS or aw.group != 1)
            and b.strides[3] == 4 and out.strides[3] == 4):
        # few tokens (decode): read the int8-coded weight, ~3x fewer bytes than float32; in the
        # row-group layout (512-bit builds) any number: its GEMM matched or beat dequantization +
        # BLAS at every pass length measured (32-512 tokens; docs/performance.md)
        return prepare_qmatmul(aw, b[0, 0], out[0, 0], ctx.kernel_threads)
    if aw is not None and ctx.encoded_only(w):
        # more tokens (prefill) and no float32 copy kept: BLAS on slabs dequantized from the codes
        if b.flags.c_contiguous and out.flags.c_contiguous:
            return prepare_dequant_matmul(aw, b.reshape(-1, b.shape[-1]), out.reshape(-1, out.shape[-1]),
                                          ctx.slab(), ctx.kernel_threads)

        # strided operands: contiguous copies made once, the product prepared once
        b_c = np.empty(b.shape, F32)
        res = np.empty((int(np.prod(b.shape[:-1])), aw.rows), F32)
        product = prepare_dequant_matmul(aw, b_c.reshape(-1, b.shape[-1]), res, ctx.slab(), ctx.kernel_threads)

        def run_copying() -> None:
            np.copyto(b_c, b)
            product()
            out[...] = res.reshape(out.shape)
        return run_copying
    wt = ctx.transposed(w) if ctx.is_weight(w) and a.shape[0] == 1 and a.shape[1] == 1 else None
    if wt is not None:
        # weights are kept (in, out)-contiguous: x @ Wt is ~1.3x faster than W @ x in numpy
        b2 = b.reshape(-1, b.shape[-1]) if b.flags.c_contiguous else None
        o2 = out.reshape(-1, out.shape[-1])
        if b2 is not None:
            return lambda: np.matmul(b2, wt, out=o2)
        return lambda: np.matmul(b.reshape(-1, b.shape[-1]), wt, out=o2)
    # general batched case: a (A3, A2, m, k), b (B3, B2, n, k); a repeats over b's batch dims
    r3, r2 = b.shape[0] // a.shape[0], b.shape[1] // a.shape[1]

    def run() -> None:
        bb = b.reshape(a.shape[0], r3, a.shape[1], r2, b.shape[2], b.shape[3])
        aa = a[:, None, :, None]
        res = np.matmul(bb, aa.swapaxes(-1, -2))
        out[...] = res.reshape(out.shape)
    return run


def _q8_mul_mat(w: Tensor, a: np.ndarray, b: np.ndarray, out: np.ndarray, ctx) -> Closure | None:
    """The integer-dot-product closure for a product with a weight kept as codes (llama.cpp's
    Q8_0 / Q8_1 / Q8_K rounding of b), or None where it does not apply.

    Any number of tokens: the kernel's GEMM (csrc/q8_gemm.c) beats quantize + dequantize + BLAS
    at every count measured (1..512 tokens; 2-core AVX-512 VNNI VM: 0.06x-0.45x its time), and
    each token's result does not depend on the others, so long prompts are batch-invariant too."""
    aw = ctx.packed(w) if a.shape[0] == 1 and a.shape[1] == 1 else None
    if (aw is None or q8_kind(aw) is None or b.shape[0] != 1 or b.shape[1] != 1
            or b.strides[3] != 4 or out.strides[3] != 4):
        return None
    return prepare_q8_matmul(aw, b[0, 0], out[0, 0], ctx.kernel_threads)


class _ExactContext:
    """The same device context with activation rounding turned off (used once it is applied)."""

    def __init__(self, ctx) -> None:
        self._ctx = ctx

    def __getattr__(self, name):
        return getattr(self._ctx, name)

    def activation_rounding(self, w):
        return None


def _mul_mat_id(node, out, src, ctx) -> Closure:
    a, b, ids = src      # a (1, E, m, k); b (1, T, n_b, k); ids (1, 1, T, n_used); out (1, T, n_used, m)
    a3, b3, ids2, o3 = a[0], b[0], ids[0, 0], out[0]
    n_b = b3.shape[1]

    def run() -> None:
        for e in np.unique(ids2):
            t_idx, u_idx = np.nonzero(ids2 == e)
            x = b3[t_idx, u_idx % n_b]
            o3[t_idx, u_idx] = x @ a3[e].T
    return run
