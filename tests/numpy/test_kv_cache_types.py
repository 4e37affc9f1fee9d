"""KV cache types on the numpy backend (issue 17): f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1 caches
stored as their real bytes, written with llama.cpp's reference rounding and read directly by
attention, single-device and under -sm tensor.

- the KV write (compiled, and the numpy path) rounds rows bit for bit as gguf.quants does, and
  the compiled dequantization is gguf's;
- attention over a typed cache equals a float64 reference on the dequantized cache (tight) and
  the f32-cache result (loose, per type);
- a synthetic model runs with every type: -sm tensor with uneven splits gives the logits of one
  device with the same type; the stored bytes are what the memory plan counts.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf.quants import dequantize, quantize

from metatp.backends.numpy import native
from metatp.backends.numpy.backend import NumpyBackend
from metatp.backends.numpy.kernels import kv_load_rows, kv_store_rows
from metatp.engine import Engine
from metatp.ir.loader import load_model
from metatp.ir.models import ModelTensors
from metatp.ir.models.common import KV_CACHE_TYPES
from metatp.ir.tensor import Flag, GGMLType
from metatp.passes.plan import DeviceLayout
from metatp.testing.oracles import ref_attention
from metatp.testing.synth import SynthSpec
from support.require import requires

F32 = np.float32
TYPED = [n for n in KV_CACHE_TYPES if n != "f32"]
kernels = requires("cpu_kernels")


def _rows(rng, n: int, k: int) -> np.ndarray:
    """Rows over many magnitudes with the rounding's edge cases: an all-zero block, exact halves
    (ties), equal |max| of both signs, a constant block, subnormal-sized values."""
    x = (rng.standard_normal((n, k)) * 10.0 ** rng.uniform(-4, 2, (n, 1))).astype(F32)
    x[0, 32:64] = 0.0
    x[1, :32] = np.arange(-16, 16, dtype=F32) / 2
    x[1, 5] = 8.0
    x[2, :32] = 0.75
    x[3, :32] = F32(1e-30) * rng.standard_normal(32).astype(F32)
    return x


def _gguf_bytes(x: np.ndarray, name: str) -> np.ndarray:
    qt = gguf.GGMLQuantizationType[name.upper()]
    return np.ascontiguousarray(quantize(x, qt)).view(np.uint8).reshape(x.shape[0], -1)


@kernels
@pytest.mark.parametrize("name", TYPED)
def test_kv_write_rounds_as_gguf_quants(name):
    rng = np.random.default_rng(3)
    x = _rows(rng, 40, 128)
    ty = int(KV_CACHE_TYPES[name])
    want = _gguf_bytes(x, name)
    assert np.array_equal(native.kv_quantize(x, ty), want)
    # the compiled KV write into strided cache rows, and the numpy path, store the same bytes
    store = kv_store_rows(x, GGMLType(ty))
    assert np.array_equal(np.ascontiguousarray(store).view(np.uint8).reshape(40, -1), want)
    if name == "f16":
        cache = np.zeros((60, 2, 128), np.float16)
        dst = cache[:, 1]
    else:
        cache = np.zeros((60, 2, want.shape[1]), np.uint8)
        dst = cache[:, 1]
    ids = rng.permutation(60)[:40].astype(np.int32)
    native.prepare_set_rows(x, ids, dst, ty)()
    assert np.array_equal(np.ascontiguousarray(dst[ids]).view(np.uint8).reshape(40, -1), want)
    assert not cache[:, 0].any()                                   # the other head untouched
    # and the compiled dequantization is gguf's, bit for bit
    deq = dequantize(want, gguf.GGMLQuantizationType[name.upper()]) if name != "f16" else \
        want.view(np.float16).astype(F32)
    assert np.array_equal(native.kv_dequantize(want, ty, 128).view(np.uint32), np.asarray(deq, F32).view(np.uint32))
    assert np.array_equal(kv_load_rows(np.ascontiguousarray(store), GGMLType(ty)).reshape(40, 128).view(np.uint32),
                          np.asarray(deq, F32).view(np.uint32))


def _typed_cache(x: np.ndarray, name: str) -> tuple[np.ndarray, np.ndarray]:
    """A float cache (n, Hkv, D) as stored in type `name` (what the kernel reads) and its values."""
    n, Hkv, D = x.shape
    ty = KV_CACHE_TYPES[name]
    stored = kv_store_rows(x.reshape(n * Hkv, D), ty)
    if name not in ("f32", "f16"):
        stored = np.ascontiguousarray(stored).view(np.uint8)
    values = kv_load_rows(stored, ty).reshape(n, Hkv, D)
    return stored.reshape(n, Hkv, -1), values


# how far attention over each type may be from the f32 cache's (max abs error / max |out|; about
# twice the largest seen: K errors move peaked softmax weights, so 4-bit K is far from f32)
LOOSE = {"f16": 3e-3, "bf16": 1.5e-2, "q8_0": 4e-2, "q5_0": 0.3, "q5_1": 0.3, "q4_0": 0.5, "q4_1": 0.5}


@kernels
@pytest.mark.parametrize("name", TYPED)
@pytest.mark.parametrize("T,threads", [(1, 1), (3, 2), (16, 3), (64, 2), (150, 2), (300, 3)])   # long: q8 passes
def test_attention_reads_typed_caches(name, T, threads):
    rng = np.random.default_rng(T * 7 + threads)
    Hkv, g, D, n_max = 2, 3, 64, 700
    H, n_vis = Hkv * g, 650
    q = rng.standard_normal((H, T, D)).astype(F32)
    xk = (rng.standard_normal((n_max, Hkv, D)) * 2).astype(F32)
    xv = rng.standard_normal((n_max, Hkv, D)).astype(F32)
    mask = np.zeros((T, n_max), F32)
    mask[:, :40] = -np.inf                                          # a window: an unseen first block
    for t in range(T):
        mask[t, n_vis - T + t + 1:] = -np.inf
    sk, vals_k = _typed_cache(xk, name)
    sv, vals_v = _typed_cache(xv, name)
    ty = int(KV_CACHE_TYPES[name])
    out = np.full((T, H, D), np.nan, F32)
    native.prepare_attention(q, sk.transpose(1, 0, 2), sv.transpose(1, 0, 2), mask, 0.125, 0.0, None, out, threads,
                         ty, ty)(n_vis)

    def ref64(k, v):
        idx = np.arange(H) // g                        # query head -> its KV head
        s = np.einsum("htd,hnd->htn", q.astype(np.float64), k.astype(np.float64).transpose(1, 0, 2)[idx])
        s = s * 0.125 + mask[None, :, :]
        s = np.exp(s - s.max(-1, keepdims=True))
        s /= s.sum(-1, keepdims=True)
        return np.einsum("htn,hnd->thd", s, v.astype(np.float64).transpose(1, 0, 2)[idx])

    exact = ref64(vals_k, vals_v)                      # the same cache values, in float64
    assert np.allclose(out, exact, rtol=1e-5, atol=1e-5)
    f32 = ref64(xk, xv)                                # the unrounded cache
    assert np.abs(out - f32).max() <= LOOSE[name] * np.abs(f32).max()
    # the shared float64 oracle over the visible cells of the same values (the long-prompt path's view)
    ref = ref_attention(q.transpose(1, 0, 2).astype(np.float64), vals_k[:n_vis].astype(np.float64),
                        vals_v[:n_vis].astype(np.float64), 0.125, mask=mask[:, :n_vis].astype(np.float64),
                        causal=False)
    assert np.allclose(out, ref, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- end to end
@pytest.fixture(scope="module")
def model(synth_factory):
    path, _ = synth_factory(SynthSpec(n_embd=128, n_head=8, n_head_kv=4, head_dim=32, n_vocab=300, seed=11,
                                      default_type="Q8_0"))
    return load_model(path)


LAYOUTS = {1: DeviceLayout(), 2: DeviceLayout(2, "tensor", (3.0, 1.0)), 3: DeviceLayout(3, "tensor", (1.0, 2.0, 1.0))}


def _engine(model, n: int, kt: str, vt: str | None = None, n_ctx: int = 256, **backend) -> Engine:
    """An engine whose KV cache has types kt / vt (LLM(cache_type_k=..., cache_type_v=...) does
    this through the engine)."""
    layout = LAYOUTS[n]
    eng = Engine(model, n_ctx, layout, NumpyBackend(layout, **backend), n_batch=128)
    eng.tensors = ModelTensors(model, n_ctx, KV_CACHE_TYPES[kt], KV_CACHE_TYPES[vt or kt])
    return eng


def _teacher_forced(eng: Engine, prompt: list[int], follow: list[int]) -> np.ndarray:
    """Logits after the prompt, then after each token of `follow` fed one at a time (decode)."""
    out = [eng.forward(prompt)]
    for t in follow:
        out.append(eng.forward([t]))
    return np.stack(out)


def _greedy(eng: Engine, prompt: list[int], n: int) -> list[int]:
    lg, toks = eng.forward(prompt), []
    for _ in range(n):
        toks.append(int(np.argmax(lg)))
        lg = eng.forward([toks[-1]])
    return toks


@pytest.mark.parametrize("kt,vt", [(n, None) for n in KV_CACHE_TYPES] + [("q8_0", "f16"), ("f16", "q4_0")])
@pytest.mark.parametrize("plen", [7, 90])           # decode-sized prompt (compiled) and a BLAS-sized one
def test_tensor_parallel_matches_one_device_per_type(model, kt, vt, plen):
    rng = np.random.default_rng(plen)
    prompt = [int(t) for t in rng.integers(1, 300, plen)]
    follow = [int(t) for t in rng.integers(1, 300, 12)]
    one = _engine(model, 1, kt, vt)
    ref = _teacher_forced(one, prompt, follow)
    one.reset()
    ref_tokens = _greedy(one, prompt, 8)
    f32 = _teacher_forced(_engine(model, 1, "f32"), prompt, follow)
    cos = np.sum(ref * f32, -1) / np.linalg.norm(ref, axis=-1) / np.linalg.norm(f32, axis=-1)
    fine = {kt, vt or kt} <= {"f32", "f16", "bf16", "q8_0"}
    assert cos.min() > (0.9999 if fine else 0.995), (kt, vt, cos.min())
    for n in (2, 3):
        eng = _engine(model, n, kt, vt)
        got = _teacher_forced(eng, prompt, follow)
        # rows are quantized per head: a split changes only float rounding upstream of the cache
        assert np.abs(got - ref).max() <= 1e-3 * np.abs(ref).max(), (kt, n)
        eng.reset()
        assert _greedy(eng, prompt, 8) == ref_tokens


@kernels
@pytest.mark.parametrize("kt", ["f16", "bf16", "q8_0", "q4_1", "q5_0"])
def test_numpy_path_matches_compiled_kernels(model, kt):
    """Without the compiled kernels the KV write rounds with gguf.quants and attention dequantizes
    the visible rows: the same values, so logits agree to float rounding."""
    rng = np.random.default_rng(1)
    prompt = [int(t) for t in rng.integers(1, 300, 9)]
    follow = [int(t) for t in rng.integers(1, 300, 6)]
    a = _teacher_forced(_engine(model, 2, kt), prompt, follow)
    b = _teacher_forced(_engine(model, 2, kt, cpu_kernels=False), prompt, follow)
    assert np.abs(a - b).max() <= 1e-4 * np.abs(a).max()


@pytest.mark.parametrize("kt,vt", [("f32", None), ("f16", None), ("bf16", "q8_0"), ("q4_0", None), ("q5_1", None)])
@pytest.mark.parametrize("n", [1, 3])
def test_cache_is_stored_at_its_planned_size(model, kt, vt, n):
    eng = _engine(model, n, kt, vt)
    mem = eng.memory_plan()
    eng.forward(list(range(1, 129)))                  # the largest batch: every buffer allocated
    be = eng.backend
    kv = [sum(a.nbytes for t, a in be.leaf[d].items() if t.flags & Flag.KV_CACHE) for d in range(n)]
    assert kv == list(mem.kv)
    alloc, planned = sum(be.allocated_bytes()), sum(mem.totals())
    assert abs(alloc - planned) <= 0.03 * planned, (alloc, planned)
    for t, a in be.leaf[0].items():
        if t.flags & Flag.KV_CACHE:
            assert a.dtype == {GGMLType.F32: np.float32, GGMLType.F16: np.float16}.get(t.type, np.uint8)
