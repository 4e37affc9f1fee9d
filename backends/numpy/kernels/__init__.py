"""numpy implementations of every registered op: the reference the GPU kernels are checked against.

Each entry of `KERNELS` takes (node, out, srcs, backend-side helpers) and returns a
zero-argument closure that computes `out` in place. Preparing closures once per plan keeps
per-token Python work to one call per node. Everything stays float32: scalars are
`np.float32` so numpy 2's promotion rules never turn a tensor into float64.
"""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from metatp.backends.numpy.codes import row_major
from metatp.backends.numpy.native import (MAX_ROWS, attention_usable, prepare_add, prepare_attention,
                                         prepare_dequant_matmul, prepare_glu, prepare_q8_matmul, prepare_qmatmul,
                                         prepare_rms_norm, prepare_rope, prepare_set_rows, q8_kind, rope_usable)
from metatp.ir.errors import UnsupportedOpError
from metatp.ir.ops import GluOp, Op, RopeMode, UnaryOp
from metatp.ir.tensor import GGMLType, Tensor

__all__ = ["KERNELS", "Closure", "rope_reference", "attention_reference", "kv_store_rows", "kv_load_rows"]

Closure = Callable[[], None]
F32 = np.float32


def _fits(b: np.ndarray, a_shape: tuple[int, ...]) -> bool:
    return all(x == y or x == 1 for x, y in zip(b.shape, a_shape))


