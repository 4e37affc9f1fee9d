"""The float product (exact numerics) on weights in the row-group layout (csrc/qmatmul_groups.c):
512-bit builds read it, each group's block dequantized once for up to 8 tokens, and from 16 tokens
on once for all of a pass's tokens (kept by the first tile, read back by the others).

Against the float64 product of the dequantized weights (within float32 rounding), batch-invariant
(each token's row bit-identical to the token alone, at every tile shape and remainder: token
counts 1-130 cross the 8/4/2/1 tiles, the kept weights' threshold and the 64-token blocks), with strided rows, 1 and 2 threads, every format the layout
takes (4-bit codes with and without bias and offsets, 8-bit codes, half or float32 scales). The
512-bit build is compiled on every x86-64 machine and run where the CPU has AVX-512; builds
without it must refuse the layout by name."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metatp.backends.numpy import native
from metatp.backends.numpy.codes import GROUP, AffineWeight, dequantize_affine, group_rows, pack_nibbles
from support.cpu import isa_library
from support.require import requires

pytestmark = requires("cpu_kernels")

F32 = np.float32


@pytest.fixture(scope="module")
def wide():
    """The 512-bit build in use (skips after building it where the CPU cannot run it)."""
    lib = isa_library("avx512-vnni")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(native.lib, "_library", lambda: (lib, "avx512-vnni"))
        assert native.float_row_groups()
        yield lib


def _grouped(rng, groups: int, k: int, bits: int, bias: int, offset: bool, half: bool) -> AffineWeight:
    rows = groups * GROUP
    scale = (rng.standard_normal((rows, k // 32)) * 0.02).astype(F32)
    off = (rng.standard_normal((rows, k // 32)) * 0.02).astype(F32) if offset else None
    if half:            # group_rows keeps scales as halves where they are exact in f16 (Q4_0, Q4_1, Q8_0)
        scale = scale.astype(np.float16).astype(F32)
        off = None if off is None else off.astype(np.float16).astype(F32)
    if bits == 4:
        q = pack_nibbles(rng.integers(-bias, 16 - bias, (rows, k)).astype(np.int8), bias)
    else:
        q = rng.integers(-128, 128, (rows, k)).astype(np.int8)
    aw = AffineWeight(q=q, scale=scale, offset=off, block=32, bits=bits, bias=bias if bits == 4 else 0)
    g = group_rows(aw)
    assert (g.scale.dtype == np.float16) == half
    return g


@settings(max_examples=60, deadline=None)
@given(groups=st.integers(1, 9), units=st.integers(1, 10), fmt=st.sampled_from([(4, 0), (4, 8), (8, 0)]),
       offset=st.booleans(), half=st.booleans(),
       ntok=st.one_of(st.integers(1, 20), st.sampled_from([15, 16, 17, 23, 24, 31, 33, 64, 77, 130])),
       pad_x=st.integers(0, 5), pad_y=st.integers(0, 5), threads=st.sampled_from([1, 2]), seed=st.integers(0, 2**16))
def test_the_row_group_float_product_matches_and_is_batch_invariant(wide, groups, units, fmt, offset, half, ntok,
                                                                    pad_x, pad_y, threads, seed):
    rng = np.random.default_rng(seed)
    bits, bias = fmt
    k = units * 32
    aw = _grouped(rng, groups, k, bits, bias, offset, half)
    rows = aw.rows
    xbuf = rng.standard_normal((ntok, k + pad_x)).astype(F32)
    ybuf = np.full((ntok, rows + pad_y), np.nan, dtype=F32)
    x, y = xbuf[:, :k], ybuf[:, :rows]
    native.prepare_qmatmul(aw, x, y, threads)()
    ref = x.astype(np.float64) @ dequantize_affine(aw).astype(np.float64).T
    assert np.allclose(y, ref, rtol=1e-5, atol=1e-5 * max(1.0, np.abs(ref).max(initial=0)))
    assert np.isnan(ybuf[:, rows:]).all()
    for t in range(ntok):
        alone = np.empty((1, rows), F32)
        native.prepare_qmatmul(aw, x[t:t + 1], alone, 1)()
        assert np.array_equal(alone[0], y[t]), f"token {t} of {ntok} differs from itself alone"


def test_grouped_and_separate_calls_give_the_same_bits(wide):
    rng = np.random.default_rng(3)
    parts = []
    for groups, k, bits, bias, off in [(72, 576, 4, 0, True), (24, 1536, 4, 8, False), (40, 576, 8, 0, False)]:
        aw = _grouped(rng, groups, k, bits, bias, off, True)
        x = rng.standard_normal((16, k)).astype(F32)
        parts.append((aw, x, np.empty((16, aw.rows), F32), np.empty((16, aw.rows), F32)))
    for aw, x, y1, _ in parts:
        native.prepare_qmatmul(aw, x, y1, 2)()
    native.group_qmatmul([native.prepare_qmatmul(aw, x, y2, 2) for aw, x, _, y2 in parts])()
    for _, _, y1, y2 in parts:
        assert np.array_equal(y1, y2)


@pytest.mark.parametrize("isa", ["avx2", "portable"])
def test_builds_without_512_bit_registers_refuse_the_layout_by_name(monkeypatch, isa):
    lib = isa_library(isa)
    monkeypatch.setattr(native.lib, "_library", lambda: (lib, isa))
    assert not native.float_row_groups()
    aw = _grouped(np.random.default_rng(0), 1, 64, 4, 0, True, True)
    with pytest.raises(ValueError, match="row-group layout"):
        native.prepare_qmatmul(aw, np.zeros((1, 64), F32), np.zeros((1, 8), F32))
