"""The emulator's mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 and m16n8k16.row.col.f32.f16.f16.f32
alone, against numpy.

The fragments are laid out here from the PTX ISA's tables ("Matrix Fragments for mma.m16n8k32",
integer types), written apart from both the emulator and cuda/mmq.cu: a wrong lane / register /
byte mapping in the emulator fails this test, and one in the kernel fails the mmq_q8 checks
(whose products go through this emulated instruction); likewise the f16 form and the mmq_h checks.
"""

from __future__ import annotations

import numpy as np
import pytest

from metatp.testing.cuda_emulator import Emulator
from support.require import requires

requires_cxx = requires("emulator")

# Each lane loads its fragments (a: 4 words, b: 2, c: 4) from global memory, runs the mma and
# stores its 4 outputs; lanes >= `active` leave before the mma (which must then fault).
def _probe(name: str, word: str, acc: str, call: str) -> str:
    return f"""
extern "C" __global__ void {name}(const {word}* a, const {word}* b, const {acc}* c, {acc}* d, int active) {{
    const int lane = threadIdx.x;
    if (lane >= active) return;
    {word} av[4], bv[2];
    {acc} cv[4], dv[4];
    for (int i = 0; i < 4; ++i) av[i] = a[4 * lane + i];
    for (int i = 0; i < 2; ++i) bv[i] = b[2 * lane + i];
    for (int i = 0; i < 4; ++i) cv[i] = c[4 * lane + i];
    mt_emu::{call}(dv, av, bv, cv);
    for (int i = 0; i < 4; ++i) d[4 * lane + i] = dv[i];
}}
"""


_PROBE = _probe("mma_probe", "int", "int", "mma_m16n8k32_s8")
_PROBE_F16 = _probe("mma_f16_probe", "unsigned", "float", "mma_m16n8k16_f16")


def _fragments(A: np.ndarray, B: np.ndarray, C: np.ndarray):
    """Per lane (groupID = lane // 4, t = lane % 4), as the PTX ISA tables give them:
    a_i (i < 16): row groupID (+8 for i in 4..7 and 12..15), col 4t + i % 4 (+16 for i >= 8);
    b_i (i < 8): row 4t + i % 4 (+16 for i >= 4), col groupID;
    c: `_c_fragments`. Element i of a / b is byte i % 4 (little-endian) of register i // 4."""
    a = np.zeros((32, 16), np.int8)
    b = np.zeros((32, 8), np.int8)
    for lane in range(32):
        g, t = divmod(lane, 4)
        for i in range(16):
            row = g + (8 if (4 <= i < 8 or i >= 12) else 0)
            a[lane, i] = A[row, 4 * t + i % 4 + (16 if i >= 8 else 0)]
        for i in range(8):
            b[lane, i] = B[4 * t + i % 4 + (16 if i >= 4 else 0), g]
    return a.view(np.int32).copy(), b.view(np.int32).copy(), _c_fragments(C, np.int32)


def _c_index(lane: int, i: int) -> tuple[int, int]:
    """(row, col) of c_i / d_i (i < 4) in lane, both forms: row groupID (+8 for i >= 2), col 2t + i % 2."""
    g, t = divmod(lane, 4)
    return g + (8 if i >= 2 else 0), 2 * t + i % 2


def _c_fragments(C: np.ndarray, dtype) -> np.ndarray:
    """The lanes' accumulator fragments (32 x 4) of C (16 x 8)."""
    return np.array([[C[_c_index(lane, i)] for i in range(4)] for lane in range(32)], dtype)


def _unpack_d(d: np.ndarray) -> np.ndarray:
    """D (16 x 8) from the lanes' c-layout outputs."""
    out = np.zeros((16, 8), d.dtype)
    for lane in range(32):
        for i in range(4):
            out[_c_index(lane, i)] = d[lane, i]
    return out


def _launch(source: str, name: str, a, b, c, active: int) -> np.ndarray:
    d = np.full((32, 4), -1, c.dtype)
    k = Emulator().probe_kernel(source, name)
    k((1,), (32,), (a, b, c, d, np.int32(active)))
    return _unpack_d(d)


def _run(A, B, C, active=32):
    return _launch(_PROBE, "mma_probe", *_fragments(A, B, C), active).astype(np.int64)


