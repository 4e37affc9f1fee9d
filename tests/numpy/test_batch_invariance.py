"""Batch invariance of the compiled decode kernels (issue 15): a sequence's row of a step gets
the same bits alone or among other sequences' rows.

- attention: a query row whose cells sit at 0..L-1 gives the same output as with its cells at
  k*ATTN_CHUNK.. among other rows (each masked to its own cells), for any batch size T, thread
  count and KV cache type;
- matmul (float codes and Q8 integer paths): a row of x gives the same output row whatever the
  other rows of the step are, where it sits among them and how many there are.
Long prompt chunks (more than MAX_ROWS rows) go to float32 BLAS, whose sums depend on the batch
shape: they are not covered.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from metatp.backends.numpy import native
from support.require import requires
from metatp.backends.numpy.codes import GROUP, AffineWeight, group_rows, pack_nibbles
from metatp.ir.tensor import GGMLType

pytestmark = requires("cpu_kernels")

F32 = np.float32
KV_TYPES = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]


def _stable_seed(*case) -> int:
    """A seed that is the same in every process: hash() of a str is salted per interpreter
    (PYTHONHASHSEED), which gave each run (and each xdist worker) other random cases."""
    return zlib.crc32(repr(case).encode())


def _cache(rng, kind: str, Hkv: int, n: int, D: int) -> np.ndarray:
    """A random cache (n rows of Hkv heads of D values) as the kernel reads it: float32, float16
    or bytes per (row, head); returned (n, Hkv, last)."""
    x = rng.standard_normal((n * Hkv, D)).astype(F32)
    ty = GGMLType[kind]
    if ty == GGMLType.F32:
        return x.reshape(n, Hkv, D)
    if ty == GGMLType.F16:
        return x.astype(np.float16).reshape(n, Hkv, D)
    q = native.kv_quantize(x, int(ty))
    return q.reshape(n, Hkv, q.shape[1])


def _attend(q, cache_k, cache_v, mask, kind, n_kv, threads, Dv):
    H, T, D = q.shape
    ty = int(GGMLType[kind])
    k, v = cache_k.transpose(1, 0, 2), cache_v.transpose(1, 0, 2)
    out = np.full((T, H, Dv), np.nan, F32)
    native.prepare_attention(q, k, v, mask, 0.125, 0.0, None, out, threads, ty, ty)(n_kv)
    return out


@pytest.mark.parametrize("kind", KV_TYPES)
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("T", [1, 2, 3, 7, 16, 33, 64])
def test_attention_row_is_the_same_alone_and_batched(kind, threads, T):
    rng = np.random.default_rng(_stable_seed(kind, threads, T))
    Hkv, g, D = 2, 3, 64
    H = Hkv * g
    L = int(rng.integers(1, 3 * native.ATTN_CHUNK))          # the sequence's length
    k_off = int(rng.integers(1, 4))                      # chunks before its first cell when batched
    off = k_off * native.ATTN_CHUNK
    n_tot = off + L + int(rng.integers(0, 2 * native.ATTN_CHUNK))
    ck_all, cv_all = _cache(rng, kind, Hkv, n_tot, D), _cache(rng, kind, Hkv, n_tot, D)
    q_row = rng.standard_normal((H, D)).astype(F32)

    # alone: cells 0..L-1, one query row
    ck_alone, cv_alone = ck_all[off:off + L].copy(), cv_all[off:off + L].copy()
    q1 = q_row[:, None, :].copy()
    m1 = np.zeros((1, L), F32)
    alone = _attend(q1, ck_alone, cv_alone, m1, kind, L, threads, D)[0]

    # batched: its cells at off.., T-1 other rows each seeing a random range, the row at position t0
    t0 = int(rng.integers(0, T))
    qT = rng.standard_normal((H, T, D)).astype(F32)
    qT[:, t0] = q_row
    mask = np.full((T, n_tot), -np.inf, F32)
    for t in range(T):
        a = int(rng.integers(0, n_tot - 1))
        mask[t, a:int(rng.integers(a + 1, n_tot + 1))] = 0.0
    mask[t0] = -np.inf
    mask[t0, off:off + L] = 0.0
    n_kv = int(np.flatnonzero(np.isfinite(mask).any(axis=0))[-1]) + 1
    batched = _attend(qT, ck_all, cv_all, mask, kind, n_kv, threads, D)[t0]
    assert np.array_equal(alone.view(np.uint32), batched.view(np.uint32)), np.abs(alone - batched).max()


@pytest.mark.parametrize("kind", ["F32", "F16", "Q8_0"])
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("seed", [0, 1])
def test_sequences_on_their_own_chunks_with_empty_chunks_between(kind, threads, seed):
    """A decode step of many sequences, each on chunks of its own, with chunks no row sees between
    and after them (a cache larger than the step uses): only the seen chunks make units, and each
    row gets the bits it gets alone."""
    rng = np.random.default_rng(seed)
    Hkv, g, D, C = 3, 3, 64, native.ATTN_CHUNK
    H, T = Hkv * g, 7
    chunks = np.sort(rng.choice(np.arange(3 * T), T, replace=False))     # each sequence's first chunk
    lens = rng.integers(1, 2 * C, T)                                         # some run into a second
    n_tot = int(max(c * C + n for c, n in zip(chunks, lens))) + 2 * C
    ck, cv = _cache(rng, kind, Hkv, n_tot, D), _cache(rng, kind, Hkv, n_tot, D)
    q = rng.standard_normal((H, T, D)).astype(F32)
    mask = np.full((T, n_tot), -np.inf, F32)
    for t, (c, n) in enumerate(zip(chunks, lens)):
        mask[t, c * C:c * C + n] = 0.0
    batched = _attend(q, ck, cv, mask, kind, n_tot, threads, D)
    for t, (c, n) in enumerate(zip(chunks, lens)):
        s = slice(c * C, c * C + n)
        alone = _attend(q[:, t:t + 1].copy(), ck[s].copy(), cv[s].copy(), np.zeros((1, n), F32), kind, n, 1, D)[0]
        assert np.array_equal(alone.view(np.uint32), batched[t].view(np.uint32)), (t, np.abs(alone - batched[t]).max())


@pytest.mark.parametrize("kind", ["F32", "F16", "Q8_0"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_attention_row_is_the_same_with_other_cells_between_its_own(kind, seed):
    """A decode step's cells land wherever cells are free, so other sequences' (masked) cells may
    sit between a sequence's own within a block: its row gives the same bits as with its cells
    side by side (the softmax sums in cell order, where exact zeros change nothing)."""
    rng = np.random.default_rng(seed)
    Hkv, g, D, L, n_blk = 2, 3, 64, 29, 64                  # one KV block of the kernel
    H = Hkv * g
    ck_all, cv_all = _cache(rng, kind, Hkv, n_blk, D), _cache(rng, kind, Hkv, n_blk, D)
    mine = np.sort(rng.choice(np.arange(1, n_blk), L - 1, replace=False))
    mine = np.concatenate([[0], mine])                    # the first cell at a chunk boundary
    q = rng.standard_normal((H, 1, D)).astype(F32)
    side_by_side = _attend(q, ck_all[mine].copy(), cv_all[mine].copy(), np.zeros((1, L), F32), kind, L, 2, D)[0]
    mask = np.full((1, n_blk), -np.inf, F32)
    mask[0, mine] = 0.0
    spread = _attend(q, ck_all, cv_all, mask, kind, int(mine[-1]) + 1, 2, D)[0]
    assert np.array_equal(side_by_side.view(np.uint32), spread.view(np.uint32)), np.abs(side_by_side - spread).max()


@pytest.mark.parametrize("kind", KV_TYPES)
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("T", [1, 4, 16])
def test_hidden_cells_change_nothing_whatever_they_hold(kind, threads, T):
    """Cells a row's mask hides (a finished sequence's stale rows next to a new one's, the rest of a
    page) leave its output bit for bit as it is when they hold anything else, NaN and inf among it:
    the kernel neither lets their scores through nor reads them past the cells any row sees."""
    rng = np.random.default_rng(_stable_seed(kind, threads, T))
    Hkv, g, D, page = 3, 3, 64, native.ATTN_CHUNK
    H, n_tot = Hkv * g, T * page
    ck, cv = _cache(rng, kind, Hkv, n_tot, D), _cache(rng, kind, Hkv, n_tot, D)
    q = rng.standard_normal((H, T, D)).astype(F32)
    mask = np.full((T, n_tot), -np.inf, F32)
    hidden = np.ones(n_tot, bool)
    for t in range(T):                   # each row its own page, its cells from a random start
        a = t * page + int(rng.integers(0, 9))
        b = a + int(rng.integers(1, page - 9))
        mask[t, a:b] = 0.0
        hidden[a:b] = False
    n_kv = int(np.flatnonzero(np.isfinite(mask).any(axis=0))[-1]) + 1
    clean = _attend(q, ck, cv, mask, kind, n_kv, threads, D)
    for fill in (np.nan, np.inf):
        dk, dv = ck.copy(), cv.copy()
        if dk.dtype in (np.float32, np.float16):
            dk[hidden], dv[hidden] = fill, fill
        else:                            # quantized rows: their block scales (a half) made NaN or inf
            bad = np.array([fill], np.float16).view(np.uint8)
            blk = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24}.get(kind)
            if blk is None:          # BF16: the top half of a float32 NaN / inf
                dk[hidden], dv[hidden] = 0xFF, 0x7F
            else:
                for o in range(0, dk.shape[2], blk):
                    dk[hidden, :, o:o + 2] = bad
                    dv[hidden, :, o:o + 2] = bad
        dirty = _attend(q, dk, dv, mask, kind, n_kv, threads, D)
        assert np.isfinite(clean).all()
        assert np.array_equal(clean.view(np.uint32), dirty.view(np.uint32)), (fill, np.abs(clean - dirty).max())


def _weight(rng, fmt: str, rows: int, k: int) -> AffineWeight:
    """Random codes in the layouts affine_blocks makes (8-bit, nibbles with a bias, offsets,
    blocks of 16 or 32, half floats)."""
    scale = (rng.standard_normal((rows, k // 32)) * 0.02).astype(F32)
    if fmt in ("Q8_0", "Q4_0"):
        scale = scale.astype(np.float16).astype(F32)      # halves, as in the file (the grouped layout keeps halves)
    if fmt == "Q8_0":
        return AffineWeight(q=rng.integers(-127, 128, (rows, k)).astype(np.int8), scale=scale, offset=None,
                            block=32, ggml_type=GGMLType.Q8_0)
    if fmt in ("Q4_0", "Q4_1"):
        q = rng.integers(-8, 8, (rows, k)).astype(np.int8) if fmt == "Q4_0" else \
            rng.integers(0, 16, (rows, k)).astype(np.int8)
        bias = 8 if fmt == "Q4_0" else 0
        off = (rng.standard_normal((rows, k // 32)) * 0.02).astype(F32) if fmt == "Q4_1" else None
        return AffineWeight(q=pack_nibbles(q, bias), scale=scale, offset=off, block=32, bits=4, bias=bias,
                            ggml_type=GGMLType[fmt])
    if fmt == "Q6_K":           # blocks of 16 with an int8 code range of 6 bits
        s16 = (rng.standard_normal((rows, k // 16)) * 0.02).astype(F32)
        return AffineWeight(q=rng.integers(-32, 32, (rows, k)).astype(np.int8), scale=s16, offset=None, block=16,
                            ggml_type=GGMLType.Q6_K)
    w = rng.standard_normal((rows, k)).astype(F32)       # F16
    return AffineWeight(q=w.astype(np.float16).view(np.uint16), scale=np.ones((rows, k // 32), F32), offset=None,
                        block=32, bits=16)


# (format, path) pairs the kernels have: half-float codes have no integer (q8) path; 4- and 8-bit
# codes in blocks of 32 also have the integer kernel's row-group layout ("q8-grouped")
MATMUL_CASES = [(f, p) for f in ("Q8_0", "Q4_0", "Q4_1", "Q6_K", "F16") for p in ("float", "q8", "q8-grouped")
                if not (f == "F16" and p != "float") and not (f == "Q6_K" and p == "q8-grouped")]


def _case(rng, fmt: str, path: str, rows: int, k: int):
    """(weight, matmul) of a (format, path) pair; the grouped layout takes rows in whole groups."""
    if path == "q8-grouped":
        return group_rows(_weight(rng, fmt, rows - rows % GROUP + GROUP, k)), native.q8_matmul
    return _weight(rng, fmt, rows, k), native.qmatmul if path == "float" else native.q8_matmul


@pytest.mark.parametrize("fmt,path", MATMUL_CASES)
@pytest.mark.parametrize("threads", [1, 2])
def test_matmul_row_does_not_depend_on_the_other_rows(fmt, path, threads):
    rng = np.random.default_rng(_stable_seed(fmt, path, threads))
    rows, k = 163, 512                        # enough work for the threads; a partial chunk of rows
    aw, mm = _case(rng, fmt, path, rows, k)
    row = (rng.standard_normal((1, k)) * 3).astype(F32)
    alone = mm(row, aw, nthreads=threads)[0]
    for T in (2, 3, 5, 16, 64):
        for at in sorted({0, 1, T // 2, T - 1}):
            x = rng.standard_normal((T, k)).astype(F32)
            x[at] = row[0]
            got = mm(x, aw, nthreads=threads)[at]
            assert np.array_equal(alone.view(np.uint32), got.view(np.uint32)), (T, at)


@pytest.mark.parametrize("fmt,path", MATMUL_CASES)
def test_matmul_row_does_not_depend_on_its_address(fmt, path):
    """The same activation row at another alignment gives the same bits (a vectorized reduction
    that peels for alignment would sum in another order)."""
    rng = np.random.default_rng(7)
    rows, k = 37, 512
    aw, mm = _case(rng, fmt, path, rows, k)
    row = (rng.standard_normal(k) * 3).astype(F32)
    results = []
    for shift in range(8):
        buf = np.zeros(k + 16, F32)
        buf[shift:shift + k] = row
        results.append(mm(buf[shift:shift + k].reshape(1, k), aw, nthreads=1)[0].view(np.uint32))
    for got in results[1:]:
        assert np.array_equal(results[0], got)


def test_attn_chunk_is_whole_kv_blocks():
    """The engine aligns sequences to ATTN_CHUNK; chunks must be whole online-softmax blocks."""
    assert native.ATTN_CHUNK % 64 == 0 and native.ATTN_CHUNK >= 64
