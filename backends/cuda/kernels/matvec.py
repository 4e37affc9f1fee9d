"""Weight x activation for a few tokens (``cuda/matvec.cu``): plain, with an add epilogue, q/k/v in one
launch, gate/up + GLU, and MUL_MAT_ID (experts); an RMS norm of x can be folded into the prologue.

The family's decisions: a MUL_MAT runs the matvec kernel, the tiled many-token kernel (the mmq
family), the prefill GEMM path (dequantize + cuBLAS, with scratch for the f16/f32 operands) or a
cupy matmul, as `matmul_path` says (the handler and `workspace` both ask it); MUL_MAT_ID runs `matvec_id`; three fusions of one-token
matvecs (`FUSIONS`: gate/up + GLU, the add epilogue, q/k/v in one launch) with x's RMS norm
folded in where only they read it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import numpy as np

from metatp.backends.cuda.device_ops import HostStep, StreamCall
from metatp.backends.cuda.kernels import mmvq
from metatp.backends.cuda.kernels.dequant import dequantize
from metatp.backends.cuda.kernels.elementwise import copy
from metatp.backends.cuda.kernels.handler import (FusionRow, Scratch, array_of, record, rows_view, unfused_in_order,
                                                  weight_operand)
from metatp.backends.cuda.kernels.mmq import (MMQ_MAX_TOKENS, MMQ_MIN_TOKENS, backend_int8_mmq, int8_mmq_steps,
                                              int8_mmq_workspace, mmq)
from metatp.backends.cuda.kernels.norm import unfused_with_folded_norm
from metatp.backends.cuda.launch import (MATVEC_MAX_TOKENS, WEIGHT_TYPES, CHUNK_ELEMS, KV_TYPES, launch, i32, f32, cdiv,
                                         estrides, check_f32, check_i32, tail, check_block_type, device_ptr,
                                         cache_type_of, rows2d)
from metatp.backends.cuda.storage import RawWeight, matmul_tokens, quant_cache_type
from metatp.backends.fusion import Fusion, FusionKind, matmuls_of_x
from metatp.ir.errors import UnsupportedOpError
from metatp.ir.ops import GluOp, Op, RopeMode
from metatp.ir.tensor import Flag, GGMLType, Tensor
from metatp.passes.plan import Plan

if TYPE_CHECKING:
    from metatp.backends.cuda.backend import CupyBackend
    from metatp.backends.cuda.executable import CupyExecutable

__all__ = ['ENTRY_POINTS', 'MATVEC_MAX_TOKENS', 'NORM_FOLD_MAX_ROWS', 'matvec', 'matvec_multi', 'matvec_glu',
           'matvec_id', 'qkv_rope_kv', 'matmul_path', 'backend_mmq_tokens', 'backend_matmul_path', 'HANDLERS', 'FUSIONS', 'workspace']

_MATVEC_NT = (1, 2, 4, 8)
_GLU_ACTS = ("swiglu", "geglu")
ENTRY_POINTS = ([f"matvec_{t}_t{n}" for t in WEIGHT_TYPES for n in _MATVEC_NT]
                + [f"matvec_multi_{t}" for t in WEIGHT_TYPES]
                + [f"matvec_{a}_{t}" for t in WEIGHT_TYPES for a in _GLU_ACTS]
                + [f"matvec_id_{t}" for t in WEIGHT_TYPES]
                + [f"qkv_rope_kv_{t}_{c}" for t in WEIGHT_TYPES for c in KV_TYPES])


def _matvec_block(units: int) -> tuple[int, int]:
    if units >= 512:
        return 256, 1
    if units >= 128:
        return 128, 2
    if units >= 64:
        return 64, 4
    return 32, 8


def matvec(w, qtype, x, y, *, ne0: int, n_rows: int, n_tokens: int | None = None,
           w_row_bytes: int | None = None, x_stride: int | None = None,
           y_stride: int | None = None, add=None, add_stride: int | None = None) -> None:
    """``y[t, r] = sum_i W[r, i] * x[t, i] (+ add[t, r])`` for a few tokens (decode; any
    count works, launched 8 tokens at a time).

    ``w``: raw weight bytes, row r at ``r * w_row_bytes`` (default: packed rows of ne0).
    ``x``: float32 (n_tokens, ne0) or (ne0,); ``y``: float32 (n_tokens, n_rows) or (n_rows,).
    ``add``: optional float32 residual (same layout as y, stride ``add_stride``; 0 = one
    row broadcast over the tokens, e.g. a bias). Token strides (elements) default to the
    arrays' leading strides.
    """
    t, qk, nbytes = check_block_type(qtype, ne0)
    check_f32(x, y, add)
    if n_tokens is None:
        n_tokens = x.shape[0] if x.ndim == 2 else 1
    if x_stride is None:
        x_stride = estrides(x)[0] if x.ndim == 2 else ne0
    if y_stride is None:
        y_stride = estrides(y)[0] if y.ndim == 2 else n_rows
    if add is not None and add_stride is None:
        add_stride = estrides(add)[0] if add.ndim == 2 and add.shape[0] > 1 else (
            0 if add.size == n_rows else n_rows)
    if add is None:
        add_stride = 0
    if w_row_bytes is None:
        w_row_bytes = ne0 // qk * nbytes
    x_small = x.shape[-1] < ne0 if x.ndim == 2 else x.size < (n_tokens - 1) * x_stride + ne0
    y_small = (y.shape[-1] < n_rows if y.ndim == 2
               else y.size < (n_tokens - 1) * y_stride + n_rows)
    if x_small or y_small:
        raise ValueError(f"x {x.shape} / y {y.shape} too small for ne0={ne0}, "
                         f"n_rows={n_rows}, n_tokens={n_tokens}")
    if n_rows == 0 or n_tokens == 0:
        return
    units = ne0 // qk * (qk // CHUNK_ELEMS[t])
    bx, by = _matvec_block(units)
    grid = (cdiv(n_rows, by),)
    for t0 in range(0, n_tokens, MATVEC_MAX_TOKENS):
        nt = min(MATVEC_MAX_TOKENS, n_tokens - t0)
        nt_k = next(n for n in _MATVEC_NT if n >= nt)
        xa = tail(x, t0, x_stride)
        ya = tail(y, t0, y_stride)
        aa = None if add is None else (add if add_stride == 0 else tail(add, t0, add_stride))
        launch("matvec", f"matvec_{t}_t{nt_k}", grid, (bx, by),
               (w, xa, ya, i32(ne0), i32(n_rows), i32(w_row_bytes), i32(nt),
                i32(x_stride), i32(y_stride), aa, i32(add_stride)))


def _norm_args(x, ne0: int, norm_weight, eps: float | None) -> tuple:
    """(norm_w, eps, flag) kernel arguments: RMS-normalise x first when eps is given."""
    check_f32(norm_weight)
    if norm_weight is not None and norm_weight.size != ne0:
        raise ValueError(f"norm weight has {norm_weight.size} elements for ne0={ne0}")
    if eps is None:
        return None, f32(0.0), i32(0)
    return norm_weight, f32(eps), i32(1)


def matvec_multi(jobs, qtype, x, *, ne0: int, norm_weight=None, eps: float | None = None) -> None:
    """One token, up to three weights sharing x: ``y_j = W_j @ x'`` in one launch (q, k, v).

    jobs: (w, y, n_rows, row_bytes) per weight (raw bytes, f32 output of n_rows). With
    ``eps`` given, x' = rms_norm(x, eps) * norm_weight (norm_weight None: no weight), so
    the RMS_NORM before the projections needs no kernel of its own."""
    if not 1 <= len(jobs) <= 3:
        raise ValueError(f"matvec_multi takes 1 to 3 weights, got {len(jobs)}")
    t, qk, nbytes = check_block_type(qtype, ne0)
    check_f32(x)
    if x.size < ne0:
        raise ValueError(f"x {x.shape} too small for ne0={ne0}")
    for _, y, n_rows, _ in jobs:
        check_f32(y)
        if y.size < n_rows:
            raise ValueError(f"y {y.shape} too small for {n_rows} rows")
    jobs = list(jobs) + [(None, None, 0, 0)] * (3 - len(jobs))
    bx, by = _matvec_block(ne0 // qk * (qk // CHUNK_ELEMS[t]))
    n_blocks = sum(cdiv(j[2], by) for j in jobs)
    if n_blocks == 0:
        return
    nw, e, flag = _norm_args(x, ne0, norm_weight, eps)
    launch("matvec", f"matvec_multi_{t}", (n_blocks,), (bx, by),
           (*(j[0] for j in jobs), *(j[1] for j in jobs), *(i32(j[2]) for j in jobs),
            *(i32(j[3]) for j in jobs), x, i32(ne0), nw, e, flag))


def qkv_rope_kv(weights, qtype, x, q, k_cache, v_cache, kv_row, pos, *, ne0: int, n_head: int, n_head_kv: int,
                head_dim: int, n_dims: int, neox: bool, freq_base: float, freq_scale: float = 1.0,
                freq_factors=None, attn_factor: float = 1.0, v_rows: int | None = None, norm_weight=None,
                eps: float | None = None, q_head_stride: int | None = None, cache_type: str | None = None) -> None:
    """One token: x' (x, RMS-normalised when eps is given, as matvec_multi), q = Wq x' and k = Wk x'
    rotated (RoPE NORMAL or NEOX at position pos[0], the first n_dims of each head), q written to
    ``q`` [n_head, head_dim] and k, v = Wv x' converted into row kv_row[0] of the caches.

    weights: ((wq, row_bytes), (wk, row_bytes), (wv, row_bytes)), raw weights of one type and
    ne0. k_cache / v_cache: [cells, n_head_kv*head_dim] / [cells, v_rows] arrays of one float
    storage type (f32, f16 or bf16 bits; a quantized cache is refused: its blocks need 32
    consecutive values in one warp). pos, kv_row: int32 in device memory (graph replays)."""
    if len(weights) != 3:
        raise ValueError(f"qkv_rope_kv takes the q, k and v weights, got {len(weights)}")
    t, qk, _ = check_block_type(qtype, ne0)
    check_f32(x, q, norm_weight, freq_factors)
    check_i32(kv_row, pos)
    if head_dim % 2 or n_dims % 2 or not 0 < n_dims <= head_dim:
        raise ValueError(f"head_dim ({head_dim}) and n_dims ({n_dims}) must be even, 0 < n_dims <= head_dim")
    if v_rows is None:
        v_rows = n_head_kv * head_dim
    if v_rows % 2:
        raise ValueError(f"v_rows ({v_rows}) must be even")
    kt = cache_type_of(k_cache, cache_type)
    if cache_type_of(v_cache, cache_type) != kt:
        raise TypeError("the k and v caches must have the same storage type")
    if kt not in KV_TYPES:
        raise UnsupportedOpError(f"qkv_rope_kv writes f32/f16/bf16 caches, not {kt} (its set_rows quantizes)")
    if freq_factors is not None and freq_factors.size < n_dims // 2:
        raise ValueError(f"freq_factors has {freq_factors.size} entries for n_dims={n_dims}")
    if x.size < ne0:
        raise ValueError(f"x {x.shape} too small for ne0={ne0}")
    k_ne0, _, k_stride = rows2d(k_cache)
    v_ne0, _, v_stride = rows2d(v_cache)
    if k_ne0 < n_head_kv * head_dim or v_ne0 < v_rows:
        raise ValueError(f"cache rows of {k_ne0} / {v_ne0} elements cannot hold k ({n_head_kv * head_dim}) "
                         f"/ v ({v_rows})")
    if q.ndim and q.shape[-1] > 1 and estrides(q)[-1] != 1:
        raise ValueError("q's head_dim must be its contiguous dimension")
    if q_head_stride is None:
        q_head_stride = estrides(q)[0] if q.ndim == 2 else head_dim
    if q.size < (n_head - 1) * q_head_stride + head_dim:
        raise ValueError(f"q {q.shape} too small for {n_head} heads of {head_dim}")
    nw, e, flag = _norm_args(x, ne0, norm_weight, eps)
    n_pairs = (n_head + n_head_kv) * head_dim // 2 + v_rows // 2
    if n_pairs == 0:
        return
    bx, by = _matvec_block(ne0 // qk * (qk // CHUNK_ELEMS[t]))
    (wq, rbq), (wk, rbk), (wv, rbv) = weights
    launch("matvec", f"qkv_rope_kv_{t}_{kt}", (cdiv(n_pairs, by),), (bx, by),
           (wq, wk, wv, i32(rbq), i32(rbk), i32(rbv), x, i32(ne0), nw, e, flag, q, i32(q_head_stride),
            k_cache, v_cache, kv_row, i32(k_stride), i32(v_stride), i32(n_head), i32(n_head_kv), i32(v_rows),
            i32(head_dim), i32(n_dims), i32(1 if neox else 0), pos, freq_factors, f32(freq_base), f32(freq_scale),
            f32(attn_factor)))


def matvec_glu(w_gate, w_up, qtype, x, y, *, ne0: int, n_rows: int,
               w_row_bytes: int | None = None, act: str = "swiglu", norm_weight=None,
               eps: float | None = None) -> None:
    """One token: ``y[r] = act(Wg[r] . x') * (Wu[r] . x')`` (gate/up projections + GLU fused).

    act: "swiglu" (silu) or "geglu" (gelu-tanh). Both weights share type and row layout.
    x' as in matvec_multi (the FFN's RMS norm folded in when eps is given)."""
    if act not in _GLU_ACTS:
        raise ValueError(f"act must be one of {_GLU_ACTS}, got {act!r}")
    t, qk, nbytes = check_block_type(qtype, ne0)
    check_f32(x, y)
    if x.size < ne0 or y.size < n_rows:
        raise ValueError(f"x {x.shape} / y {y.shape} too small for ne0={ne0}, n_rows={n_rows}")
    if w_row_bytes is None:
        w_row_bytes = ne0 // qk * nbytes
    if n_rows == 0:
        return
    nw, e, flag = _norm_args(x, ne0, norm_weight, eps)
    bx, by = _matvec_block(ne0 // qk * (qk // CHUNK_ELEMS[t]))
    launch("matvec", f"matvec_{act}_{t}", (cdiv(n_rows, by),), (bx, by),
           (w_gate, w_up, x, y, i32(ne0), i32(n_rows), i32(w_row_bytes), nw, e, flag))


def matvec_id(w, qtype, x, y, ids, *, ne0: int, n_rows: int, expert_bytes: int,
              w_row_bytes: int | None = None) -> None:
    """ggml MUL_MAT_ID: ``y[t, u] = W[ids[t, u]] @ x[t, u % n_b]``.

    ``w``: experts' raw bytes, expert e at ``e * expert_bytes``; ``x`` float32
    (n_tokens, n_b, ne0); ``y`` float32 (n_tokens, n_used, n_rows); ``ids`` int32
    (n_tokens, n_used). Strides come from the arrays (rows contiguous)."""
    t, qk, nbytes = check_block_type(qtype, ne0)
    check_f32(x, y)
    check_i32(ids)
    if x.ndim != 3 or y.ndim != 3 or ids.ndim != 2:
        raise ValueError("matvec_id wants x (T, n_b, ne0), y (T, n_used, n_rows), ids (T, n_used)")
    n_tok, n_b, _ = x.shape
    n_used = ids.shape[1]
    if y.shape != (n_tok, n_used, n_rows) or ids.shape[0] != n_tok or x.shape[2] != ne0:
        raise ValueError(f"shapes do not match: x {x.shape}, y {y.shape}, ids {ids.shape}")
    xs, ys, is_ = estrides(x), estrides(y), estrides(ids)
    if (ne0 > 1 and xs[2] != 1) or (n_rows > 1 and ys[2] != 1):
        raise ValueError("rows of x and y must be contiguous")
    if w_row_bytes is None:
        w_row_bytes = ne0 // qk * nbytes
    if n_rows * n_used * n_tok == 0:
        return
    bx, by = _matvec_block(ne0 // qk * (qk // CHUNK_ELEMS[t]))
    launch("matvec", f"matvec_id_{t}", (cdiv(n_rows, by), n_used, n_tok), (bx, by),
           (w, x, y, ids, i32(ne0), i32(n_rows), i32(w_row_bytes), i32(expert_bytes),
            i32(n_b), i32(xs[1]), i32(xs[0]), i32(ys[1]), i32(ys[0]), i32(is_[1]),
            i32(is_[0])))


# ---------------------------------------------------------------- the decision
# Folding an RMS norm into a matvec makes every block recompute the norm of x: worth one
# launch for q/k/v or gate/up, not for a 49k-row lm head (thousands of blocks).
NORM_FOLD_MAX_ROWS = 8192


def _plain_weight(w: Tensor) -> bool:
    """A 2-D weight of its own (not a view, not batched): what the matvec and GEMM paths take."""
    return bool(w.flags & Flag.WEIGHT) and w.view_src is None and w.ne[2] == 1 and w.ne[3] == 1


def matmul_path(node: Tensor, gemm_available: bool,
                mmq_tokens: tuple[int, int] = (MMQ_MIN_TOKENS, MMQ_MAX_TOKENS),
                batch_invariant: bool = False) -> str:
    """How a MUL_MAT runs: "general" (two activations or a batched weight: a cupy matmul);
    for a plain weight by its token count: "mmq" (the tiled kernel) within `mmq_tokens`
    (inclusive; the backend's mmq_min_tokens / mmq_max_tokens options), else "matvec" up to
    MATVEC_MAX_TOKENS, "gemm" (dequantize + cuBLAS) above, or without cuBLAS the tiled
    kernel ("matvec" when the range is empty).

    `batch_invariant`: "mmq" for every token count, 1 included. Its per-(row, token) sum is one
    thread's FMA chain over the row length in a fixed order (steps of MMQ_KS elements, each in
    the weight's chunk order), the same whatever the tile size (16/32/64 tokens) or the token's
    place in it; matvec's sum is a block reduction whose shape is fixed too, but it comes with
    the one-token fusions (an RMS norm folded into the prologue computes the norm in another
    order than the norm kernel a pass of several rows runs), and cuBLAS picks its algorithm by
    shape. So one kernel, no fusion that depends on the token count, no cuBLAS."""
    if not _plain_weight(node.src[0]):
        return "general"
    if batch_invariant:
        return "mmq"
    tokens = matmul_tokens(node)
    lo, hi = mmq_tokens
    if lo <= tokens <= hi:
        return "mmq"
    if tokens <= MATVEC_MAX_TOKENS:
        return "matvec"
    if gemm_available:
        return "gemm"
    return "mmq" if lo <= hi else "matvec"


def backend_mmq_tokens(backend: CupyBackend) -> tuple[int, int]:
    """The token range the backend runs the tiled kernel for (its options, or the defaults)."""
    return backend.mmq_min_tokens, backend.mmq_max_tokens


def backend_matmul_path(backend: CupyBackend, node: Tensor) -> str:
    """`matmul_path` with the backend's cuBLAS, tiled-kernel range and batch invariance; under
    numerics="q8" a quantized weight's "matvec" is "mmvq" (int8 dot products) and its "mmq" / "gemm"
    "mmq_q8" (`mmvq.q8_path`)."""
    path = matmul_path(node, backend.rt.gemm_available(), backend_mmq_tokens(backend), backend.batch_invariant)
    return mmvq.q8_path(backend, node, path)


def _gemm_scratch(k: int, m: int, n_tok: int, matmul_dtype: str) -> Scratch:
    """The GEMM path's operand copies: the weight dequantized, x converted (f16 or f32)."""
    dt = np.float16 if matmul_dtype == "f16" else np.float32
    return {f"gemm_w_{dt.__name__}": (m * k, dt), f"gemm_x_{dt.__name__}": (n_tok * k, dt)}


def workspace(backend: CupyBackend, plan: Plan, node: Tensor, d: int, one_token_too: bool = False) -> Scratch:
    """A MUL_MAT on the GEMM path needs its operand copies on device d (on an int8 path: its
    quantized or rounded x; on the int8 tensor-core mmq, mmq.py, its Q8 activations)."""
    path = backend_matmul_path(backend, node) if node.op is Op.MUL_MAT else None
    if path == "mmq_q8":
        int8 = int8_mmq_workspace(backend, plan, node, d)
        if int8:
            return int8
    if path in ("mmvq", "mmq_q8"):
        return mmvq.workspace_of(path, node.src[0].type.name.lower(), plan.of(node.src[0]).local[d].ne[0],
                                 matmul_tokens(node))
    if path != "gemm":
        return {}
    lw = plan.of(node.src[0]).local[d]
    return _gemm_scratch(lw.ne[0], lw.ne[1], matmul_tokens(node), backend.matmul_dtype)


# ---------------------------------------------------------------- handlers
def _run_mul_mat(ex: CupyExecutable, d: int, node: Tensor) -> list:
    path = backend_matmul_path(ex.backend, node)
    if path == "general":
        return _matmul_general(ex, d, node)
    w, x = node.src
    data, wtype, row_bytes, _ = weight_operand(ex, d, w)
    loc_w = ex.plan.of(w).local[d]
    k, m = loc_w.ne[0], loc_w.ne[1]
    xr, yr = rows_view(ex, array_of(ex, d, x)), rows_view(ex, array_of(ex, d, node))
    if path in ("matvec", "mmvq"):
        return record(_decode_launcher(ex, d, matvec, node), data, wtype, xr, yr, ne0=k, n_rows=m,
                      w_row_bytes=row_bytes)
    if path == "mmq_q8":      # numerics "q8", many tokens: the int8 tensor-core mmq where it takes the type
        if backend_int8_mmq(ex.backend, wtype, xr.shape[0], k):
            return int8_mmq_steps(ex, d, data, wtype, row_bytes, k, m, xr, yr)
        return mmvq.many_token_steps(ex, d, node, data, wtype, row_bytes, k, m, xr, yr)
    if path == "mmq":
        return record(mmq, data, wtype, xr, yr, ne0=k, n_rows=m, w_row_bytes=row_bytes)
    return _gemm_steps(ex, d, data, wtype, row_bytes, k, m, xr, yr)


def _gemm_steps(ex: CupyExecutable, d: int, data, wtype: str, row_bytes: int, k: int, m: int, xr, yr) -> list:
    """Many tokens: dequantize the weight to f16 (or f32), convert x, one cuBLAS GEMM into y (a
    stream call: captured with the launches where the runtime's cuBLAS can be)."""
    n_tok = xr.shape[0]
    wbuf, xbuf = (ex.scratch_buffer(d, key, n, dtype)
                  for key, (n, dtype) in _gemm_scratch(k, m, n_tok, ex.backend.matmul_dtype).items())
    w2 = wbuf[: m * k].reshape(m, k)
    x2 = xbuf[: n_tok * k].reshape(n_tok, k)
    steps = record(dequantize, data, wtype, w2, ne0=k, n_rows=m, src_row_bytes=row_bytes)
    steps += record(copy, xr, x2)
    ldy = yr.strides[0] // 4 if yr.shape[0] > 1 else m
    args = (m, n_tok, k, device_ptr(w2), device_ptr(x2), device_ptr(yr), ldy,
            ex.backend.matmul_dtype, ex.devs[d].stream, ex.devs[d].gpu)
    keep = (wbuf, xbuf, yr)
    steps.append(StreamCall(lambda keep=keep: ex.rt.gemm(*args), "cuBLAS GEMM", ex.rt.gemm_capturable()))
    return steps


def _matmul_general(ex: CupyExecutable, d: int, node: Tensor) -> list:
    """MUL_MAT of two activations (or a batched weight): a cupy matmul, eager only."""
    a, b, out = array_of(ex, d, node.src[0]), array_of(ex, d, node.src[1]), array_of(ex, d, node)
    if isinstance(a, RawWeight) or a.dtype != np.float32 or b.dtype != np.float32:
        raise UnsupportedOpError(f"cupy backend: MUL_MAT {node.name!r} of these operand types")
    r3, r2 = b.shape[0] // a.shape[0], b.shape[1] // a.shape[1]
    rt = ex.rt

    def run() -> None:
        bb = b.reshape(a.shape[0], r3, a.shape[1], r2, b.shape[2], b.shape[3])
        aa = a[:, None, :, None].swapaxes(-1, -2)
        out[...] = rt.matmul(bb, aa).reshape(out.shape)
    return [HostStep(run, "batched matmul")]


def _run_mul_mat_id(ex: CupyExecutable, d: int, node: Tensor) -> list:
    w, x, ids = node.src
    data, wtype, row_bytes, expert_bytes = weight_operand(ex, d, w)
    loc_w = ex.plan.of(w).local[d]
    return record(matvec_id, data, wtype, array_of(ex, d, x)[0], array_of(ex, d, node)[0],
                  array_of(ex, d, ids)[0, 0], ne0=loc_w.ne[0], n_rows=loc_w.ne[1],
                  expert_bytes=expert_bytes, w_row_bytes=row_bytes)


# ---------------------------------------------------------------- fused handlers
def _decode_launcher(ex: CupyExecutable, d: int, launcher, mm: Tensor):
    """`launcher` (matvec, matvec_multi or matvec_glu) for the product mm, or its int8 twin (same
    arguments) where mm's path is "mmvq" (numerics="q8"): the one place the choice is made."""
    if backend_matmul_path(ex.backend, mm) != "mmvq":
        return launcher
    return mmvq.int8_twin(ex, d, launcher, mm)


def _folded_norm_args(ex: CupyExecutable, d: int, norm) -> dict:
    """matvec keyword arguments folding MUL(RMS_NORM(x0), w) into the prologue."""
    if norm is None:
        return {}
    mul, rms = norm
    return {"norm_weight": array_of(ex, d, mul.src[1]).reshape(-1), "eps": rms.params["eps"]}


def _folded_norm_input(ex: CupyExecutable, d: int, x: Tensor, norm):
    return rows_view(ex, array_of(ex, d, norm[1].src[0] if norm is not None else x)).reshape(-1)


def _fused_matvec_add(ex: CupyExecutable, d: int, f: Fusion) -> list:
    node, mm, other = f.at, f.parts["mm"], f.parts["other"]
    data, wtype, row_bytes, _ = weight_operand(ex, d, mm.src[0])
    loc_w = ex.plan.of(mm.src[0]).local[d]
    xr, yr = rows_view(ex, array_of(ex, d, mm.src[1])), rows_view(ex, array_of(ex, d, node))
    oa = rows_view(ex, array_of(ex, d, other))
    broadcast = other.ne != mm.ne
    add_stride = 0 if broadcast else (oa.strides[0] // 4 if oa.shape[0] > 1 else loc_w.ne[1])
    return record(_decode_launcher(ex, d, matvec, mm), data, wtype, xr, yr, ne0=loc_w.ne[0], n_rows=loc_w.ne[1],
                  w_row_bytes=row_bytes, add=oa, add_stride=add_stride)


def _fused_matvec_glu(ex: CupyExecutable, d: int, f: Fusion) -> list:
    node, gate, up, norm = f.at, f.parts["gate"], f.parts["up"], f.parts.get("norm")
    dg, wtype, row_bytes, _ = weight_operand(ex, d, gate.src[0])
    du, _, _, _ = weight_operand(ex, d, up.src[0])
    loc_w = ex.plan.of(gate.src[0]).local[d]
    act = "swiglu" if node.params["glu"] == GluOp.SWIGLU.value else "geglu"
    launcher = _decode_launcher(ex, d, matvec_glu, gate)
    return record(launcher, dg, du, wtype, _folded_norm_input(ex, d, gate.src[1], norm),
                  array_of(ex, d, node).reshape(-1), ne0=loc_w.ne[0], n_rows=loc_w.ne[1],
                  w_row_bytes=row_bytes, act=act, **_folded_norm_args(ex, d, norm))


def _fused_matvec_multi(ex: CupyExecutable, d: int, f: Fusion) -> list:
    members, norm = f.parts["members"], f.parts["norm"]
    jobs, wtype, ne0 = [], None, None
    for mm in members:
        data, wtype, row_bytes, _ = weight_operand(ex, d, mm.src[0])
        loc_w = ex.plan.of(mm.src[0]).local[d]
        ne0 = loc_w.ne[0]
        jobs.append((data, array_of(ex, d, mm).reshape(-1), loc_w.ne[1], row_bytes))
    launcher = _decode_launcher(ex, d, matvec_multi, members[0])
    return record(launcher, jobs, wtype, _folded_norm_input(ex, d, members[0].src[1], norm),
                  ne0=ne0, **_folded_norm_args(ex, d, norm))


def _fused_qkv_rope_kv(ex: CupyExecutable, d: int, f: Fusion) -> list:
    """Norm + q/k/v + RoPE + K/V cache write of one token as one qkv_rope_kv launch."""
    p = f.parts
    mq, mk, mv, rq, sk, sv, norm = p["q"], p["k"], p["v"], p["q_rope"], p["k_store"], p["v_store"], p["norm"]
    weights, wtype = [], None
    for mm in (mq, mk, mv):
        data, wtype, row_bytes, _ = weight_operand(ex, d, mm.src[0])
        weights.append((data, row_bytes))
    q = array_of(ex, d, rq)[0, 0]
    n_head, head_dim = q.shape
    k_rows = ex.plan.of(sk.src[0]).local[d].ne[0]
    ff = rq.src[2] if len(rq.src) > 2 else None
    prm = rq.params
    return record(qkv_rope_kv, weights, wtype, _folded_norm_input(ex, d, mq.src[1], norm), q,
                  array_of(ex, d, sk)[0, 0], array_of(ex, d, sv)[0, 0], array_of(ex, d, sk.src[1]).reshape(-1),
                  array_of(ex, d, rq.src[1]).reshape(-1), ne0=ex.plan.of(mq.src[0]).local[d].ne[0],
                  n_head=n_head, n_head_kv=k_rows // head_dim, head_dim=head_dim, n_dims=prm["n_dims"],
                  neox=prm["mode"] == RopeMode.NEOX, freq_base=prm["freq_base"], freq_scale=prm["freq_scale"],
                  freq_factors=array_of(ex, d, ff).reshape(-1) if ff is not None else None,
                  v_rows=ex.plan.of(sv.src[0]).local[d].ne[0], cache_type=quant_cache_type(sk.type),
                  **_folded_norm_args(ex, d, norm))


# ---------------------------------------------------------------- fusion finders
def _is_matvec(ex: CupyExecutable, mm: Tensor) -> bool:
    """A MUL_MAT the matvec kernels take (a plain weight, a few tokens; never under batch
    invariance, where every MUL_MAT runs the tiled kernel and nothing is fused into it)."""
    return (mm.op is Op.MUL_MAT and not ex.backend.batch_invariant and _plain_weight(mm.src[0])
            and matmul_tokens(mm) <= MATVEC_MAX_TOKENS)


def _norm_of(ex: CupyExecutable, x: Tensor, readers: set[Tensor]) -> tuple[Tensor, Tensor] | None:
    """(MUL node, RMS_NORM node) when x = RMS_NORM(x0) * w (w a weight row) and exactly
    `readers` read x: the norm can be folded into their matvec prologue."""
    if x.op is not Op.MUL or set(ex.facts.readers.get(x, [])) != readers:
        return None
    rms, w = x.src[0], x.src[1]
    if rms.op is not Op.RMS_NORM or not (w.flags & Flag.WEIGHT) or w.ne != (rms.ne[0], 1, 1, 1):
        return None
    if rms.ne[1] * rms.ne[2] * rms.ne[3] != 1 or not ex.facts.sole_reader(rms, x):
        return None
    if any(isinstance(ex.arrays[d][w], RawWeight) for d in ex.devices):
        return None
    if not all(ex.facts.fusable(x, r) for r in readers):
        return None
    return x, rms


def _same_weight_layout(ex: CupyExecutable, weights: Sequence[Tensor]) -> bool:
    for d in ex.devices:
        ops_ = [weight_operand(ex, d, w) for w in weights]
        ne0 = {ex.plan.of(w).local[d].ne[0] for w in weights}
        if len({o[1] for o in ops_}) != 1 or len(ne0) != 1:
            return False
    return True


def _group_rows(ex: CupyExecutable, mms: Sequence[Tensor]) -> int:
    """Output rows of a group of matvecs on the busiest device."""
    return max(sum(ex.plan.of(mm.src[0]).local[d].ne[1] for mm in mms) for d in ex.devices)


def _find_glu(ex: CupyExecutable, node: Tensor, taken) -> list[Fusion]:
    """GLU(MUL_MAT(Wg, x), MUL_MAT(Wu, x)) for one token -> one matvec_glu launch at the
    GLU (with x's RMS norm folded in when only gate and up read it)."""
    if node.op is not Op.GLU or len(node.src) != 2 or node.src[1] is None:
        return []
    gate, up = node.src
    if not (_is_matvec(ex, gate) and _is_matvec(ex, up)) or matmul_tokens(gate) != 1:
        return []
    if gate.src[1] is not up.src[1] or gate is up or gate.src[0].ne != up.src[0].ne:
        return []
    if not (ex.facts.sole_reader(gate, node) and ex.facts.sole_reader(up, node)):
        return []
    if not _same_weight_layout(ex, [gate.src[0], up.src[0]]):
        return []
    x = gate.src[1]
    norm = _norm_of(ex, x, {gate, up}) if _group_rows(ex, [gate]) <= NORM_FOLD_MAX_ROWS else None
    if norm is not None:
        return [Fusion(FusionKind.MATVEC_GLU, node, (gate, up, *norm), keep=(norm[1].src[0],),
                       parts={"gate": gate, "up": up, "norm": norm})]
    return [Fusion(FusionKind.MATVEC_GLU, node, (gate, up), keep=(x,), parts={"gate": gate, "up": up})]


def _find_add(ex: CupyExecutable, node: Tensor, taken) -> list[Fusion]:
    """ADD(mm, other) / ADD(other, mm) with other a residual of mm's shape or a bias row:
    the add rides in the matvec epilogue."""
    if node.op is not Op.ADD:
        return []
    for i in (0, 1):
        mm, other = node.src[i], node.src[1 - i]
        if mm is other or mm in taken or not _is_matvec(ex, mm) or not ex.facts.sole_reader(mm, node):
            continue
        if other.type == GGMLType.F32 and (other.ne == mm.ne or other.ne == (mm.ne[0], 1, 1, 1)):
            if not any(isinstance(ex.arrays[d].get(other), RawWeight) for d in ex.devices):
                return [Fusion(FusionKind.MATVEC_ADD, node, (mm,), keep=(mm.src[1],),
                               parts={"mm": mm, "other": other})]
    return []


def _find_multi(ex: CupyExecutable, node: Tensor, taken) -> list[Fusion]:
    """The one-token MUL_MATs reading the same x (q, k, v) in groups of up to three, run at
    the first one's position (later ones' outputs detached); x's RMS norm folded in when
    only they read it. A lone matvec is fused only to fold a norm in (the lm head)."""
    idx = ex.plan.graph.index
    readers = matmuls_of_x(ex.facts, node, taken, lambda r: _is_matvec(ex, r) and matmul_tokens(r) == 1)
    if not readers:
        return []
    if not _same_weight_layout(ex, [r.src[0] for r in readers]):
        return []
    norm = _norm_of(ex, node, set(readers)) if len(readers) <= 3 else None
    if norm is not None and _group_rows(ex, readers) > NORM_FOLD_MAX_ROWS:
        norm = None
    groups = [readers[i:i + 3] for i in range(0, len(readers), 3)]
    out = []
    for g in groups:
        if len(g) == 1 and norm is None:
            continue
        if any(not ex.facts.uses_after(m, idx[g[0]]) for m in g[1:]):
            continue
        absorbed = tuple(g[1:]) + (tuple(norm) if norm is not None else ())
        keep = (norm[1].src[0],) if norm is not None else ()
        out.append(Fusion(FusionKind.MATVEC_MULTI, g[0], absorbed, keep=keep, detach=tuple(g[1:]),
                          parts={"members": tuple(g), "norm": norm}))
    return out


# ---- norm + q/k/v + RoPE + KV write (QKV_ROPE_KV)
def _through_reshapes(ex: CupyExecutable, t: Tensor) -> tuple[list[Tensor], Tensor] | None:
    """(the RESHAPEs after t, the one node reading the last of them) when every link has that
    one reader and nothing else views t's memory; else None."""
    chain: list[Tensor] = []
    cur = t
    while True:
        rs = ex.facts.readers.get(cur, [])
        if len(rs) != 1:
            return None
        if rs[0].op is not Op.RESHAPE:
            break
        cur = rs[0]
        chain.append(cur)
    viewers = set(ex.facts.readers_with_views.get(t, []))
    return (chain, rs[0]) if viewers <= {*chain, rs[0]} else None


def _qkv_chain(ex: CupyExecutable, mm: Tensor) -> tuple[str, Tensor | None, Tensor | None] | None:
    """What follows one of the three products: ("q", rope, None), ("k", rope, store) or
    ("v", None, store), through contiguous reshapes; None for anything else (a bias, a norm)."""
    found = _through_reshapes(ex, mm)
    if found is None:
        return None
    chain, nxt = found
    if nxt.op is Op.SET_ROWS and nxt.src[0] is (chain[-1] if chain else mm):
        return "v", None, nxt
    if nxt.op is not Op.ROPE or not chain or nxt.src[0] is not chain[-1]:
        return None
    after = _through_reshapes(ex, nxt)
    if after is not None and after[1].op is Op.SET_ROWS and after[1].src[0] is (after[0][-1] if after[0] else nxt):
        return "k", nxt, after[1]
    if any(r.op is Op.SET_ROWS for r in ex.facts.readers_with_views.get(nxt, [])):
        return None
    return "q", nxt, None


def _rope_fusable(rq: Tensor, rk: Tensor) -> bool:
    """Q and K ropes the kernel's epilogue does: one token, same parameters, positions and freq
    factors, NORMAL or NEOX, one head size."""
    prm = rq.params
    return (prm == rk.params and rq.src[1:] == rk.src[1:] and prm["mode"] in (RopeMode.NORMAL, RopeMode.NEOX)
            and rq.ne[0] == rk.ne[0] and rq.ne[2] == 1 and rk.ne[2] == 1 and rq.ne[3] == 1 and rk.ne[3] == 1
            and set(prm) == {"n_dims", "mode", "freq_base", "freq_scale"})


def _stores_fusable(sk: Tensor, sv: Tensor) -> bool:
    """K and V stores the kernel writes: one row, the same row index, float caches of one type."""
    ids = sk.src[1]
    return (ids is sv.src[1] and ids.ne == (1, 1, 1, 1) and sk.type == sv.type
            and quant_cache_type(sk.type) is None and quant_cache_type(sv.type) is None
            and sk.src[0].ne[1] == 1 and sv.src[0].ne[1] == 1)


def _untouched_between(ex: CupyExecutable, t: Tensor, start: int, end: int) -> bool:
    """No node at graph positions start..end-1 reads `t` or a view of its memory."""
    idx = ex.plan.graph.index
    root = t.view_src or t
    return not any(start <= idx[r] < end for r in ex.facts.readers_with_views.get(root, []) if r in idx)


def _find_qkv_rope_kv(ex: CupyExecutable, node: Tensor, taken) -> list[Fusion]:
    """The one-token q, k, v products of one x, q and k roped, k and v stored into the KV cache
    (a llama layer's attention input) -> one qkv_rope_kv launch at the first product, with x's
    RMS norm folded in when only the products read it. Refused (today's kernels run) for biases,
    q/k norms, weights of different types, several tokens, quantized caches, other rope modes."""
    if not ex.backend.fuse_qkv_rope:
        return []
    mms = matmuls_of_x(ex.facts, node, taken, lambda r: _is_matvec(ex, r) and matmul_tokens(r) == 1)
    if len(mms) != 3 or backend_matmul_path(ex.backend, mms[0]) != "matvec":    # numerics "q8": the int8 twins
        return []
    chains = {}
    for mm in mms:
        c = _qkv_chain(ex, mm)
        if c is None or c[0] in chains:
            return []
        chains[c[0]] = (mm, c[1], c[2])
    (mq, rq, _), (mk, rk, sk), (mv, _, sv) = chains["q"], chains["k"], chains["v"]
    if not (_rope_fusable(rq, rk) and _stores_fusable(sk, sv)):
        return []
    if not _same_weight_layout(ex, [mq.src[0], mk.src[0], mv.src[0]]):
        return []
    at = mms[0]
    idx = ex.plan.graph.index
    later = (mq, rq, mk, rk, sk, mv, sv)
    if any(t is not at and (t in taken or not ex.facts.fusable(t, at)) for t in later):
        return []
    leaves = [rq.src[1], sk.src[1], *rq.src[2:]]
    if any(t.op is not Op.NONE and not (idx.get(t, len(idx)) < idx[at]) for t in leaves):
        return []
    if not (_untouched_between(ex, sk, idx[at], idx[sk]) and _untouched_between(ex, sv, idx[at], idx[sv])):
        return []
    norm = _norm_of(ex, node, set(mms)) if _group_rows(ex, mms) <= NORM_FOLD_MAX_ROWS else None
    absorbed = tuple(t for t in later if t is not at) + (tuple(norm) if norm is not None else ())
    # everything the unfused fallback writes at `at` lives from there (stores write the cache)
    early = tuple(t for t in (mq, rq, mk, rk, mv) if t is not at)
    return [Fusion(FusionKind.QKV_ROPE_KV, at, absorbed, keep=(norm[1].src[0],) if norm is not None else (),
                   early=early, parts={"q": mq, "k": mk, "v": mv, "q_rope": rq, "k_rope": rk, "k_store": sk,
                                       "v_store": sv, "norm": norm})]


HANDLERS = {Op.MUL_MAT: _run_mul_mat, Op.MUL_MAT_ID: _run_mul_mat_id}
FUSIONS = (
    FusionRow(FusionKind.MATVEC_GLU, _find_glu, _fused_matvec_glu, unfused_with_folded_norm),
    FusionRow(FusionKind.MATVEC_ADD, _find_add, _fused_matvec_add, unfused_in_order),
    FusionRow(FusionKind.QKV_ROPE_KV, _find_qkv_rope_kv, _fused_qkv_rope_kv, unfused_with_folded_norm),
    FusionRow(FusionKind.MATVEC_MULTI, _find_multi, _fused_matvec_multi, unfused_with_folded_norm),
)
