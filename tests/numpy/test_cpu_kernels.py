"""The numpy backend's compiled CPU kernels (backends/csrc/, through backends/numpy/native/) against
the float64 references of metatp.testing.oracles (or the dequantized product), and the backend
with them against the backend without them.

Skipped only where no C compiler can build them (they are then unused: the backend keeps numpy).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metatp.backends.numpy import native
from metatp.backends.numpy.codes import AffineWeight, dequantize_affine, pack_nibbles
from metatp.backends.collectives import HostCollective
from metatp.testing.oracles import gelu, ref_attention, ref_rope, silu
from support.cpu import isa_library
from support.require import requires

pytestmark = requires("cpu_kernels")

F32 = np.float32


def _affine(rng, rows: int, k: int, block: int, offset: bool, bits: int = 8, bias: int = 8) -> AffineWeight:
    scale = (rng.standard_normal((rows, k // block)) * 0.02).astype(F32)
    off = (rng.standard_normal((rows, k // block)) * 0.02).astype(F32) if offset else None
    if bits == 16:              # half floats (bias 1: bfloat16), scale 1 as affine_blocks makes them
        w = rng.standard_normal((rows, k)).astype(F32)
        q = (w.view(np.uint32) >> 16).astype(np.uint16) if bias == 1 else w.astype(np.float16).view(np.uint16)
        return AffineWeight(q=q, scale=np.ones((rows, k // 32), F32), offset=None, block=32, bits=16,
                            bf16=bias == 1)
    if bits == 4:
        q = rng.integers(-bias, 16 - bias, (rows, k)).astype(np.int8)
        return AffineWeight(q=pack_nibbles(q, bias), scale=scale, offset=off, block=block, bits=4, bias=bias)
    return AffineWeight(q=rng.integers(-128, 128, (rows, k)).astype(np.int8), scale=scale, offset=off, block=block)


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(0, 70), units=st.integers(1, 12), block=st.sampled_from([16, 32]), offset=st.booleans(),
       bits=st.sampled_from([8, 4, 16]), bias=st.sampled_from([0, 8, 1]),
       ntok=st.one_of(st.integers(1, 9), st.sampled_from([33, 64])),   # up to a step of 64 rows
       pad_x=st.integers(0, 5),
       pad_y=st.integers(0, 5), threads=st.sampled_from([1, 2]), seed=st.integers(0, 2**16))
def test_qmatmul_matches_dequantized_product(rows, units, block, offset, bits, bias, ntok, pad_x, pad_y, threads,
                                             seed):
    rng = np.random.default_rng(seed)
    k = units * 32
    aw = _affine(rng, rows, k, block, offset, bits, bias)
    xbuf = rng.standard_normal((ntok, k + pad_x)).astype(F32)      # rows with a stride past K
    ybuf = np.full((ntok, rows + pad_y), np.nan, dtype=F32)
    x, y = xbuf[:, :k], ybuf[:, :rows]
    native.prepare_qmatmul(aw, x, y, threads)()
    ref = x.astype(np.float64) @ dequantize_affine(aw).astype(np.float64).T
    assert np.allclose(y, ref, rtol=1e-5, atol=1e-5 * max(1.0, np.abs(ref).max(initial=0)))
    assert np.isnan(ybuf[:, rows:]).all()          # nothing written past the rows


def test_qmatmul_group_is_bit_identical_to_separate_calls():
    rng = np.random.default_rng(1)
    shapes = [(200, 576, 32, True, 8), (64, 192, 16, False, 4), (1, 32, 32, True, 4), (300, 1536, 32, False, 8)]
    parts = []
    for rows, k, block, off, bits in shapes:
        aw = _affine(rng, rows, k, block, off, bits)
        x = rng.standard_normal((3, k)).astype(F32)
        parts.append((aw, x, np.empty((3, rows), F32), np.empty((3, rows), F32)))
    for aw, x, y1, _ in parts:
        native.prepare_qmatmul(aw, x, y1, 2)()
    native.group_qmatmul([native.prepare_qmatmul(aw, x, y2, 2) for aw, x, _, y2 in parts])()
    for _, _, y1, y2 in parts:
        assert np.array_equal(y1, y2)


@pytest.mark.parametrize("bits,bias", [(8, 0), (4, 8), (4, 0), (16, 0), (16, 1)])
@pytest.mark.parametrize("block,offset", [(32, True), (32, False), (16, False), (16, True)])
def test_dequantize_is_bit_identical_to_the_reference(block, offset, bits, bias):
    aw = _affine(np.random.default_rng(block), 130, 256, block, offset, bits, bias)
    assert np.array_equal(native.dequantize(aw, 2).view(np.uint32), dequantize_affine(aw).view(np.uint32))


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("slab_rows", [1, 7, 64, 1000])
def test_dequant_matmul_in_slabs_matches_blas(slab_rows, bits):
    rng = np.random.default_rng(slab_rows)
    aw = _affine(rng, 100, 96, 32, True, bits)
    x = rng.standard_normal((40, 96)).astype(F32)
    y = np.full((40, 100), np.nan, F32)
    native.prepare_dequant_matmul(aw, x, y, np.empty(slab_rows * 96, F32))()
    assert np.allclose(y, x @ dequantize_affine(aw).T, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("isa", ["avx2", "portable"])
def test_other_isa_builds_agree(monkeypatch, isa):
    """The AVX2 and plain-C code paths (other machines' builds) give the same products (each
    built here, and run where this CPU can: support.cpu.isa_library)."""
    lib = isa_library(isa)
    monkeypatch.setattr(native.lib, "_library", lambda: (lib, isa))
    rng = np.random.default_rng(5)
    for bits, bias, block, off in [(8, 0, 32, True), (4, 8, 32, True), (4, 0, 16, False), (8, 0, 16, False),
                                   (16, 0, 32, False), (16, 1, 32, False)]:
        aw = _affine(rng, 70, 192, block, off, bits, bias)
        x = rng.standard_normal((11, 192)).astype(F32)      # a tile of 8 tokens and one of 3
        ref = x.astype(np.float64) @ dequantize_affine(aw).astype(np.float64).T
        assert np.allclose(native.qmatmul(x, aw, nthreads=2), ref, rtol=1e-5, atol=1e-5)
        assert np.array_equal(native.dequantize(aw), dequantize_affine(aw))


@pytest.mark.parametrize("isa", ["avx2", "portable"])
def test_a_tokens_products_are_its_bits_alone_at_every_token_count(monkeypatch, isa):
    """Batch invariance of the exact products on the builds without 512-bit registers: a token's
    row of y has the bits of that token alone at token counts across the tiles of 4, 3, 2 and 1
    tokens (and their rows a tile), for every code format, blocks of 16 and 32, with and without
    offsets, on 1 and 2 threads."""
    lib = isa_library(isa)
    monkeypatch.setattr(native.lib, "_library", lambda: (lib, isa))
    rng = np.random.default_rng(11)
    for bits, bias, block, off in [(8, 0, 32, True), (4, 8, 32, False), (4, 0, 32, True), (4, 0, 16, True),
                                   (8, 0, 16, False), (16, 0, 32, False), (16, 1, 32, False)]:
        aw = _affine(rng, 37, 192, block, off, bits, bias)
        x = rng.standard_normal((17, 192)).astype(F32)
        alone = np.concatenate([native.qmatmul(x[t:t + 1], aw, nthreads=1) for t in range(17)])
        ref = x.astype(np.float64) @ dequantize_affine(aw).astype(np.float64).T
        assert np.allclose(alone, ref, rtol=1e-5, atol=1e-5)
        for n in (2, 3, 4, 5, 7, 8, 9, 16, 17):
            for threads in (1, 2):
                got = native.qmatmul(x[:n], aw, nthreads=threads)
                assert np.array_equal(got.view(np.uint32), alone[:n].view(np.uint32)), (bits, bias, block, off, n, threads)


def test_qmatmul_rejects_bad_shapes():
    aw = _affine(np.random.default_rng(0), 4, 64, 32, False)
    with pytest.raises(ValueError, match="x must be float32"):
        native.prepare_qmatmul(aw, np.zeros((1, 32), F32), np.zeros((1, 4), F32))
    with pytest.raises(ValueError, match="out must be float32"):
        native.prepare_qmatmul(aw, np.zeros((1, 64), F32), np.zeros((1, 5), F32))


@settings(max_examples=40, deadline=None)
@given(T=st.one_of(st.integers(1, 8), st.just(64)), H=st.integers(1, 5), half=st.integers(1, 16), extra=st.sampled_from([0, 4]),
       neox=st.booleans(), seed=st.integers(0, 2**16))
def test_rope_matches_reference(T, H, half, extra, neox, seed):
    from metatp.backends.numpy.kernels import rope_cos_sin

    rng = np.random.default_rng(seed)
    n_dims, D = 2 * half, 2 * half + extra
    big = rng.standard_normal((T, H + 1, D + 3)).astype(F32)
    x = big[:, 1:, :D]                                        # strided (T, H, D) view
    pos = rng.integers(0, 4000, T).astype(np.int32)
    cs = np.empty((2, T, half), F32)
    cs[0], cs[1] = rope_cos_sin(pos, n_dims, 10000.0, 1.0)
    out = np.full((T, H, D), np.nan, F32)
    native.prepare_rope(x, out, n_dims, neox, cs)()
    ref = ref_rope(x, pos, n_dims, 10000.0, 1.0, neox)
    assert np.allclose(out, ref, rtol=1e-5, atol=1e-5)


def _ref_attention(q, k, v, mask, scale, softcap, sinks):
    """The float64 oracle in the kernel's layouts: q (H, T, D), k/v (Hkv, n_kv, D) -> (T, H, D)."""
    return ref_attention(q.transpose(1, 0, 2).astype(np.float64), k.transpose(1, 0, 2).astype(np.float64),
                         v.transpose(1, 0, 2).astype(np.float64), scale, mask=mask.astype(np.float64),
                         softcap=softcap, causal=False, sinks=sinks)


