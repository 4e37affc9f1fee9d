"""Decode attention at depth (issue 25 item 3), on every ISA build of the kernels this CPU runs.

- the compiled attention over every KV cache type equals the float64 oracle (`ref_attention`) on
  the dequantized cache, at visible lengths on both sides of the 64-cell blocks and the 128-cell
  chunks (and under hypothesis over lengths, windows, token counts, head sizes and GQA groups);
- numerics "q8" with a q8_0 K cache takes Q.K in integers with Q8_0-rounded queries: it equals the
  oracle fed those rounded queries, and every other cache type ignores the flag (the same bits);
- a sequence's rows do not depend on what the rest of the cache holds or on the other rows of the
  call (batch invariance), when it starts at a multiple of the chunk: masked cells holding
  infinities change nothing.
"""

from __future__ import annotations


import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metatp.backends.numpy import native
from metatp.backends.numpy.kernels import kv_load_rows, kv_store_rows
from metatp.ir.models.common import KV_CACHE_TYPES
from metatp.testing.oracles import ref_attention, ref_q8_quantize
from support.require import requires

pytestmark = requires("cpu_kernels")

F32 = np.float32
TYPES = list(KV_CACHE_TYPES)          # f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1
TOL = dict(rtol=1e-5, atol=1e-5)


def _cache(x: np.ndarray, name: str) -> tuple[np.ndarray, np.ndarray]:
    """A float cache (n, Hkv, D) stored as type `name` (the kernel's view, (Hkv, n, .)) and the
    values it holds (the oracle's)."""
    n, hkv, d = x.shape
    ty = KV_CACHE_TYPES[name]
    stored = kv_store_rows(x.reshape(n * hkv, d), ty)
    if name not in ("f32", "f16"):
        stored = np.ascontiguousarray(stored).view(np.uint8)
    values = kv_load_rows(stored, ty).reshape(n, hkv, d).astype(np.float64)
    return stored.reshape(n, hkv, -1).transpose(1, 0, 2), values


