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
from metatp.backends.cuda.kernels.norm import folded_norm_args, unfused_with_folded_norm
from metatp.backends.cuda.launch import (MATVEC_MAX_TOKENS, WEIGHT_TYPES, CHUNK_ELEMS, launch, i32, cdiv,
                                         estrides, check_f32, check_i32, tail, check_block_type, device_ptr)
from metatp.backends.cuda.storage import RawWeight, matmul_tokens
from metatp.backends.cuda.token_rows import token_rows
from metatp.backends.fusion import Fusion, FusionKind, matmuls_of_x
from metatp.ir.errors import UnsupportedOpError
from metatp.ir.ops import GluOp, Op
from metatp.ir.tensor import Flag, GGMLType, Tensor
from metatp.passes.plan import Plan

if TYPE_CHECKING:
    from metatp.backends.cuda.backend import CupyBackend
    from metatp.backends.cuda.executable import CupyExecutable

__all__ = ['ENTRY_POINTS', 'MATVEC_MAX_TOKENS', 'NORM_FOLD_MAX_ROWS', 'matvec', 'matvec_multi', 'matvec_glu',
           'matvec_id', 'matmul_path', 'backend_mmq_tokens', 'backend_matmul_path', 'HANDLERS', 'FUSIONS', 'workspace',
           # what the fused kernels built on matvec's row core (qkv_rope) share with it
           'busiest_output_rows', 'folded_norm_input', 'folded_norm_kwargs', 'is_matvec', 'matvec_block', 'norm_of',
           'same_weight_layout']

_MATVEC_NT = (1, 2, 4, 8)
_GLU_ACTS = ("swiglu", "geglu")
ENTRY_POINTS = ([f"matvec_{t}_t{n}" for t in WEIGHT_TYPES for n in _MATVEC_NT]
                + [f"matvec_multi_{t}" for t in WEIGHT_TYPES]
                + [f"matvec_{a}_{t}" for t in WEIGHT_TYPES for a in _GLU_ACTS]
                + [f"matvec_id_{t}" for t in WEIGHT_TYPES])


