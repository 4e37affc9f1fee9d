"""The integer kernels of numerics="q8" at many tokens a step (csrc/q8_gemm.c's 16-row x 8-token
tiles with 512-bit registers, 16 x 4 with AVX2 for nibble and 8-bit codes, token cache blocks, and the decode tiles of repack.c / q8_matmul.c below 8 tokens),
for every ISA build this CPU can run (the `lib` / `use` fixtures of test_q8_kernels build each):

- integer block sums bit-exact and float results within float32 rounding of a float64 reference
  built from `q8_quantize_numpy` and integer sums in numpy, over formats, shapes, token counts
  1..512 and tile remainders;
- batch invariance at every tile shape: a token's result is the same bits whatever the token
  count (tile remainders, the 8-token GEMM threshold, 64-token cache blocks), the thread count,
  or the other products sharing its call;
- the backend sends q8 products of long prompts (more than MAX_ROWS tokens) to these kernels, and
  a q8 decode step gives a sequence the same logits whatever its batch-mates.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from metatp.backends.numpy import native
from metatp.backends.numpy.codes import GROUP, group_rows, groupable
from metatp.backends.numpy.kernels.matmul import q8_quantize_numpy
from support.require import requires
from test_q8_kernels import FORMATS, _activations, _weight, lib, use  # noqa: F401  (lib, use: fixtures)

pytestmark = requires("cpu_kernels")

# token counts around every boundary of the tiling: tile remainders 1..7, the GEMM threshold (8),
# the 64-token cache blocks, MAX_ROWS (64), long prompts
EDGES = [1, 2, 3, 4, 5, 7, 8, 9, 12, 15, 16, 17, 31, 63, 64, 65, 127, 128, 129, 200, 511, 512]


def _reference(aw, q: np.ndarray, x: np.ndarray, kind: int):
    """(integer sums per 16 elements (n, rows, K/16), float64 result (n, rows), bound of
    sum |terms|) from numpy's rounding of x (`q8_quantize_numpy`) and numpy integer sums."""
    xq, d, s, isum = q8_quantize_numpy(x, kind)
    n, k = x.shape
    xb = xq.astype(np.int64).reshape(n, k // 16, 16)
    qb = q.astype(np.int64).reshape(aw.rows, k // 16, 16)
    isums = np.einsum("nbi,rbi->nrb", xb, qb)
    abs_sums = np.einsum("nbi,rbi->nrb", np.abs(xb), np.abs(qb))
    per = isums.reshape(n, aw.rows, k // aw.block, aw.block // 16).sum(-1).astype(np.float64)
    abs_per = abs_sums.reshape(n, aw.rows, k // aw.block, aw.block // 16).sum(-1).astype(np.float64)
    dx = np.repeat(d.astype(np.float64), (256 if kind == native.Q8_K else 32) // aw.block, axis=1)
    factor = aw.scale[None].astype(np.float64) * dx[:, None]
    y, mag = (per * factor).sum(-1), (abs_per * np.abs(factor)).sum(-1)
    if aw.offset is not None:
        xs = s.astype(np.float64) if kind == native.Q8_1 else dx * isum.reshape(n, -1, aw.block // 16).sum(-1)
        off = aw.offset[None].astype(np.float64) * xs[:, None]
        y, mag = y + off.sum(-1), mag + np.abs(off).sum(-1)
    return isums, y, mag


def _bits(a: np.ndarray) -> np.ndarray:
    return a.view(np.uint32)


@settings(max_examples=40, deadline=None)
@given(fmt=st.sampled_from(sorted(FORMATS)), groups=st.integers(1, 5), blocks=st.integers(1, 3),
       n=st.one_of(st.sampled_from(EDGES), st.integers(1, 512)), threads=st.sampled_from([1, 2]),
       grouped=st.booleans(), seed=st.integers(0, 2**16))
def test_many_tokens_exact_sums_and_results_within_rounding(use, fmt, groups, blocks, n, threads, grouped, seed):
    """Odd and even numbers of row groups (the GEMM pairs groups; a last one alone takes the
    decode tile), row-major or row-group layout, K of one to three 256-blocks (three: more than
    the 16 blocks of 32 whose sums the AVX2 tile works out before it scales them)."""
    rng = np.random.default_rng(seed)
    k = blocks * 256
    aw, q = _weight(rng, fmt, groups * GROUP, k)
    kind = FORMATS[fmt][0]
    x = _activations(rng, n, k)
    isums, ref, mag = _reference(aw, q, x, kind)
    xq = q8_quantize_numpy(x, kind)[0]
    assert np.array_equal(native.q8_quantize(x, kind)[0], xq)
    if grouped and groupable(aw):
        aw = group_rows(aw)
        isums = isums.reshape(n, aw.rows, -1, 2).sum(-1)           # that layout sums whole blocks of 32
    assert np.array_equal(native.q8_isums(aw, xq), isums)
    y = native.q8_matmul(x, aw, nthreads=threads)
    m = k // 16 + (k // aw.block if aw.offset is not None else 0)
    assert np.all(np.abs(y - ref) <= (m + 2) * 2.0**-24 * mag), np.abs(y - ref).max()
    # every token alone (the decode tile) gives the bits it got among n
    for t in sorted({0, n - 1, int(rng.integers(0, n))}):
        assert np.array_equal(_bits(native.q8_matmul(x[t:t + 1], aw, nthreads=threads)[0]), _bits(y[t]))


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_a_tokens_bits_do_not_depend_on_the_token_count(use, fmt):
    """Every prefix length at the tiling's edges (and 1 or 2 threads) gives each token the bits
    of the full 512-token step, for 3 row groups (a pair and a lone group) in either layout."""
    rng = np.random.default_rng(7)
    aw, _ = _weight(rng, fmt, 3 * GROUP, 256)
    x = _activations(rng, 512, 256)
    for w in {id(aw): aw, 0: group_rows(aw) if groupable(aw) else aw}.values():
        full = native.q8_matmul(x, w, nthreads=2)
        for n in EDGES:
            for threads in (1, 2):
                assert np.array_equal(_bits(native.q8_matmul(x[:n], w, nthreads=threads)), _bits(full[:n])), (n, threads)
        # a window that starts off every tile and block boundary
        assert np.array_equal(_bits(native.q8_matmul(x[13:150], w, nthreads=2)), _bits(full[13:150]))


def test_grouped_products_of_many_tokens_share_one_quantization(use):
    """Several products in one call at 200 tokens (the threads quantize the shared x once, then
    share out every item's rows by token block): each equal to its own call."""
    rng = np.random.default_rng(3)
    x = _activations(rng, 200, 512)
    parts = []
    for fmt, rows in (("Q4_1", 40), ("Q4_1", 48), ("Q8_0", 24), ("Q4_0", 16), ("Q6_K", 20), ("Q4_K", 8)):
        aw, _ = _weight(rng, fmt, rows, 512)
        parts.append((group_rows(aw) if groupable(aw) else aw, np.empty((200, rows), np.float32)))
    native.group_qmatmul([native.prepare_q8_matmul(aw, x, y, 2) for aw, y in parts])()
    for aw, y in parts:
        assert np.array_equal(_bits(y), _bits(native.q8_matmul(x, aw, nthreads=1)))


def test_long_prompts_take_the_integer_kernels(synth_factory):
    """numerics="q8": a 100-token prompt (past MAX_ROWS, a pass of its own) multiplies on the
    integer kernels, not on quantize + dequantize + BLAS; its logits agree with the float
    emulation's as in the decode test of test_q8_kernels."""
    from metatp import LLM
    from metatp.backends.numpy.kernels import matmul as numpy_kernels
    from metatp.testing.synth import SynthSpec

    assert native.MAX_ROWS < 100
    spec = SynthSpec(n_layer=2, n_embd=256, n_head=4, n_head_kv=2, n_ff=512, n_vocab=300, seed=5,
                     types={"q": "Q4_1", "k": "Q8_0", "v": "Q4_0", "o": "Q5_0", "gate": "Q4_K", "up": "Q5_1",
                            "down": "Q6_K", "embd": "Q8_0"})
    path, _ = synth_factory(spec)
    tokens = [int(t) for t in np.random.default_rng(0).integers(1, 300, 100)]
    rows = []

    def counting(aw, x2, y2, *args, **kw):
        rows.append(x2.shape[0])
        return native.prepare_q8_matmul(aw, x2, y2, *args, **kw)

    out = {}
    for name, kw in (("int", {}), ("emulated", {"cpu_kernels": False})):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(numpy_kernels, "prepare_q8_matmul", counting)
            llm = LLM(path, n_ctx=256, backend="numpy", numerics="q8", **kw)
            out[name] = llm.engine.forward(tokens)
        if name == "int":
            assert max(rows) >= 100
        else:
            assert not rows
        rows.clear()
    scale = np.abs(out["emulated"]).max()
    assert np.abs(out["int"] - out["emulated"]).max() < 0.05 * scale


def test_q8_decode_logits_do_not_depend_on_batch_mates(synth_factory):
    """numerics="q8" at the engine level: a sequence's decode logits are the same bits alone (one
    row: the decode tile), with 11 neighbours (12 rows: the GEMM, a remainder of 4) and with 20
    (21 rows), its cells placed after other sequences' or not."""
    from metatp import LLM
    from metatp.engine import StepItem
    from metatp.testing.synth import SynthSpec

    spec = SynthSpec(n_layer=2, n_embd=128, n_head=4, n_head_kv=2, n_ff=256, n_vocab=300, seed=9,
                     types={"q": "Q4_1", "k": "Q8_0", "v": "Q4_0", "o": "Q4_1", "gate": "Q4_0", "up": "Q4_1",
                            "down": "Q8_0", "embd": "Q8_0"})
    path, _ = synth_factory(spec)
    llm = LLM(path, n_ctx=2048, backend="numpy", numerics="q8")
    eng = llm.engine

    def decode(k_before: int, k_with: int) -> list[np.ndarray]:
        before = [eng.new_sequence() for _ in range(k_before)]
        for i, s in enumerate(before):
            eng.run([StepItem(s, [3 + i, 5, 8], "last")])
        seq, others = eng.new_sequence(), [eng.new_sequence() for _ in range(k_with)]
        eng.run([StepItem(seq, [1, 2, 3, 4, 5], "last")] + [StepItem(o, [6 + i % 9, 2], "last")
                                                             for i, o in enumerate(others)])
        got = []
        for t in range(3):
            out = eng.run([StepItem(seq, [20 + t], "last")] + [StepItem(o, [9 + t], "last") for o in others])
            got.append(out[0])
        for s in before + [seq] + others:
            eng.free(s)
        return got

    want = decode(0, 0)
    for k_before, k_with in ((0, 11), (3, 20)):
        for g, w in zip(decode(k_before, k_with), want):
            assert np.array_equal(g.view(np.uint32), w.view(np.uint32)), (k_before, k_with)


@settings(max_examples=16, deadline=None)
@given(fmt=st.sampled_from(sorted(FORMATS)), groups=st.integers(2, 5), blocks=st.integers(1, 3),
       n=st.sampled_from([16, 17, 20, 24, 31, 32, 33, 64]), seed=st.integers(0, 2**16))
def test_amx_tiles_give_the_bits_of_the_avx512_tiles(fmt, groups, blocks, n, seed):
    """csrc/q8_amx.c (the avx512-amx build, and -march=native on a CPU with AMX) forms each
    result by the float operations of q8_gemm.c's 512-bit tile in the same block order: the same
    bits, 16-token tiles and remainders alike, on either side of AMX_MAX_TOKENS (32) (where the
    OS refuses the tile state, that build runs the 512-bit tile itself)."""
    from support.cpu import isa_library

    amx, vnni = isa_library("avx512-amx"), isa_library("avx512-vnni")
    rng = np.random.default_rng(seed)
    k = blocks * 256
    aw, _ = _weight(rng, fmt, groups * GROUP, k)
    if groupable(aw):
        aw = group_rows(aw)
    x = _activations(rng, n, k)
    outs = []
    for lib in (amx, vnni):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(native.lib, "_library", lambda lib=lib: (lib, native.library_isa(lib)))
            outs.append(native.q8_matmul(x, aw, nthreads=2))
    assert np.array_equal(_bits(outs[0]), _bits(outs[1]))
