"""Weight x activation for many tokens (``cuda/mmq.cu``, llama.cpp's MMQ idea): each weight block is
decoded once per tile of up to 64 tokens into shared memory and used for all of them.

The family owns no op: ``matvec.matmul_path`` decides when a MUL_MAT runs it (between the matvec
kernel's few tokens and the dequantize + cuBLAS path, `MMQ_MIN_TOKENS`..`MMQ_MAX_TOKENS` by
default, the backend's ``mmq_min_tokens`` / ``mmq_max_tokens`` options override them; every count
under ``batch_invariant``: a (row, token) sum is one thread's FMA chain in a fixed order, whatever
the tile or the token count), and the matvec handler launches `mmq`.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

from metatp.backends.cuda.kernels.handler import Scratch
from metatp.ir.errors import UnsupportedOpError
from metatp.backends.cuda.launch import (MATVEC_MAX_TOKENS, NULL, WEIGHT_TYPES, cdiv, check_block_type, check_f32,
                                         empty, estrides, i32, launch)

__all__ = ['ENTRY_POINTS', 'MMQ_TILE_ROWS', 'MMQ_TILE_TOKENS', 'MMQ_MIN_TOKENS', 'MMQ_MAX_TOKENS', 'mmq',
           'mmq_tile_tokens', 'HANDLERS', 'FUSIONS', 'workspace', 'Q8_0', 'Q8_1', 'Q8_K', 'MMQ_Q8_KIND',
           'MMQ_Q8_TILE_TOKENS', 'Q8Acts', 'q8_acts_shapes', 'q8_acts_empty', 'q8_quantize', 'mmq_q8', 'mmq_q8_tile_tokens',
           'mmq_q8_scratch', 'q8_acts_from_scratch', 'use_int8_mmq']

#: output rows per block (MT_MMQ_TR in mmq.cu)
MMQ_TILE_ROWS = 64
#: the token tiles compiled (TT of the mmq_<type>_t<TT> entries)
MMQ_TILE_TOKENS = (16, 32, 64)

#: The token counts a MUL_MAT runs the tiled kernel for (by default; backend options override).
#: Below: the matvec kernel (its own limit, MATVEC_MAX_TOKENS, with its fusions). Above: dequantize
#: + cuBLAS when cuBLAS is there (the f32 tile product runs on CUDA cores, cuBLAS's f16 GEMM on
#: tensor cores: an estimate puts the crossover near 16 tokens for 1B-sized weights; measure it with
#: ``python -m scripts.mmq_crossover`` on the GPU and set these). Without
#: cuBLAS every count above MATVEC_MAX_TOKENS takes this kernel.
MMQ_MIN_TOKENS = MATVEC_MAX_TOKENS + 1
MMQ_MAX_TOKENS = 16

#: How llama.cpp rounds the activations a weight type's integer products take (its vec_dot_type;
#: the numpy backend's `_Q8_KIND_OF_TYPE`): Q8_0 / Q8_1 blocks of 32, Q8_K blocks of 256.
Q8_0, Q8_1, Q8_K = 0, 1, 2
#: The weight types the int8 tensor-core kernel (mmq_q8_<type>_t<TT>) takes, with their activation kind.
MMQ_Q8_KIND = {"q8_0": Q8_0, "q4_0": Q8_0, "q4_1": Q8_1, "q4_k": Q8_K, "q5_k": Q8_K, "q6_k": Q8_K}
#: the token tiles of the int8 entries
MMQ_Q8_TILE_TOKENS = (16, 32, 64, 128)
_Q8_QUANTIZE_ENTRY = {Q8_0: "q8_quantize_0", Q8_1: "q8_quantize_1", Q8_K: "q8_quantize_k"}

ENTRY_POINTS = ([f"mmq_{t}_t{n}" for t in WEIGHT_TYPES for n in MMQ_TILE_TOKENS] + list(_Q8_QUANTIZE_ENTRY.values())
                + [f"mmq_q8_{t}_t{n}" for t in MMQ_Q8_KIND for n in MMQ_Q8_TILE_TOKENS])


def mmq_tile_tokens(n_tokens: int) -> int:
    """Tokens per block: the smallest compiled tile holding n_tokens, else the largest."""
    return next((n for n in MMQ_TILE_TOKENS if n >= n_tokens), MMQ_TILE_TOKENS[-1])


def mmq(w, qtype, x, y, *, ne0: int, n_rows: int, n_tokens: int | None = None, w_row_bytes: int | None = None,
        x_stride: int | None = None, y_stride: int | None = None) -> None:
    """``y[t, r] = sum_i W[r, i] * x[t, i]`` for many tokens, one launch.

    ``w``: raw weight bytes, row r at ``r * w_row_bytes`` (default: packed rows of ne0);
    ``x``: float32 (n_tokens, ne0); ``y``: float32 (n_tokens, n_rows). Token strides
    (elements) default to the arrays' leading strides."""
    t, qk, nbytes = check_block_type(qtype, ne0)
    check_f32(x, y)
    if n_tokens is None:
        n_tokens = x.shape[0] if x.ndim == 2 else 1
    if x_stride is None:
        x_stride = estrides(x)[0] if x.ndim == 2 else ne0
    if y_stride is None:
        y_stride = estrides(y)[0] if y.ndim == 2 else n_rows
    if w_row_bytes is None:
        w_row_bytes = ne0 // qk * nbytes
    x_small = (x.shape[1] < ne0 or x.shape[0] < n_tokens) if x.ndim == 2 else x.size < (n_tokens - 1) * x_stride + ne0
    y_small = (y.shape[1] < n_rows or y.shape[0] < n_tokens) if y.ndim == 2 else y.size < (n_tokens - 1) * y_stride + n_rows
    if x_small or y_small:
        raise ValueError(f"x {x.shape} / y {y.shape} too small for ne0={ne0}, n_rows={n_rows}, "
                         f"n_tokens={n_tokens}")
    if n_rows == 0 or n_tokens == 0:
        return
    tt = mmq_tile_tokens(n_tokens)
    launch("mmq", f"mmq_{t}_t{tt}", (cdiv(n_rows, MMQ_TILE_ROWS), cdiv(n_tokens, tt)), (256,),
           (w, x, y, i32(ne0), i32(n_rows), i32(w_row_bytes), i32(n_tokens), i32(x_stride), i32(y_stride)))


