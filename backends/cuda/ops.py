"""What each node runs on a CUDA device: the op table `CUDA_OPS` and the fused handlers.

A handler takes the executable, a device and a node, and returns that device's steps for the
node: kernel launches recorded with frozen arguments (`launch.recording`) or `HostStep`s
(cuBLAS, cupy ops: eager only). A handler raises ValueError / TypeError / UnsupportedOpError
for a layout its kernel cannot take. `FUSED_OPS` holds one handler per `FusionKind` this
kernel set implements (the fusions `fusion.py` finds); a fused handler that refuses a layout
makes the executable run the fusion's nodes one by one.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from metatp.backends.cuda import kernels as ck
from metatp.backends.cuda.device_ops import HostStep
from metatp.backends.cuda.launch import device_ptr, recording
from metatp.backends.cuda.storage import RawWeight, graph_itemsize, quant_cache_type
from metatp.backends.fusion import Fusion, FusionKind
from metatp.ir.errors import UnsupportedOpError
from metatp.ir.ops import GluOp, Op, RopeMode, UnaryOp
from metatp.ir.tensor import Flag, Tensor

if TYPE_CHECKING:
    from metatp.backends.cuda.executable import CupyExecutable

__all__ = ["CUDA_OPS", "FUSED_OPS", "Handler", "record", "weight_operand", "norm_times_weight"]

Handler = Callable[["CupyExecutable", int, Tensor], list]


def record(fn, *args, **kw) -> list:
    """The launches `fn(*args, **kw)` makes, recorded with frozen arguments."""
    with recording() as launches:
        fn(*args, **kw)
    return [la.frozen() for la in launches]


def _a(ex: CupyExecutable, d: int, t: Tensor | None):
    return ex.arrays[d][t] if t is not None else None


# ---- op handlers: each returns the node's steps on device d
def _get_rows(ex: CupyExecutable, d: int, node: Tensor) -> list:
    src, ids = node.src
    a, out, idx = _a(ex, d, src), _a(ex, d, node), _a(ex, d, ids)
    if isinstance(a, RawWeight):
        return record(ck.get_rows, a.data, a.wtype, idx, out, ne0=a.ne[0],
                            src_row_bytes=a.nb[1], src_batch_bytes=(a.nb[2], a.nb[3]))
    if a.dtype != np.float32:
        raise UnsupportedOpError(f"cupy backend: GET_ROWS of a {a.dtype} tensor ({src.name!r})")
    st = a.strides                  # numpy order (ne3, ne2, ne1, ne0), bytes
    if src.ne[0] > 1 and st[3] != 4:
        raise UnsupportedOpError(f"cupy backend: GET_ROWS source {src.name!r} rows are not contiguous")
    return record(ck.get_rows, a, "f32", idx, out, ne0=src.ne[0], src_row_bytes=st[2],
                        src_batch_bytes=(st[1], st[0]))


def _rms_norm(ex: CupyExecutable, d: int, node: Tensor) -> list:
    return record(ck.rms_norm, _a(ex, d, node.src[0]), _a(ex, d, node), eps=node.params["eps"])


def _norm(ex: CupyExecutable, d: int, node: Tensor) -> list:
    return record(ck.norm, _a(ex, d, node.src[0]), _a(ex, d, node), eps=node.params["eps"])


def _fused_norm(ex: CupyExecutable, d: int, f: Fusion) -> list:
    return norm_times_weight(ex, d, f.at, f.parts["norm"])


def norm_times_weight(ex: CupyExecutable, d: int, node: Tensor, norm_node: Tensor) -> list:
    """MUL(RMS_NORM(x) or NORM(x), w) as one kernel writing the MUL's buffer."""
    fn = ck.rms_norm if norm_node.op is Op.RMS_NORM else ck.norm
    w = _a(ex, d, node.src[1]).reshape(-1)
    return record(fn, _a(ex, d, norm_node.src[0]), _a(ex, d, node), eps=norm_node.params["eps"],
                        weight=w)


def _binary(ex: CupyExecutable, op: str, d: int, node: Tensor) -> list:
    return record(ck.binary, op, _a(ex, d, node.src[0]), _a(ex, d, node.src[1]), _a(ex, d, node))


def _add(ex: CupyExecutable, d: int, node: Tensor) -> list:
    return _binary(ex, "add", d, node)


def _mul(ex: CupyExecutable, d: int, node: Tensor) -> list:
    return _binary(ex, "mul", d, node)


