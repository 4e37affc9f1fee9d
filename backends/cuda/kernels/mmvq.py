"""Weight x activation with int8 dot products (``cuda/mmvq.cu``, llama.cpp's mmvq): the cupy backend's
numerics="q8" (alias "llamacpp"), the numpy backend's llama.cpp rounding on the GPU.

Activations are rounded to the Q8 blocks llama.cpp's CPU backend multiplies a weight type with
(`ACTIVATION_KIND`: Q8_0, Q8_1 or Q8_K, as the numpy backend's `_Q8_KIND_OF_TYPE`), then the weight's
integer codes and the activation codes are multiplied 4 at a time (``__dp4a``) and the block scales
(and mins) applied per block. One token: the launch rounds x in its prologue, into shared memory
(after the folded RMS norm, if any). Several tokens: `quantize_q8` writes the Q8 blocks to a
workspace (`q8_workspace`) and the product reads them. More than MATVEC_MAX_TOKENS tokens:
`many_token_steps` rounds x to its Q8 grid (q * d) and runs the f32 tiled `mmq` on it.

Which MUL_MAT runs what is `q8_path` (called by `matvec.backend_matmul_path`, the family's one
decision). f16 and bf16 weights: x rounded to f16 (`round_f16`, after the folded norm), then matvec's
own kernels (or mmq), as the numpy backend's round_f16; f32 weights and MUL_MAT_ID stay exact (as in
the numpy backend).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import numpy as np

from metatp.backends.cuda.kernels.handler import Scratch, record
from metatp.backends.cuda.kernels.mmq import mmq
from metatp.backends.cuda.kernels.norm import folded_norm_args
from metatp.backends.cuda.token_rows import row_stride, token_count, token_rows
from metatp.backends.cuda.launch import (MATVEC_MAX_TOKENS, cdiv, check_block_type, check_f32, i32,
                                         launch, sm_count, tail)
from metatp.ir.tensor import Tensor

if TYPE_CHECKING:
    from metatp.backends.cuda.backend import CupyBackend
    from metatp.backends.cuda.executable import CupyExecutable

__all__ = ['ENTRY_POINTS', 'ACTIVATION_KIND', 'Q8_NUMERICS', 'q8_path', 'q8_workspace', 'quantize_q8', 'round_q8',
           'mmvq', 'mmvq_multi', 'mmvq_glu', 'round_f16', 'half_rounded', 'int8_twin', 'many_token_steps', 'HANDLERS', 'FUSIONS', 'workspace']

#: weight type -> the Q8 kind its activations are rounded to (llama.cpp's vec_dot_type)
ACTIVATION_KIND = {"q8_0": "q8_0", "q4_0": "q8_0", "q5_0": "q8_0", "q4_1": "q8_1", "q5_1": "q8_1", "q2_k": "q8_k",
                   "q3_k": "q8_k", "q4_k": "q8_k", "q5_k": "q8_k", "q6_k": "q8_k"}
#: half-float weights: x rounded to f16 before the float product (the numpy backend's round_f16)
_HALF_TYPES = ("f16", "bf16")
#: elements per activation block of each kind (f16: the numpy backend rounds rows of 32k elements only)
_KIND_BLOCK = {"q8_0": 32, "q8_1": 32, "q8_k": 256, "f16": 32}
#: the backend's numerics values that select this family
Q8_NUMERICS = ("q8", "llamacpp")

_NT = (1, 2, 4, 8)
_GLU_ACTS = ("swiglu", "geglu")
ENTRY_POINTS = ([f"mmvq_{t}_x1" for t in ACTIVATION_KIND]
                + [f"mmvq_{t}_t{n}" for t in ACTIVATION_KIND for n in _NT]
                + [f"mmvq_multi_{t}" for t in ACTIVATION_KIND]
                + [f"mmvq_{a}_{t}" for t in ACTIVATION_KIND for a in _GLU_ACTS]
                + [f"mmvq_{op}_{k}" for k in ("q8_0", "q8_1", "q8_k") for op in ("quantize", "round")]
                + ["mmvq_round_f16"])

#: one-token launches of more rows than this quantize x once into the workspace instead of in
#: every block's prologue (an lm head has thousands of blocks; as matvec's NORM_FOLD_MAX_ROWS)
PROLOGUE_MAX_ROWS = 8192
#: a prologue launch has at most this many blocks per SM; each walks several row blocks, so x is
#: rounded once per resident block rather than once per row block (GPU run: tune against the
#: workspace route, `mmvq(..., prologue=False)`)
PROLOGUE_BLOCKS_PER_SM = 4


def _prologue_grid(n_row_blocks: int) -> tuple[int]:
    """Blocks of a prologue launch: one per row block, at most PROLOGUE_BLOCKS_PER_SM per SM."""
    return (max(1, min(n_row_blocks, PROLOGUE_BLOCKS_PER_SM * sm_count())),)


# ---------------------------------------------------------------- the decision
def q8_path(backend: CupyBackend, node: Tensor, path: str) -> str:
    """The path of a MUL_MAT under the backend's numerics: "mmvq" (int8 dot products) where
    `matvec.matmul_path` said "matvec", "mmq_q8" (x rounded, then the tiled kernel) where it said
    "mmq" or "gemm", for a quantized weight this family reads; else `path` unchanged."""
    if backend.numerics not in Q8_NUMERICS or path == "general":
        return path
    kind = _kind_of(node.src[0].type.name.lower())
    if kind is None or node.src[0].ne[0] % _KIND_BLOCK[kind]:
        return path
    return "mmvq" if path == "matvec" else "mmq_q8"


def _kind_of(wtype: str) -> str | None:
    """The activation rounding of a weight type: a Q8 kind, "f16" (half-float weights), or None."""
    return "f16" if wtype in _HALF_TYPES else ACTIVATION_KIND.get(wtype)


def q8_workspace(ne0: int, n_tokens: int) -> Scratch:
    """The quantized activations of a product: codes (int8) and d, s (float32, per 32 elements)."""
    return {"mmvq_xq": (n_tokens * ne0, np.int8), "mmvq_xds": (2 * n_tokens * (ne0 // 32), np.float32)}


def _round_workspace(ne0: int, n_tokens: int) -> Scratch:
    return {"mmvq_xr": (n_tokens * ne0, np.float32)}


def _rounds_for_mmq(wtype: str) -> bool:
    """Many tokens: is x rounded to its Q8 grid enough for the f32 tiled kernel to give the int8
    result? Yes for Q8_0 and Q8_K (no min term, or one that multiplies d * sum q); not for Q8_1,
    whose min term multiplies s = f16(amax/127 * sum q), not f16(amax/127) * sum q: a 5e-4 relative
    error on a term often larger than the result (2e-3 on the logits of a Q4_1 model), so Q4_1
    keeps the int8 kernel, 8 tokens a launch (and Q5_1, the same kind)."""
    return _kind_of(wtype) != "q8_1"


def workspace_of(path: str, wtype: str, ne0: int, n_tokens: int) -> Scratch:
    """Scratch a MUL_MAT of weight type `wtype` on `path` ("mmvq" or "mmq_q8") needs on a device."""
    if _kind_of(wtype) == "f16" or (path == "mmq_q8" and _rounds_for_mmq(wtype)):
        return _round_workspace(ne0, n_tokens)
    return q8_workspace(ne0, n_tokens)


# ---------------------------------------------------------------- launchers
def _block(units: int) -> tuple[int, int]:
    """(threads per row, rows per block) for rows of `units` 32-element blocks."""
    if units >= 256:
        return 256, 1
    if units >= 128:
        return 128, 2
    if units >= 64:
        return 64, 4
    return 32, 8


def _check(qtype, ne0: int) -> tuple[str, str]:
    """(weight type name, activation kind) for a type this family reads; ne0 whole blocks."""
    t, _, _ = check_block_type(qtype, ne0)
    kind = ACTIVATION_KIND.get(t)
    if kind is None:
        raise ValueError(f"mmvq: no int8 product for weight type {t!r}; types: {sorted(ACTIVATION_KIND)}")
    if ne0 % _KIND_BLOCK[kind]:
        raise ValueError(f"mmvq: ne0={ne0} is not a whole number of {kind} blocks")
    return t, kind


def _q8_launch(op: str, kind: str, x, x_stride: int, ne0: int, n_tokens: int, outs: tuple) -> None:
    nb = ne0 // _KIND_BLOCK[kind]
    launch("mmvq", f"mmvq_{op}_{kind}", (cdiv(nb, 8), n_tokens), (32, 8),
           (x, i32(x_stride), i32(ne0), i32(n_tokens), *outs))


def quantize_q8(x, kind: str, xq, xds, *, ne0: int, n_tokens: int | None = None, x_stride: int | None = None) -> None:
    """Round the rows of x (float32 (n_tokens, ne0)) to `kind` ("q8_0", "q8_1", "q8_k") blocks:
    codes into xq (int8, token t at t*ne0), d into xds[:n*ne0/32] and s into the next n*ne0/32."""
    check_f32(x, xds)
    n_tokens = token_count(x, n_tokens)
    x_stride = row_stride(x, ne0, x_stride)
    nd = n_tokens * (ne0 // 32)
    if xq.dtype != np.int8 or xq.size < n_tokens * ne0 or xds.size < 2 * nd:
        raise ValueError(f"quantize_q8: workspace too small for {n_tokens} tokens of {ne0}")
    if n_tokens:
        _q8_launch("quantize", kind, x, x_stride, ne0, n_tokens, (xq, xds, xds[nd:]))


def round_q8(x, kind: str, out, *, ne0: int, n_tokens: int | None = None, x_stride: int | None = None,
             out_stride: int | None = None) -> None:
    """out = x rounded to its `kind` grid (q * d: the codes and scales of `quantize_q8`), float32."""
    check_f32(x, out)
    n_tokens = token_count(x, n_tokens)
    x_stride = row_stride(x, ne0, x_stride)
    out_stride = row_stride(out, ne0, out_stride)
    if n_tokens:
        _q8_launch("round", kind, x, x_stride, ne0, n_tokens, (out, i32(out_stride)))


def round_f16(x, out, *, ne0: int, n_tokens: int | None = None, x_stride: int | None = None,
              out_stride: int | None = None, norm_weight=None, eps: float | None = None) -> None:
    """out = x rounded to f16 (as float32), after x's RMS norm when eps is given (norm_weight: its
    weight, or None): what llama.cpp's CPU backend multiplies an f16 / bf16 weight with."""
    check_f32(x, out)
    n_tokens = token_count(x, n_tokens)
    x_stride = row_stride(x, ne0, x_stride)
    out_stride = row_stride(out, ne0, out_stride)
    nw, e, flag = folded_norm_args(ne0, norm_weight, eps)
    if n_tokens:
        launch("mmvq", "mmvq_round_f16", (n_tokens,), (256,),
               (x, i32(x_stride), i32(ne0), i32(n_tokens), out, i32(out_stride), nw, e, flag))


