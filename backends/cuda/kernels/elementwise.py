"""Element-wise and small row kernels (``cuda/elementwise.cu``): broadcasting binary ops, unary
activations, GLU, softmax, argmax / top-k, GET_ROWS, ADD_ID, strided copies with conversion, the
all-reduce's in-place add and the bf16 wire conversions.

The family's decisions: which kernel each of GET_ROWS, ADD / MUL / DIV, ADD_ID, SCALE, UNARY,
GLU, SOFT_MAX, ARGSORT_TOP_K, CONT and CPY runs (`HANDLERS`). No fusions, no scratch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from metatp.backends.cuda.kernels.handler import array_of, no_workspace, record
from metatp.backends.cuda.launch import (WEIGHT_TYPES, CHUNK_ELEMS, BLOCK_1D, launch, i32, i64, f32, grid1d,
                                         act_type, estrides, rows2d, nd, check_f32, check_i32, check_contig,
                                         row_block, check_block_type)
from metatp.backends.cuda.storage import RawWeight
from metatp.ir.errors import UnsupportedOpError
from metatp.ir.ops import GluOp, Op, UnaryOp
from metatp.ir.tensor import Tensor

if TYPE_CHECKING:
    from metatp.backends.cuda.executable import CupyExecutable

__all__ = ['ENTRY_POINTS', 'binary', 'add', 'sub', 'mul', 'div', 'add_inplace', 'unary', 'scale', 'silu', 'gelu',
           'sigmoid', 'softplus', 'fill', 'swiglu', 'geglu', 'soft_max', 'argmax', 'top_k', 'get_rows', 'add_id',
           'copy', 'f32_to_bf16', 'bf16_to_f32', 'HANDLERS', 'FUSIONS', 'workspace']

_CPY_PAIRS = (("f32", "f32"), ("f32", "f16"), ("f16", "f32"), ("f16", "f16"),
              ("f32", "bf16"), ("bf16", "f32"))
_UNARY_OPS = ("scale", "silu", "gelu", "sigmoid", "softplus")
_TOPK_MAX = 256
ENTRY_POINTS = ([f"binary_{op}_f32" for op in ("add", "sub", "mul", "div")]
                + ["add_inplace_f32", "add_inplace_f32_bf16", "add_inplace_bf16", "fill_f32"]
                + [f"unary_{op}_f32" for op in _UNARY_OPS]
                + ["swiglu_f32", "geglu_f32", "soft_max_f32", "argmax_f32"]
                + [f"get_rows_{t}" for t in WEIGHT_TYPES]
                + ["add_id_f32", "top_k_f32"]
                + [f"cpy_{a}_{b}" for a, b in _CPY_PAIRS]
                + ["f32_to_bf16", "bf16_to_f32"])


def binary(op: str, a, b, out) -> None:
    """``out = a (op) b`` with ggml broadcasting of b (op: add, sub, mul, div), f32, <= 4-D.

    ``b`` is aligned to ``a`` from the innermost dim; each of its dims must be 1 or divide
    a's. Arbitrary strides for a, b and out (out may alias a).
    """
    if op not in ("add", "sub", "mul", "div"):
        raise ValueError(f"unknown binary op {op!r}")
    check_f32(a, b, out)
    if tuple(out.shape) != tuple(a.shape):
        raise ValueError(f"out shape {out.shape} != a shape {a.shape}")
    ne, as_ = nd(a)
    bne, bs = nd(b)
    _, ys = nd(out)
    for i in range(4):
        if bne[i] == 0 or ne[i] % bne[i]:
            raise ValueError(f"cannot broadcast b {b.shape} onto a {a.shape}")
    total = ne[0] * ne[1] * ne[2] * ne[3]
    if total == 0:
        return
    launch("elementwise", f"binary_{op}_f32", grid1d(total), (BLOCK_1D,),
           (a, b, out, *map(i32, ne), *map(i32, as_), *map(i32, bne), *map(i32, bs),
            *map(i32, ys)))


def add(a, b, out) -> None:
    binary("add", a, b, out)


def sub(a, b, out) -> None:
    binary("sub", a, b, out)


def mul(a, b, out) -> None:
    binary("mul", a, b, out)


def div(a, b, out) -> None:
    binary("div", a, b, out)


def add_inplace(y, x) -> None:
    """``y += x`` (contiguous, same size). y f32 with x f32 or bf16 (uint16); or both bf16."""
    check_contig(x, y)
    if x.size != y.size:
        raise ValueError("size mismatch")
    ty, tx = act_type(y), act_type(x)
    name = {("f32", "f32"): "add_inplace_f32", ("f32", "bf16"): "add_inplace_f32_bf16",
            ("bf16", "bf16"): "add_inplace_bf16"}.get((ty, tx))
    if name is None:
        raise TypeError(f"add_inplace: unsupported types y={ty} x={tx}")
    if y.size:
        launch("elementwise", name, grid1d(y.size), (BLOCK_1D,), (y, x, i64(y.size)))


def unary(op: str, x, out, p0: float = 0.0, p1: float = 0.0) -> None:
    """``out = f(x)`` element-wise over strided <= 4-D f32 views (out may be x).

    op: scale (x*p0 + p1), silu, gelu (tanh approximation), sigmoid, softplus."""
    if op not in _UNARY_OPS:
        raise ValueError(f"unknown unary op {op!r}; have {_UNARY_OPS}")
    check_f32(x, out)
    if tuple(x.shape) != tuple(out.shape):
        raise ValueError(f"shape mismatch {x.shape} vs {out.shape}")
    ne, xs = nd(x)
    _, ys = nd(out)
    total = ne[0] * ne[1] * ne[2] * ne[3]
    if total:
        launch("elementwise", f"unary_{op}_f32", grid1d(total), (BLOCK_1D,),
               (x, out, *map(i32, ne), *map(i32, xs), *map(i32, ys), f32(p0), f32(p1)))


def scale(x, out, s: float, b: float = 0.0) -> None:
    """``out = x * s + b`` (out may be x)."""
    unary("scale", x, out, s, b)


def silu(x, out) -> None:
    unary("silu", x, out)


def gelu(x, out) -> None:
    unary("gelu", x, out)


def sigmoid(x, out) -> None:
    unary("sigmoid", x, out)


def softplus(x, out) -> None:
    unary("softplus", x, out)


def fill(y, value: float = 0.0) -> None:
    """Fill a contiguous f32 array (fill_f32 counts in int32: at most 2^31 - 1 elements)."""
    check_f32(y)
    check_contig(y)
    if y.size >= 2**31:
        raise ValueError(f"fill: an array of shape {tuple(y.shape)} has {y.size} elements; fill_f32 takes fewer than 2^31")
    if y.size:
        launch("elementwise", "fill_f32", grid1d(y.size), (BLOCK_1D,),
               (y, i32(y.size), f32(value)))


def _glu(name: str, gate, up, out) -> None:
    check_f32(gate, up, out)
    ne0, n_rows, gs = rows2d(gate)
    une0, un_rows, us = rows2d(up)
    one0, on_rows, ys = rows2d(out)
    if (une0, un_rows) != (ne0, n_rows) or (one0, on_rows) != (ne0, n_rows):
        raise ValueError("gate, up and out must have the same shape")
    if ne0 * n_rows:
        launch("elementwise", name, grid1d(ne0 * n_rows), (BLOCK_1D,),
               (gate, up, out, i32(ne0), i32(n_rows), i32(gs), i32(us), i32(ys)))


def swiglu(gate, up, out) -> None:
    """``out = silu(gate) * up`` per row.

    Views of one fused tensor work: ``swiglu(x[:, :n], x[:, n:], out)``.
    """
    _glu("swiglu_f32", gate, up, out)


def geglu(gate, up, out) -> None:
    """``out = gelu_tanh(gate) * up`` per row."""
    _glu("geglu_f32", gate, up, out)


def soft_max(x, out, *, mask=None, scale: float = 1.0) -> None:
    """Row softmax of ``x * scale + mask[r % mask_rows]``; x/out (rows, ne0), mask (mask_rows, ne0)."""
    check_f32(x, out, mask)
    ne0, n_rows, xs = rows2d(x)
    _, _, ys = rows2d(out)
    if mask is not None:
        mne0, mrows, ms = rows2d(mask)
        if mne0 != ne0:
            raise ValueError("mask row length differs from x")
    else:
        mrows, ms = 1, 0
    if n_rows:
        launch("elementwise", "soft_max_f32", (n_rows,), (row_block(ne0),),
               (x, mask, out, i32(ne0), i32(n_rows), i32(xs), i32(ms), i32(ys),
                i32(mrows), f32(scale)))


def argmax(x, out) -> None:
    """``out[r] = argmax(x[r])`` (first index on ties); x f32 (rows, ne0), out int32 (rows,)."""
    check_f32(x)
    check_i32(out)
    ne0, n_rows, xs = rows2d(x)
    if n_rows:
        launch("elementwise", "argmax_f32", (n_rows,), (row_block(ne0),),
               (x, out, i32(ne0), i32(n_rows), i32(xs)))


def top_k(x, out, k: int) -> None:
    """``out[r] = argsort(-x[r], stable)[:k]`` (int32); x f32 (rows, ne0), out (rows, k)."""
    check_f32(x)
    check_i32(out)
    ne0, n_rows, xs = rows2d(x)
    kk, o_rows, ys = rows2d(out)
    if not 0 < k <= min(ne0, _TOPK_MAX) or kk != k or o_rows != n_rows:
        raise ValueError(f"top_k: k={k} with x {x.shape}, out {out.shape} (k <= {_TOPK_MAX})")
    if n_rows:
        launch("elementwise", "top_k_f32", (n_rows,), (row_block(ne0, 256),),
               (x, out, i32(ne0), i32(n_rows), i32(k), i32(xs), i32(ys)))


def get_rows(src, qtype, idx, out, *, ne0: int, src_row_bytes: int | None = None,
             src_batch_bytes: tuple[int, int] = (0, 0)) -> None:
    """ggml GET_ROWS: ``out[i3, i2, i1] = dequant(src row idx[i3, i2, i1] of batch (i2, i3))``.

    ``src``: raw rows of a weight (any dtype, only the pointer is used) or an f32 array;
    ``src_row_bytes`` / ``src_batch_bytes`` (bytes per i2, i3 step) describe its layout.
    ``idx``: int32 (n,) or numpy order (ne3, ne2, n); ``out``: f32 (n, ne0) or (ne3, ne2, n, ne0).
    """
    t, qk, nbytes = check_block_type(qtype, ne0)
    check_f32(out)
    check_i32(idx)
    if src_row_bytes is None:
        src_row_bytes = ne0 // qk * nbytes
    ine, is_ = nd(idx)
    one, os_ = nd(out)
    if one[0] != ne0 or one[1:] != ine[:3] or ine[3] != 1 or (ne0 > 1 and os_[0] != 1):
        raise ValueError(f"get_rows: idx {idx.shape} and out {out.shape} do not fit ne0={ne0}")
    n_idx, ne2, ne3 = ine[0], ine[1], ine[2]
    # 64-bit batch strides: a whole 2-D weight can exceed 2 GiB (a 128k x 8192 f16 embedding);
    # a stride over a dimension of size 1 is never used and goes as 0.
    sb2 = int(src_batch_bytes[0]) if ne2 > 1 else 0
    sb3 = int(src_batch_bytes[1]) if ne3 > 1 else 0
    units = ne0 // qk * (qk // CHUNK_ELEMS[t]) * n_idx * ne2 * ne3
    if units:
        launch("elementwise", f"get_rows_{t}", grid1d(units), (BLOCK_1D,),
               (src, idx, out, i32(ne0), i32(n_idx), i32(ne2), i32(ne3),
                i32(src_row_bytes), i64(sb2), i64(sb3),
                i32(is_[0]), i32(is_[1]), i32(is_[2]), i32(os_[1]), i32(os_[2]),
                i32(os_[3])))


def add_id(a, b, ids, out) -> None:
    """ggml ADD_ID: ``out[t, u] = a[t, u] + b[ids[t, u]]``; a/out f32 (T, n_used, ne0),
    b f32 (n_expert, ne0), ids int32 (T, n_used)."""
    check_f32(a, b, out)
    check_i32(ids)
    if a.ndim != 3 or b.ndim != 2 or ids.ndim != 2 or tuple(out.shape) != tuple(a.shape):
        raise ValueError(f"add_id: a {a.shape}, b {b.shape}, ids {ids.shape}, out {out.shape}")
    n_tok, n_used, ne0 = a.shape
    as_, bs, is_, ys = estrides(a), estrides(b), estrides(ids), estrides(out)
    if ne0 > 1 and (as_[2] != 1 or bs[1] != 1 or ys[2] != 1):
        raise ValueError("add_id: rows must be contiguous")
    if a.size:
        launch("elementwise", "add_id_f32", grid1d(a.size), (BLOCK_1D,),
               (a, b, ids, out, i32(ne0), i32(n_used), i32(n_tok), i32(as_[1]),
                i32(as_[0]), i32(bs[0]), i32(is_[1]), i32(is_[0]), i32(ys[1]),
                i32(ys[0])))


def copy(src, dst) -> None:
    """Strided <= 4-D copy ``dst[...] = src[...]`` with conversion between f32/f16/bf16(uint16)."""
    if tuple(src.shape) != tuple(dst.shape):
        raise ValueError(f"shape mismatch {src.shape} vs {dst.shape}")
    ts, td = act_type(src), act_type(dst)
    if (ts, td) not in _CPY_PAIRS:
        raise TypeError(f"copy {ts} -> {td} is not supported")
    ne, ss = nd(src)
    _, ds = nd(dst)
    total = ne[0] * ne[1] * ne[2] * ne[3]
    if total:
        launch("elementwise", f"cpy_{ts}_{td}", grid1d(total), (BLOCK_1D,),
               (src, dst, *map(i32, ne), *map(i32, ss), *map(i32, ds)))


def f32_to_bf16(x, out) -> None:
    """Contiguous f32 -> bf16 bits (uint16), round to nearest even (ggml)."""
    check_f32(x)
    check_contig(x, out)
    if act_type(out) != "bf16":
        raise TypeError("out must be uint16 (bf16 bits)")
    if x.size:
        launch("elementwise", "f32_to_bf16", grid1d(x.size), (BLOCK_1D,),
               (x, out, i64(x.size)))


def bf16_to_f32(x, out) -> None:
    """Contiguous bf16 bits (uint16) -> f32."""
    check_f32(out)
    check_contig(x, out)
    if act_type(x) != "bf16":
        raise TypeError("x must be uint16 (bf16 bits)")
    if x.size:
        launch("elementwise", "bf16_to_f32", grid1d(x.size), (BLOCK_1D,),
               (x, out, i64(x.size)))


# ---------------------------------------------------------------- handlers
def _run_get_rows(ex: CupyExecutable, d: int, node: Tensor) -> list:
    src, ids = node.src
    a, out, idx = array_of(ex, d, src), array_of(ex, d, node), array_of(ex, d, ids)
    if isinstance(a, RawWeight):
        return record(get_rows, a.data, a.wtype, idx, out, ne0=a.ne[0],
                      src_row_bytes=a.nb[1], src_batch_bytes=(a.nb[2], a.nb[3]))
    if a.dtype != np.float32:
        raise UnsupportedOpError(f"cupy backend: GET_ROWS of a {a.dtype} tensor ({src.name!r})")
    st = a.strides                  # numpy order (ne3, ne2, ne1, ne0), bytes
    if src.ne[0] > 1 and st[3] != 4:
        raise UnsupportedOpError(f"cupy backend: GET_ROWS source {src.name!r} rows are not contiguous")
    return record(get_rows, a, "f32", idx, out, ne0=src.ne[0], src_row_bytes=st[2],
                  src_batch_bytes=(st[1], st[0]))


def _run_binary(ex: CupyExecutable, op: str, d: int, node: Tensor) -> list:
    return record(binary, op, array_of(ex, d, node.src[0]), array_of(ex, d, node.src[1]), array_of(ex, d, node))


def _run_add(ex: CupyExecutable, d: int, node: Tensor) -> list:
    return _run_binary(ex, "add", d, node)


def _run_mul(ex: CupyExecutable, d: int, node: Tensor) -> list:
    return _run_binary(ex, "mul", d, node)


def _run_div(ex: CupyExecutable, d: int, node: Tensor) -> list:
    return _run_binary(ex, "div", d, node)


def _run_add_id(ex: CupyExecutable, d: int, node: Tensor) -> list:
    a, b, ids = (array_of(ex, d, s) for s in node.src)
    return record(add_id, a[0], b[0, 0], ids[0, 0], array_of(ex, d, node)[0])


def _run_scale(ex: CupyExecutable, d: int, node: Tensor) -> list:
    p = node.params
    return record(scale, array_of(ex, d, node.src[0]), array_of(ex, d, node), p["s"], p["b"])


_UNARY_KERNELS = {UnaryOp.SILU.value: "silu", UnaryOp.GELU_TANH.value: "gelu", UnaryOp.SIGMOID.value: "sigmoid",
                  UnaryOp.SOFTPLUS.value: "softplus"}


def _run_unary(ex: CupyExecutable, d: int, node: Tensor) -> list:
    op = _UNARY_KERNELS.get(node.params["unary"])
    if op is None:
        raise UnsupportedOpError(f"cupy backend: UNARY {node.params['unary']!r} has no kernel")
    return record(unary, op, array_of(ex, d, node.src[0]), array_of(ex, d, node))


def _run_glu(ex: CupyExecutable, d: int, node: Tensor) -> list:
    fn = {GluOp.SWIGLU.value: swiglu, GluOp.GEGLU_TANH.value: geglu}.get(node.params["glu"])
    if fn is None:
        raise UnsupportedOpError(f"cupy backend: GLU {node.params['glu']!r} has no kernel")
    out = array_of(ex, d, node)
    if len(node.src) == 2 and node.src[1] is not None:
        gate, up = array_of(ex, d, node.src[0]), array_of(ex, d, node.src[1])
    else:
        x = array_of(ex, d, node.src[0])
        n = out.shape[-1]
        gate, up = (x[..., n:], x[..., :n]) if node.params.get("swapped") else (x[..., :n], x[..., n:])
    return record(fn, gate, up, out)


def _run_soft_max(ex: CupyExecutable, d: int, node: Tensor) -> list:
    mask = array_of(ex, d, node.src[1]) if len(node.src) > 1 else None
    return record(soft_max, array_of(ex, d, node.src[0]), array_of(ex, d, node), mask=mask,
                  scale=node.params["scale"])


def _run_argsort_top_k(ex: CupyExecutable, d: int, node: Tensor) -> list:
    return record(top_k, array_of(ex, d, node.src[0]), array_of(ex, d, node), node.params["k"])


def _run_copy(ex: CupyExecutable, d: int, node: Tensor) -> list:
    """CONT and CPY: a strided copy with conversion (flat when the shapes differ)."""
    src, dst = array_of(ex, d, node.src[0]), array_of(ex, d, node)
    if tuple(src.shape) != tuple(dst.shape):
        if not (src.flags.c_contiguous and dst.flags.c_contiguous) or src.size != dst.size:
            raise UnsupportedOpError("cupy backend: copy between different shapes needs contiguous tensors")
        src, dst = src.reshape(-1), dst.reshape(-1)
    return record(copy, src, dst)


HANDLERS = {
    Op.GET_ROWS: _run_get_rows,
    Op.ADD: _run_add,
    Op.MUL: _run_mul,
    Op.DIV: _run_div,
    Op.ADD_ID: _run_add_id,
    Op.SCALE: _run_scale,
    Op.UNARY: _run_unary,
    Op.GLU: _run_glu,
    Op.SOFT_MAX: _run_soft_max,
    Op.ARGSORT_TOP_K: _run_argsort_top_k,
    Op.CONT: _run_copy,
    Op.CPY: _run_copy,
}
FUSIONS = ()
workspace = no_workspace