# ---------------------------------------------------------------- the int8 path (numerics "q8")
class Q8Acts(NamedTuple):
    """Activation rows rounded to Q8 blocks, as `q8_quantize` writes them (and as
    `oracles.ref_q8_quantize` returns them): codes int8 (n, K); scales float32 (n, K/32), or
    (n, K/256) for Q8_K; Q8_1's s float32 (n, K/32), else None; int32 sums of 16 codes (n, K/16)."""
    q: Any
    d: Any
    s: Any
    isum: Any


def q8_acts_shapes(kind: int, n_tokens: int, k: int) -> dict[str, tuple[tuple[int, int], Any]]:
    """Shape and dtype of each `Q8Acts` field (the absent s left out)."""
    if kind not in _Q8_QUANTIZE_ENTRY:
        raise ValueError(f"q8 activation kind {kind!r}: 0 (Q8_0), 1 (Q8_1) or 2 (Q8_K)")
    qb = 256 if kind == Q8_K else 32
    if k <= 0 or k % qb:
        raise ValueError(f"q8 activations of kind {kind}: K={k} is not a whole number of {qb}-blocks")
    out = {"q": ((n_tokens, k), np.int8), "d": ((n_tokens, k // qb), np.float32),
           "isum": ((n_tokens, k // 16), np.int32)}
    if kind == Q8_1:
        out["s"] = ((n_tokens, k // 32), np.float32)
    return out


def q8_acts_empty(kind: int, n_tokens: int, k: int) -> Q8Acts:
    """Fresh device arrays for `q8_quantize`'s output."""
    arrays = {f: empty(shape, dt) for f, (shape, dt) in q8_acts_shapes(kind, n_tokens, k).items()}
    return Q8Acts(arrays["q"], arrays["d"], arrays.get("s"), arrays["isum"])


def mmq_q8_scratch(kind: int, n_tokens: int, k: int) -> Scratch:
    """The int8 path's workspace (one flat buffer per `Q8Acts` field), sized for n_tokens."""
    return {f"mmq_q8_{f}": (shape[0] * shape[1], dt) for f, (shape, dt) in q8_acts_shapes(kind, n_tokens, k).items()}


def q8_acts_from_scratch(buffers: dict, kind: int, n_tokens: int, k: int) -> Q8Acts:
    """`Q8Acts` views of the flat scratch buffers `mmq_q8_scratch` named (at least as large)."""
    views = {f: buffers[f"mmq_q8_{f}"][: shape[0] * shape[1]].reshape(shape)
             for f, (shape, _) in q8_acts_shapes(kind, n_tokens, k).items()}
    return Q8Acts(views["q"], views["d"], views.get("s"), views["isum"])


def _check_acts(acts: Q8Acts, kind: int, n_tokens: int, k: int) -> None:
    for f, (shape, dt) in q8_acts_shapes(kind, n_tokens, k).items():
        a = getattr(acts, f)
        if a is None or tuple(a.shape) != shape or a.dtype != dt or not a.flags.c_contiguous:
            raise ValueError(f"q8 activations: {f} must be a contiguous {np.dtype(dt).name} array of shape {shape}")


def q8_quantize(x, kind: int, acts: Q8Acts, *, k: int, n_tokens: int | None = None, x_stride: int | None = None) -> None:
    """Round float32 activation rows x (n_tokens, k) to Q8 blocks into `acts` (llama.cpp's
    rounding, bit for bit as `oracles.ref_q8_quantize`)."""
    check_f32(x)
    if n_tokens is None:
        n_tokens = x.shape[0] if x.ndim == 2 else 1
    if x_stride is None:
        x_stride = estrides(x)[0] if x.ndim == 2 else k
    _check_acts(acts, kind, n_tokens, k)
    if (x.shape[1] < k or x.shape[0] < n_tokens) if x.ndim == 2 else x.size < (n_tokens - 1) * x_stride + k:
        raise ValueError(f"x {x.shape} too small for k={k}, n_tokens={n_tokens}")
    if n_tokens == 0:
        return
    blocks = k // (256 if kind == Q8_K else 32)
    launch("mmq", _Q8_QUANTIZE_ENTRY[kind], (cdiv(blocks, 8), n_tokens), (256,),
           (x, acts.q, acts.d, NULL if acts.s is None else acts.s, acts.isum, i32(k), i32(n_tokens), i32(x_stride)))


def mmq_q8_tile_tokens(n_tokens: int) -> int:
    """Tokens per block of the int8 entries: the smallest tile holding n_tokens, else the largest."""
    return next((n for n in MMQ_Q8_TILE_TOKENS if n >= n_tokens), MMQ_Q8_TILE_TOKENS[-1])


def mmq_q8(w, qtype, x, y, acts: Q8Acts, *, ne0: int, n_rows: int, n_tokens: int | None = None,
           w_row_bytes: int | None = None, x_stride: int | None = None, y_stride: int | None = None) -> None:
    """``y[t, r] = W[r] . q8(x[t])``: x rounded to the weight type's Q8 blocks (into `acts`, a
    workspace), then the int8 tensor-core product. Two launches; the products are llama.cpp's
    (integer per 32-element block, f32 scales), not the exact path's f32 ones."""
    t, qk, nbytes = check_block_type(qtype, ne0)
    if t not in MMQ_Q8_KIND:
        raise UnsupportedOpError(f"int8 mmq: weight type {t} has no integer kernel (types: {', '.join(MMQ_Q8_KIND)})")
    kind = MMQ_Q8_KIND[t]
    check_f32(x, y)
    if n_tokens is None:
        n_tokens = x.shape[0] if x.ndim == 2 else 1
    if y_stride is None:
        y_stride = estrides(y)[0] if y.ndim == 2 else n_rows
    if w_row_bytes is None:
        w_row_bytes = ne0 // qk * nbytes
    if (y.shape[1] < n_rows or y.shape[0] < n_tokens) if y.ndim == 2 else y.size < (n_tokens - 1) * y_stride + n_rows:
        raise ValueError(f"y {y.shape} too small for n_rows={n_rows}, n_tokens={n_tokens}")
    q8_quantize(x, kind, acts, k=ne0, n_tokens=n_tokens, x_stride=x_stride)
    if n_rows == 0 or n_tokens == 0:
        return
    tt = mmq_q8_tile_tokens(n_tokens)
    launch("mmq", f"mmq_q8_{t}_t{tt}", (cdiv(n_rows, MMQ_TILE_ROWS), cdiv(n_tokens, tt)), (128,),
           (w, acts.q, acts.d, NULL if acts.s is None else acts.s, acts.isum, y, i32(ne0), i32(n_rows),
            i32(w_row_bytes), i32(n_tokens), i32(y_stride)))


# JOIN POINT (numerics): the dp4a engineer's `numerics` option lands in the backend; the coordinator
# joins this function with theirs. Until then `numerics` is whatever the caller passes ("exact" keeps
# today's paths).
def use_int8_mmq(numerics: str, wtype: str, n_tokens: int, ne0: int) -> bool:
    """True when a MUL_MAT runs quantize + int8 mmq: llama.cpp numerics ("q8" / "llamacpp"), more
    than MATVEC_MAX_TOKENS tokens (fewer take the dp4a matvec), a type with an integer kernel and a
    row of whole activation blocks."""
    if numerics not in ("q8", "llamacpp") or n_tokens <= MATVEC_MAX_TOKENS or wtype not in MMQ_Q8_KIND:
        return False
    return ne0 % (256 if MMQ_Q8_KIND[wtype] == Q8_K else 32) == 0


def workspace(backend, plan, node, d: int, one_token_too: bool = False) -> Scratch:
    """The tiled kernel needs no scratch (the matvec family asks for the GEMM path's)."""
    return {}


HANDLERS: dict = {}
FUSIONS = ()