@settings(max_examples=40, deadline=None)
@given(T=st.one_of(st.integers(1, 4), st.sampled_from([17, 64, 150])), Hkv=st.integers(1, 3), g=st.integers(1, 3),
       D=st.sampled_from([8, 16, 64]),
       n_max=st.integers(1, 40), data=st.data(), softcap=st.sampled_from([0.0, 30.0]), sinks=st.booleans(),
       seed=st.integers(0, 2**16))
def test_attention_matches_reference(T, Hkv, g, D, n_max, data, softcap, sinks, seed):
    rng = np.random.default_rng(seed)
    H = Hkv * g
    n_vis = data.draw(st.integers(1, n_max))
    q = rng.standard_normal((H, T, D)).astype(F32)
    cache_k = rng.standard_normal((n_max, Hkv, D)).astype(F32)      # cache rows, heads inside: strided views
    cache_v = rng.standard_normal((n_max, Hkv, D)).astype(F32)
    k, v = cache_k.transpose(1, 0, 2), cache_v.transpose(1, 0, 2)
    mask = np.zeros((T, n_max), F32)
    for t in range(T):                                              # causal over the visible rows
        mask[t, max(1, n_vis - T + t + 1):] = -np.inf
    sk = rng.standard_normal(H).astype(F32) if sinks else None
    out = np.full((T, H, D), np.nan, F32)
    run = native.prepare_attention(q, k, v, mask, 0.125, softcap, sk, out)
    run(n_vis)
    ref = _ref_attention(q, k[:, :n_vis], v[:, :n_vis], mask[:, :n_vis], 0.125, softcap, sk)
    assert np.allclose(out, ref, rtol=1e-5, atol=1e-5)


