"""Where a product's token rows lie: the count and element strides of x, y and a residual.

The one-token-at-a-time products (matvec, mmvq) and the many-token ones (mmq, the q8 rounding
kernels) take the same arguments: x (n_tokens, ne0) or flat, y (n_tokens, n_rows) or flat, an
optional residual, each with an optional token stride. Resolving the defaults and checking the
arrays are big enough in one place keeps the families' launchers from drifting apart (one of
them used to check only the row length of a 2-D x, not its token count).
"""

from __future__ import annotations

from typing import NamedTuple

from metatp.backends.cuda.launch import estrides

__all__ = ["TokenRows", "token_count", "row_stride", "require_rows", "token_rows"]


class TokenRows(NamedTuple):
    """Token count and element strides of a product's operands (add_stride 0: one row
    broadcast over the tokens, or no residual)."""
    n_tokens: int
    x_stride: int
    y_stride: int
    add_stride: int


def token_count(x, n_tokens: int | None) -> int:
    """The given count, else x's leading dimension (a flat x is one token)."""
    if n_tokens is not None:
        return n_tokens
    return x.shape[0] if x.ndim == 2 else 1


def row_stride(a, row_len: int, given: int | None) -> int:
    """The given token stride, else a 2-D array's leading stride (a flat one: packed rows)."""
    if given is not None:
        return given
    return estrides(a)[0] if a.ndim == 2 else row_len


def require_rows(a, name: str, row_len: int, n_tokens: int, stride: int) -> None:
    """Refuse an array that cannot hold n_tokens rows of row_len elements `stride` apart."""
    if a.ndim == 2:
        small = a.shape[1] < row_len or a.shape[0] < n_tokens
    else:
        small = a.size < (n_tokens - 1) * stride + row_len
    if small and n_tokens:
        raise ValueError(f"{name} {tuple(a.shape)} too small for {n_tokens} token rows of {row_len} "
                         f"(stride {stride})")


def token_rows(x, y, *, ne0: int, n_rows: int, n_tokens: int | None = None, x_stride: int | None = None,
               y_stride: int | None = None, add=None, add_stride: int | None = None) -> TokenRows:
    """Resolve the defaults of ``y = W x (+ add)``'s layout and refuse arrays too small for it.

    A residual without a stride: a 2-D one of several rows uses its leading stride; one of
    n_rows elements is broadcast (stride 0, e.g. a bias); otherwise packed rows."""
    n = token_count(x, n_tokens)
    xs = row_stride(x, ne0, x_stride)
    ys = row_stride(y, n_rows, y_stride)
    if add is None:
        adds = 0
    elif add_stride is not None:
        adds = add_stride
    elif add.ndim == 2 and add.shape[0] > 1:
        adds = estrides(add)[0]
    else:
        adds = 0 if add.size == n_rows else n_rows
    require_rows(x, "x", ne0, n, xs)
    require_rows(y, "y", n_rows, n, ys)
    return TokenRows(n, xs, ys, adds)
