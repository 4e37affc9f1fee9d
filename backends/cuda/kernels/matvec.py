"""Weight x activation for a few tokens (``cuda/matvec.cu``): plain, with an add epilogue, q/k/v in one
launch, gate/up + GLU, and MUL_MAT_ID (experts); an RMS norm of x can be folded into the prologue.
"""

from __future__ import annotations

from metatp.backends.cuda.launch import (WEIGHT_TYPES, CHUNK_ELEMS, launch, i32, f32, cdiv, estrides,
                                         check_f32, check_i32, tail, check_block_type)

__all__ = ['ENTRY_POINTS', 'MATVEC_MAX_TOKENS', 'matvec', 'matvec_multi', 'matvec_glu', 'matvec_id']

#: matvec handles up to this many tokens per launch (llama.cpp's MMVQ_MAX_BATCH_SIZE).
MATVEC_MAX_TOKENS = 8
_MATVEC_NT = (1, 2, 4, 8)
_GLU_ACTS = ("swiglu", "geglu")
ENTRY_POINTS = ([f"matvec_{t}_t{n}" for t in WEIGHT_TYPES for n in _MATVEC_NT]
                + [f"matvec_multi_{t}" for t in WEIGHT_TYPES]
                + [f"matvec_{a}_{t}" for t in WEIGHT_TYPES for a in _GLU_ACTS]
                + [f"matvec_id_{t}" for t in WEIGHT_TYPES])


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