@settings(max_examples=30, deadline=None)
@given(T=st.integers(1, 4), Hkv=st.integers(1, 3), g=st.integers(1, 3), D=st.sampled_from([12, 64, 80]),
       n_vis=st.integers(100, 2100), hidden=st.integers(0, 700), threads=st.sampled_from([1, 2, 3]),
       sinks=st.booleans(), seed=st.integers(0, 2**16))
def test_attention_split_kv_matches_reference(T, Hkv, g, D, n_vis, hidden, threads, sinks, seed):
    """Long caches: the threads split the KV length (several chunks per KV head, merged with a
    log-sum-exp), blocks of rows stream with an online softmax; rows hidden by the mask at the
    start (a sliding window) leave whole chunks with nothing visible."""
    rng = np.random.default_rng(seed)
    H = Hkv * g
    hidden = min(hidden, n_vis - T)
    q = rng.standard_normal((H, T, D)).astype(F32)
    cache_k = (rng.standard_normal((n_vis + 5, Hkv, D)) * 2).astype(F32)
    cache_v = rng.standard_normal((n_vis + 5, Hkv, D)).astype(F32)
    k, v = cache_k.transpose(1, 0, 2), cache_v.transpose(1, 0, 2)
    mask = np.zeros((T, n_vis + 5), F32)
    mask[:, :hidden] = -np.inf
    for t in range(T):
        mask[t, n_vis - T + t + 1:] = -np.inf
    sk = rng.standard_normal(H).astype(F32) if sinks else None
    out = np.full((T, H, D), np.nan, F32)
    native.prepare_attention(q, k, v, mask, 0.125, 0.0, sk, out, threads)(n_vis)
    ref = _ref_attention(q, k[:, :n_vis], v[:, :n_vis], mask[:, :n_vis], 0.125, 0.0, sk)
    assert np.allclose(out, ref, rtol=1e-5, atol=1e-5)


