"""Elementwise and row-wise op builders: binary ops, GET_ROWS, the norms, SCALE, ADD_ID, SOFT_MAX,
GLU, the unary activations, top-k and SUM_ROWS (compiled calls for ADD, RMS_NORM and GLU)."""

from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from metatp.backends.numpy.codes import row_major
from metatp.backends.numpy.kernels.common import F32, Closure
from metatp.backends.numpy.native import prepare_add, prepare_glu, prepare_rms_norm
from metatp.ir.errors import UnsupportedOpError
from metatp.ir.ops import GluOp, UnaryOp
from metatp.ir.tensor import Tensor


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
    """A residual add as a compiled call (a few-token step's joins its batch), else numpy."""
    if ctx.use_kernels and src[0].shape == src[1].shape == out.shape:
        a2, b2, o2 = _rows(src[0]), _rows(src[1]), _rows(out)
        ok = a2 is not None and b2 is not None and o2 is not None
        kernel = prepare_add(a2, b2, o2, ctx.row_threads(a2.shape[0])) if ok else None
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
    """The (T, n) row view of a (1, 1, T, n) array, else None."""
    if a is None or a.ndim != 4 or a.shape[:2] != (1, 1):
        return None
    return a[0, 0]


def _rms_norm(node, out, src, ctx) -> Closure:
    x = src[0]
    threads = ctx.row_threads(x.shape[-2] if x.ndim >= 2 else 1)
    return rms_norm_mul(x, None, node.params["eps"], out, ctx.use_kernels, threads)


def rms_norm_mul(x: np.ndarray, w: np.ndarray | None, eps: float, out: np.ndarray, use_kernels: bool = False,
                 threads: int = 1) -> Closure:
    """RMS_NORM followed by MUL with a weight (or no weight), in one closure (same rounding as
    the two ops); a compiled call when `use_kernels` (a prompt's rows shared by `threads`, the
    backend's `row_threads`: numpy ran them on one thread while the others waited, ~5% of a
    512-token prompt)."""
    eps32 = F32(eps)
    x2, o2 = _rows(x), _rows(out)
    if use_kernels and x2 is not None and o2 is not None:
        kernel = prepare_rms_norm(x2, None if w is None else w.reshape(-1), o2, eps, threads)
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

def _add_id(node, out, src, ctx) -> Closure:
    a, b, ids = src      # a (1, T, n_used, n); b (1, 1, E, n); ids (1, 1, T, n_used)
    b2, ids2 = b[0, 0], ids[0, 0]
    return lambda: np.add(a[0], b2[ids2], out=out[0])

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
    if ctx.use_kernels and kind and a.ndim == 4 and a.shape[:2] == (1, 1):
        kernel = prepare_glu(a[0, 0], b[0, 0], out[0, 0], kind, ctx.row_threads(a.shape[2]))
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