def _repeat_to(b: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """ggml_repeat: tile b so that it has `shape` (b's dims divide shape's)."""
    reps = tuple(s // x for s, x in zip(shape, b.shape))
    return np.tile(b, reps)


def _binary(fn) -> Callable:
    def make(node: Tensor, out: np.ndarray, src: Sequence[np.ndarray], ctx) -> Closure:
        a, b = src[0], src[1]
        if _fits(b, a.shape):
            return lambda: fn(a, b, out=out)
        return lambda: fn(a, _repeat_to(b, a.shape), out=out)
    return make


_numpy_add = _binary(np.add)


def _add(node, out, src, ctx) -> Closure:
    """A residual add of a few-token step as a compiled call (it joins the step's batch), else numpy."""
    if ctx.use_kernels and src[0].shape == src[1].shape == out.shape:
        a2, b2, o2 = _rows(src[0]), _rows(src[1]), _rows(out)
        kernel = None if a2 is None or b2 is None or o2 is None else prepare_add(a2, b2, o2)
        if kernel is not None:
            return kernel
    return _numpy_add(node, out, src, ctx)


def _get_rows(node, out, src, ctx) -> Closure:
    a, ids = src    # a (ne3, ne2, rows, ne0); ids (1, ne3, ne2, n); out (ne3, ne2, n, ne0)
    aw = ctx.packed(node.src[0]) if ctx.encoded_only(node.src[0]) else None
    if aw is not None and ids.shape[:3] == (1, 1, 1):
        # an embedding kept as int8 codes: dequantize just the rows asked for (same bits as gguf)
        i1, o2, n, k = ids[0, 0, 0], out[0, 0], out.shape[2], aw.k
        nb = k // aw.block

        def run_codes() -> None:
            q, scale, offset = row_major(aw, i1)
            rows = aw.codes_of(q).reshape(n, nb, aw.block).astype(F32)
            np.multiply(rows, scale[:, :, None], out=rows)
            if offset is not None:
                np.add(rows, offset[:, :, None], out=rows)
            o2[...] = rows.reshape(n, k)
        return run_codes
    if ctx.encoded_only(node.src[0]):
        raise UnsupportedOpError(f"numpy backend: GET_ROWS {node.name!r} with ids of shape {ids.shape} on an "
                                 "int8-coded table")
    if a.shape[:2] == (1, 1) and ids.shape[:3] == (1, 1, 1):
        a2, i1, o2 = a[0, 0], ids[0, 0, 0], out[0, 0]
        return lambda: np.take(a2, i1, axis=0, out=o2)

    def run() -> None:
        for i3 in range(out.shape[0]):
            for i2 in range(out.shape[1]):
                out[i3, i2] = a[i3, i2][ids[0, i3, i2]]
    return run


def rms_scale(x: np.ndarray, eps: np.float32) -> np.ndarray:
    """1 / sqrt(mean(x^2) + eps) per row, as ggml computes it (sum in double, the rest in float)."""
    n = x.shape[-1]
    mean = (np.einsum("...i,...i->...", x, x, dtype=np.float64) / n).astype(F32)[..., None]
    mean += eps
    np.sqrt(mean, out=mean)
    return np.divide(F32(1), mean, out=mean)


def _rows(a: np.ndarray | None) -> np.ndarray | None:
    """The (T, n) row view of a (1, 1, T, n) array of a few-token step, else None."""
    if a is None or a.ndim != 4 or a.shape[:2] != (1, 1) or a.shape[2] > PACKED_MAX_TOKENS:
        return None
    return a[0, 0]


def _rms_norm(node, out, src, ctx) -> Closure:
    return rms_norm_mul(src[0], None, node.params["eps"], out, ctx.use_kernels)


def rms_norm_mul(x: np.ndarray, w: np.ndarray | None, eps: float, out: np.ndarray, use_kernels: bool = False
                 ) -> Closure:
    """RMS_NORM followed by MUL with a weight (or no weight), in one closure (same rounding as
    the two ops); a compiled call for few-token steps when `use_kernels`."""
    eps32 = F32(eps)
    x2, o2 = _rows(x), _rows(out)
    if use_kernels and x2 is not None and o2 is not None:
        kernel = prepare_rms_norm(x2, None if w is None else w.reshape(-1), o2, eps)
        if kernel is not None:
            return kernel
    if w is None:
        return lambda: np.multiply(x, rms_scale(x, eps32), out=out)

    def run() -> None:
        np.multiply(x, rms_scale(x, eps32), out=out)
        np.multiply(out, w, out=out)
    return run


def _norm(node, out, src, ctx) -> Closure:
    x = src[0]
    eps = F32(node.params["eps"])

    def run() -> None:
        mean = x.mean(axis=-1, keepdims=True)
        np.subtract(x, mean, out=out)
        var = np.mean(out * out, axis=-1, keepdims=True)
        var += eps
        np.divide(out, np.sqrt(var), out=out)
    return run


def _scale(node, out, src, ctx) -> Closure:
    x = src[0]
    s, b = F32(node.params["s"]), F32(node.params["b"])
    if b == 0:
        return lambda: np.multiply(x, s, out=out)

    def run() -> None:
        np.multiply(x, s, out=out)
        np.add(out, b, out=out)
    return run


def q8_quantize_reference(x: np.ndarray, kind: int) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray]:
    """llama.cpp's rounding of activation rows x (n, K) before an integer dot product (the x86
    quantize_row_q8_0 / q8_1 and quantize_row_q8_K_ref), in numpy: the reference the compiled
    Q8 kernels are held to. kind 0 (Q8_0) / 1 (Q8_1): blocks of 32, d = amax/127 kept as f16,
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
    blocks of 32 with an f16 scale, `q8_quantize_reference`), then back to float32: the float
    emulation of numerics="llamacpp" where the integer kernels do not run (long prompts, no
    compiler)."""
    q, d, _, _ = q8_quantize_reference(x.reshape(-1, x.shape[-1]), 0)
    res = (q.reshape(-1, 32).astype(F32) * d.reshape(-1, 1)).reshape(x.shape)
    if out is None:
        return res
    out[...] = res
    return out


# Up to this many tokens (a step of up to 64 sequences' decode tokens) the compiled kernels run:
# their per-row results do not depend on the other rows (batch invariance). Above it the float32
# BLAS product runs (prompt chunks): compute-bound there, BLAS blocks for the cache better than
# the kernel (measured crossover ~20 tokens on a 2-core AVX-512 VM), but its sums are not
# batch-invariant.
PACKED_MAX_TOKENS = MAX_ROWS


def _mul_mat(node, out, src, ctx) -> Closure:
    a, b = src
    w = node.src[0]
    rounding = ctx.activation_rounding(w)
    if rounding is not None and b.shape[-1] % 32 == 0:
        # llama.cpp numerics: the activation is quantized (or made f16) before the dot product;
        # few tokens on int8 codes take the integer kernels, the rest the float emulation
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
    if (aw is not None and b.shape[0] == 1 and b.shape[1] == 1 and b.shape[2] <= PACKED_MAX_TOKENS
            and b.strides[3] == 4 and out.strides[3] == 4):
        # few tokens (decode): read the int8-coded weight, ~3x fewer bytes than float32
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
    """The integer-dot-product closure for a few-token product with a weight kept as codes
    (llama.cpp's Q8_0 / Q8_1 / Q8_K rounding of b), or None where it does not apply."""
    aw = ctx.packed(w) if a.shape[0] == 1 and a.shape[1] == 1 else None
    if (aw is None or q8_kind(aw) is None or b.shape[0] != 1 or b.shape[1] != 1 or b.shape[2] > PACKED_MAX_TOKENS
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


def round_f16(x: np.ndarray, out: np.ndarray) -> np.ndarray:
    out[...] = x.astype(np.float16)
    return out


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


def _add_id(node, out, src, ctx) -> Closure:
    a, b, ids = src      # a (1, T, n_used, n); b (1, 1, E, n); ids (1, 1, T, n_used)
    b2, ids2 = b[0, 0], ids[0, 0]
    return lambda: np.add(a[0], b2[ids2], out=out[0])


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
        if ctx.use_kernels and r2.shape[0] <= PACKED_MAX_TOKENS:
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


def rope_cos_sin(pos: np.ndarray, n_dims: int, freq_base: float, freq_scale: float,
                 freq_factors: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin tables (T, n_dims/2) for positions `pos`."""
    inv = freq_base ** (-np.arange(0, n_dims, 2, dtype=np.float64) / n_dims)
    if freq_factors is not None:
        inv = inv / freq_factors.astype(np.float64).reshape(-1)[: n_dims // 2]
    theta = pos.astype(np.float64)[:, None] * freq_scale * inv[None, :]
    return np.cos(theta).astype(F32), np.sin(theta).astype(F32)


def rope_reference(x: np.ndarray, pos: np.ndarray, n_dims: int, mode: int, freq_base: float,
                   freq_scale: float = 1.0, freq_factors: np.ndarray | None = None) -> np.ndarray:
    """x: (T, H, D) float32 -> roped copy (normal: adjacent pairs; NEOX: halves)."""
    out = np.array(x, dtype=F32, copy=True)
    cos, sin = rope_cos_sin(pos, n_dims, freq_base, freq_scale, freq_factors)
    cos, sin = cos[:, None, :], sin[:, None, :]
    if mode == RopeMode.NEOX:
        x0, x1 = x[..., : n_dims // 2], x[..., n_dims // 2: n_dims]
        out[..., : n_dims // 2] = x0 * cos - x1 * sin
        out[..., n_dims // 2: n_dims] = x0 * sin + x1 * cos
    else:
        x0, x1 = x[..., 0:n_dims:2], x[..., 1:n_dims:2]
        out[..., 0:n_dims:2] = x0 * cos - x1 * sin
        out[..., 1:n_dims:2] = x0 * sin + x1 * cos
    return out


def _rope(node, out, src, ctx) -> Closure:
    x, pos = src[0], src[1]
    ff = src[2] if len(src) > 2 and src[2] is not None else None
    p = node.params
    n_dims, mode = p["n_dims"], p["mode"]
    h = n_dims // 2
    x3, o3, pos1 = x[0], out[0], pos[0, 0, 0]   # (T, H, D)
    if n_dims < x.shape[-1]:
        tail = (x3[..., n_dims:], o3[..., n_dims:])
    else:
        tail = None
    if mode == RopeMode.NEOX:
        xa, xb, oa, ob = x3[..., :h], x3[..., h:n_dims], o3[..., :h], o3[..., h:n_dims]
    else:
        xa, xb, oa, ob = x3[..., 0:n_dims:2], x3[..., 1:n_dims:2], o3[..., 0:n_dims:2], o3[..., 1:n_dims:2]

    key = ("rope", n_dims, p["freq_base"], p["freq_scale"], id(pos), id(ff))

    def tables() -> tuple[np.ndarray, np.ndarray]:
        cos, sin = rope_cos_sin(pos1, n_dims, p["freq_base"], p["freq_scale"], ff)
        return cos[:, None, :], sin[:, None, :]

    if ctx.use_kernels and x3.shape[0] <= PACKED_MAX_TOKENS:
        if rope_usable(x3, o3):
            # one compiled call instead of six numpy ones; the tables live in one buffer per plan
            cs = ctx.persistent(key + ("rope-buf",), lambda: np.empty((2, x3.shape[0], h), F32))

            def fill() -> np.ndarray:
                cs[0], cs[1] = rope_cos_sin(pos1, n_dims, p["freq_base"], p["freq_scale"], ff)
                return cs
            kernel = prepare_rope(x3, o3, n_dims, mode == RopeMode.NEOX, cs)

            def make_fill_once() -> Callable[[], None]:
                def fill_once() -> None:
                    ctx.per_step(key + ("filled",), fill)
                return fill_once
            # one object for every rope of the plan reading these tables: a batch runs it once a step
            fill_once = ctx.persistent(key + ("fill-once",), make_fill_once)

            def run_kernel() -> None:
                fill_once()
                kernel()
            run_kernel.kernel, run_kernel.prepare = kernel, fill_once     # for cpu_kernels.batch
            return run_kernel

    def run() -> None:
        cos, sin = ctx.per_step(key, tables)     # every layer shares one table per step
        a_cos, b_sin = xa * cos, xb * sin
        np.subtract(a_cos, b_sin, out=oa)
        np.multiply(xa, sin, out=ob)
        np.add(ob, xb * cos, out=ob)
        if tail is not None:
            tail[1][...] = tail[0]
    return run


def attention_reference(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None, scale: float,
                        softcap: float = 0.0, sinks: np.ndarray | None = None) -> np.ndarray:
    """q (H, T, D), k/v (Hkv, n_kv, D), mask (T, n_kv) additive -> (T, H, Dv). Consecutive q heads share a kv head."""
    H, T, D = q.shape
    Hkv, n_kv, Dv = v.shape
    g = H // Hkv
    qg = np.ascontiguousarray(q).reshape(Hkv, g * T, D)
    s = np.matmul(qg, k.transpose(0, 2, 1))
    s *= F32(scale)
    if softcap:
        s = F32(softcap) * np.tanh(s / F32(softcap))
    s = s.reshape(Hkv, g, T, n_kv)
    if mask is not None:
        s += mask[:T]
    m = s.max(axis=-1, keepdims=True)
    if sinks is not None:
        sk = sinks.reshape(Hkv, g, 1, 1).astype(F32)
        m = np.maximum(m, sk)
    np.subtract(s, m, out=s)
    np.exp(s, out=s)
    denom = s.sum(axis=-1, keepdims=True)
    if sinks is not None:
        denom += np.exp(sk - m)
    s /= denom
    o = np.matmul(s.reshape(Hkv, g * T, n_kv), v)
    return o.reshape(H, T, Dv).transpose(1, 0, 2)


class _VisibleSetter:
    """Sets the visible cache length of several attention kernels from one computation."""

    def __init__(self, visible: Callable[[], int]) -> None:
        self.visible = visible
        self.kernels: list = []

    def run(self) -> None:
        n = self.visible()
        for kernel in self.kernels:
            kernel.set_n_kv(n)


def _flash_attn(node, out, src, ctx) -> Closure:
    q, k, v = src[0][0], src[1][0], src[2][0]
    mask = src[3][0, 0] if len(src) > 3 and src[3] is not None else None
    sinks = src[4].reshape(-1) if len(src) > 4 and src[4] is not None else None
    scale, softcap = node.params["scale"], node.params.get("softcap", 0.0)
    k_type, v_type = node.src[1].type, node.src[2].type     # the cache types: K/V are read as stored
    o3 = out[0]
    if mask is None:
        def run_unmasked() -> None:
            o3[...] = attention_reference(q, kv_load_rows(k, k_type), kv_load_rows(v, v_type), None, scale, softcap,
                                          sinks)
        return run_unmasked
    src_mask = node.src[3]

    def visible() -> int:
        # cache rows past the last one any query can see contribute exactly 0: skip them
        cols = np.flatnonzero(np.isfinite(mask[: q.shape[1]]).any(axis=0))
        return int(cols[-1]) + 1 if cols.size else 1

    if ctx.use_kernels and q.shape[1] <= PACKED_MAX_TOKENS:
        if (attention_usable(q, k, v, o3, int(k_type), int(v_type)) and mask.dtype == np.float32
                and mask.strides[1] == 4):
            kernel = prepare_attention(q, k, v, mask, scale, softcap, sinks, o3, ctx.kernel_threads, int(k_type),
                                       int(v_type))
            # one setter for every attention of the plan reading this mask (a batch runs it once a
            # step): the visible length computed once, set on each kernel
            setter = ctx.persistent(("visible-setter", id(src_mask), q.shape[1]), lambda: _VisibleSetter(
                lambda: ctx.per_step(("visible", id(src_mask)), visible)))
            setter.kernels.append(kernel)
            set_visible = setter.run

            def run_kernel() -> None:
                set_visible()
                kernel.call()
            run_kernel.kernel, run_kernel.prepare = kernel.call, set_visible     # for cpu_kernels.batch
            return run_kernel

    def run() -> None:
        # long prompts: the visible cache rows as float32 (dequantized), then the reference
        n = ctx.per_step(("visible", id(src_mask)), visible)
        o3[...] = attention_reference(q, kv_load_rows(k[:, :n], k_type), kv_load_rows(v[:, :n], v_type), mask[:, :n],
                                      scale, softcap, sinks)
    return run


def _soft_max(node, out, src, ctx) -> Closure:
    x = src[0]
    mask = src[1] if len(src) > 1 and src[1] is not None else None
    scale = F32(node.params["scale"])

    def run() -> None:
        np.multiply(x, scale, out=out)
        if mask is not None:
            np.add(out, mask, out=out)
        np.subtract(out, out.max(axis=-1, keepdims=True), out=out)
        np.exp(out, out=out)
        np.divide(out, out.sum(axis=-1, keepdims=True), out=out)
    return run


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (F32(1) + np.exp(-x))


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    c = F32(0.7978845608028654)
    return F32(0.5) * x * (F32(1) + np.tanh(c * (x + F32(0.044715) * x * x * x)))


_ACT = {
    GluOp.SWIGLU.value: _silu, GluOp.GEGLU_TANH.value: _gelu_tanh,
    UnaryOp.SILU.value: _silu, UnaryOp.GELU_TANH.value: _gelu_tanh,
    UnaryOp.SIGMOID.value: lambda x: F32(1) / (F32(1) + np.exp(-x)),
    UnaryOp.SOFTPLUS.value: lambda x: np.logaddexp(F32(0), x).astype(F32),
}


def _glu(node, out, src, ctx) -> Closure:
    act = _ACT[node.params["glu"]]
    if len(src) == 2 and src[1] is not None:
        a, b = src
    else:
        x = src[0]
        n = out.shape[-1]
        a, b = (x[..., n:], x[..., :n]) if node.params.get("swapped") else (x[..., :n], x[..., n:])
    kind = {_silu: "silu", _gelu_tanh: "gelu_tanh"}.get(act)
    if ctx.use_kernels and kind and a.ndim == 4 and a.shape[:2] == (1, 1) and a.shape[2] <= PACKED_MAX_TOKENS:
        kernel = prepare_glu(a[0, 0], b[0, 0], out[0, 0], kind)
        if kernel is not None:
            return kernel
    if act is _silu:
        def run_silu() -> None:
            np.negative(a, out=out)
            np.exp(out, out=out)
            np.add(out, F32(1), out=out)
            np.divide(a, out, out=out)
            np.multiply(out, b, out=out)
        return run_silu
    return lambda: np.multiply(act(a), b, out=out)


def _unary(node, out, src, ctx) -> Closure:
    act = _ACT[node.params["unary"]]
    x = src[0]
    return lambda: np.copyto(out, act(x))


def _top_k(node, out, src, ctx) -> Closure:
    x = src[0]
    k = node.params["k"]

    def run() -> None:
        idx = np.argsort(-x, axis=-1, kind="stable")[..., :k]
        out[...] = idx
    return run


def _sum_rows(node, out, src, ctx) -> Closure:
    x = src[0]
    return lambda: np.sum(x, axis=-1, keepdims=True, out=out)


KERNELS: dict[Op, Callable[..., Closure]] = {
    Op.GET_ROWS: _get_rows,
    Op.RMS_NORM: _rms_norm,
    Op.NORM: _norm,
    Op.ADD: _add,
    Op.MUL: _binary(np.multiply),
    Op.DIV: _binary(np.divide),
    Op.ADD_ID: _add_id,
    Op.SCALE: _scale,
    Op.MUL_MAT: _mul_mat,
    Op.MUL_MAT_ID: _mul_mat_id,
    Op.CONT: _copy,
    Op.CPY: _copy,
    Op.SET_ROWS: _set_rows,
    Op.ROPE: _rope,
    Op.FLASH_ATTN_EXT: _flash_attn,
    Op.SOFT_MAX: _soft_max,
    Op.GLU: _glu,
    Op.UNARY: _unary,
    Op.ARGSORT_TOP_K: _top_k,
    Op.SUM_ROWS: _sum_rows,
}


def kernel_for(node: Tensor) -> Callable[..., Closure]:
    try:
        return KERNELS[node.op]
    except KeyError:
        raise UnsupportedOpError(f"numpy backend: no kernel for op {node.op.name} (node {node.name!r})") from None