@settings(max_examples=25, deadline=None)
@given(n_items=st.integers(1, 4), T=st.one_of(st.integers(1, 3), st.sampled_from([64, 100])), Hkv=st.integers(1, 3),
       g=st.integers(1, 3),
       n_vis=st.integers(1, 700), q8_0=st.booleans(), threads=st.sampled_from([1, 2]), seed=st.integers(0, 2**16))
def test_grouped_attentions_give_the_bits_of_separate_calls(n_items, T, Hkv, g, n_vis, q8_0, threads, seed):
    """Under -sm tensor one layer's attention on every device is one grouped call: the units and
    rows of all of them shared by one parallel region, the thread count from their total work
    (so a group may use two threads where each alone used one). Each output has the bits of its
    call alone, the shared visible length (n_kv_at) bounds every item. Passes of 64 and 100 query
    tokens (a prompt) hand their units to the threads as they finish instead of in static shares."""
    rng = np.random.default_rng(seed)
    H, D, n_max = Hkv * g, 64, 760
    ty = 8 if q8_0 else 0                                         # a q8_0 cache: integer Q.K (numerics q8)
    mask = np.zeros((T, n_max), F32)
    for t in range(T):
        mask[t, n_vis - T + t + 1 if n_vis > T else t + 1:] = -np.inf
    cell = np.full(1, n_vis, np.int64)
    grouped, alone = [], []
    for _ in range(n_items):
        q = rng.standard_normal((H, T, D)).astype(F32)
        xk = rng.standard_normal((n_max, Hkv, D)).astype(F32)
        xv = rng.standard_normal((n_max, Hkv, D)).astype(F32)
        if q8_0:
            xk = native.kv_quantize(xk.reshape(-1, D), ty).reshape(n_max, Hkv, -1)
            xv = native.kv_quantize(xv.reshape(-1, D), ty).reshape(n_max, Hkv, -1)
        k, v = xk.transpose(1, 0, 2), xv.transpose(1, 0, 2)
        out_g, out_a = (np.full((T, H, D), np.nan, F32) for _ in range(2))
        grouped.append((native.prepare_attention(q, k, v, mask, 0.125, 0.0, None, out_g, threads, ty, ty, q8=q8_0,
                                                 n_kv_at=cell), out_g))
        alone.append((native.prepare_attention(q, k, v, mask, 0.125, 0.0, None, out_a, 1, ty, ty, q8=q8_0), out_a))
    native.group_attention([run.call for run, _ in grouped])()
    for (_, out_g), (run, out_a) in zip(grouped, alone):
        run(n_vis)
        assert np.isfinite(out_a).all()
        assert np.array_equal(out_g, out_a)


