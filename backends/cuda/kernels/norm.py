"""Row reductions (``cuda/norm.cu``): RMS norm and layer norm (optionally times a weight row), SUM_ROWS.

The family's decisions: RMS_NORM, NORM and SUM_ROWS run these kernels; MUL(norm(x), w) with w
a float weight row runs as one norm x weight launch (`FusionKind.NORM`), and a matvec fusion
that folded an RMS norm in and then refused a layout runs it as that launch too
(`unfused_with_folded_norm`). No scratch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from metatp.backends.cuda.kernels.handler import FusionRow, array_of, no_workspace, record, unfused_in_order
from metatp.backends.cuda.launch import MATVEC_MAX_TOKENS, launch, i32, f32, nd, check_f32, row_block
from metatp.backends.cuda.storage import RawWeight
from metatp.backends.fusion import Fusion, FusionKind, norm_weight_fusion
from metatp.ir.ops import Op
from metatp.ir.tensor import Tensor

if TYPE_CHECKING:
    from metatp.backends.cuda.executable import CupyExecutable

__all__ = ['ENTRY_POINTS', 'rms_norm', 'norm', 'sum_rows', 'folded_norm_args', 'unfused_with_folded_norm',
           'HANDLERS', 'FUSIONS', 'workspace']

ENTRY_POINTS = ["rms_norm_f32", "norm_f32", "sum_rows_f32"]


def folded_norm_args(ne0: int, norm_weight, eps: float | None) -> tuple:
    """(norm_w, eps, flag) arguments of a product kernel that RMS-normalises x in its prologue (the
    norm folded into matvec / mmvq / the fused q/k/v): flag 1 when eps is given; norm_w may be None
    (no weight)."""
    check_f32(norm_weight)
    if norm_weight is not None and norm_weight.size != ne0:
        raise ValueError(f"norm weight has {norm_weight.size} elements for ne0={ne0}")
    if eps is None:
        return None, f32(0.0), i32(0)
    return norm_weight, f32(eps), i32(1)


def _rows_nd(x, y) -> tuple[list[int], list[int], list[int]]:
    ne, xs = nd(x)
    yne, ys = nd(y)
    if ne[1:] != yne[1:]:
        raise ValueError(f"row dims differ: {x.shape} vs {y.shape}")
    if (ne[0] > 1 and xs[0] != 1) or (yne[0] > 1 and ys[0] != 1):
        raise ValueError("rows must be contiguous")
    return ne, xs, ys


def _norm(name: str, x, y, eps: float, weight) -> None:
    check_f32(x, y, weight)
    ne, xs, ys = _rows_nd(x, y)
    if tuple(x.shape) != tuple(y.shape):
        raise ValueError(f"shape mismatch {x.shape} vs {y.shape}")
    if weight is not None and weight.size != ne[0]:
        raise ValueError(f"weight has {weight.size} elements for rows of {ne[0]}")
    n_rows = ne[1] * ne[2] * ne[3]
    if n_rows == 0 or ne[0] == 0:
        return
    launch("norm", name, (n_rows,), (row_block(ne[0]),),
           (x, weight, y, i32(ne[0]), i32(ne[1]), i32(ne[2]), i32(n_rows), i32(xs[1]),
            i32(xs[2]), i32(xs[3]), i32(ys[1]), i32(ys[2]), i32(ys[3]), f32(eps)))


def rms_norm(x, y, *, eps: float, weight=None) -> None:
    """``y = x / sqrt(mean(x^2) + eps) * weight`` per row (rows: any strided <= 4-D view;
    weight None: no multiply; y may be x)."""
    _norm("rms_norm_f32", x, y, eps, weight)


def norm(x, y, *, eps: float, weight=None) -> None:
    """Layer norm without bias: ``y = (x - mean) / sqrt(var + eps) * weight`` per row."""
    _norm("norm_f32", x, y, eps, weight)


def sum_rows(x, y) -> None:
    """``y[..., 0] = x.sum(-1)`` (ggml SUM_ROWS: y has the shape of x with ne0 = 1)."""
    check_f32(x, y)
    ne, xs = nd(x)
    yne, ys = nd(y)
    if yne[0] != 1 or yne[1:] != ne[1:] or (ne[0] > 1 and xs[0] != 1):
        raise ValueError(f"sum_rows: x {x.shape} -> y {y.shape} does not fit")
    n_rows = ne[1] * ne[2] * ne[3]
    if n_rows:
        launch("norm", "sum_rows_f32", (n_rows,), (row_block(ne[0]),),
               (x, y, i32(ne[0]), i32(ne[1]), i32(ne[2]), i32(n_rows), i32(xs[1]),
                i32(xs[2]), i32(xs[3]), i32(ys[1]), i32(ys[2]), i32(ys[3])))


# ---------------------------------------------------------------- handlers
def _run_rms_norm(ex: CupyExecutable, d: int, node: Tensor) -> list:
    return record(rms_norm, array_of(ex, d, node.src[0]), array_of(ex, d, node), eps=node.params["eps"])


def _run_norm(ex: CupyExecutable, d: int, node: Tensor) -> list:
    return record(norm, array_of(ex, d, node.src[0]), array_of(ex, d, node), eps=node.params["eps"])


def _run_sum_rows(ex: CupyExecutable, d: int, node: Tensor) -> list:
    return record(sum_rows, array_of(ex, d, node.src[0]), array_of(ex, d, node))


def _run_norm_times_weight(ex: CupyExecutable, d: int, node: Tensor, norm_node: Tensor) -> list:
    """MUL(RMS_NORM(x) or NORM(x), w) as one kernel writing the MUL's buffer."""
    fn = rms_norm if norm_node.op is Op.RMS_NORM else norm
    w = array_of(ex, d, node.src[1]).reshape(-1)
    return record(fn, array_of(ex, d, norm_node.src[0]), array_of(ex, d, node), eps=norm_node.params["eps"],
                  weight=w)


