"""Row reductions (``cuda/norm.cu``): RMS norm and layer norm (optionally times a weight row), SUM_ROWS.
"""

from __future__ import annotations

from metatp.backends.cuda.launch import launch, i32, f32, nd, check_f32, row_block

__all__ = ['ENTRY_POINTS', 'rms_norm', 'norm', 'sum_rows']

ENTRY_POINTS = ["rms_norm_f32", "norm_f32", "sum_rows_f32"]


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