def test_a_group_refuses_items_whose_scratch_is_too_small_for_its_threads():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 1, 16)).astype(F32)
    k = rng.standard_normal((1, 8, 16)).astype(F32)
    out = np.empty((1, 2, 16), F32)
    one = native.prepare_attention(q, k, k, None, 0.125, 0.0, None, out, 1)
    two = native.prepare_attention(q, k, k, None, 0.125, 0.0, None, out, 2)
    group = native.group_attention([one.call, two.call])        # runs on the fewer threads: fine
    group()
    with pytest.raises(ValueError, match="prepared attention"):
        native.group_attention([])


@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_glu_matches_the_oracle(act):
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((64, 2 * 300)) * 4).astype(F32)
    a, b = x[:, :300], x[:, 300:]
    out = np.empty((64, 300), F32)
    native.prepare_glu(a, b, out, act)()
    ref = (silu if act == "silu" else gelu)(a.astype(np.float64)) * b
    assert np.allclose(out, ref, rtol=1e-5, atol=1e-6 * np.abs(ref).max())   # 1 + tanh cancels near -1
    assert native.prepare_glu(a, b, out, "relu") is None        # not a kernel activation: numpy keeps it


@given(T=st.integers(1, 9), n=st.integers(1, 700), weight=st.booleans(), pad=st.integers(0, 3),
       scale=st.sampled_from([1e-3, 1.0, 300.0]), seed=st.integers(0, 2**16))
@settings(max_examples=60, deadline=None)
def test_rms_norm_matches_numpy(T, n, weight, pad, scale, seed):
    """The compiled norm rounds as numpy_kernels' (double sum of squares, float after); the double
    sums may be added in another order, so the scale can differ in its last bit at most."""
    from metatp.backends.numpy.kernels import rms_norm_mul

    rng = np.random.default_rng(seed)
    xbuf = (rng.standard_normal((T, n + pad)) * scale).astype(F32)
    x = xbuf[:, :n]
    w = rng.standard_normal(n).astype(F32) if weight else None
    out = np.full((T, n + pad), np.nan, F32)
    native.prepare_rms_norm(x, w, out[:, :n], 1e-5)()
    ref = np.empty((T, n), F32)
    rms_norm_mul(x, w, 1e-5, ref)()
    assert np.allclose(out[:, :n], ref, rtol=3e-7, atol=0)
    assert np.isnan(out[:, n:]).all()


def test_add_matches_numpy():
    rng = np.random.default_rng(5)
    a, b = rng.standard_normal((2, 7, 300)).astype(F32)
    out = np.empty((7, 300), F32)
    native.prepare_add(a, b, out)()
    assert np.array_equal(out, a + b)
    assert native.prepare_add(a, b[:, :299], out) is None        # shapes that differ: numpy keeps it


def test_row_kernels_share_a_prompts_rows_among_threads_with_the_bits_of_one():
    """A prompt-sized pass (300 rows of 600: past the size from which the row kernels share their
    rows among threads): glu, rms_norm, add and rope on 2 threads give the bits of 1 thread, and
    each agrees with its numpy reference."""
    from metatp.backends.numpy.kernels import rms_norm_mul, rope_cos_sin

    rng = np.random.default_rng(11)
    T, n = 300, 600
    x = (rng.standard_normal((T, 2 * n)) * 3).astype(F32)
    a, b = x[:, :n], x[:, n:]
    w = rng.standard_normal(n).astype(F32)
    pos = np.arange(T, dtype=np.int32)
    cs = np.empty((2, T, 32), F32)
    cs[0], cs[1] = rope_cos_sin(pos, 64, 10000.0, 1.0)
    x3 = a[:, :576].reshape(T, 9, 64)
    runs = {}
    for threads in (1, 2):
        outs = [np.full((T, n), np.nan, F32) for _ in range(3)] + [np.full((T, 9, 64), np.nan, F32)]
        native.prepare_glu(a, b, outs[0], "silu", threads)()
        native.prepare_rms_norm(a, w, outs[1], 1e-5, threads)()
        native.prepare_add(a, b, outs[2], threads)()
        native.prepare_rope(x3, outs[3], 64, True, cs, threads)()
        runs[threads] = outs
    for one, two in zip(runs[1], runs[2]):
        assert np.array_equal(one.view(np.uint32), two.view(np.uint32))
    glu, rms, add, rope = runs[2]
    ref = silu(a.astype(np.float64)) * b
    assert np.allclose(glu, ref, rtol=1e-5, atol=1e-6 * np.abs(ref).max())
    ref_rms = np.empty((T, n), F32)
    rms_norm_mul(a, w, 1e-5, ref_rms)()
    assert np.allclose(rms, ref_rms, rtol=3e-7, atol=0)
    assert np.array_equal(add, a + b)
    assert np.allclose(rope, ref_rope(x3, pos, 64, 10000.0, 1.0, True), rtol=1e-5, atol=1e-5)