def _fused_norm(ex: CupyExecutable, d: int, f: Fusion) -> list:
    return _run_norm_times_weight(ex, d, f.at, f.parts["norm"])


def unfused_with_folded_norm(ex: CupyExecutable, d: int, f: Fusion) -> list:
    """A fusion that folded MUL(RMS_NORM(x), w) in, run node by node: the folded norm runs as
    the norm x weight kernel writing the MUL's buffer (the RMS_NORM's buffer may be gone)."""
    idx = ex.plan.graph.index
    steps: list = []
    for t in sorted(f.members, key=lambda t: idx[t]):
        if t.op is Op.RMS_NORM:
            continue
        if t.op is Op.MUL and t.src[0].op is Op.RMS_NORM:
            steps += _run_norm_times_weight(ex, d, t, t.src[0])
            continue
        steps += ex.node_steps(d, t)
    return steps


# ---------------------------------------------------------------- fusion
def _find_norm(ex: CupyExecutable, node: Tensor, taken) -> list[Fusion]:
    """MUL(RMS_NORM(x) or NORM(x), w) with w a weight row [ne0] (as the numpy backend fuses)."""
    return norm_weight_fusion(ex, node, (Op.RMS_NORM, Op.NORM), lambda mul, nrm: _norm_keep(ex, mul, nrm))


def _norm_keep(ex: CupyExecutable, node: Tensor, norm_node: Tensor) -> tuple[Tensor, ...] | None:
    """What the norm x weight kernel needs kept alive: x, when nothing reads it after the MUL
    (not for a prefill-sized x); None when the kernel cannot take the weight (raw blocks)."""
    w = node.src[1]
    if any(isinstance(ex.arrays[d][w], RawWeight) for d in ex.devices):
        return None
    x = norm_node.src[0]
    x_root = x.view_src or x
    keep: tuple[Tensor, ...] = ()
    if x_root.op is not Op.NONE and not ex.facts.uses_after(x_root, ex.plan.graph.index[node]):
        keep = (x_root,)
        if norm_node.ne[1] * norm_node.ne[2] * norm_node.ne[3] > MATVEC_MAX_TOKENS:
            return None          # keeping a prefill-sized tensor alive costs more than the launch
    return keep


workspace = no_workspace

HANDLERS = {Op.RMS_NORM: _run_rms_norm, Op.NORM: _run_norm, Op.SUM_ROWS: _run_sum_rows}
FUSIONS = (FusionRow(FusionKind.NORM, _find_norm, _fused_norm, unfused_in_order),)