def _div(ex: CupyExecutable, d: int, node: Tensor) -> list:
    return _binary(ex, "div", d, node)


def _add_id(ex: CupyExecutable, d: int, node: Tensor) -> list:
    a, b, ids = (_a(ex, d, s) for s in node.src)
    return record(ck.add_id, a[0], b[0, 0], ids[0, 0], _a(ex, d, node)[0])


def _scale(ex: CupyExecutable, d: int, node: Tensor) -> list:
    p = node.params
    return record(ck.scale, _a(ex, d, node.src[0]), _a(ex, d, node), p["s"], p["b"])


def _unary(ex: CupyExecutable, d: int, node: Tensor) -> list:
    op = {UnaryOp.SILU.value: "silu", UnaryOp.GELU_TANH.value: "gelu", UnaryOp.SIGMOID.value: "sigmoid",
          UnaryOp.SOFTPLUS.value: "softplus"}.get(node.params["unary"])
    if op is None:
        raise UnsupportedOpError(f"cupy backend: UNARY {node.params['unary']!r} has no kernel")
    return record(ck.unary, op, _a(ex, d, node.src[0]), _a(ex, d, node))


def _glu(ex: CupyExecutable, d: int, node: Tensor) -> list:
    fn = {GluOp.SWIGLU.value: ck.swiglu, GluOp.GEGLU_TANH.value: ck.geglu}.get(node.params["glu"])
    if fn is None:
        raise UnsupportedOpError(f"cupy backend: GLU {node.params['glu']!r} has no kernel")
    out = _a(ex, d, node)
    if len(node.src) == 2 and node.src[1] is not None:
        gate, up = _a(ex, d, node.src[0]), _a(ex, d, node.src[1])
    else:
        x = _a(ex, d, node.src[0])
        n = out.shape[-1]
        gate, up = (x[..., n:], x[..., :n]) if node.params.get("swapped") else (x[..., :n], x[..., n:])
    return record(fn, gate, up, out)


def _soft_max(ex: CupyExecutable, d: int, node: Tensor) -> list:
    mask = _a(ex, d, node.src[1]) if len(node.src) > 1 else None
    return record(ck.soft_max, _a(ex, d, node.src[0]), _a(ex, d, node), mask=mask,
                        scale=node.params["scale"])


def _argsort_top_k(ex: CupyExecutable, d: int, node: Tensor) -> list:
    return record(ck.top_k, _a(ex, d, node.src[0]), _a(ex, d, node), node.params["k"])


def _sum_rows(ex: CupyExecutable, d: int, node: Tensor) -> list:
    return record(ck.sum_rows, _a(ex, d, node.src[0]), _a(ex, d, node))


def _cont(ex: CupyExecutable, d: int, node: Tensor) -> list:
    return _copy(ex, d, _a(ex, d, node.src[0]), _a(ex, d, node))


def _cpy(ex: CupyExecutable, d: int, node: Tensor) -> list:
    return _copy(ex, d, _a(ex, d, node.src[0]), _a(ex, d, node))


def _copy(ex: CupyExecutable, d: int, src, dst) -> list:
    if tuple(src.shape) != tuple(dst.shape):
        if not (src.flags.c_contiguous and dst.flags.c_contiguous) or src.size != dst.size:
            raise UnsupportedOpError("cupy backend: copy between different shapes needs contiguous tensors")
        src, dst = src.reshape(-1), dst.reshape(-1)
    return record(ck.copy, src, dst)


def _set_rows(ex: CupyExecutable, d: int, node: Tensor, second=None) -> list:
    rows, ids, _ = node.src
    if rows.ne[2] != 1 or rows.ne[3] != 1 or ids.ne[1] != 1 or ids.ne[2] != 1:
        raise UnsupportedOpError(f"cupy backend: SET_ROWS {node.name!r} with batch dims is not supported")
    return record(ck.set_rows, _a(ex, d, rows)[0, 0], _a(ex, d, node)[0, 0], _a(ex, d, ids)[0, 0, 0],
                  second=second, cache_type=quant_cache_type(node.type))