def _literal_butterfly(bufs, active):
    """llama.cpp's exchange as written: every device adds a copy of its partner's value."""
    n = len(bufs)
    for b, on in zip(bufs, active):
        if not on:
            b.fill(0)
    p2 = 1 << (n.bit_length() - 1)
    for j in range(p2, n):
        bufs[j - p2] += bufs[j].copy()
    off = p2 // 2
    while off >= 1:
        tmps = [bufs[j ^ off].copy() for j in range(p2)]
        for j in range(p2):
            bufs[j] += tmps[j]
        off //= 2
    for j in range(p2, n):
        bufs[j][...] = bufs[j - p2]


@pytest.mark.parametrize("n", range(1, 10))
def test_allreduce_kernel_and_numpy_have_the_butterfly_bits(n):
    rng = np.random.default_rng(n)
    base = [(rng.standard_normal(1000) * 10 ** rng.uniform(-3, 3, 1000)).astype(F32) for _ in range(n)]
    active = [bool(rng.integers(0, 4)) or j == 0 for j in range(n)]
    for j in range(n):
        if not active[j]:
            base[j][:] = np.nan                       # garbage in a device that computed nothing
    ref = [b.copy() for b in base]
    _literal_butterfly(ref, active)
    fast = [b.copy() for b in base]
    HostCollective("butterfly").allreduce(fast, active)
    compiled = [b.copy() for b in base]
    native.prepare_allreduce(compiled, active)()
    for j in range(n):
        assert np.array_equal(fast[j], ref[j]) and np.array_equal(compiled[j], ref[j])
    assert not np.isnan(ref[0]).any()


# ------------------------------------------------------------------ the backend with / without them
@pytest.mark.filterwarnings("ignore:3 devices but only 2 KV heads")       # zero attention slices on purpose
@pytest.mark.parametrize("n_devices,ts", [(1, None), (2, None), (3, [1, 2, 1])])
def test_backend_with_kernels_matches_numpy_path(synth_factory, n_devices, ts):
    from metatp import LLM
    from metatp.testing.synth import SynthSpec

    spec = SynthSpec(n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, n_vocab=300, seed=7,
                     types={"q": "Q4_1", "k": "Q8_0", "v": "Q4_0", "o": "F16", "gate": "BF16", "up": "Q4_1",
                            "down": "Q5_0", "embd": "Q8_0"})
    path, _ = synth_factory(spec)
    logits = []
    for kernels in (False, True):
        llm = LLM(path, n_ctx=160, backend="numpy", n_devices=n_devices, tensor_split=ts, cpu_kernels=kernels)
        eng = llm.engine
        eng.forward(list(range(1, 71)))                    # prefill: BLAS on dequantized slabs (> 64 tokens)
        steps = [eng.forward(list(range(3, 67)))]          # 64 tokens: the compiled kernels' largest step
        steps += [eng.forward([t]) for t in (5, 9, 200)]   # decode: the compiled kernels
        logits.append(np.stack(steps))
        if kernels:
            be = eng.backend
            assert any(be.packed(t, 0) is not None for t in be.leaf[0])
            by_name = {t.name: t for t in be.leaf[0]}
            embd, head = by_name["token_embd.weight"], by_name["output.weight"]   # tied
            assert be.encoded_only(embd) and be.encoded_only(head)
            if n_devices == 1:                                   # one set of codes for both leaves
                assert be.packed(embd, 0) is be.packed(head, 0)
    assert np.allclose(logits[0], logits[1], rtol=1e-4, atol=1e-4 * np.abs(logits[0]).max())
    assert (logits[0].argmax(-1) == logits[1].argmax(-1)).all()


