"""The affine int8 repacking of GGUF quantized weights decodes to exactly what gguf decodes."""

from __future__ import annotations

from pathlib import Path

import gguf
import gguf.quants
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metatp.backends.numpy.codes import (AFFINE_TYPES, GROUP, HALF_SCALE_TYPES, NIBBLE_BIAS, AffineWeight,
                                          affine_blocks, affine_bytes, dequantize_affine, encodable, group_rows,
                                          groupable, grouped_affine_blocks, pack_nibbles, unpack_nibbles)
from metatp.ir.errors import ConfigError, UnsupportedOpError
from metatp.ir.tensor import GGMLType, block_size, type_size
from support.require import requires

T = GGMLType
SYMMETRIC = {T.Q4_0, T.Q5_0, T.Q8_0, T.Q3_K, T.Q6_K}
EXPECTED = {T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K}
# byte offsets, inside one GGUF block, of the f16 d / dmin fields
F16_FIELDS = {
    T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,),
    T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,),
}
TYPES = sorted(EXPECTED)

MODELS = Path("/root/.cache/metatp")
SMOL = MODELS / "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA = MODELS / "gemma-3-270m-q4_k_m.gguf"


def random_raw(t: GGMLType, rows: int, k: int, seed: int, moderate: bool = True) -> np.ndarray:
    """Random GGUF bytes for a (rows, K) weight; with moderate=True the f16 d/dmin fields are N(0, 1)."""
    rng = np.random.default_rng(seed)
    nb = k // block_size(t)
    raw = rng.integers(0, 256, size=(rows, nb, type_size(t)), dtype=np.uint8)
    if moderate:
        for at in F16_FIELDS[t]:
            raw[:, :, at : at + 2] = rng.standard_normal((rows, nb)).astype("<f2").view(np.uint8).reshape(rows, nb, 2)
    return raw.reshape(rows, nb * type_size(t))


def assert_bit_exact(aw: AffineWeight, raw: np.ndarray, t: GGMLType) -> None:
    ref = gguf.quants.dequantize(raw, t)
    got = dequantize_affine(aw)
    assert got.dtype == np.float32 and got.shape == ref.shape
    np.testing.assert_array_equal(got.view(np.uint32), ref.view(np.uint32))


