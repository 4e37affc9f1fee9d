"""Weight x activation for many tokens (``cuda/mmq.cu``, llama.cpp's MMQ idea): each weight block is
decoded once per tile of up to 64 tokens into shared memory and used for all of them.

The family owns no op: ``matvec.matmul_path`` decides when a MUL_MAT runs it (between the matvec
kernel's few tokens and the dequantize + cuBLAS path, `MMQ_MIN_TOKENS`..`MMQ_MAX_TOKENS` by
default, the backend's ``mmq_min_tokens`` / ``mmq_max_tokens`` options override them; every count
under ``batch_invariant``: a (row, token) sum is one thread's FMA chain in a fixed order, whatever
the tile or the token count), and the matvec handler launches `mmq`.
"""

from __future__ import annotations

from metatp.backends.cuda.kernels.handler import Scratch
from metatp.backends.cuda.launch import (MATVEC_MAX_TOKENS, WEIGHT_TYPES, cdiv, check_block_type, check_f32, estrides,
                                         i32, launch)

__all__ = ['ENTRY_POINTS', 'MMQ_TILE_ROWS', 'MMQ_TILE_TOKENS', 'MMQ_MIN_TOKENS', 'MMQ_MAX_TOKENS', 'mmq',
           'mmq_tile_tokens', 'HANDLERS', 'FUSIONS', 'workspace']

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

ENTRY_POINTS = [f"mmq_{t}_t{n}" for t in WEIGHT_TYPES for n in MMQ_TILE_TOKENS]


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


def workspace(backend, plan, node, d: int, one_token_too: bool = False) -> Scratch:
    """The tiled kernel needs no scratch (the matvec family asks for the GEMM path's)."""
    return {}


HANDLERS: dict = {}
FUSIONS = ()
