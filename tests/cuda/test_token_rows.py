"""The token-row layout every product launcher resolves (`backends.cuda.token_rows`): defaults from the
arrays, and arrays too small for the rows refused before a kernel could read past them."""

from __future__ import annotations

import numpy as np
import pytest

from metatp.backends.cuda.token_rows import TokenRows, token_rows


def test_defaults_come_from_the_arrays():
    x, y = np.zeros((3, 80), np.float32)[:, :64], np.zeros((3, 16), np.float32)
    assert token_rows(x, y, ne0=64, n_rows=16) == TokenRows(3, 80, 16, 0)
    flat = np.zeros(64, np.float32)
    assert token_rows(flat, np.zeros(16, np.float32), ne0=64, n_rows=16) == TokenRows(1, 64, 16, 0)


@pytest.mark.parametrize("add_shape, stride", [((16,), 0), ((1, 16), 0), ((3, 16), 16), ((48,), 16)])
def test_a_residual_is_broadcast_or_strided(add_shape, stride):
    x, y = np.zeros((3, 64), np.float32), np.zeros((3, 16), np.float32)
    add = np.zeros(add_shape, np.float32)
    assert token_rows(x, y, ne0=64, n_rows=16, add=add).add_stride == stride
    assert token_rows(x, y, ne0=64, n_rows=16, add=add, add_stride=7).add_stride == 7


@pytest.mark.parametrize("x_shape, y_shape, n_tokens, name", [
    ((2, 64), (4, 16), 4, "x"),        # a 2-D x with fewer rows than tokens (matvec used to let it through)
    ((4, 63), (4, 16), 4, "x"),
    ((4, 64), (3, 16), 4, "y"),
    ((4 * 64 - 1,), (4, 16), 4, "x"),
])
def test_arrays_too_small_for_the_rows_are_refused(x_shape, y_shape, n_tokens, name):
    x, y = np.zeros(x_shape, np.float32), np.zeros(y_shape, np.float32)
    with pytest.raises(ValueError, match=rf"^{name} .* too small for {n_tokens} token rows"):
        token_rows(x, y, ne0=64, n_rows=16, n_tokens=n_tokens)