def test_accepted_types_and_numbering():
    assert AFFINE_TYPES == EXPECTED | {T.F16, T.BF16}
    for t in AFFINE_TYPES:  # metatp's GGMLType must number types exactly as gguf does
        assert int(t) == gguf.GGMLQuantizationType[t.name].value


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
@settings(max_examples=20, deadline=None)
@given(rows=st.integers(1, 5), n_blocks=st.integers(1, 4), seed=st.integers(0, 2**32 - 1))
def test_matches_gguf_bit_exactly(t, rows, n_blocks, seed):
    k = n_blocks * block_size(t)
    raw = random_raw(t, rows, k, seed)
    aw = affine_blocks(raw, t, k)
    assert aw.block == (16 if t in (T.Q2_K, T.Q3_K, T.Q6_K) else 32)
    if t in NIBBLE_BIAS:             # codes that fit a nibble are stored two a byte
        assert aw.bits == 4 and aw.q.dtype == np.uint8 and aw.q.shape == (rows, k // 2)
    else:
        assert aw.bits == 8 and aw.q.dtype == np.int8 and aw.q.shape == (rows, k)
    assert aw.codes().dtype == np.int8 and aw.codes().shape == (rows, k) and (aw.rows, aw.k) == (rows, k)
    assert aw.scale.dtype == np.float32 and aw.scale.shape == (rows, k // aw.block)
    assert (aw.offset is None) == (t in SYMMETRIC)
    if aw.offset is not None:
        assert aw.offset.dtype == np.float32 and aw.offset.shape == aw.scale.shape
    assert aw.nbytes == affine_bytes(t, rows, k)
    assert_bit_exact(aw, raw, t)


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_arbitrary_bytes_match_including_inf_nan(t):
    """Fully random bytes (f16 fields may be inf/NaN/subnormal) still decode like gguf."""
    k = 2 * block_size(t)
    raw = random_raw(t, 64, k, seed=int(t), moderate=False)
    with np.errstate(invalid="ignore", over="ignore"):
        got = dequantize_affine(affine_blocks(raw, int(t), k))  # a plain int type is accepted too
        ref = gguf.quants.dequantize(raw, t)
    np.testing.assert_array_equal(got, ref)  # NaN == NaN here


def test_code_ranges():
    k = 256
    for t, lo, hi in [(T.Q4_0, -8, 7), (T.Q4_1, 0, 15), (T.Q5_0, -16, 15), (T.Q5_1, 0, 31), (T.Q8_0, -128, 127),
                      (T.Q2_K, 0, 3), (T.Q3_K, -4, 3), (T.Q4_K, 0, 15), (T.Q5_K, 0, 31), (T.Q6_K, -32, 31)]:
        q = affine_blocks(random_raw(t, 64, k, seed=1), t, k).codes()
        assert q.min() == lo and q.max() == hi, t.name


@given(st.integers(1, 4), st.integers(1, 3), st.sampled_from([0, 8]), st.integers(0, 2**16))
def test_nibble_packing_round_trips(rows, groups, bias, seed):
    q = np.random.default_rng(seed).integers(-bias, 16 - bias, (rows, 32 * groups)).astype(np.int8)
    p = pack_nibbles(q, bias)
    assert p.dtype == np.uint8 and p.shape == (rows, 16 * groups)
    assert np.array_equal(unpack_nibbles(p, bias), q)
    assert np.array_equal(p[:, :16] & 0x0F, (q[:, :16] + bias).astype(np.uint8))     # element j: low nibble
    assert np.array_equal(p[:, :16] >> 4, (q[:, 16:32] + bias).astype(np.uint8))     # element 16+j: high


@pytest.mark.parametrize("t", [T.F32, T.Q8_1, T.Q8_K, T.IQ4_NL, T.IQ2_XXS, T.TQ2_0])
def test_unsupported_type(t):
    raw = np.zeros((1, type_size(t) * 8), np.uint8)
    with pytest.raises(UnsupportedOpError, match=t.name):
        affine_blocks(raw, t, 256)
    with pytest.raises(UnsupportedOpError, match=t.name):
        affine_bytes(t, 1, 256)


def test_unknown_type_number():
    with pytest.raises(UnsupportedOpError):
        affine_blocks(np.zeros((1, 18), np.uint8), 9999, 32)


@pytest.mark.parametrize("t", TYPES, ids=lambda t: t.name)
def test_wrong_row_length(t):
    k = 2 * block_size(t)
    raw = random_raw(t, 3, k, seed=0)
    for bad in (raw[:, :-1], np.concatenate([raw, raw[:, :1]], axis=1), raw.reshape(-1)):
        with pytest.raises(ConfigError, match=t.name) as e:
            affine_blocks(bad, t, k)
        assert isinstance(e.value, ValueError)
    with pytest.raises(ConfigError):  # K not a whole number of blocks
        affine_blocks(raw, t, k + 1)
    with pytest.raises(ConfigError):
        affine_bytes(t, 3, k - 1)
    with pytest.raises(ConfigError):  # not uint8
        affine_blocks(raw.view(np.int8), t, k)


def _check_tensors(tensors, want: set[GGMLType], rows: int = 192) -> None:
    """tensors: (type, K, raw rows) triples; checks the first two of each wanted type."""
    seen: dict[GGMLType, int] = {}
    for t, k, raw in tensors:
        if t not in want or seen.get(t, 0) >= 2:
            continue
        seen[t] = seen.get(t, 0) + 1
        raw = raw[:rows]
        assert_bit_exact(affine_blocks(raw, t, k), raw, t)
    assert set(seen) == want


@requires("model", why=None if SMOL.exists() else "SmolLM2-135M Q4_1 model not cached")
def test_real_model_smollm():
    """Tensors as gguf.GGUFReader exposes them (uint8, shape (rows, row_bytes))."""
    reader = gguf.GGUFReader(SMOL)
    tensors = ((GGMLType(x.tensor_type), int(x.shape[0]), np.asarray(x.data).reshape(-1, x.data.shape[-1]))
               for x in reader.tensors)
    _check_tensors(tensors, {T.Q4_1, T.Q8_0})


@requires("model", why=None if GEMMA.exists() else "gemma-3-270m Q4_K_M model not cached")
def test_real_model_gemma():
    """Read through metatp's validated layout + a memmap: GGUFReader spends ~11 s on gemma's 262k vocab."""
    from metatp.ir.gguf_validate import validate_gguf

    layout = validate_gguf(GEMMA)
    data = np.memmap(GEMMA, dtype=np.uint8, mode="r")

    def tensors():
        for x in layout.tensors:
            t = GGMLType(x.ggml_type)
            if t in AFFINE_TYPES and len(x.ne) == 2:
                start = layout.data_offset + x.offset
                yield t, x.ne[0], np.asarray(data[start : start + x.n_bytes]).reshape(x.ne[1], -1)

    _check_tensors(tensors(), {T.Q5_0, T.Q4_K, T.Q6_K, T.Q8_0})


@pytest.mark.parametrize("t", [T.F16, T.BF16])
def test_half_float_weights_are_kept_as_they_are(t):
    """F16/BF16 weights become 16-bit codes with scale 1: the values are exactly the file's."""
    rng = np.random.default_rng(int(t))
    vals = (rng.standard_normal((3, 64)) * 10 ** rng.uniform(-6, 4, (3, 64))).astype(np.float32)
    vals[0, :4] = [0.0, -0.0, 6e-8, -65504.0] if t == T.F16 else [0.0, -0.0, 1e-30, -3e38]
    if t == T.F16:
        raw = vals.astype(np.float16).view(np.uint8)
    else:
        raw = (vals.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
    aw = affine_blocks(raw, t, 64)
    assert aw.bits == 16 and aw.q.dtype == np.uint16 and aw.offset is None and (aw.rows, aw.k) == (3, 64)
    assert aw.nbytes == affine_bytes(t, 3, 64)
    np.testing.assert_array_equal(dequantize_affine(aw), gguf.quants.dequantize(raw, t).reshape(3, 64))
    assert encodable(t, 64) and not encodable(t, 48)      # rows must be whole 32-element blocks
    with pytest.raises(ConfigError, match="multiple of 32"):
        affine_blocks(raw[:, :96], t, 48)


@pytest.mark.parametrize("t", [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.Q4_K, T.Q6_K], ids=lambda t: t.name)
def test_row_group_layout_keeps_values_and_planned_bytes(t):
    """group_rows (the integer kernel's layout) of real file blocks: the same decoded values,
    scales kept as halves exactly where the file's are halves, and the bytes memory planning
    counts for it; types it does not take (blocks of 16) are left alone."""
    import gguf

    rows, k = 16, 512
    w = np.random.default_rng(1).standard_normal((rows, k)).astype(np.float32)
    try:
        raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType[t.name])
    except NotImplementedError:
        raw = random_raw(t, rows, k, 3)
    aw = affine_blocks(raw, t, k)
    if not groupable(aw):
        assert aw.block == 16
        return
    g = group_rows(aw)
    assert (g.rows, g.k, g.group) == (rows, k, GROUP)
    assert (g.scale.dtype == np.float16) == (t in HALF_SCALE_TYPES)
    assert np.array_equal(dequantize_affine(g).view(np.uint32), dequantize_affine(aw).view(np.uint32))
    assert g.nbytes == affine_bytes(t, rows, k, grouped=True)
    assert affine_bytes(t, rows + 1, k, grouped=True) == affine_bytes(t, rows + 1, k)     # no whole groups: as is


@pytest.mark.parametrize("t", [T.Q4_0, T.Q4_1, T.Q8_0, T.Q4_K, T.Q6_K], ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [40, 16, 12])
def test_grouped_blocks_made_a_chunk_at_a_time_equal_grouping_the_whole(t, rows):
    """The loader's chunked `grouped_affine_blocks` (chunks of 16 rows here) gives the arrays of
    group_rows(affine_blocks(...)) with the planned scale type; weights it cannot group (rows not
    whole groups, blocks of 16) come back row-major, as affine_blocks makes them."""
    k = 256
    raw = random_raw(t, rows, k, 7)
    whole = affine_blocks(raw, t, k)
    got = grouped_affine_blocks(raw, t, k, chunk_rows=16)
    if not groupable(whole):
        assert got.group == 1 and np.array_equal(got.q, whole.q) and np.array_equal(got.scale, whole.scale)
        return
    want = group_rows(whole, half=t in HALF_SCALE_TYPES)
    assert got.group == GROUP and got.nbytes == affine_bytes(t, rows, k, grouped=True)
    for a, b in [(got.q, want.q), (got.scale, want.scale), (got.offset, want.offset)]:
        assert (a is None) == (b is None)
        if a is not None:
            assert a.dtype == b.dtype and np.array_equal(a.view(np.uint8), b.view(np.uint8))


@pytest.mark.parametrize("t", [T.Q4_1, T.Q8_0], ids=lambda t: t.name)
def test_grouped_blocks_keep_non_finite_file_scales_in_float32(t):
    """Arbitrary bytes (infinite and NaN f16 scales): the chunked grouping falls back to float32
    scales for the whole weight and keeps every decoded value, bit for bit."""
    raw = random_raw(t, 40, 256, 5, moderate=False)
    got = grouped_affine_blocks(raw, t, 256, chunk_rows=16)
    assert got.group == GROUP and got.scale.dtype == np.float32
    with np.errstate(invalid="ignore"):
        assert np.array_equal(dequantize_affine(got).view(np.uint32),
                              dequantize_affine(affine_blocks(raw, t, 256)).view(np.uint32))