@requires_cxx
@pytest.mark.parametrize("seed", [0, 1])
def test_emulated_mma_is_the_matrix_product(seed):
    rng = np.random.default_rng(seed)
    A = rng.integers(-128, 128, (16, 32), dtype=np.int8)
    B = rng.integers(-128, 128, (32, 8), dtype=np.int8)
    C = rng.integers(-2**20, 2**20, (16, 8), dtype=np.int32)
    want = A.astype(np.int64) @ B.astype(np.int64) + C
    np.testing.assert_array_equal(_run(A, B, C), want)


@requires_cxx
def test_emulated_mma_extremes():
    """-128 * -128 summed 32 times (the largest product) and a single nonzero element per matrix."""
    A = np.full((16, 32), -128, np.int8)
    B = np.full((32, 8), -128, np.int8)
    C = np.zeros((16, 8), np.int32)
    np.testing.assert_array_equal(_run(A, B, C), np.full((16, 8), 32 * 128 * 128))
    A = np.zeros((16, 32), np.int8)
    B = np.zeros((32, 8), np.int8)
    A[11, 21] = 3
    B[21, 6] = -5
    want = np.zeros((16, 8), np.int64)
    want[11, 6] = -15
    np.testing.assert_array_equal(_run(A, B, C), want)


@requires_cxx
def test_emulated_mma_needs_the_whole_warp():
    """.aligned: all 32 lanes execute it; a lane that left first is a launch error, not garbage."""
    z8 = np.zeros((16, 32), np.int8)
    with pytest.raises(RuntimeError, match="mma.sync.aligned.*32 lanes"):
        _run(z8, np.zeros((32, 8), np.int8), np.zeros((16, 8), np.int32), active=31)


# ---- mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 (the tensor-core tiles, mmq_h_*)
def _fragments_f16(A: np.ndarray, B: np.ndarray, C: np.ndarray):
    """The PTX ISA's table for m16n8k16 with .f16 (groupID = lane // 4, t = lane % 4):
    a_i (i < 8): row groupID for a0, a1, a4, a5 and groupID + 8 for a2, a3, a6, a7; col 2t + (i & 1),
    + 8 for i >= 4; b_i (i < 4): row 2t + (i & 1), + 8 for i >= 2; col groupID; c as the integer form.
    Element i is half i % 2 (the low half first) of register i // 2."""
    a = np.zeros((32, 8), np.float16)
    b = np.zeros((32, 4), np.float16)
    for lane in range(32):
        g, t = divmod(lane, 4)
        for i in range(8):
            a[lane, i] = A[g + (8 if i in (2, 3, 6, 7) else 0), 2 * t + (i & 1) + (8 if i >= 4 else 0)]
        for i in range(4):
            b[lane, i] = B[2 * t + (i & 1) + (8 if i >= 2 else 0), g]
    return a.view(np.uint32).copy(), b.view(np.uint32).copy(), _c_fragments(C, np.float32)


def _run_f16(A, B, C, active=32):
    return _launch(_PROBE_F16, "mma_f16_probe", *_fragments_f16(A, B, C), active)


@requires_cxx
@pytest.mark.parametrize("seed", [0, 1])
def test_emulated_f16_mma_is_the_matrix_product(seed):
    """D = A B + C with f16 A and B, f32 C and D: the products are exact in f32 and the sum is rounded
    once, so the result is the float64 product rounded to f32."""
    rng = np.random.default_rng(seed)
    A = rng.standard_normal((16, 16)).astype(np.float16)
    B = rng.standard_normal((16, 8)).astype(np.float16)
    C = rng.standard_normal((16, 8)).astype(np.float32)
    want = (A.astype(np.float64) @ B.astype(np.float64) + C).astype(np.float32)
    np.testing.assert_array_equal(_run_f16(A, B, C), want)
    # one nonzero element each: the mapping of a single (row, k, col)
    A, B = np.zeros((16, 16), np.float16), np.zeros((16, 8), np.float16)
    A[13, 9], B[9, 5] = 0.5, -3.0
    want = np.zeros((16, 8), np.float32)
    want[13, 5] = -1.5
    np.testing.assert_array_equal(_run_f16(A, B, np.zeros((16, 8), np.float32)), want)


@requires_cxx
def test_emulated_f16_mma_needs_the_whole_warp():
    with pytest.raises(RuntimeError, match="mma.sync.aligned.*32 lanes"):
        _run_f16(np.zeros((16, 16), np.float16), np.zeros((16, 8), np.float16), np.zeros((16, 8), np.float32),
                 active=30)