def _rope(ex: CupyExecutable, d: int, node: Tensor, second=None) -> list:
    x, pos = node.src[0], node.src[1]
    ff = node.src[2] if len(node.src) > 2 else None
    if x.ne[3] != 1:
        raise UnsupportedOpError(f"cupy backend: ROPE {node.name!r} with ne3 > 1")
    p = node.params
    xa, out = _a(ex, d, x)[0], _a(ex, d, node)[0]
    ffa = _a(ex, d, ff).reshape(-1) if ff is not None else None
    head_dim, n_head, n_tok = xa.shape[2], xa.shape[1], xa.shape[0]
    return record(ck.rope, xa, out, _a(ex, d, pos).reshape(-1), head_dim=head_dim, n_head=n_head,
                        n_tokens=n_tok, n_dims=p["n_dims"], freq_base=p["freq_base"],
                        freq_scale=p["freq_scale"], neox=p["mode"] == RopeMode.NEOX, freq_factors=ffa,
                        second=second)


def _flash_attn_ext(ex: CupyExecutable, d: int, node: Tensor) -> list:
    q, k, v = node.src[0], node.src[1], node.src[2]
    mask = node.src[3] if len(node.src) > 3 else None
    if len(node.src) > 4 and node.src[4] is not None:
        raise UnsupportedOpError(f"cupy backend: FLASH_ATTN_EXT {node.name!r} with attention sinks")
    qa, ka, va = _a(ex, d, q), _a(ex, d, k), _a(ex, d, v)
    loc = {t: ex.plan.of(t).local[d] for t in (q, k, v)}
    D, T, H = loc[q].ne[0], loc[q].ne[1], loc[q].ne[2]
    n_kv, Hkv = loc[k].ne[1], loc[k].ne[2]
    if loc[v].ne[0] != D:
        raise UnsupportedOpError(f"cupy backend: FLASH_ATTN_EXT {node.name!r}: V head size differs from K's")
    qs = (loc[q].nb[2] // 4, loc[q].nb[1] // 4)
    # strides in storage elements: a quantized cache is bytes (its views are byte views of blocks)
    kq, vq = quant_cache_type(k.type), quant_cache_type(v.type)
    gk, gv = (1 if kq else graph_itemsize(k)), (1 if vq else graph_itemsize(v))
    ks = (loc[k].nb[2] // gk, loc[k].nb[1] // gk)
    vs = (loc[v].nb[2] // gv, loc[v].nb[1] // gv)
    if kq != vq:
        raise UnsupportedOpError(f"cupy backend: FLASH_ATTN_EXT {node.name!r}: K ({k.type.name}) and V "
                                 f"({v.type.name}) caches of different types")
    ma = _a(ex, d, mask) if mask is not None else None
    kw = dict(n_head=H, n_head_kv=Hkv, head_dim=D, n_tokens=T, n_kv=n_kv, scale=node.params["scale"],
              softcap=node.params.get("softcap", 0.0), causal=False, q_strides=qs, k_strides=ks,
              v_strides=vs, mask=ma[0, 0] if ma is not None else None,
              mask_stride=(ex.plan.of(mask).local[d].nb[1] // 4) if mask is not None else None,
              kv_len=ex.kv_len_view(d, mask) if mask is not None else None, kv_type=kq)
    out = _a(ex, d, node)
    if T <= ck.ATTN_DECODE_MAX_TOKENS:
        n_splits, _ = ck.decode_splits(Hkv, H, T, n_kv)
        if n_splits > 1:
            kw["workspace"] = ex.scratch_buffer(d, "attn", ck.attn_workspace_floats(H, D, T, n_splits),
                                                   np.float32)
        kw["n_splits"] = n_splits
    return record(ck.flash_attn, qa, ka, va, out, **kw)

# ---- matmuls
def weight_operand(ex: CupyExecutable, d: int, w: Tensor) -> tuple[Any, str, int, int]:
    """(data, weight type, row bytes, matrix bytes) of a weight for the matvec kernels."""
    a = ex.arrays[d][w]
    if isinstance(a, RawWeight):
        return a.data, a.wtype, a.nb[1], a.nb[2]
    if a.dtype != np.float32 or not a.flags.c_contiguous:
        raise UnsupportedOpError(f"cupy backend: weight {w.name!r} must be f32 or raw GGUF blocks")
    loc = ex.plan.of(w).local[d]
    return a, "f32", loc.ne[0] * 4, loc.ne[0] * loc.ne[1] * 4


def _rows(ex: CupyExecutable, arr):
    """A 2-D (rows, ne0) view of an array whose leading dims collapse (else ValueError)."""
    ne0, n_rows, stride = ck.rows2d(arr)
    return ex.rt.view(arr, 0, (n_rows, ne0), (stride * arr.dtype.itemsize, arr.dtype.itemsize),
                        arr.dtype) if arr.size else arr.reshape(n_rows, ne0)


def _mul_mat(ex: CupyExecutable, d: int, node: Tensor) -> list:
    w, x = node.src
    if not (w.flags & Flag.WEIGHT and w.view_src is None and w.ne[2] == 1 and w.ne[3] == 1):
        return _matmul_general(ex, d, node)
    data, wtype, row_bytes, _ = weight_operand(ex, d, w)
    loc_w = ex.plan.of(w).local[d]
    k, m = loc_w.ne[0], loc_w.ne[1]
    xr, yr = _rows(ex, _a(ex, d, x)), _rows(ex, _a(ex, d, node))
    n_tok = xr.shape[0]
    if n_tok <= ck.MATVEC_MAX_TOKENS or not ex.rt.gemm_available():
        return record(ck.matvec, data, wtype, xr, yr, ne0=k, n_rows=m, w_row_bytes=row_bytes)
    return _gemm_steps(ex, d, data, wtype, row_bytes, k, m, xr, yr)


def _gemm_steps(ex: CupyExecutable, d: int, data, wtype: str, row_bytes: int, k: int, m: int, xr, yr) -> list:
    """Prefill: dequantize the weight to f16 (or f32), convert x, one cuBLAS GEMM into y."""
    dt = np.float16 if ex.backend.matmul_dtype == "f16" else np.float32
    n_tok = xr.shape[0]
    wbuf = ex.scratch_buffer(d, f"gemm_w_{dt.__name__}", m * k, dt)
    xbuf = ex.scratch_buffer(d, f"gemm_x_{dt.__name__}", n_tok * k, dt)
    w2 = wbuf[: m * k].reshape(m, k)
    x2 = xbuf[: n_tok * k].reshape(n_tok, k)
    steps = record(ck.dequantize, data, wtype, w2, ne0=k, n_rows=m, src_row_bytes=row_bytes)
    steps += record(ck.copy, xr, x2)
    ldy = yr.strides[0] // 4 if yr.shape[0] > 1 else m
    args = (m, n_tok, k, device_ptr(w2), device_ptr(x2), device_ptr(yr), ldy,
            ex.backend.matmul_dtype, ex.devs[d].stream, ex.devs[d].gpu)
    keep = (wbuf, xbuf, yr)
    steps.append(HostStep(lambda keep=keep: ex.rt.gemm(*args), "cuBLAS GEMM"))
    return steps


def _matmul_general(ex: CupyExecutable, d: int, node: Tensor) -> list:
    """MUL_MAT of two activations (or a batched weight): a cupy matmul, eager only."""
    a, b, out = _a(ex, d, node.src[0]), _a(ex, d, node.src[1]), _a(ex, d, node)
    if isinstance(a, RawWeight) or a.dtype != np.float32 or b.dtype != np.float32:
        raise UnsupportedOpError(f"cupy backend: MUL_MAT {node.name!r} of these operand types")
    r3, r2 = b.shape[0] // a.shape[0], b.shape[1] // a.shape[1]
    rt = ex.rt

    def run() -> None:
        bb = b.reshape(a.shape[0], r3, a.shape[1], r2, b.shape[2], b.shape[3])
        aa = a[:, None, :, None].swapaxes(-1, -2)
        out[...] = rt.matmul(bb, aa).reshape(out.shape)
    return [HostStep(run, "batched matmul")]


def _norm_args(ex: CupyExecutable, d: int, norm) -> dict:
    """matvec keyword arguments folding MUL(RMS_NORM(x0), w) into the prologue."""
    if norm is None:
        return {}
    mul, rms = norm
    return {"norm_weight": _a(ex, d, mul.src[1]).reshape(-1), "eps": rms.params["eps"]}


def _norm_input(ex: CupyExecutable, d: int, x: Tensor, norm):
    return _rows(ex, _a(ex, d, norm[1].src[0] if norm is not None else x)).reshape(-1)


def _fused_matvec_add(ex: CupyExecutable, d: int, f: Fusion) -> list:
    node, mm, other = f.at, f.parts["mm"], f.parts["other"]
    data, wtype, row_bytes, _ = weight_operand(ex, d, mm.src[0])
    loc_w = ex.plan.of(mm.src[0]).local[d]
    xr, yr = _rows(ex, _a(ex, d, mm.src[1])), _rows(ex, _a(ex, d, node))
    oa = _rows(ex, _a(ex, d, other))
    broadcast = other.ne != mm.ne
    add_stride = 0 if broadcast else (oa.strides[0] // 4 if oa.shape[0] > 1 else loc_w.ne[1])
    return record(ck.matvec, data, wtype, xr, yr, ne0=loc_w.ne[0], n_rows=loc_w.ne[1],
                        w_row_bytes=row_bytes, add=oa, add_stride=add_stride)


def _fused_matvec_glu(ex: CupyExecutable, d: int, f: Fusion) -> list:
    node, gate, up, norm = f.at, f.parts["gate"], f.parts["up"], f.parts.get("norm")
    dg, wtype, row_bytes, _ = weight_operand(ex, d, gate.src[0])
    du, _, _, _ = weight_operand(ex, d, up.src[0])
    loc_w = ex.plan.of(gate.src[0]).local[d]
    act = "swiglu" if node.params["glu"] == GluOp.SWIGLU.value else "geglu"
    return record(ck.matvec_glu, dg, du, wtype, _norm_input(ex, d, gate.src[1], norm),
                        _a(ex, d, node).reshape(-1), ne0=loc_w.ne[0], n_rows=loc_w.ne[1],
                        w_row_bytes=row_bytes, act=act, **_norm_args(ex, d, norm))


def _fused_matvec_multi(ex: CupyExecutable, d: int, f: Fusion) -> list:
    members, norm = f.parts["members"], f.parts["norm"]
    jobs, wtype, ne0 = [], None, None
    for mm in members:
        data, wtype, row_bytes, _ = weight_operand(ex, d, mm.src[0])
        loc_w = ex.plan.of(mm.src[0]).local[d]
        ne0 = loc_w.ne[0]
        jobs.append((data, _a(ex, d, mm).reshape(-1), loc_w.ne[1], row_bytes))
    return record(ck.matvec_multi, jobs, wtype, _norm_input(ex, d, members[0].src[1], norm),
                        ne0=ne0, **_norm_args(ex, d, norm))


def _fused_rope_pair(ex: CupyExecutable, d: int, f: Fusion) -> list:
    first, second = f.parts["first"], f.at
    x2 = _a(ex, d, second.src[0])[0]
    return _rope(ex, d, first, second=(x2, _a(ex, d, second)[0], x2.shape[1], None, None))


def _fused_set_rows_pair(ex: CupyExecutable, d: int, f: Fusion) -> list:
    first, second = f.parts["first"], f.at
    return _set_rows(ex, d, first, second=(_a(ex, d, second.src[0])[0, 0], _a(ex, d, second)[0, 0]))


def _mul_mat_id(ex: CupyExecutable, d: int, node: Tensor) -> list:
    w, x, ids = node.src
    data, wtype, row_bytes, expert_bytes = weight_operand(ex, d, w)
    loc_w = ex.plan.of(w).local[d]
    return record(ck.matvec_id, data, wtype, _a(ex, d, x)[0], _a(ex, d, node)[0],
                        _a(ex, d, ids)[0, 0], ne0=loc_w.ne[0], n_rows=loc_w.ne[1],
                        expert_bytes=expert_bytes, w_row_bytes=row_bytes)


CUDA_OPS: dict[Op, Handler] = {
    Op.GET_ROWS: _get_rows,
    Op.RMS_NORM: _rms_norm,
    Op.NORM: _norm,
    Op.ADD: _add,
    Op.MUL: _mul,
    Op.DIV: _div,
    Op.ADD_ID: _add_id,
    Op.SCALE: _scale,
    Op.UNARY: _unary,
    Op.GLU: _glu,
    Op.SOFT_MAX: _soft_max,
    Op.ARGSORT_TOP_K: _argsort_top_k,
    Op.SUM_ROWS: _sum_rows,
    Op.CONT: _cont,
    Op.CPY: _cpy,
    Op.SET_ROWS: _set_rows,
    Op.ROPE: _rope,
    Op.FLASH_ATTN_EXT: _flash_attn_ext,
    Op.MUL_MAT: _mul_mat,
    Op.MUL_MAT_ID: _mul_mat_id,
}

FUSED_OPS: dict[FusionKind, Callable[["CupyExecutable", int, Fusion], list]] = {
    FusionKind.NORM: _fused_norm,
    FusionKind.MATVEC_ADD: _fused_matvec_add,
    FusionKind.MATVEC_GLU: _fused_matvec_glu,
    FusionKind.MATVEC_MULTI: _fused_matvec_multi,
    FusionKind.ROPE_PAIR: _fused_rope_pair,
    FusionKind.SET_ROWS_PAIR: _fused_set_rows_pair,
}
