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
import sys

import numpy as np
import pytest

from metatp.backends.cuda import kernels as ck
from metatp.backends.cuda.launch import using
from metatp.testing.cuda_emulator import Emulator
from support.require import requires

pytestmark = requires("emulator")

#: MAP_NORESERVE (0x4000 on Linux; not every Python's mmap module names it): address space only
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform.startswith("linux") else 0)
#: a row stride whose third row (index 2) starts past 2^31 units
STRIDE = 2**30 + 2**16
PAGE = 4096


class Sparse:
    """A lazily backed host buffer: `base` (uint8) starts `before` bytes into the mapping."""

    def __init__(self, before: int, after: int):
        try:
            self._mm = mmap.mmap(-1, before + after, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE)
        except OSError as e:
            pytest.fail(f"cannot reserve {before + after} bytes of address space (strict overcommit, "
                        f"vm.overcommit_memory=2, or a ulimit -v?): {e}")
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


def _q8_0_rows(buf: Sparse, rows: int, ne0: int, seed: int) -> np.ndarray:
    """Q8_0 weight rows written STRIDE bytes apart; returns their float values."""
    rng = np.random.default_rng(seed)
    scales = rng.choice(np.array([0.5, -0.25, 2.0, 0.125], np.float16), (rows, ne0 // 32))
    codes = rng.integers(-127, 128, (rows, ne0), dtype=np.int8)
    for r in range(rows):
        for b in range(ne0 // 32):
            block = buf.at(r * STRIDE + 34 * b, np.uint8, 34)
            block[:2] = np.frombuffer(scales[r, b].tobytes(), np.uint8)
            block[2:] = codes[r, 32 * b:32 * b + 32].view(np.uint8)
    return codes.astype(np.float32) * np.repeat(scales.astype(np.float32), 32, axis=1)


def _q8_grid(n_tokens: int, ne0: int, seed: int) -> np.ndarray:
    """Activations the Q8 rounding keeps exactly: codes times 1/8, each 32-block reaching 127."""
    rng = np.random.default_rng(seed)
    codes = rng.integers(-127, 128, (n_tokens, ne0)).astype(np.float32)
    codes[:, ::32] = 127.0
    return codes / 8.0


def test_dequant_source_row_offset_past_2gb(emu):
    """dequant (the f16 scratch for cuBLAS): source row r at r * src_row_bytes."""
    rows = 3
    buf = Sparse(*_span(rows, STRIDE))
    w = _q8_0_rows(buf, rows, 32, seed=1)
    out = np.zeros((rows, 32), np.float32)
    ck.dequant.dequantize(buf.base, "q8_0", out, ne0=32, n_rows=rows, src_row_bytes=STRIDE)
    np.testing.assert_array_equal(out, w)


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


def test_mmvq_weight_row_offset_past_2gb(emu):
    """mmvq (the int8 decode product; one token rounded in the prologue, and two through the
    quantized workspace): W row r at r * row_bytes."""
    ne0, rows = 64, 3
    buf = Sparse(*_span(rows, STRIDE))
    w = _q8_0_rows(buf, rows, ne0, seed=2).astype(np.float64)
    x = _q8_grid(2, ne0, seed=3)
    y1 = np.zeros(rows, np.float32)
    ck.mmvq.mmvq(buf.base, "q8_0", x[0], y1, ne0=ne0, n_rows=rows, w_row_bytes=STRIDE)
    np.testing.assert_allclose(y1, w @ x[0], rtol=1e-5)
    xq, xds = (np.zeros(n, dt) for n, dt in ck.mmvq.q8_workspace(ne0, 2).values())
    y2 = np.zeros((2, rows), np.float32)
    ck.mmvq.mmvq(buf.base, "q8_0", x, y2, ne0=ne0, n_rows=rows, w_row_bytes=STRIDE, xq=xq, xds=xds)
    np.testing.assert_allclose(y2, x @ w.T, rtol=1e-5)


def test_mmq_weight_row_offset_past_2gb(emu):
    """mmq (the float tile) and mmq_q8 (the int8 mma tile): W row r at r * row_bytes."""
    ne0, rows, n_tok = 64, 3, 5
    buf = Sparse(*_span(rows, STRIDE))
    w = _q8_0_rows(buf, rows, ne0, seed=4).astype(np.float64)
    x = _q8_grid(n_tok, ne0, seed=5)
    y = np.zeros((n_tok, rows), np.float32)
    ck.mmq.mmq(buf.base, "q8_0", x, y, ne0=ne0, n_rows=rows, w_row_bytes=STRIDE)
    np.testing.assert_allclose(y, x @ w.T, rtol=1e-5)
    acts = ck.mmq.q8_acts_empty(ck.mmq.MMQ_Q8_KIND["q8_0"], n_tok, ne0)
    y8 = np.zeros((n_tok, rows), np.float32)
    ck.mmq.mmq_q8(buf.base, "q8_0", x, y8, acts, ne0=ne0, n_rows=rows, w_row_bytes=STRIDE)
    np.testing.assert_allclose(y8, x @ w.T, rtol=1e-5)


def _attention_ref(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float, offset: int) -> np.ndarray:
    """float64 causal attention, one KV head: q [T, H, D], k / v [n_kv, D]; key j seen by token t
    when j <= t + offset."""
    s = np.einsum("thd,jd->thj", q.astype(np.float64), k.astype(np.float64)) * scale
    t_idx = np.arange(q.shape[0])[:, None, None]
    s = np.where(np.arange(k.shape[0])[None, None, :] <= t_idx + offset, s, -np.inf)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    return np.einsum("thj,jd->thd", p / p.sum(axis=-1, keepdims=True), v.astype(np.float64))


@pytest.mark.parametrize("kernel", ["decode", "prefill"])
def test_attention_cache_row_offset_past_2g_elements(emu, kernel):
    """flash attention over an f16 cache: key / value row j at j * row_stride elements (past 2^31)."""
    n_head, d, n_kv = 2, 64, 3
    n_tok = 1 if kernel == "decode" else n_kv
    buf = Sparse(*_span(n_kv, 2 * STRIDE))
    rng = np.random.default_rng(6)
    k = rng.standard_normal((n_kv, d)).astype(np.float16)
    v = rng.standard_normal((n_kv, d)).astype(np.float16)
    for j in range(n_kv):
        buf.at(j * 2 * STRIDE, np.float16, d)[:] = k[j]
        buf.at(j * 2 * STRIDE + 2 * d, np.float16, d)[:] = v[j]
    cache = buf.base.view(np.float16)
    q = rng.standard_normal((n_tok, n_head, d)).astype(np.float32)
    out = np.zeros((n_tok, n_head, d), np.float32)
    run = ck.attn.flash_attn_decode if kernel == "decode" else ck.attn.flash_attn_prefill
    extra = {"n_splits": 1} if kernel == "decode" else {}
    run(q, cache, cache[d:], out, n_head=n_head, n_head_kv=1, head_dim=d, n_tokens=n_tok, n_kv=n_kv,
        scale=0.125, k_strides=(d, STRIDE), v_strides=(d, STRIDE), **extra)
    np.testing.assert_allclose(out, _attention_ref(q, k, v, 0.125, n_kv - n_tok), rtol=1e-4, atol=1e-5)


def test_argmax_row_offset_past_2g_elements(emu):
    """argmax over logits rows: row r at r * row_stride elements (past 2^31)."""
    ne0, rows = 256, 3
    buf = Sparse(*_span(rows, 4 * STRIDE))
    want = np.array([17, 200, 3], np.int32)
    for r in range(rows):
        row = buf.at(r * 4 * STRIDE, np.float32, ne0)
        row[:] = -1.0
        row[want[r]] = 5.0
    x = np.lib.stride_tricks.as_strided(buf.base.view(np.float32), (rows, ne0), (4 * STRIDE, 4))
    out = np.zeros(rows, np.int32)
    ck.elementwise.argmax(x, out)
    np.testing.assert_array_equal(out, want)
