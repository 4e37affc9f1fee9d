"""Offsets past 2^31 in the CUDA kernels, on the CPU emulator, without allocating gigabytes.

Each kernel is launched with a row stride (bytes or elements) of about 2^30 and a row index of 2,
so its last row's offset passes 2^31: formed in 32-bit `int` it would wrap. The buffers are
private anonymous mappings reserved without backing (MAP_NORESERVE): only the few pages the test
writes or the kernel reads get memory; the rest of the 4-9 GB of address space reads as zeros.
The base pointer sits in the middle of its mapping, so a wrapped (negative) offset lands on mapped
zeros and the test fails on wrong values (not a segfault). The shapes these offsets stand for, and
the table of every kernel's largest offsets, are in docs/kernels.md ("32-bit indices").
"""

from __future__ import annotations

import mmap

import numpy as np
import pytest

from metatp.backends.cuda import kernels as ck
from metatp.backends.cuda.launch import using
from metatp.testing.cuda_emulator import Emulator
from support.require import requires

pytestmark = requires("emulator")

#: Linux's MAP_NORESERVE (Python's mmap module names it from 3.13 on)
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)
#: a row stride whose third row (index 2) starts past 2^31 units
STRIDE = 2**30 + 2**16
PAGE = 4096


class Sparse:
    """A lazily backed host buffer: `base` (uint8) starts `before` bytes into the mapping."""

    def __init__(self, before: int, after: int):
        self._mm = mmap.mmap(-1, before + after, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE)
        self.base = np.frombuffer(self._mm, dtype=np.uint8)[before:]

    def at(self, offset: int, dtype, count: int) -> np.ndarray:
        """`count` elements of `dtype` at byte `offset` from the base."""
        size = np.dtype(dtype).itemsize * count
        return self.base[offset:offset + size].view(dtype)


def _span(rows: int, stride_bytes: int) -> tuple[int, int]:
    """(before, after) bytes of a mapping for `rows` rows `stride_bytes` apart: room after the base
    for every row, and before it for a 32-bit wrap of the last row's offset."""
    last = (rows - 1) * stride_bytes
    return last + PAGE, last + 2 * PAGE


@pytest.fixture(scope="module")
def emu():
    with using(Emulator()) as e:
        yield e


def test_matvec_weight_row_offset_past_2gb(emu):
    """matvec (the row core matvec_multi, the GLU and qkv_rope share): W row r at r * row_bytes."""
    ne0, rows = 64, 3
    buf = Sparse(*_span(rows, STRIDE))
    rng = np.random.default_rng(0)
    w = rng.standard_normal((rows, ne0)).astype(np.float32)
    for r in range(rows):
        buf.at(r * STRIDE, np.float32, ne0)[:] = w[r]
    x = rng.standard_normal(ne0).astype(np.float32)
    y = np.zeros(rows, np.float32)
    ck.matvec.matvec(buf.base, "f32", x, y, ne0=ne0, n_rows=rows, w_row_bytes=STRIDE)
    np.testing.assert_allclose(y, w.astype(np.float64) @ x, rtol=1e-5, atol=1e-5)


def test_dequant_source_row_offset_past_2gb(emu):
    """dequant (the f16 scratch for cuBLAS): source row r at r * src_row_bytes."""
    rows = 3
    buf = Sparse(*_span(rows, STRIDE))
    rng = np.random.default_rng(1)
    scales = np.array([0.5, -0.25, 2.0], np.float16)
    codes = rng.integers(-127, 128, (rows, 32), dtype=np.int8)
    for r in range(rows):
        block = buf.at(r * STRIDE, np.uint8, 34)
        block[:2] = np.frombuffer(scales[r].tobytes(), np.uint8)
        block[2:] = codes[r].view(np.uint8)
    out = np.zeros((rows, 32), np.float32)
    ck.dequant.dequantize(buf.base, "q8_0", out, ne0=32, n_rows=rows, src_row_bytes=STRIDE)
    np.testing.assert_array_equal(out, codes.astype(np.float32) * scales.astype(np.float32)[:, None])


def test_get_rows_source_row_offset_past_2gb(emu):
    """get_rows (an embedding lookup): source row idx[i] at idx[i] * src_row_bytes."""
    ne0, rows = 64, 3
    buf = Sparse(*_span(rows, STRIDE))
    table = np.arange(rows * ne0, dtype=np.float32).reshape(rows, ne0) + 1.0
    for r in range(rows):
        buf.at(r * STRIDE, np.float32, ne0)[:] = table[r]
    idx = np.array([2, 0, 2], np.int32)
    out = np.zeros((idx.size, ne0), np.float32)
    ck.elementwise.get_rows(buf.base, "f32", idx, out, ne0=ne0, src_row_bytes=STRIDE)
    np.testing.assert_array_equal(out, table[idx])


def test_set_rows_cache_row_offset_past_2g_elements(emu):
    """set_rows into an f16 cache: row idx[r] at idx[r] * dst_row_stride elements (past 2^31)."""
    ne0, rows = 64, 3
    buf = Sparse(*_span(rows, 2 * STRIDE))
    cache = buf.base.view(np.float16)
    src = (np.arange(2 * ne0, dtype=np.float32).reshape(2, ne0) - 40.0) / 8.0
    idx = np.array([2, 0], np.int32)
    ck.kv.set_rows(src, cache, idx, ne0=ne0, dst_row_stride=STRIDE)
    got = np.stack([buf.at(r * 2 * STRIDE, np.float16, ne0) for r in (2, 0)])
    np.testing.assert_array_equal(got, src.astype(np.float16))
    assert not buf.at(STRIDE * 2, np.float16, ne0).any()  # row 1: untouched
