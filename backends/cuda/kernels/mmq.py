"""Weight x activation for many tokens (``cuda/mmq.cu``, llama.cpp's MMQ idea): each weight block is
decoded once per tile of up to 64 tokens into shared memory and used for all of them.

The family owns no op: ``matvec.matmul_path`` decides when a MUL_MAT runs it (between the matvec
kernel's few tokens and the dequantize + cuBLAS path, `MMQ_MIN_TOKENS`..`MMQ_MAX_TOKENS` by
default, the backend's ``mmq_min_tokens`` / ``mmq_max_tokens`` options override them; every count
under ``batch_invariant``: a (row, token) sum is one thread's FMA chain in a fixed order, whatever
the tile or the token count), and the matvec handler launches `mmq`.

The int8 path (numerics "q8", llama.cpp's rounding): `q8_quantize` rounds the activations to Q8
blocks as `oracles.ref_q8_quantize` does, bit for bit, and `mmq_q8` multiplies them with the weight's
codes on the tensor cores (``mmq_i8_<type>_t<TT>``, mma.sync m16n8k32 s8, sm_80+). `use_int8_mmq`
says which MUL_MATs take it (the join point with the numerics option's other kernels), and
`int8_mmq_steps` / `int8_mmq_workspace` are what the matvec handler and its workspace call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from metatp.backends.cuda.kernels.handler import Scratch, record
from metatp.backends.cuda.storage import matmul_tokens
from metatp.backends.cuda.token_rows import require_rows, row_stride, token_count, token_rows
from metatp.ir.errors import UnsupportedOpError
from metatp.ir.tensor import Tensor
from metatp.passes.plan import Plan

if TYPE_CHECKING:
    from metatp.backends.cuda.backend import CupyBackend
    from metatp.backends.cuda.executable import CupyExecutable
from metatp.backends.cuda.launch import (MATVEC_MAX_TOKENS, NULL, WEIGHT_TYPES, cdiv, check_block_type, check_f32,
                                         empty, i32, launch)

__all__ = ['ENTRY_POINTS', 'MMQ_TILE_ROWS', 'MMQ_TILE_TOKENS', 'MMQ_MIN_TOKENS', 'MMQ_MAX_TOKENS', 'mmq',
           'mmq_tile_tokens', 'HANDLERS', 'FUSIONS', 'workspace', 'Q8_0', 'Q8_1', 'Q8_K', 'MMQ_Q8_KIND',
           'MMQ_Q8_TILE_TOKENS', 'Q8Acts', 'q8_acts_shapes', 'q8_acts_empty', 'q8_quantize', 'mmq_q8', 'mmq_q8_tile_tokens',
           'mmq_q8_scratch', 'q8_acts_from_scratch', 'use_int8_mmq', 'backend_int8_mmq',
           'int8_mmq_workspace', 'int8_mmq_steps']

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
#: The weight types the int8 tensor-core kernel (mmq_i8_<type>_t<TT>) takes, with their activation kind.
MMQ_Q8_KIND = {"q8_0": Q8_0, "q4_0": Q8_0, "q5_0": Q8_0, "q4_1": Q8_1, "q5_1": Q8_1, "q2_k": Q8_K, "q3_k": Q8_K,
               "q4_k": Q8_K, "q5_k": Q8_K, "q6_k": Q8_K}
#: the token tiles of the int8 entries
MMQ_Q8_TILE_TOKENS = (16, 32, 64, 128)
_Q8_QUANTIZE_ENTRY = {Q8_0: "q8_quantize_0", Q8_1: "q8_quantize_1", Q8_K: "q8_quantize_k"}

ENTRY_POINTS = ([f"mmq_{t}_t{n}" for t in WEIGHT_TYPES for n in MMQ_TILE_TOKENS]
                + [f"mmq_h_{t}_t{n}" for t in WEIGHT_TYPES for n in MMQ_TILE_TOKENS] + list(_Q8_QUANTIZE_ENTRY.values())
                + [f"mmq_i8_{t}_t{n}" for t in MMQ_Q8_KIND for n in MMQ_Q8_TILE_TOKENS])


def mmq_tile_tokens(n_tokens: int) -> int:
    """Tokens per block: the smallest compiled tile holding n_tokens, else the largest."""
    return next((n for n in MMQ_TILE_TOKENS if n >= n_tokens), MMQ_TILE_TOKENS[-1])


def mmq(w, qtype, x, y, *, ne0: int, n_rows: int, n_tokens: int | None = None, w_row_bytes: int | None = None,
        x_stride: int | None = None, y_stride: int | None = None, tensor_cores: bool = False) -> None:
    """``y[t, r] = sum_i W[r, i] * x[t, i]`` for many tokens, one launch.

    ``w``: raw weight bytes, row r at ``r * w_row_bytes`` (default: packed rows of ne0);
    ``x``: float32 (n_tokens, ne0); ``y``: float32 (n_tokens, n_rows). Token strides
    (elements) default to the arrays' leading strides. ``tensor_cores``: the same tiles rounded to
    f16 and multiplied on the tensor cores (``mmq_h_*``, sm_80+; the cuBLAS path's operand rounding,
    f32 sums), else f32 products on the CUDA cores."""
    t, qk, nbytes = check_block_type(qtype, ne0)
    check_f32(x, y)
    n_tokens, x_stride, y_stride, _ = token_rows(x, y, ne0=ne0, n_rows=n_rows, n_tokens=n_tokens,
                                                 x_stride=x_stride, y_stride=y_stride)
    if w_row_bytes is None:
        w_row_bytes = ne0 // qk * nbytes
    if n_rows == 0 or n_tokens == 0:
        return
    tt = mmq_tile_tokens(n_tokens)
    name = f"mmq_h_{t}_t{tt}" if tensor_cores else f"mmq_{t}_t{tt}"
    launch("mmq", name, (cdiv(n_rows, MMQ_TILE_ROWS), cdiv(n_tokens, tt)), (256,),
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
    n_tokens = token_count(x, n_tokens)
    x_stride = row_stride(x, k, x_stride)
    _check_acts(acts, kind, n_tokens, k)
    require_rows(x, "x", k, n_tokens, x_stride)
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
    n_tokens, x_stride, y_stride, _ = token_rows(x, y, ne0=ne0, n_rows=n_rows, n_tokens=n_tokens,
                                                 x_stride=x_stride, y_stride=y_stride)
    if w_row_bytes is None:
        w_row_bytes = ne0 // qk * nbytes
    q8_quantize(x, kind, acts, k=ne0, n_tokens=n_tokens, x_stride=x_stride)
    if n_rows == 0 or n_tokens == 0:
        return
    tt = mmq_q8_tile_tokens(n_tokens)
    launch("mmq", f"mmq_i8_{t}_t{tt}", (cdiv(n_rows, MMQ_TILE_ROWS), cdiv(n_tokens, tt)), (128,),
           (w, acts.q, acts.d, NULL if acts.s is None else acts.s, acts.isum, y, i32(ne0), i32(n_rows),
            i32(w_row_bytes), i32(n_tokens), i32(y_stride)))


# ---------------------------------------------------------------- which products take the int8 mma
def use_int8_mmq(numerics: str, wtype: str, n_tokens: int, ne0: int, batch_invariant: bool = False) -> bool:
    """True when a MUL_MAT runs quantize + int8 mmq: llama.cpp numerics ("q8" / "llamacpp"), more
    than MATVEC_MAX_TOKENS tokens (fewer take the dp4a matvec) or any count under batch invariance
    (one kernel for every count: a (row, token) sum is one lane's chain over the units in order,
    whatever the tile), a type with an integer kernel and a row of whole activation blocks."""
    if numerics not in ("q8", "llamacpp") or wtype not in MMQ_Q8_KIND:
        return False
    if n_tokens <= MATVEC_MAX_TOKENS and not batch_invariant:
        return False
    return ne0 % (256 if MMQ_Q8_KIND[wtype] == Q8_K else 32) == 0


def backend_int8_mmq(backend: CupyBackend, wtype: str, n_tokens: int, ne0: int) -> bool:
    """`use_int8_mmq` with the backend's numerics and batch invariance, on GPUs with int8 tensor cores
    (sm_80+; below, q8's many-token products round x to its grid for the f32 mmq: `mmvq.many_token_steps`)."""
    return (getattr(backend, "int8_tensor_cores", True)
            and use_int8_mmq(getattr(backend, "numerics", "exact"), wtype, n_tokens, ne0, backend.batch_invariant))


def int8_mmq_workspace(backend: CupyBackend, plan: Plan, node: Tensor, d: int) -> Scratch:
    """The Q8 activations' scratch of a MUL_MAT that takes the int8 path on device d (else none)."""
    w = node.src[0]
    wt, k, n_tok = w.type.name.lower(), plan.of(w).local[d].ne[0], matmul_tokens(node)
    if not backend_int8_mmq(backend, wt, n_tok, k):
        return {}
    return mmq_q8_scratch(MMQ_Q8_KIND[wt], n_tok, k)


def int8_mmq_steps(ex: CupyExecutable, d: int, data, wtype: str, row_bytes: int, k: int, m: int, xr, yr) -> list:
    """A MUL_MAT's steps on the int8 path: quantize x into the scratch, then mmq_q8."""
    kind, n_tok = MMQ_Q8_KIND[wtype], xr.shape[0]
    bufs = {key: ex.scratch_buffer(d, key, n, dt) for key, (n, dt) in mmq_q8_scratch(kind, n_tok, k).items()}
    acts = q8_acts_from_scratch(bufs, kind, n_tok, k)
    return record(mmq_q8, data, wtype, xr, yr, acts, ne0=k, n_rows=m, w_row_bytes=row_bytes)


def workspace(backend, plan, node, d: int, one_token_too: bool = False) -> Scratch:
    """The tiled kernel needs no scratch (the matvec family asks for the GEMM path's)."""
    return {}


HANDLERS: dict = {}
FUSIONS = ()
