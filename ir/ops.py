"""The op registry: one enum of ops, shape inference per op, and one ggml-like builder per op.

Builders check their inputs and raise `UnsupportedOpError` with the op and shapes when the
inputs do not fit, so a model builder bug shows up where it is made, not in a backend.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, Sequence

from metatp.ir.errors import UnsupportedOpError
from metatp.ir.tensor import Flag, GGMLType, Tensor, contiguous_nb

__all__ = ["Op", "OpInfo", "OPS", "GluOp", "UnaryOp", "RopeMode"]


class Op(enum.Enum):
    NONE = "none"                  # leaf: weight, input or KV cache
    GET_ROWS = "get_rows"
    RMS_NORM = "rms_norm"
    NORM = "norm"
    ADD = "add"
    MUL = "mul"
    ADD_ID = "add_id"
    SCALE = "scale"
    MUL_MAT = "mul_mat"
    MUL_MAT_ID = "mul_mat_id"
    RESHAPE = "reshape"
    VIEW = "view"
    PERMUTE = "permute"
    TRANSPOSE = "transpose"
    CONT = "cont"
    CPY = "cpy"
    SET_ROWS = "set_rows"
    ROPE = "rope"
    FLASH_ATTN_EXT = "flash_attn_ext"
    SOFT_MAX = "soft_max"
    GLU = "glu"
    UNARY = "unary"
    ARGSORT_TOP_K = "top_k"
    SUM_ROWS = "sum_rows"
    DIV = "div"


class GluOp(enum.Enum):
    SWIGLU = "swiglu"          # silu(a) * b
    GEGLU_TANH = "geglu_tanh"  # gelu_tanh(a) * b


class UnaryOp(enum.Enum):
    SILU = "silu"
    GELU_TANH = "gelu_tanh"
    SIGMOID = "sigmoid"
    SOFTPLUS = "softplus"


class RopeMode(enum.IntEnum):
    NORMAL = 0   # rotate adjacent pairs (x[2i], x[2i+1])
    NEOX = 2     # rotate halves (x[i], x[i + n_dims/2])


@dataclass(frozen=True)
class OpInfo:
    op: Op
    n_src: tuple[int, int]   # min, max number of sources
    is_view: bool            # output aliases the memory of a source (CPY/SET_ROWS: their destination)
    doc: str
    runs_kernel: bool = True  # a backend computes something (False: leaves and pure views)

    @property
    def is_pure_view(self) -> bool:
        """Only re-describes memory (RESHAPE, VIEW, PERMUTE, TRANSPOSE): nothing to run.
        CPY and SET_ROWS are views of their destination that do write it."""
        return self.is_view and not self.runs_kernel


OPS: dict[Op, OpInfo] = {}


def _register(op: Op, n_src: tuple[int, int], is_view: bool, doc: str, runs_kernel: bool = True) -> None:
    OPS[op] = OpInfo(op, n_src, is_view, doc, runs_kernel)


_register(Op.NONE, (0, 0), False, "leaf tensor (weight, input, KV cache)", runs_kernel=False)
_register(Op.GET_ROWS, (2, 2), False, "rows of src0 picked by int32 ids src1")
_register(Op.RMS_NORM, (1, 1), False, "x / sqrt(mean(x^2) + eps) per row")
_register(Op.NORM, (1, 1), False, "(x - mean) / sqrt(var + eps) per row")
_register(Op.ADD, (2, 2), False, "src0 + src1, src1 repeated to src0's shape")
_register(Op.MUL, (2, 2), False, "src0 * src1, src1 repeated to src0's shape")
_register(Op.DIV, (2, 2), False, "src0 / src1, src1 repeated to src0's shape")
_register(Op.ADD_ID, (3, 3), False, "src0[:, e, t] + src1[:, ids[e, t]] (per-expert bias)")
_register(Op.SCALE, (1, 1), False, "x * s + b")
_register(Op.MUL_MAT, (2, 2), False, "src1 @ src0^T: [k,m] x [k,n] -> [m,n]")
_register(Op.MUL_MAT_ID, (3, 3), False, "per-token expert matmuls selected by ids")
_register(Op.RESHAPE, (1, 1), True, "same memory, new contiguous shape", runs_kernel=False)
_register(Op.VIEW, (1, 1), True, "strided window into src0", runs_kernel=False)
_register(Op.PERMUTE, (1, 1), True, "reorder dimensions", runs_kernel=False)
_register(Op.TRANSPOSE, (1, 1), True, "swap dims 0 and 1", runs_kernel=False)
_register(Op.CONT, (1, 1), False, "contiguous copy")
_register(Op.CPY, (2, 2), True, "copy src0 into src1 (result aliases src1)")
_register(Op.SET_ROWS, (3, 3), True, "dest[ids[i]] = rows[i]; src = (rows, ids, dest)")
_register(Op.ROPE, (2, 3), False, "rotary position embedding")
_register(Op.FLASH_ATTN_EXT, (3, 5), False, "softmax(q k^T * scale + mask) v, GQA")
_register(Op.SOFT_MAX, (1, 2), False, "softmax(x * scale + mask) per row")
_register(Op.GLU, (1, 2), False, "gated linear unit: act(a) * b")
_register(Op.UNARY, (1, 1), False, "element-wise activation")
_register(Op.ARGSORT_TOP_K, (1, 1), False, "indices of the k largest per row (descending)")
_register(Op.SUM_ROWS, (1, 1), False, "sum of each row")


def _err(op: Op, msg: str, *srcs: Tensor) -> UnsupportedOpError:
    shapes = ", ".join(f"{s.name or '?'} ne={list(s.ne)}" for s in srcs if s is not None)
    return UnsupportedOpError(f"{op.name}: {msg} ({shapes})")


def _can_repeat(a: Tensor, b: Tensor) -> bool:
    """ggml_can_repeat: b's dims divide a's dims."""
    return all(bd != 0 and ad % bd == 0 for ad, bd in zip(a.ne, b.ne))


def new_node(op: Op, src: Sequence[Tensor | None], ne: Sequence[int], *, params: dict | None = None,
             type: GGMLType = GGMLType.F32, name: str = "") -> Tensor:
    lo, hi = OPS[op].n_src
    n = len(src)
    if not lo <= n <= hi:
        raise UnsupportedOpError(f"{op.name}: takes {lo}..{hi} sources, got {n}")
    return Tensor(name, op, src, params, type, ne)


def _new_view(op: Op, a: Tensor, ne: Sequence[int], nb: Sequence[int], offs: int, params: dict | None = None,
              name: str = "", extra_src: Sequence[Tensor] = ()) -> Tensor:
    base = a if a.view_src is None else a.view_src
    offs_total = offs + (a.view_offs if a.view_src is not None else 0)
    t = Tensor(name, op, (a, *extra_src), params, a.type, ne, nb, view_src=base, view_offs=offs_total)
    return t


# ---------------------------------------------------------------- leaves


def new_tensor(name: str, ne: Sequence[int], type: GGMLType = GGMLType.F32, flags: Flag = Flag.NONE) -> Tensor:
    return Tensor(name, Op.NONE, (), None, type, ne, flags=flags)


# ---------------------------------------------------------------- compute ops


def get_rows(a: Tensor, ids: Tensor, name: str = "") -> Tensor:
    if ids.type != GGMLType.I32:
        raise _err(Op.GET_ROWS, "ids must be I32", a, ids)
    if a.ne[2] != ids.ne[1] or a.ne[3] != ids.ne[2]:
        raise _err(Op.GET_ROWS, "ids batch dims must match", a, ids)
    return new_node(Op.GET_ROWS, (a, ids), (a.ne[0], ids.ne[0], ids.ne[1], ids.ne[2]), name=name)


def rms_norm(a: Tensor, eps: float, name: str = "") -> Tensor:
    return new_node(Op.RMS_NORM, (a,), a.ne, params={"eps": float(eps)}, name=name)


def norm(a: Tensor, eps: float, name: str = "") -> Tensor:
    return new_node(Op.NORM, (a,), a.ne, params={"eps": float(eps)}, name=name)


def _binary(op: Op, a: Tensor, b: Tensor, name: str) -> Tensor:
    if not _can_repeat(a, b):
        raise _err(op, "src1 cannot be repeated to src0's shape", a, b)
    return new_node(op, (a, b), a.ne, name=name)


def add(a: Tensor, b: Tensor, name: str = "") -> Tensor:
    return _binary(Op.ADD, a, b, name)


def mul(a: Tensor, b: Tensor, name: str = "") -> Tensor:
    return _binary(Op.MUL, a, b, name)


def div(a: Tensor, b: Tensor, name: str = "") -> Tensor:
    return _binary(Op.DIV, a, b, name)


def add_id(a: Tensor, b: Tensor, ids: Tensor, name: str = "") -> Tensor:
    """a: [n, n_used, T]; b: [n, n_expert] bias; ids: I32 [n_used, T]."""
    if a.ne[0] != b.ne[0] or ids.ne[0] != a.ne[1] or ids.ne[1] != a.ne[2]:
        raise _err(Op.ADD_ID, "shapes do not match", a, b, ids)
    return new_node(Op.ADD_ID, (a, b, ids), a.ne, name=name)


def scale(a: Tensor, s: float, b: float = 0.0, name: str = "") -> Tensor:
    return new_node(Op.SCALE, (a,), a.ne, params={"s": float(s), "b": float(b)}, name=name)


def mul_mat(a: Tensor, b: Tensor, name: str = "") -> Tensor:
    """ggml_mul_mat: a [k, m, ...], b [k, n, ...] -> [m, n, ...] (a broadcast over b's batch dims)."""
    if a.ne[0] != b.ne[0]:
        raise _err(Op.MUL_MAT, "inner dimensions differ", a, b)
    if b.ne[2] % a.ne[2] or b.ne[3] % a.ne[3]:
        raise _err(Op.MUL_MAT, "batch dims of src0 must divide those of src1", a, b)
    return new_node(Op.MUL_MAT, (a, b), (a.ne[1], b.ne[1], b.ne[2], b.ne[3]), name=name)


def mul_mat_id(a: Tensor, b: Tensor, ids: Tensor, name: str = "") -> Tensor:
    """a: experts [k, m, n_expert]; b: [k, n_b, T] (n_b = 1 or n_used); ids: I32 [n_used, T] -> [m, n_used, T]."""
    if a.ne[0] != b.ne[0] or ids.ne[1] != b.ne[2] or b.ne[1] not in (1, ids.ne[0]):
        raise _err(Op.MUL_MAT_ID, "shapes do not match", a, b, ids)
    return new_node(Op.MUL_MAT_ID, (a, b, ids), (a.ne[1], ids.ne[0], b.ne[2], 1), name=name)


def cont(a: Tensor, name: str = "") -> Tensor:
    return new_node(Op.CONT, (a,), a.ne, type=a.type, name=name)


def cpy(a: Tensor, dst: Tensor, name: str = "") -> Tensor:
    """Copy a into dst (converting the type); the result aliases dst."""
    if a.nelements != dst.nelements:
        raise _err(Op.CPY, "element counts differ", a, dst)
    base = dst.view_src or dst
    offs = dst.view_offs if dst.view_src is not None else 0
    return Tensor(name, Op.CPY, (a, dst), None, dst.type, dst.ne, dst.nb, view_src=base, view_offs=offs)


def set_rows(dest: Tensor, rows: Tensor, ids: Tensor, name: str = "") -> Tensor:
    """dest[ids[i], :] = rows[i, :]. The result aliases dest (src = rows, ids, dest)."""
    if rows.ne[0] != dest.ne[0] or ids.ne[0] != rows.ne[1] or ids.type != GGMLType.I32:
        raise _err(Op.SET_ROWS, "rows/ids do not fit the destination", dest, rows, ids)
    base = dest.view_src or dest
    offs = dest.view_offs if dest.view_src is not None else 0
    return Tensor(name, Op.SET_ROWS, (rows, ids, dest), None, dest.type, dest.ne, dest.nb,
                  view_src=base, view_offs=offs)


def rope(a: Tensor, pos: Tensor, n_dims: int, mode: RopeMode, freq_base: float, freq_scale: float = 1.0,
         freq_factors: Tensor | None = None, name: str = "") -> Tensor:
    """a: [head_dim, n_head, T]; pos: I32 [T]."""
    if pos.type != GGMLType.I32 or pos.ne[0] != a.ne[2]:
        raise _err(Op.ROPE, "positions must be I32 with one entry per token", a, pos)
    if n_dims > a.ne[0] or n_dims % 2:
        raise _err(Op.ROPE, f"n_dims={n_dims} must be even and <= head size", a)
    params = {"n_dims": int(n_dims), "mode": int(mode), "freq_base": float(freq_base), "freq_scale": float(freq_scale)}
    src = (a, pos) if freq_factors is None else (a, pos, freq_factors)
    return new_node(Op.ROPE, src, a.ne, params=params, name=name)


def flash_attn_ext(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float, softcap: float = 0.0,
                   sinks: Tensor | None = None, name: str = "") -> Tensor:
    """q: [D, T, H]; k, v: [D, n_kv, H_kv]; mask: [n_kv, T] (additive) -> [D_v, H, T]."""
    if q.ne[0] != k.ne[0] or k.ne[1] != v.ne[1] or k.ne[2] != v.ne[2]:
        raise _err(Op.FLASH_ATTN_EXT, "q/k/v shapes do not match", q, k, v)
    if k.ne[2] == 0 or q.ne[2] % max(k.ne[2], 1):
        raise _err(Op.FLASH_ATTN_EXT, "q heads must be a multiple of kv heads", q, k)
    if mask is not None and (mask.ne[0] != k.ne[1] or mask.ne[1] < q.ne[1]):
        raise _err(Op.FLASH_ATTN_EXT, "mask must be [n_kv, >= n_tokens]", mask, k, q)
    src: list[Tensor | None] = [q, k, v, mask]
    if sinks is not None:
        src.append(sinks)
    params = {"scale": float(scale), "softcap": float(softcap)}
    return new_node(Op.FLASH_ATTN_EXT, src, (v.ne[0], q.ne[2], q.ne[1], 1), params=params, name=name)


def soft_max(a: Tensor, mask: Tensor | None = None, scale: float = 1.0, name: str = "") -> Tensor:
    src = (a,) if mask is None else (a, mask)
    return new_node(Op.SOFT_MAX, src, a.ne, params={"scale": float(scale)}, name=name)


def glu_split(a: Tensor, b: Tensor, op: GluOp = GluOp.SWIGLU, name: str = "") -> Tensor:
    """act(a) * b with separate gate `a` and up `b` (ggml_swiglu_split)."""
    if a.ne != b.ne:
        raise _err(Op.GLU, "gate and up shapes differ", a, b)
    return new_node(Op.GLU, (a, b), a.ne, params={"glu": op.value}, name=name)


def glu_fused(a: Tensor, op: GluOp = GluOp.SWIGLU, swapped: bool = False, name: str = "") -> Tensor:
    """act(first half) * second half of each row (swapped: act(second) * first)."""
    if a.ne[0] % 2:
        raise _err(Op.GLU, "fused GLU needs an even row length", a)
    return new_node(Op.GLU, (a,), (a.ne[0] // 2, *a.ne[1:]), params={"glu": op.value, "swapped": swapped}, name=name)


def unary(a: Tensor, op: UnaryOp, name: str = "") -> Tensor:
    return new_node(Op.UNARY, (a,), a.ne, params={"unary": op.value}, name=name)


def top_k(a: Tensor, k: int, name: str = "") -> Tensor:
    if not 0 < k <= a.ne[0]:
        raise _err(Op.ARGSORT_TOP_K, f"k={k} out of range", a)
    return new_node(Op.ARGSORT_TOP_K, (a,), (k, *a.ne[1:]), params={"k": int(k)}, type=GGMLType.I32, name=name)


def sum_rows(a: Tensor, name: str = "") -> Tensor:
    return new_node(Op.SUM_ROWS, (a,), (1, *a.ne[1:]), name=name)


# ---------------------------------------------------------------- views


def reshape(a: Tensor, *ne: int, name: str = "") -> Tensor:
    if not a.is_contiguous:
        raise _err(Op.RESHAPE, "source must be contiguous", a)
    ne4 = tuple(ne) + (1,) * (4 - len(ne))
    if ne4[0] * ne4[1] * ne4[2] * ne4[3] != a.nelements:
        raise _err(Op.RESHAPE, f"cannot reshape to {list(ne)}", a)
    return _new_view(Op.RESHAPE, a, ne4, contiguous_nb(a.type, ne4), 0, name=name)


def view(a: Tensor, ne: Sequence[int], nb: Sequence[int], offset: int, name: str = "") -> Tensor:
    """A strided window: `ne` elements with byte strides `nb[1:]` starting `offset` bytes into a."""
    ne4 = tuple(ne) + (1,) * (4 - len(ne))
    nbs = list(nb) + [0] * (3 - len(nb))
    nb4 = [a.nb[0], nbs[0], nbs[1], nbs[2]]
    for i in range(len(ne), 4):   # trailing dims of size 1: stride = span of the previous dim
        nb4[i] = nb4[i - 1] * ne4[i - 1] if i > 0 else nb4[0]
    params = {"ne": ne4, "nb": tuple(nb4), "offset": int(offset)}
    t = _new_view(Op.VIEW, a, ne4, nb4, offset, params=params, name=name)
    return t


def permute(a: Tensor, ax0: int, ax1: int, ax2: int, ax3: int, name: str = "") -> Tensor:
    """ggml_permute: source dim i goes to position axes[i]."""
    axes = (ax0, ax1, ax2, ax3)
    if sorted(axes) != [0, 1, 2, 3]:
        raise _err(Op.PERMUTE, f"bad axes {axes}", a)
    ne = [0] * 4
    nb = [0] * 4
    for i, ax in enumerate(axes):
        ne[ax] = a.ne[i]
        nb[ax] = a.nb[i]
    return _new_view(Op.PERMUTE, a, ne, nb, 0, params={"axes": axes}, name=name)


def transpose(a: Tensor, name: str = "") -> Tensor:
    ne = (a.ne[1], a.ne[0], a.ne[2], a.ne[3])
    nb = (a.nb[1], a.nb[0], a.nb[2], a.nb[3])
    return _new_view(Op.TRANSPOSE, a, ne, nb, 0, name=name)


BUILDERS: dict[Op, Callable[..., Tensor]] = {
    Op.GET_ROWS: get_rows, Op.RMS_NORM: rms_norm, Op.NORM: norm, Op.ADD: add, Op.MUL: mul, Op.DIV: div,
    Op.ADD_ID: add_id, Op.SCALE: scale, Op.MUL_MAT: mul_mat, Op.MUL_MAT_ID: mul_mat_id, Op.CONT: cont,
    Op.CPY: cpy, Op.SET_ROWS: set_rows, Op.ROPE: rope, Op.FLASH_ATTN_EXT: flash_attn_ext,
    Op.SOFT_MAX: soft_max, Op.GLU: glu_split, Op.UNARY: unary, Op.ARGSORT_TOP_K: top_k,
    Op.SUM_ROWS: sum_rows, Op.RESHAPE: reshape, Op.VIEW: view, Op.PERMUTE: permute, Op.TRANSPOSE: transpose,
}
