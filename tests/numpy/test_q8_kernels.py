"""The integer (Q8 activation) kernels of numerics="llamacpp" against a float64 oracle of the same
rounding: activations quantized bit for bit as `metatp.testing.oracles.ref_q8_quantize` (llama.cpp's
x86 quantize_row_q8_0 / q8_1 and quantize_row_q8_K_ref), integer block sums bit-exact, float
results within float32 rounding of the exact (float64) combination of those sums, for every build
of the dot product this machine can run (VNNI, AVX2, portable; each built explicitly).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metatp.backends.numpy import native
from metatp.backends.numpy.codes import (GROUP, AffineWeight, affine_blocks, dequantize_affine, group_rows, groupable,
                                          pack_nibbles, row_major)
from metatp.ir.tensor import GGMLType
from metatp.testing.oracles import make_weight, ref_q8_quantize
from support.cpu import BUILDS, isa_library
from support.require import requires

pytestmark = requires("cpu_kernels")

F32 = np.float32

# (weight type, activation kind, block, offset, bits, bias, code range): every affine type kept as codes
FORMATS = {
    "Q4_0": (native.Q8_0, 32, False, 4, 8, (-8, 7)),
    "Q4_1": (native.Q8_1, 32, True, 4, 0, (0, 15)),
    "Q5_0": (native.Q8_0, 32, False, 8, 0, (-16, 15)),
    "Q5_1": (native.Q8_1, 32, True, 8, 0, (0, 31)),
    "Q8_0": (native.Q8_0, 32, False, 8, 0, (-128, 127)),
    "Q2_K": (native.Q8_K, 16, True, 4, 0, (0, 3)),
    "Q3_K": (native.Q8_K, 16, False, 4, 8, (-4, 3)),
    "Q4_K": (native.Q8_K, 32, True, 4, 0, (0, 15)),
    "Q5_K": (native.Q8_K, 32, True, 8, 0, (0, 31)),
    "Q6_K": (native.Q8_K, 16, False, 8, 0, (-32, 31)),
}


@pytest.fixture(scope="module", params=list(BUILDS))
def lib(request):
    """Each ISA build of the kernels, loaded: skipped where this CPU cannot run it (it is still
    compiled, so a syntax error in another machine's path fails here)."""
    return isa_library(request.param)


@pytest.fixture(scope="module")
def use(lib):
    """The kernels' entry points run on `lib` for the tests of one module-scoped build."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(native.lib, "_library", lambda: (lib, native.library_isa(lib)))
        yield lib


def _weight(rng, fmt: str, rows: int, k: int) -> tuple[AffineWeight, np.ndarray]:
    kind, block, offset, bits, bias, (lo, hi) = FORMATS[fmt]
    q = rng.integers(lo, hi + 1, (rows, k)).astype(np.int8)
    scale = (rng.standard_normal((rows, k // block)) * 0.02).astype(F32)
    off = (rng.standard_normal((rows, k // block)) * 0.02).astype(F32) if offset else None
    codes = pack_nibbles(q, bias) if bits == 4 else q
    return AffineWeight(q=codes, scale=scale, offset=off, block=block, bits=bits, bias=bias,
                        ggml_type=GGMLType[fmt]), q


def _activations(rng, n: int, k: int) -> np.ndarray:
    """Rows over many magnitudes, with ties for the rounding (x*127/amax at .5), zero blocks and
    repeated maxima of both signs."""
    x = (rng.standard_normal((n, k)) * 10.0 ** rng.uniform(-4, 2, (n, 1))).astype(F32)
    if k >= 64:
        x[0, 32:64] = 0.0                                  # an all-zero block
        x[-1, :32] = np.arange(-16, 16, dtype=F32) / 2     # exact halves: ties to even
        x[-1, 5] = -x[-1, :32].__abs__().max()             # equal |max| of both signs
    return x


def _reference(aw: AffineWeight, q: np.ndarray, x: np.ndarray, kind: int):
    """(integer sums per 16 elements, the float64 result) from the oracle's rounding of x."""
    xq, d, s, isum = ref_q8_quantize(x, kind)
    n, k = x.shape
    isums = (q.astype(np.int64)[None] * xq.astype(np.int64)[:, None]).reshape(n, aw.rows, k // 16, 16).sum(-1)
    per = isums.reshape(n, aw.rows, k // aw.block, aw.block // 16).sum(-1).astype(np.float64)
    dx = np.repeat(d.astype(np.float64), (256 if kind == native.Q8_K else 32) // aw.block, axis=1)
    factor = aw.scale[None].astype(np.float64) * dx[:, None]
    terms = per * factor
    # magnitude: the integer sums taken element by element, so any partial grouping is bounded
    abs_per = (np.abs(q.astype(np.int64)[None] * xq.astype(np.int64)[:, None])
               .reshape(n, aw.rows, k // aw.block, aw.block).sum(-1).astype(np.float64))
    mags = abs_per * np.abs(factor)
    if aw.offset is not None:
        xs = s.astype(np.float64) if kind == native.Q8_1 else dx * isum.reshape(n, -1, aw.block // 16).sum(-1)
        off = aw.offset[None].astype(np.float64) * xs[:, None]
        terms, mags = np.concatenate([terms, off], axis=-1), np.concatenate([mags, np.abs(off)], axis=-1)
    return isums, terms.sum(-1), mags.sum(-1)


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 9), blocks=st.integers(1, 3), kind=st.sampled_from([native.Q8_0, native.Q8_1, native.Q8_K]),
       seed=st.integers(0, 2**16))
def test_activation_rounding_is_bit_exact(use, n, blocks, kind, seed):
    x = _activations(np.random.default_rng(seed), n, blocks * 256)
    got, want = native.q8_quantize(x, kind), ref_q8_quantize(x, kind)
    for g, w in zip(got, want):
        if w is None:
            assert g is None
            continue
        assert g.dtype == w.dtype and g.shape == w.shape and np.array_equal(g.view(np.uint8), w.view(np.uint8))


def test_f16_rounding_is_numpys(use):
    """The f16 rounding of block scales (round to nearest even) over normals, subnormals, the
    overflow edge and exact ties, against numpy's float16 cast."""
    rng = np.random.default_rng(2)
    halves = np.arange(0, 0x7C00, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(F32)
    ties = (halves[:-1] + (halves[1:] - halves[:-1]) / F32(2)).astype(F32)         # exactly between two
    near = np.concatenate([np.nextafter(ties, F32(0)), np.nextafter(ties, F32(np.inf))])
    wide = (rng.standard_normal(20000) * 10.0 ** rng.uniform(-12, 6, 20000)).astype(F32)
    x = np.concatenate([halves, ties, near, wide, -wide, [65504.0, 65519.0, 65520.0, 1e9, 0.0, -0.0]]).astype(F32)
    with np.errstate(over="ignore"):
        want = x.astype(np.float16).astype(F32)
    assert np.array_equal(native.round_half(x).view(np.uint32), want.view(np.uint32))


@settings(max_examples=60, deadline=None)
@given(fmt=st.sampled_from(sorted(FORMATS)), rows=st.integers(1, 40), blocks=st.integers(1, 3),
       n=st.integers(1, 9), threads=st.sampled_from([1, 2]), grouped=st.booleans(), half=st.booleans(),
       seed=st.integers(0, 2**16))
def test_integer_sums_exact_and_float_results_within_rounding(use, fmt, rows, blocks, n, threads, grouped, half,
                                                              seed):
    """Every format, row-major or (where it applies) in the row-group layout, with float32 scales
    or scales that are halves (which that layout then keeps as halves)."""
    rng = np.random.default_rng(seed)
    k = blocks * 256
    aw, q = _weight(rng, fmt, rows + (-rows % GROUP if grouped else 0), k)
    if half:
        aw = replace(aw, scale=aw.scale.astype(np.float16).astype(F32),
                     offset=None if aw.offset is None else aw.offset.astype(np.float16).astype(F32))
    x = _activations(rng, n, k)
    kind = FORMATS[fmt][0]
    assert native.q8_kind(aw) == kind
    isums, ref, mag = _reference(aw, q, x, kind)
    xq = ref_q8_quantize(x, kind)[0]
    if grouped and groupable(aw):
        aw = group_rows(aw)
        assert (aw.scale.dtype == np.float16) == half
        isums = isums.reshape(n, aw.rows, -1, 2).sum(-1)                   # its sums are per block of 32
    assert np.array_equal(native.q8_isums(aw, xq), isums)                     # bit-exact integer sums
    y = native.q8_matmul(x, aw, nthreads=threads)
    # float32: per term one rounded product of the scales and one rounded fused add, then sums of
    # m terms: the textbook bound (m + 2) * u * sum |terms| (u = 2^-24)
    m = k // 16 + (k // aw.block if aw.offset is not None else 0)
    assert np.all(np.abs(y - ref) <= (m + 2) * 2.0**-24 * mag), np.abs(y - ref).max()


def test_strided_rows_and_grouped_items_are_the_same_bits(use):
    """Rows with a stride past K, several products in one call (one parallel region; items that
    read the same x share its quantization), each equal to its own call."""
    rng = np.random.default_rng(4)
    x_buf = rng.standard_normal((3, 512 + 7)).astype(F32)
    x = x_buf[:, :512]
    parts = []
    for fmt in ("Q4_1", "Q4_0", "Q8_0", "Q6_K", "Q4_K", "Q4_1"):
        aw, _ = _weight(rng, fmt, 50, 512)
        y_buf = np.full((3, 50 + 3), np.nan, F32)
        parts.append((aw, y_buf, np.empty((3, 50), F32)))
    for aw, y_buf, _ in parts:
        native.prepare_q8_matmul(aw, x, y_buf[:, :50], 2)()
        assert np.isnan(y_buf[:, 50:]).all()
    native.group_qmatmul([native.prepare_q8_matmul(aw, x, y2, 2) for aw, _, y2 in parts])()
    for aw, y_buf, y2 in parts:
        assert np.array_equal(y_buf[:, :50], y2)
        assert np.array_equal(y2, native.q8_matmul(np.ascontiguousarray(x), aw))


def test_row_group_layout_joins_calls_and_keeps_its_values(use):
    """Weights in the row-group layout: in one call with row-major items (sharing one x), each
    result within rounding of its row-major twin; dequantized (the long-prompt path) bit for bit
    the same values; rows read back row-major for the embedding lookup; the float kernel refuses
    them with a clear error."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((3, 512)).astype(F32)
    calls, pairs = [], []
    for fmt in ("Q4_1", "Q4_0", "Q8_0", "Q4_K", "Q5_1", "Q6_K"):
        aw, _ = _weight(rng, fmt, 48, 512)
        gw = group_rows(aw) if groupable(aw) else aw
        y = np.empty((3, 48), F32)
        calls.append(native.prepare_q8_matmul(gw, x, y, 2))
        pairs.append((aw, gw, y))
    native.group_qmatmul(calls)()
    for aw, gw, y in pairs:
        ref = native.q8_matmul(x, aw)
        assert np.allclose(y, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
        assert np.array_equal(native.dequantize(gw).view(np.uint32), native.dequantize(aw).view(np.uint32))
        assert np.array_equal(gw.codes([3, 40, 17]), aw.codes([3, 40, 17]))
        assert np.array_equal(row_major(gw, [9])[1], aw.scale[[9]])
    grouped, flat = pairs[0][1], pairs[0][0]
    if native.float_row_groups():       # 512-bit builds' float kernel reads the layout (test_float_groups.py)
        ref = x.astype(np.float64) @ dequantize_affine(flat).astype(np.float64).T
        assert np.allclose(native.qmatmul(x, grouped), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())
    else:
        with pytest.raises(ValueError, match="row-group layout"):
            native.prepare_qmatmul(grouped, x, np.empty((3, 48), F32))
    with pytest.raises(ValueError, match="rows a multiple of 8"):
        group_rows(_weight(rng, "Q4_1", 12, 512)[0])


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_real_gguf_blocks_take_their_llamacpp_activation_type(fmt):
    """affine_blocks records the GGUF type, so the kernel rounds x as llama.cpp does for it; a
    K-quant row that is not whole 256-blocks and half floats stay on the float path."""
    import gguf

    t = GGMLType[fmt]
    rng = np.random.default_rng(0)
    w = rng.standard_normal((4, 256)).astype(F32)
    try:
        raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType[fmt])
    except NotImplementedError:             # K-quants: gguf only reads them; real random blocks instead
        raw = make_weight(rng, fmt.lower(), 4, 256)[0]
    aw = affine_blocks(raw, t, 256)
    assert aw.ggml_type is t and native.q8_kind(aw) == FORMATS[fmt][0]
    y = native.q8_matmul(np.ones((1, 256), F32), aw)
    ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[fmt]).sum(-1)
    assert np.allclose(y[0], ref, rtol=2e-3, atol=2e-3 * np.abs(ref).max())      # 1/127 as f16: 5e-4
    half = affine_blocks(w.astype(np.float16).view(np.uint8), GGMLType.F16, 256)
    assert native.q8_kind(half) is None


def test_bad_arguments_are_refused():
    aw, _ = _weight(np.random.default_rng(0), "Q6_K", 4, 256)
    with pytest.raises(ValueError, match="kind"):
        native.prepare_q8_matmul(aw, np.zeros((1, 256), F32), np.zeros((1, 4), F32), kind=native.Q8_0)   # blocks of 16
    aw32, _ = _weight(np.random.default_rng(0), "Q4_K", 4, 256)
    sliced = AffineWeight(q=aw32.q[:, :64], scale=aw32.scale[:, :4], offset=aw32.offset[:, :4], block=32, bits=4,
                          ggml_type=GGMLType.Q4_K)
    assert native.q8_kind(sliced) is None                     # 128 columns: not a whole Q8_K block


@pytest.mark.parametrize("numerics", ["llamacpp", "q8"])
def test_backend_runs_llamacpp_numerics_on_the_integer_kernels(synth_factory, numerics):
    """Decode steps in numerics="llamacpp" (or its alias "q8") take the integer kernels; their
    logits equal the float emulation's up to where one Q8_1 offset term is f16-rounded, and
    three simulated devices give the single-device tokens."""
    from metatp import LLM
    from metatp.testing.synth import SynthSpec

    spec = SynthSpec(n_layer=2, n_embd=256, n_head=4, n_head_kv=2, n_ff=512, n_vocab=300, seed=11,
                     types={"q": "Q4_1", "k": "Q8_0", "v": "Q4_0", "o": "Q5_0", "gate": "Q4_K", "up": "Q5_1",
                            "down": "Q6_K", "embd": "Q8_0"})
    path, _ = synth_factory(spec)
    from metatp.backends.numpy.kernels import matmul as numpy_kernels

    used = []

    def counting(*args, **kw):
        used.append(args[0].ggml_type)
        return native.prepare_q8_matmul(*args, **kw)

    out = {}
    for name, kw in (("int", {}), ("emulated", {"cpu_kernels": False}), ("exact", {"numerics": "exact"}),
                     ("tp", {"n_devices": 2})):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(numpy_kernels, "prepare_q8_matmul", counting)
            llm = LLM(path, n_ctx=64, backend="numpy", **{"numerics": numerics, **kw})
            eng = llm.engine
            eng.forward(list(range(1, 6)))
            out[name] = np.stack([eng.forward([t]) for t in (5, 9, 200)])
        if name == "int":
            assert {GGMLType.Q4_1, GGMLType.Q6_K, GGMLType.Q4_K, GGMLType.Q8_0} <= set(used)
        if name in ("emulated", "exact"):
            assert not used
        used.clear()
    scale = np.abs(out["exact"]).max()
    assert np.abs(out["int"] - out["emulated"]).max() < 0.05 * scale
    assert np.abs(out["int"] - out["tp"]).max() < 1e-3 * scale
    assert not np.array_equal(out["int"], out["exact"])