def half_rounded(launcher, buf, *args, **kw) -> None:
    """`launcher` (matvec, matvec_multi or matvec_glu, called with its own arguments) on x rounded
    to f16 in `buf` (the folded RMS norm, if any, applied while rounding)."""
    name = launcher.__name__
    x_at = {"matvec": 2, "matvec_multi": 2, "matvec_glu": 3}[name]
    x, ne0 = args[x_at], kw["ne0"]
    norm = {"norm_weight": kw.pop("norm_weight", None), "eps": kw.pop("eps", None)}
    n_tok = (x.shape[0] if x.ndim == 2 else 1) if name == "matvec" else 1
    xh = buf[: n_tok * ne0].reshape(n_tok, ne0)
    round_f16(x if x.ndim == 2 or name != "matvec" else x.reshape(1, ne0), xh, ne0=ne0, n_tokens=n_tok, **norm)
    launcher(*args[:x_at], xh if name == "matvec" and x.ndim == 2 else xh.reshape(-1), *args[x_at + 1:], **kw)


def _smem(ne0: int) -> int:
    """Dynamic shared memory of a prologue launch: codes, then d and s per 32 elements."""
    return ne0 + 8 * (ne0 // 32)


def mmvq(w, qtype, x, y, *, ne0: int, n_rows: int, n_tokens: int | None = None, w_row_bytes: int | None = None,
         x_stride: int | None = None, y_stride: int | None = None, add=None, add_stride: int | None = None,
         xq=None, xds=None, prologue: bool | None = None) -> None:
    """`matvec.matvec` with int8 dot products (same arguments and layouts). One token of at most
    PROLOGUE_MAX_ROWS rows (or `prologue` True): x rounded in the launch's prologue; else x is
    quantized first into the workspace `xq` / `xds` (`q8_workspace`), which must then be given."""
    t, kind = _check(qtype, ne0)
    check_f32(x, y, add)
    n_tokens, x_stride, y_stride, add_stride = token_rows(x, y, ne0=ne0, n_rows=n_rows, n_tokens=n_tokens,
                                                          x_stride=x_stride, y_stride=y_stride, add=add,
                                                          add_stride=add_stride)
    if w_row_bytes is None:
        _, qk, nbytes = check_block_type(qtype, ne0)
        w_row_bytes = ne0 // qk * nbytes
    if n_rows == 0 or n_tokens == 0:
        return
    bx, by = _block(ne0 // 32)
    grid = (cdiv(n_rows, by),)
    if prologue is None:
        prologue = n_tokens == 1 and (n_rows <= PROLOGUE_MAX_ROWS or xq is None)
    if prologue:
        if n_tokens != 1:
            raise ValueError(f"mmvq: the prologue rounds one token, not {n_tokens}")
        launch("mmvq", f"mmvq_{t}_x1", _prologue_grid(grid[0]), (bx, by),
               (w, x, y, i32(ne0), i32(n_rows), i32(w_row_bytes), add),
               shared_mem=_smem(ne0))
        return
    if xq is None or xds is None:
        raise ValueError(f"mmvq: {n_tokens} tokens need the quantized-activation workspace (xq, xds)")
    quantize_q8(x, kind, xq, xds, ne0=ne0, n_tokens=n_tokens, x_stride=x_stride)
    nd = n_tokens * (ne0 // 32)
    for t0 in range(0, n_tokens, MATVEC_MAX_TOKENS):
        nt = min(MATVEC_MAX_TOKENS, n_tokens - t0)
        nt_k = next(n for n in _NT if n >= nt)
        d0 = t0 * (ne0 // 32)
        aa = None if add is None else (add if add_stride == 0 else tail(add, t0, add_stride))
        launch("mmvq", f"mmvq_{t}_t{nt_k}", grid, (bx, by),
               (w, xq[t0 * ne0:], xds[d0:nd], xds[nd + d0:], tail(y, t0, y_stride), i32(ne0), i32(n_rows),
                i32(w_row_bytes), i32(nt), i32(y_stride), aa, i32(add_stride)))


def mmvq_multi(jobs, qtype, x, *, ne0: int, norm_weight=None, eps: float | None = None) -> None:
    """`matvec.matvec_multi` with int8 dot products: one token, up to three weights sharing x (rounded
    once per block, after the folded RMS norm when eps is given)."""
    if not 1 <= len(jobs) <= 3:
        raise ValueError(f"mmvq_multi takes 1 to 3 weights, got {len(jobs)}")
    t, _ = _check(qtype, ne0)
    check_f32(x)
    if x.size < ne0:
        raise ValueError(f"x {x.shape} too small for ne0={ne0}")
    for _, y, n_rows, _ in jobs:
        check_f32(y)
        if y.size < n_rows:
            raise ValueError(f"y {y.shape} too small for {n_rows} rows")
    jobs = list(jobs) + [(None, None, 0, 0)] * (3 - len(jobs))
    bx, by = _block(ne0 // 32)
    n_blocks = sum(cdiv(j[2], by) for j in jobs)
    if n_blocks == 0:
        return
    nw, e, flag = folded_norm_args(ne0, norm_weight, eps)
    launch("mmvq", f"mmvq_multi_{t}", _prologue_grid(n_blocks), (bx, by),
           (*(j[0] for j in jobs), *(j[1] for j in jobs), *(i32(j[2]) for j in jobs),
            *(i32(j[3]) for j in jobs), x, i32(ne0), nw, e, flag), shared_mem=_smem(ne0))


def mmvq_glu(w_gate, w_up, qtype, x, y, *, ne0: int, n_rows: int, w_row_bytes: int | None = None,
             act: str = "swiglu", norm_weight=None, eps: float | None = None) -> None:
    """`matvec.matvec_glu` with int8 dot products: ``y[r] = act(Wg[r] . x') * (Wu[r] . x')``, x'
    rounded once per block after the folded RMS norm (when eps is given)."""
    if act not in _GLU_ACTS:
        raise ValueError(f"act must be one of {_GLU_ACTS}, got {act!r}")
    t, _ = _check(qtype, ne0)
    _, qk, nbytes = check_block_type(qtype, ne0)
    check_f32(x, y)
    if x.size < ne0 or y.size < n_rows:
        raise ValueError(f"x {x.shape} / y {y.shape} too small for ne0={ne0}, n_rows={n_rows}")
    w_row_bytes = ne0 // qk * nbytes if w_row_bytes is None else w_row_bytes
    if n_rows == 0:
        return
    nw, e, flag = folded_norm_args(ne0, norm_weight, eps)
    bx, by = _block(ne0 // 32)
    launch("mmvq", f"mmvq_{act}_{t}", _prologue_grid(cdiv(n_rows, by)), (bx, by),
           (w_gate, w_up, x, y, i32(ne0), i32(n_rows), i32(w_row_bytes), nw, e, flag), shared_mem=_smem(ne0))


# ---------------------------------------------------------------- what matvec's handlers call
def _scratch(ex: CupyExecutable, d: int, need: Scratch) -> list:
    return [ex.scratch_buffer(d, key, n, dtype) for key, (n, dtype) in need.items()]


def int8_twin(ex: CupyExecutable, d: int, launcher, mm: Tensor):
    """The launcher standing in for matvec's `launcher` (matvec, matvec_multi, matvec_glu) on the
    product `mm`, with the same arguments: the int8 one (the plain one bound to its workspace), or
    for an f16 / bf16 weight `launcher` itself on x rounded to f16 (`half_rounded`)."""
    name = launcher.__name__
    loc_w = ex.plan.of(mm.src[0]).local[d]
    if _kind_of(mm.src[0].type.name.lower()) == "f16":
        (buf,) = _scratch(ex, d, _round_workspace(loc_w.ne[0], _tokens(mm)))
        return functools.partial(half_rounded, launcher, buf)
    if name == "matvec_multi":
        return mmvq_multi
    if name == "matvec_glu":
        return mmvq_glu
    if name != "matvec":
        raise ValueError(f"mmvq: no int8 twin of {name!r}")
    xq, xds = _scratch(ex, d, q8_workspace(loc_w.ne[0], _tokens(mm)))
    return functools.partial(mmvq, xq=xq, xds=xds)


def _tokens(mm: Tensor) -> int:
    from metatp.backends.cuda.storage import matmul_tokens
    return matmul_tokens(mm)


def many_token_steps(ex: CupyExecutable, d: int, mm: Tensor, data, wtype: str, row_bytes: int, k: int, m: int,
                     xr, yr) -> list:
    """A MUL_MAT of more than MATVEC_MAX_TOKENS tokens under numerics="q8": x rounded to its Q8 grid
    (the codes and scales the int8 kernels use), then the f32 tiled `mmq` (not cuBLAS's f16
    operands, which would round again); Q4_1 and Q5_1 weights (Q8_1): the int8 kernel 8 tokens a launch
    (`_rounds_for_mmq`). The one place an int8 tensor-core mmq would replace."""
    n_tok = xr.shape[0]
    if _kind_of(wtype) == "f16":
        (buf,) = _scratch(ex, d, _round_workspace(k, n_tok))
        xh = buf[: n_tok * k].reshape(n_tok, k)
        return record(round_f16, xr, xh, ne0=k) + record(mmq, data, wtype, xh, yr, ne0=k, n_rows=m,
                                                         w_row_bytes=row_bytes)
    if not _rounds_for_mmq(wtype):
        xq, xds = _scratch(ex, d, q8_workspace(k, n_tok))
        return record(mmvq, data, wtype, xr, yr, ne0=k, n_rows=m, w_row_bytes=row_bytes, xq=xq, xds=xds)
    (buf,) = _scratch(ex, d, _round_workspace(k, n_tok))
    xq = buf[: n_tok * k].reshape(n_tok, k)
    steps = record(round_q8, xr, ACTIVATION_KIND[wtype], xq, ne0=k)
    steps += record(mmq, data, wtype, xq, yr, ne0=k, n_rows=m, w_row_bytes=row_bytes)
    return steps


def workspace(backend, plan, node, d: int, one_token_too: bool = False) -> Scratch:
    """The family owns no op: matvec's `workspace` asks `workspace_of` for the MUL_MATs it sends here."""
    return {}


HANDLERS: dict = {}
FUSIONS = ()