def _q8_rounded(q: np.ndarray) -> np.ndarray:
    """Queries (H, T, D) as llama.cpp's Q8_0 rounding leaves them (codes x f16 scales), float64."""
    H, T, D = q.shape
    codes, d, _, _ = ref_q8_quantize(q.reshape(H * T, D), 0)
    vals = codes.astype(np.float64).reshape(H * T, D // 32, 32) * d.astype(np.float64)[..., None]
    return vals.reshape(H, T, D)


def attend(q, sk, sv, mask, n_vis, kt, vt, Dv, threads=2, q8=False, scale=0.125):
    """The compiled attention of queries q (H, T, D) over cache views sk/sv of types kt/vt."""
    H, T, _ = q.shape
    out = np.full((T, H, Dv), np.nan, F32)
    native.prepare_attention(q, sk, sv, mask, scale, 0.0, None, out, threads, int(KV_CACHE_TYPES[kt]),
                             int(KV_CACHE_TYPES[vt]), q8=q8)(n_vis)
    return out


def check(rng, kt: str, vt: str, n_vis: int, T: int, *, hkv=3, g=3, D=64, Dv=None, start=0, threads=2,
          q8=False, extra=0):
    """The kernel against the oracle: a decode/prompt pass of T rows over cells [start, n_vis),
    causal in its last T cells, the cache `extra` cells longer than visible."""
    Dv = Dv or D
    H, n_max = hkv * g, n_vis + extra
    q = rng.standard_normal((H, T, D)).astype(F32)
    sk, vk = _cache((rng.standard_normal((n_max, hkv, D)) * 2).astype(F32), kt)
    sv, vv = _cache(rng.standard_normal((n_max, hkv, Dv)).astype(F32), vt)
    mask = np.zeros((T, n_max), F32)
    mask[:, :start] = -np.inf
    for t in range(T):
        mask[t, n_vis - T + t + 1:] = -np.inf
    out = attend(q, sk, sv, mask, n_vis, kt, vt, Dv, threads, q8)
    qref = _q8_rounded(q) if q8 and kt == "q8_0" else q.astype(np.float64)
    ref = ref_attention(qref.transpose(1, 0, 2), vk[:n_vis], vv[:n_vis], 0.125, mask=mask[:, :n_vis].astype(np.float64),
                        causal=False)
    assert np.allclose(out, ref, **TOL), (kt, vt, n_vis, T, np.abs(out - ref).max())
    return out


# visible lengths on both sides of the 64-cell blocks and the 128-cell chunks
DEPTHS = [1, 7, 63, 64, 65, 127, 128, 129, 191, 255, 256, 257, 1000]


@pytest.mark.parametrize("kt", TYPES)
def test_every_cache_type_at_block_and_chunk_edges(build, kt):
    rng = np.random.default_rng(len(kt))
    for n_vis in DEPTHS:
        for T in (1, 3):
            check(rng, kt, kt, n_vis, T, extra=5)


@pytest.mark.parametrize("D,Dv", [(64, 64), (128, 128), (96, 96), (32, 32), (160, 160)])
@pytest.mark.parametrize("kt,vt", [("f16", "f16"), ("q8_0", "q8_0"), ("q8_0", "f32"), ("f32", "q4_0"),
                                   ("bf16", "q8_0")])
def test_head_sizes_and_mixed_types(build, D, Dv, kt, vt):
    """V rows of 64-value slices read in registers (f32/f16/bf16/q8_0) or dequantized first (the
    rest, and head sizes not a multiple of 64)."""
    rng = np.random.default_rng(D + Dv)
    for n_vis, T in ((300, 1), (129, 4)):
        check(rng, kt, vt, n_vis, T, D=D, Dv=Dv, start=40)


@pytest.mark.parametrize("n_vis,T", [(1, 1), (129, 1), (1537, 1), (700, 5), (256, 64)])
def test_q8_queries_match_the_oracle_on_rounded_queries(build, n_vis, T):
    rng = np.random.default_rng(n_vis)
    check(rng, "q8_0", "q8_0", n_vis, T, q8=True, start=3)
    check(rng, "q8_0", "f16", n_vis, T, q8=True)


@settings(max_examples=30, deadline=None)
@given(kt=st.sampled_from(TYPES), vt=st.sampled_from(["f32", "f16", "bf16", "q8_0", "q5_1"]),
       n_vis=st.integers(1, 600), T=st.integers(1, 6), start=st.integers(0, 300), g=st.sampled_from([1, 3, 4]),
       hkv=st.integers(1, 3), threads=st.integers(1, 3), q8=st.booleans(), seed=st.integers(0, 2**16))
def test_attention_matches_the_oracle(build, kt, vt, n_vis, T, start, g, hkv, threads, q8, seed):
    T = min(T, n_vis)
    check(np.random.default_rng(seed), kt, vt, n_vis, T, hkv=hkv, g=g, start=min(start, n_vis - T),
          threads=threads, q8=q8, extra=seed % 70)


@pytest.mark.parametrize("kt", ["f32", "f16", "bf16", "q4_1"])
def test_q8_flag_is_ignored_without_a_q8_0_k_cache(build, kt):
    rng = np.random.default_rng(7)
    H, T, D, n = 9, 2, 64, 300
    q = rng.standard_normal((H, T, D)).astype(F32)
    sk, _ = _cache(rng.standard_normal((n, 3, D)).astype(F32), kt)
    sv, _ = _cache(rng.standard_normal((n, 3, D)).astype(F32), "q8_0")
    mask = np.zeros((T, n), F32)
    a = attend(q, sk, sv, mask, n, kt, "q8_0", D, q8=False)
    b = attend(q, sk, sv, mask, n, kt, "q8_0", D, q8=True)
    assert np.array_equal(a, b)


@pytest.mark.parametrize("kt,vt,q8", [("f32", "f32", False), ("f16", "f16", False), ("q8_0", "q8_0", False),
                                      ("q8_0", "q8_0", True), ("bf16", "q4_0", False)])
def test_a_sequence_ignores_the_rest_of_the_cache(build, kt, vt, q8):
    """Batch invariance: a sequence of 300 cells at cell 0 alone, and the same cells at cell 384
    (a chunk multiple) after another sequence's cells, with its row beside that sequence's row in
    one call and the cells it cannot see holding infinities in V: the same bits."""
    rng = np.random.default_rng(11)
    H, D, n, off = 9, 64, 300, 384
    q = rng.standard_normal((H, 1, D)).astype(F32)
    xk, xv = rng.standard_normal((n, 3, D)).astype(F32), rng.standard_normal((n, 3, D)).astype(F32)
    sk, _ = _cache(xk, kt)
    sv, _ = _cache(xv, vt)
    alone = attend(q, sk, sv, np.zeros((1, n), F32), n, kt, vt, D, q8=q8)
    other_k, other_v = rng.standard_normal((off, 3, D)).astype(F32), rng.standard_normal((off, 3, D)).astype(F32)
    if vt in ("f32", "f16"):
        other_v[250:260] = np.inf                 # cells no row sees: never weighed, never read into a sum
    bk, _ = _cache(np.concatenate([other_k, xk]), kt)
    bv, _ = _cache(np.concatenate([other_v, xv]), vt)
    q2 = np.concatenate([q, rng.standard_normal((H, 1, D)).astype(F32)], axis=1)     # row 1: the other sequence
    mask = np.full((2, off + n), -np.inf, F32)
    mask[0, off:] = 0.0
    mask[1, :200] = 0.0
    for threads in (1, 2, 3):
        both = attend(q2, bk, bv, mask, off + n, kt, vt, D, threads=threads, q8=q8)
        assert np.array_equal(both[0], alone[0])
        assert np.isfinite(both).all()


@pytest.mark.parametrize("kt,vt,q8", [("f32", "f32", False), ("f16", "f16", False), ("q8_0", "q8_0", True),
                                      ("bf16", "q8_0", False)])
def test_a_sequence_ignores_where_its_cells_sit_in_a_chunk(build, kt, vt, q8):
    """A decode step's cells land wherever cells are free: a sequence's 40 cells spread over the
    first 64-cell block among another sequence's (masked, V holding infinities) give the bits of
    the same cells side by side."""
    rng = np.random.default_rng(5)
    H, D, L, n = 9, 64, 40, 64
    mine = np.concatenate([[0], np.sort(rng.choice(np.arange(1, n), L - 1, replace=False))])
    xk, xv = rng.standard_normal((n, 3, D)).astype(F32), rng.standard_normal((n, 3, D)).astype(F32)
    if vt == "f32":
        others = np.setdiff1d(np.arange(n), mine)
        xv[others[:4]] = np.inf
    q = rng.standard_normal((H, 1, D)).astype(F32)
    sk, _ = _cache(xk[mine], kt)
    sv, _ = _cache(xv[mine], vt)
    side_by_side = attend(q, sk, sv, np.zeros((1, L), F32), L, kt, vt, D, q8=q8)
    sk, _ = _cache(xk, kt)
    sv, _ = _cache(xv, vt)
    mask = np.full((1, n), -np.inf, F32)
    mask[0, mine] = 0.0
    spread = attend(q, sk, sv, mask, int(mine[-1]) + 1, kt, vt, D, q8=q8)
    assert np.array_equal(side_by_side.view(np.uint32), spread.view(np.uint32))


@pytest.mark.parametrize("numerics,ctk", [("q8", "q8_0"), ("exact", "f16"), ("q8", "f16"), ("exact", "f32"), ("exact", "q8_0")])
def test_engine_decode_at_depth_does_not_depend_on_batch_mates(synth_factory, numerics, ctk):
    """End to end with a typed cache: a sequence 300 tokens deep (past two chunks) decodes the
    same logits alone and beside 5 others, its cells placed after theirs or not (the engine puts
    each sequence at a chunk multiple). Prompts go in passes of at most 64 tokens: exact mode's
    longer passes take numpy/BLAS attention, whose sums depend on the batch shape."""
    from metatp import LLM
    from metatp.engine import StepItem
    from metatp.testing.synth import SynthSpec

    spec = SynthSpec(n_layer=2, n_embd=256, n_head=4, n_head_kv=2, n_ff=256, n_vocab=300, seed=4, n_ctx_train=4096,
                     types={"q": "Q4_1", "k": "Q8_0", "v": "Q4_0", "o": "Q4_1", "gate": "Q4_0", "up": "Q4_1",
                            "down": "Q8_0", "embd": "Q8_0"})       # products kept as codes (no BLAS)
    path, _ = synth_factory(spec)
    eng = LLM(path, n_ctx=4096, backend="numpy", numerics=numerics, cache_type_k=ctk, cache_type_v=ctk).engine
    prompt = [int(x) for x in np.random.default_rng(1).integers(0, 300, 300)]

    def decode(k_before: int, k_with: int) -> list[np.ndarray]:
        before = [eng.new_sequence() for _ in range(k_before)]
        for i, s in enumerate(before):
            for _ in range(3):
                eng.run([StepItem(s, [3 + i, 5, 8] * 20, "last")])
        seq, others = eng.new_sequence(), [eng.new_sequence() for _ in range(k_with)]
        for i in range(0, len(prompt), 60):       # passes of <= 64 tokens: the compiled kernels in both numerics
            eng.run([StepItem(seq, prompt[i:i + 60], "last")])
        for i, o in enumerate(others):
            for j in range(1 + i):
                eng.run([StepItem(o, [6 + i, 2] * 30, "last")])
        got = [eng.run([StepItem(seq, [20 + t], "last")] + [StepItem(o, [9 + t], "last") for o in others])[0]
               for t in range(3)]
        for s in before + [seq] + others:
            eng.free(s)
        return got

    want = decode(0, 0)
    for k_before, k_with in ((0, 5), (2, 5)):
        for g, w in zip(decode(k_before, k_with), want):
            assert np.array_equal(g.view(np.uint32), w.view(np.uint32)), (k_before, k_with)


@pytest.mark.parametrize("kt,vt,q8", [("f32", "f32", False), ("f16", "f16", False), ("q8_0", "q8_0", True),
                                      ("q4_1", "q5_0", False)])
def test_a_step_of_many_sequences_matches_the_oracle_and_each_alone(build, kt, vt, q8):
    """A decode step of 10 sequences, each from its own chunk multiple, with lengths on both sides
    of the 64-cell blocks (and one over two chunks): most blocks of the call are hidden from every
    row of a unit, and most chunks from every row. The rows equal the oracle, and each row's bits
    are its bits alone (the skipped blocks and chunks change nothing)."""
    rng = np.random.default_rng(3)
    H, D = 9, 64
    lengths = [1, 40, 63, 64, 65, 100, 127, 128, 200, 7]
    starts = np.cumsum([0] + [-(-n // 128) * 128 for n in lengths[:-1]])
    n = int(starts[-1] + lengths[-1])
    T = len(lengths)
    q = rng.standard_normal((H, T, D)).astype(F32)
    sk, vk = _cache((rng.standard_normal((n, 3, D)) * 2).astype(F32), kt)
    sv, vv = _cache(rng.standard_normal((n, 3, D)).astype(F32), vt)
    mask = np.full((T, n), -np.inf, F32)
    for t, (s, ln) in enumerate(zip(starts, lengths)):
        mask[t, s:s + ln] = 0.0
    for threads in (1, 2):
        out = attend(q, sk, sv, mask, n, kt, vt, D, threads=threads, q8=q8)
        qref = _q8_rounded(q) if q8 and kt == "q8_0" else q.astype(np.float64)
        ref = ref_attention(qref.transpose(1, 0, 2), vk, vv, 0.125, mask=mask.astype(np.float64), causal=False)
        assert np.allclose(out, ref, **TOL), np.abs(out - ref).max()
        for t, (s, ln) in enumerate(zip(starts, lengths)):
            alone = attend(q[:, t:t + 1], sk[:, s:s + ln], sv[:, s:s + ln], np.zeros((1, ln), F32), ln, kt, vt, D,
                           threads=threads, q8=q8)
            assert np.array_equal(out[t].view(np.uint32), alone[0].view(np.uint32)), (t, ln)