def matvec_block(units: int) -> tuple[int, int]:
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
    n_tokens, x_stride, y_stride, add_stride = token_rows(x, y, ne0=ne0, n_rows=n_rows, n_tokens=n_tokens,
                                                          x_stride=x_stride, y_stride=y_stride, add=add,
                                                          add_stride=add_stride)
    if w_row_bytes is None:
        w_row_bytes = ne0 // qk * nbytes
    if n_rows == 0 or n_tokens == 0:
        return
    units = ne0 // qk * (qk // CHUNK_ELEMS[t])
    bx, by = matvec_block(units)
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
    bx, by = matvec_block(ne0 // qk * (qk // CHUNK_ELEMS[t]))
    n_blocks = sum(cdiv(j[2], by) for j in jobs)
    if n_blocks == 0:
        return
    nw, e, flag = folded_norm_args(ne0, norm_weight, eps)
    launch("matvec", f"matvec_multi_{t}", (n_blocks,), (bx, by),
           (*(j[0] for j in jobs), *(j[1] for j in jobs), *(i32(j[2]) for j in jobs),
            *(i32(j[3]) for j in jobs), x, i32(ne0), nw, e, flag))


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
    nw, e, flag = folded_norm_args(ne0, norm_weight, eps)
    bx, by = matvec_block(ne0 // qk * (qk // CHUNK_ELEMS[t]))
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
    bx, by = matvec_block(ne0 // qk * (qk // CHUNK_ELEMS[t]))
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
        return record(mmq, data, wtype, xr, yr, ne0=k, n_rows=m, w_row_bytes=row_bytes,
                      tensor_cores=ex.backend.mmq_tensor_cores)
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


def folded_norm_kwargs(ex: CupyExecutable, d: int, norm) -> dict:
    """matvec keyword arguments folding MUL(RMS_NORM(x0), w) into the prologue."""
    if norm is None:
        return {}
    mul, rms = norm
    return {"norm_weight": array_of(ex, d, mul.src[1]).reshape(-1), "eps": rms.params["eps"]}


def folded_norm_input(ex: CupyExecutable, d: int, x: Tensor, norm):
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
    return record(launcher, dg, du, wtype, folded_norm_input(ex, d, gate.src[1], norm),
                  array_of(ex, d, node).reshape(-1), ne0=loc_w.ne[0], n_rows=loc_w.ne[1],
                  w_row_bytes=row_bytes, act=act, **folded_norm_kwargs(ex, d, norm))


def _fused_matvec_multi(ex: CupyExecutable, d: int, f: Fusion) -> list:
    members, norm = f.parts["members"], f.parts["norm"]
    jobs, wtype, ne0 = [], None, None
    for mm in members:
        data, wtype, row_bytes, _ = weight_operand(ex, d, mm.src[0])
        loc_w = ex.plan.of(mm.src[0]).local[d]
        ne0 = loc_w.ne[0]
        jobs.append((data, array_of(ex, d, mm).reshape(-1), loc_w.ne[1], row_bytes))
    launcher = _decode_launcher(ex, d, matvec_multi, members[0])
    return record(launcher, jobs, wtype, folded_norm_input(ex, d, members[0].src[1], norm),
                  ne0=ne0, **folded_norm_kwargs(ex, d, norm))


# ---------------------------------------------------------------- fusion finders
def is_matvec(ex: CupyExecutable, mm: Tensor) -> bool:
    """A MUL_MAT the matvec kernels take (a plain weight, a few tokens; never under batch
    invariance, where every MUL_MAT runs the tiled kernel and nothing is fused into it)."""
    return (mm.op is Op.MUL_MAT and not ex.backend.batch_invariant and _plain_weight(mm.src[0])
            and matmul_tokens(mm) <= MATVEC_MAX_TOKENS)


def norm_of(ex: CupyExecutable, x: Tensor, readers: set[Tensor]) -> tuple[Tensor, Tensor] | None:
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


def same_weight_layout(ex: CupyExecutable, weights: Sequence[Tensor]) -> bool:
    for d in ex.devices:
        ops_ = [weight_operand(ex, d, w) for w in weights]
        ne0 = {ex.plan.of(w).local[d].ne[0] for w in weights}
        if len({o[1] for o in ops_}) != 1 or len(ne0) != 1:
            return False
    return True


def busiest_output_rows(ex: CupyExecutable, mms: Sequence[Tensor]) -> int:
    """Output rows of a group of matvecs on the busiest device."""
    return max(sum(ex.plan.of(mm.src[0]).local[d].ne[1] for mm in mms) for d in ex.devices)


def _find_glu(ex: CupyExecutable, node: Tensor, taken) -> list[Fusion]:
    """GLU(MUL_MAT(Wg, x), MUL_MAT(Wu, x)) for one token -> one matvec_glu launch at the
    GLU (with x's RMS norm folded in when only gate and up read it)."""
    if node.op is not Op.GLU or len(node.src) != 2 or node.src[1] is None:
        return []
    gate, up = node.src
    if not (is_matvec(ex, gate) and is_matvec(ex, up)) or matmul_tokens(gate) != 1:
        return []
    if gate.src[1] is not up.src[1] or gate is up or gate.src[0].ne != up.src[0].ne:
        return []
    if not (ex.facts.sole_reader(gate, node) and ex.facts.sole_reader(up, node)):
        return []
    if not same_weight_layout(ex, [gate.src[0], up.src[0]]):
        return []
    x = gate.src[1]
    norm = norm_of(ex, x, {gate, up}) if busiest_output_rows(ex, [gate]) <= NORM_FOLD_MAX_ROWS else None
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
        if mm is other or mm in taken or not is_matvec(ex, mm) or not ex.facts.sole_reader(mm, node):
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
    readers = matmuls_of_x(ex.facts, node, taken, lambda r: is_matvec(ex, r) and matmul_tokens(r) == 1)
    if not readers:
        return []
    if not same_weight_layout(ex, [r.src[0] for r in readers]):
        return []
    norm = norm_of(ex, node, set(readers)) if len(readers) <= 3 else None
    if norm is not None and busiest_output_rows(ex, readers) > NORM_FOLD_MAX_ROWS:
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


HANDLERS = {Op.MUL_MAT: _run_mul_mat, Op.MUL_MAT_ID: _run_mul_mat_id}
FUSIONS = (
    FusionRow(FusionKind.MATVEC_GLU, _find_glu, _fused_matvec_glu, unfused_with_folded_norm),
    FusionRow(FusionKind.MATVEC_ADD, _find_add, _fused_matvec_add, unfused_in_order),
    FusionRow(FusionKind.MATVEC_MULTI, _find_multi, _fused_matvec_multi, unfused_with_folded_norm),
)