def test_kernels_can_be_turned_off(monkeypatch):
    monkeypatch.setenv("METATP_CPU_KERNELS", "0")
    native.lib._library.cache_clear()
    try:
        assert not native.available() and "METATP_CPU_KERNELS=0" in native.kernel_info()
    finally:
        monkeypatch.delenv("METATP_CPU_KERNELS")
        native.lib._library.cache_clear()
    assert native.available()


def test_a_failed_build_falls_back_with_a_warning(monkeypatch, tmp_path):
    from metatp.backends.numpy.backend import NumpyBackend
    from metatp.ir.errors import ConfigError

    monkeypatch.setenv("CC", "false")                     # a "compiler" that always fails
    monkeypatch.setenv("METATP_KERNEL_CACHE", str(tmp_path))
    native.lib._library.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="could not be built"):
            assert not native.available()
        assert native.kernel_info() == "off (build failed)"
        assert NumpyBackend().use_kernels is False        # the backend keeps numpy
        with pytest.raises(ConfigError, match="unavailable"):
            NumpyBackend(cpu_kernels=True)
    finally:
        monkeypatch.undo()
        native.lib._library.cache_clear()
    assert native.available()


@pytest.mark.filterwarnings("ignore:3 devices but only 2 KV heads")
def test_devices_in_threads_match_one_thread(synth_factory):
    """The backend's threaded mode (simulated devices side by side, device-major order, no
    grouped matmuls) computes the same logits as the default node-major order."""
    from metatp.backends.numpy.backend import NumpyBackend
    from metatp.engine import Engine
    from metatp.ir.loader import load_model
    from metatp.passes.plan import DeviceLayout
    from metatp.testing.synth import SynthSpec

    spec = SynthSpec(n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, n_vocab=300, seed=8,
                     types={"q": "Q4_0", "k": "Q8_0", "v": "Q4_1", "o": "Q8_0", "gate": "Q4_1", "up": "Q4_0",
                            "down": "Q8_0", "embd": "Q8_0"})
    path, _ = synth_factory(spec)
    model = load_model(path)
    layout = DeviceLayout(3, "tensor", (1.0, 2.0, 1.0))
    out = []
    for threads in (False, True):
        eng = Engine(model, 64, layout, NumpyBackend(layout, parallel_devices=threads), n_batch=64)
        eng.forward(list(range(1, 20)))
        out.append(np.stack([eng.forward([t]) for t in (3, 7, 11)]))
    assert np.allclose(out[0], out[1], rtol=1e-5, atol=1e-5 * np.abs(out[0]).max())


def test_set_rows_matches_numpy_and_refuses_bad_ids():
    rng = np.random.default_rng(9)
    cache = rng.standard_normal((50, 2, 40)).astype(F32)          # rows, then a head dim: strided rows
    dst = cache[:, 1, :]
    src_buf = rng.standard_normal((3, 48)).astype(F32)
    src = src_buf[:, :40]
    ids = np.array([7, 0, 49], np.int32)
    want = dst.copy()
    want[ids] = src
    native.prepare_set_rows(src, ids, dst)()
    assert np.array_equal(dst, want)
    bad = native.prepare_set_rows(src, np.array([1, 50, 2], np.int32), dst)
    with pytest.raises(IndexError, match="outside"):
        bad()
    assert np.array_equal(dst, want)                               # nothing written
    assert native.prepare_set_rows(src, ids.astype(np.int64), dst) is None     # not a kernel dtype


def test_default_threads_share_the_machine_among_local_mpi_ranks(monkeypatch):
    """N ranks on one machine each take cores / N threads (N ranks of all cores spin against
    each other); an explicit thread count wins."""
    for var in ("METATP_NUM_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", *native.lib._LOCAL_SIZE_VARS):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(native.lib.os, "sched_getaffinity", lambda pid: set(range(8)), raising=False)
    assert native.default_threads() == 8
    monkeypatch.setenv("MPI_LOCALNRANKS", "2")
    assert native.default_threads() == 4
    monkeypatch.setenv("MPI_LOCALNRANKS", "16")
    assert native.default_threads() == 1
    monkeypatch.setenv("METATP_NUM_THREADS", "3")
    assert native.default_threads() == 3
