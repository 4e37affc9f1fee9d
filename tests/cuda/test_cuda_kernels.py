"""Every CUDA kernel against a numpy reference, on a GPU and on the CPU emulator.

The checks live in test support, one module per kernel family
(``metatp.testing.kernel_checks``; ``scripts/gpu_kernels_check.py`` is their command
line); each group here runs one of them and fails with the table of failing cases. Each group runs twice: on a real GPU through CuPy (marked ``gpu``, skipped without
one) and on the kernel emulator (the same sources compiled as host C++ by g++, one fiber
per CUDA thread; skipped without a C++ compiler). The few tests at the end check the
numpy oracles themselves and run anywhere.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from metatp.backends.cuda import kernels as ck
from metatp.backends.cuda.launch import using
from metatp.testing import kernel_checks as gkc, oracles
from metatp.testing.cuda_emulator import Emulator
from support.require import requires

requires_gpu = requires("gpu")
requires_cxx = requires("emulator")


def _check(group: str, emulate: bool) -> None:
    results = gkc.check_all_kernels([group], seed=1234, time_reps=0, emulate=emulate)
    assert results, "no cases ran"
    bad = [r for r in results if not r["pass"]]
    if bad:
        details = "\n".join(
            f"{r['name']} [{r['dtype']}]: {r.get('error')}\n{r.get('traceback', '')}"
            for r in bad if r.get("error")
        )
        pytest.fail(f"{len(bad)}/{len(results)} cases failed\n{gkc.markdown_table(bad)}\n{details}")


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("group", gkc.CHECK_NAMES)
def test_kernel_group(group):
    _check(group, emulate=False)


@requires_cxx
@pytest.mark.parametrize("group", gkc.CHECK_NAMES)
def test_kernel_group_on_emulator(group):
    _check(group, emulate=True)


@requires_cxx
def test_emulator_refuses_what_a_gpu_refuses():
    """Argument C types, block size limits and dynamic shared memory are checked at launch."""
    null = np.uint64(0)
    with using(Emulator()):
        x = np.ones((2, 64), np.float32)
        k = ck.get_kernel("norm", "rms_norm_f32")
        ints = [np.int32(v) for v in (64, 2, 1, 2, 64, 0, 0, 64, 0, 0)]
        with pytest.raises(TypeError, match="np.float32"):
            k((2,), (64,), (x, null, x, *ints, 1e-5))                    # a Python float
        with pytest.raises(RuntimeError, match="invalid launch"):
            k((2,), (2048,), (x, null, x, *ints, np.float32(1e-5)))
        attn = ck.get_kernel("attn", "attn_prefill_f16")
        with pytest.raises(RuntimeError, match="max_dynamic_shared_size_bytes"):
            attn((1,), (128,), (null,) * 6 + (np.int32(0),) * 12 + (np.float32(0),) * 2
                 + (np.int32(0),) * 2, shared_mem=64 * 1024)


@requires_cxx
def test_none_pointer_is_refused_like_cupy_13():
    """CuPy 13 passes a None argument as a pointer to garbage: the emulator refuses it, and every
    launcher passes an absent pointer as np.uint64(0) instead."""
    with using(Emulator()):
        x = np.ones((2, 64), np.float32)
        y = np.zeros_like(x)
        k = ck.get_kernel("norm", "rms_norm_f32")
        ints = [np.int32(v) for v in (64, 2, 1, 2, 64, 0, 0, 64, 0, 0)]
        with pytest.raises(TypeError, match="argument 1 is None"):
            k((2,), (64,), (x, None, x, *ints, np.float32(1e-5)))
        ck.rms_norm(x, y, eps=1e-5)                   # no weight: launched with a NULL pointer
        np.testing.assert_allclose(y, 1.0, rtol=1e-5)
        with ck.recording() as launches:              # every optional pointer left out
            ck.rms_norm(x, y, eps=1e-5)
            ck.matvec.matvec(np.zeros((4, 64), np.float32), "f32", x, np.zeros((2, 4), np.float32), ne0=64, n_rows=4)
            ck.soft_max(x, y)
            pos = np.zeros(2, np.int32)
            ck.rope.rope(x.reshape(2, 1, 64), y.reshape(2, 1, 64), pos, head_dim=64, n_head=1, n_tokens=2,
                    n_dims=64, freq_base=1e4)
            q = np.ones((1, 2, 64), np.float32)
            kv = np.ones((8, 1, 64), np.float16)
            ck.flash_attn_decode(q, kv, kv, np.zeros_like(q), n_head=2, n_head_kv=1, head_dim=64, n_tokens=1,
                                 n_kv=8, scale=0.125, n_splits=1)
        assert launches and all(a is not None for la in launches for a in la.args)
        for la in launches:                           # and they run (the emulator checks every argument)
            la()


@requires_cxx
def test_get_rows_batch_strides_are_64_bit():
    """A 2-D source whose matrix exceeds 2 GiB (a 128k x 8192 f16 embedding) must not overflow:
    a batch stride over a size-1 dimension goes as 0, a used one as int64."""
    rng = np.random.default_rng(0)
    src = rng.standard_normal((5, 64)).astype(np.float32)
    idx = np.array([3, 0, 4], np.int32)
    out = np.zeros((3, 64), np.float32)
    with using(Emulator()):
        ck.get_rows(src, "f32", idx, out, ne0=64, src_row_bytes=256, src_batch_bytes=(5 << 30, 5 << 32))
        np.testing.assert_array_equal(out, src[idx])
        with ck.recording() as launches:
            ck.get_rows(src, "f32", idx, out, ne0=64, src_row_bytes=256, src_batch_bytes=(5 << 30, 5 << 32))
        assert launches[0].args[8:10] == (np.int64(0), np.int64(0))
        batched = rng.standard_normal((2, 3, 64)).astype(np.float32)        # ne2 = 2 batches of 3 rows
        bidx = np.array([[[2, 0]], [[1, 1]]], np.int32).reshape(1, 2, 2)
        bout = np.zeros((1, 2, 2, 64), np.float32)
        with ck.recording() as launches:
            ck.get_rows(batched, "f32", bidx, bout, ne0=64, src_row_bytes=256, src_batch_bytes=(3 * 256, 0))
        assert isinstance(launches[0].args[8], np.int64) and int(launches[0].args[8]) == 3 * 256
        launches[0]()
        np.testing.assert_array_equal(bout[0, 0], batched[0][[2, 0]])
        np.testing.assert_array_equal(bout[0, 1], batched[1][[1, 1]])


# ------------------------------------------------------------- oracle sanity (CPU)
def test_bf16_bits_match_gguf():
    import gguf
    x = (np.random.default_rng(0).standard_normal(1000) * 100).astype(np.float32)
    x[:3] = [np.inf, -np.inf, np.nan]
    ours = oracles.f32_to_bf16_bits(x)
    ref = gguf.quants.quantize(x, gguf.GGMLQuantizationType.BF16).view(np.uint16)
    assert np.array_equal(ours, ref)


@pytest.mark.parametrize("wtype", ["q8_0", "q4_0", "q4_1", "q4_k", "q5_k", "q6_k", "bf16"])
def test_make_weight_oracle(wtype):
    raw, deq = oracles.make_weight(np.random.default_rng(1), wtype, 3, 512)
    assert raw.dtype == np.uint8 and raw.shape[0] == 3
    assert deq.shape == (3, 512) and np.isfinite(deq).all() and np.abs(deq).max() > 0


def test_ref_attention_single_key_returns_v():
    rng = np.random.default_rng(2)
    q = rng.standard_normal((1, 4, 8))
    k = rng.standard_normal((1, 2, 8))
    v = rng.standard_normal((1, 2, 8))
    out = oracles.ref_attention(q, k, v, 0.3)
    assert np.allclose(out, v[0][[0, 0, 1, 1]][None])


def test_ref_rope_position_zero_is_identity():
    x = np.random.default_rng(3).standard_normal((2, 3, 16))
    y = oracles.ref_rope(x, np.zeros(2, np.int32), 16, 10000.0, 1.0, neox=True)
    assert np.allclose(x, y)


def test_rel_err_flags_nan():
    assert oracles.rel_err(np.array([1.0, np.nan]), np.array([1.0, 2.0])) == math.inf
    assert oracles.rel_err(np.array([1.0, 2.0]), np.array([1.0, 2.0])) == 0.0


@requires_cxx
def test_quantized_cache_launchers_refuse_what_they_cannot_take():
    """A uint8 cache must be named; rows must be whole blocks; attention needs byte strides."""
    with using(Emulator()):
        src = np.ones((2, 64), np.float32)
        idx = np.array([0, 1], np.int32)
        cache = np.zeros((4, 2 * 34), np.uint8)
        with pytest.raises(TypeError, match="quantized type named"):
            ck.set_rows(src, cache, idx)
        with pytest.raises(TypeError, match="given as"):
            ck.set_rows(src, np.zeros((4, 64), np.float16), idx, cache_type="q8_0")
        with pytest.raises(ValueError, match="whole blocks"):
            ck.set_rows(np.ones((2, 48), np.float32), cache, idx, cache_type="q8_0")
        with pytest.raises(ValueError, match="cannot hold"):
            ck.set_rows(src, np.zeros((4, 34), np.uint8), idx, cache_type="q8_0")
        ck.set_rows(src, cache, idx, cache_type="q8_0")
        assert np.array_equal(cache[:2], oracles.kv_quantize(src, "q8_0"))
        q = np.ones((1, 2, 64), np.float32)
        kv = np.zeros((8, 1, 2 * 34), np.uint8)
        kw = dict(n_head=2, n_head_kv=1, head_dim=64, n_tokens=1, n_kv=8, scale=0.125, kv_type="q8_0")
        with pytest.raises(ValueError, match="byte strides"):
            ck.flash_attn_decode(q, kv, kv, np.zeros_like(q), **kw)
        with pytest.raises(ValueError, match="whole q4_0 blocks"):
            ck.flash_attn_decode(q, kv, kv, np.zeros_like(q), **{**kw, "head_dim": 48, "kv_type": "q4_0"},
                                 k_strides=(68, 68), v_strides=(68, 68))


@pytest.mark.parametrize("cache_type", ["f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1"])
def test_kv_rows_oracle(cache_type):
    """The cache oracle: stored form and its value (within the type's rounding of the input)."""
    x = np.random.default_rng(4).standard_normal((3, 2, 64)).astype(np.float32)
    stored, val = oracles.kv_rows(x, cache_type)
    assert val.shape == x.shape and val.dtype == np.float64
    if cache_type in ck.KV_QUANT_TYPES:
        qk, nbytes = ck.KV_QUANT_TYPES[cache_type]
        assert stored.dtype == np.uint8 and stored.shape == (3, 2, 64 // qk * nbytes)
    tol = {"f32": 0, "f16": 1e-3, "bf16": 1e-2, "q8_0": 2e-2, "q5_0": 0.1, "q5_1": 0.1}.get(cache_type, 0.2)
    assert np.abs(val - x).max() <= tol * np.abs(x).max()


@requires_cxx
def test_mmq_crossover_script_runs_the_three_paths_on_the_emulator(capsys):
    """scripts/mmq_crossover (the GPU session's timing of matvec / mmq / dequantize + cuBLAS):
    on the emulator every path's product matches the reference and nothing is timed."""
    from scripts import mmq_crossover

    assert mmq_crossover.main(["--emulate"]) == 0
    out = capsys.readouterr().out
    assert "| tiny q4_k 20x256 | q4_k | 17 |" in out and "no suggestion" in out


def test_mmq_crossover_suggests_where_the_tiled_kernel_wins_everywhere():
    from scripts.mmq_crossover import suggest

    def row(shape, t, mv, mq, gm):
        return {"shape": shape, "tokens": t, "matvec_us": mv, "mmq_us": mq, "gemm_us": gm}
    rows = [row("a", 4, 1.0, 2.0, 9.0), row("a", 16, 5.0, 3.0, 9.0), row("a", 64, 20.0, 8.0, 9.0),
            row("a", 256, 80.0, 30.0, 10.0), row("b", 16, 5.0, 3.0, 9.0), row("b", 64, 20.0, 9.5, 9.0)]
    assert suggest(rows) == (16, 16)            # at 64 tokens cuBLAS wins for shape b
    assert suggest(rows[:4]) == (16, 64)
    assert suggest([row("a", 4, 1.0, 2.0, 9.0)]) is None
    assert suggest([{**row("a", 4, 1.0, 2.0, 9.0), "gemm_us": None}]) is None
    assert suggest([{**row("a", 16, 5.0, 3.0, 9.0), "mmq_i8_us": 1.0}]) == (16, 16)   # q8 numerics' path apart


def test_mmq_crossover_int8_range_is_where_it_beats_cublas_and_the_f32_tiles_everywhere():
    from scripts.mmq_crossover import suggest_int8

    def row(shape, t, mq, gm, i8):
        return {"shape": shape, "tokens": t, "matvec_us": 0.1, "mmq_us": mq, "gemm_us": gm, "mmq_i8_us": i8}
    rows = [row("a", 16, 3.0, 9.0, 2.0), row("a", 64, 8.0, 9.0, 4.0), row("a", 256, 30.0, 10.0, 12.0),
            row("b", 16, 3.0, 9.0, 2.0), row("b", 64, 9.0, 5.0, 6.0)]
    assert suggest_int8(rows) == (16, 16)       # at 64 tokens cuBLAS wins for shape b; at 256 for a
    assert suggest_int8(rows[:2]) == (16, 64)
    assert suggest_int8([row("a", 16, 3.0, 9.0, None)]) is None


def test_mmq_crossover_tensor_core_range_is_where_it_beats_every_exact_path_everywhere():
    from scripts.mmq_crossover import disagreeing, suggest, suggest_tensor_cores

    def row(shape, t, mv, mq, gm, h):
        return {"shape": shape, "tokens": t, "matvec_us": mv, "mmq_us": mq, "gemm_us": gm, "mmq_h_us": h}
    rows = [row("a", 8, 1.0, 2.0, 9.0, 1.5), row("a", 16, 5.0, 3.0, 9.0, 2.0), row("a", 256, 80.0, 30.0, 10.0, 8.0),
            row("b", 16, 5.0, 3.0, 9.0, 2.5), row("b", 256, 80.0, 30.0, 10.0, 11.0)]
    assert suggest_tensor_cores(rows) == (16, 16)      # at 8 tokens the matvec kernel wins; at 256 cuBLAS for b
    assert suggest_tensor_cores(rows[:3]) == (16, 256)
    assert suggest(rows) == (16, 16)                   # the f32 tiles' range ignores the tensor-core column
    assert suggest_tensor_cores([{**row("a", 16, 5.0, 3.0, 9.0, 2.0), "mmq_h_us": None}]) is None
    # its error is held to the f16 bound, as the GEMM path's (both round their operands to f16)
    errs = {"matvec_err": 1e-7, "mmq_err": 1e-7, "gemm_err": 1e-3, "mmq_h_err": 1e-3, "mmq_i8_err": None}
    assert disagreeing([{**row("a", 16, 1, 1, 1, 1), **errs}]) == []
    bad = {**row("a", 16, 1, 1, 1, 1), **errs, "mmq_h_err": 1e-2}
    assert disagreeing([bad]) == [(bad, "mmq_h")]
