"""The QKV_ROPE_KV fusion end to end on the emulated cupy backend: (RMS norm +) q/k/v + RoPE + the
K/V cache row in one launch a layer, on float and quantized caches and on llama.cpp's mixed q/k + v
weight types, against the same engine with ``fuse_qkv_rope=False`` (matvec_multi, the rope pair and
the set_rows pair); the finder's refusals; the launcher's."""

from __future__ import annotations

import warnings
from dataclasses import replace

import numpy as np
import pytest

from metatp.backends.cuda.backend import CupyBackend
from metatp.backends.cuda.kernels.qkv_rope import CACHE_CODES
from metatp.backends.cuda.launch import CACHE_TYPES, Launch
from metatp.backends.fusion import FusionKind
from metatp.backends.numpy.backend import NumpyBackend
from metatp.engine import Engine
from metatp.ir.errors import UnsupportedOpError
from metatp.ir.loader import load_model
from metatp.ir.models import ModelTensors
from metatp.ir.models.common import BatchSpec, cache_type
from metatp.passes import DeviceLayout
from metatp.testing import EmuRuntime
from metatp.testing.compare import teacher_forced
from metatp.testing.synth import SynthSpec
from metatp.testing.oracles import rel_err
from support.require import require
from support.emulated_gpu import record_scratch_requests

PROMPT = [5, 17, 42, 99, 3, 250, 7, 8, 9, 10, 11, 12]

#: models whose attention input the QKV_ROPE_KV fusion takes: no biases or q/k norms; llama ropes
#: NORMAL pairs, qwen2 (without its biases) NEOX halves; "llama-q4_k-v-q6_k" is a Q4_K_M layer
#: (attn_v in Q6_K), "llama-q5_0-v-q8_0" its fallback when n_embd is not a multiple of 256,
#: "llama-mixed-refused" a pair of types with no kernel (the golden llama-q's); a narrow FFN (n_ff 64,
#: F32): the fusion is the attention input's, and each emulated FFN row costs as much as a q/k/v row
QKV_SPECS = {
    "llama-q4_1": SynthSpec(n_layer=2, n_embd=192, n_head=6, n_head_kv=3, n_ff=64, n_vocab=320, seed=3,
                            types={"q": "Q4_1", "k": "Q4_1", "v": "Q4_1", "o": "Q4_1", "embd": "Q8_0"}),
    "qwen2-neox-f32": SynthSpec(arch="qwen2", n_layer=1, n_embd=128, n_head=4, n_head_kv=2, n_ff=64, seed=5),
    "llama-q4_k-v-q6_k": SynthSpec(n_layer=2, n_embd=256, n_head=8, n_head_kv=2, n_ff=64, n_vocab=320, seed=7,
                                   types={"q": "Q4_K", "k": "Q4_K", "v": "Q6_K", "o": "Q4_K", "embd": "Q8_0"}),
    "llama-q5_0-v-q8_0": SynthSpec(n_layer=1, n_embd=192, n_head=6, n_head_kv=3, n_ff=64, n_vocab=320, seed=3,
                                   types={"q": "Q5_0", "k": "Q5_0", "v": "Q8_0", "o": "Q5_0", "embd": "Q8_0"}),
    "llama-mixed-refused": SynthSpec(n_layer=1, n_embd=192, n_head=6, n_head_kv=3, n_ff=64, n_vocab=320, seed=3,
                                     types={"q": "Q4_1", "k": "Q4_1", "v": "Q8_0", "o": "Q4_1", "embd": "Q8_0"}),
}


def layout_for(n: int, ts=None) -> DeviceLayout:
    return DeviceLayout(n, "tensor" if n > 1 else "none", tuple(ts) if ts else None)


def engines(model, n: int = 1, ts=None, kv: str | None = None, **backend_kw) -> tuple[Engine, Engine]:
    """(emulated cupy engine, numpy reference engine); `kv`: both caches of that type."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lay = layout_for(n, ts)
        eng = Engine(model, 512, lay, CupyBackend(lay, runtime=EmuRuntime(), matmul_dtype="f32", **backend_kw))
        ref = Engine(model, 512, lay, NumpyBackend(lay))
    if kv is not None:
        eng.tensors = ModelTensors(model, 512, cache_type(kv), cache_type(kv, "v"))
    return eng, ref


def assert_same_greedy(got, want, tol: float) -> None:
    """Same argmax, unless the reference's top two are closer than the numerical tolerance."""
    for i, (a, b) in enumerate(zip(got, want)):
        ia, ib = int(np.argmax(a)), int(np.argmax(b))
        if ia != ib:
            margin = float(b[ib] - b[ia])
            assert margin <= tol * np.abs(b).max(), f"step {i}: greedy token {ia} != {ib} (margin {margin})"


def _qkv_launches(eng) -> set[str]:
    """The qkv_rope_kv kernels the engine's emulated runtime launched."""
    return {name for _, name, _ in eng.backend.rt._kernels if name.startswith("qkv_rope_kv_")}


#: position of the cache-type code among the kernel's arguments (after wq .. q_head_stride, k_cache, v_cache)
_CODE_ARG = 15


@pytest.fixture
def cache_codes(monkeypatch) -> set[int]:
    """The cache_type codes the qkv_rope_kv launches of the test passed (its launcher's `launch`, logged)."""
    from metatp.backends.cuda.kernels import qkv_rope as family

    codes: set[int] = set()
    real = family.launch

    def logged(fam, name, grid, block, args, *rest, **kw):
        codes.add(int(args[_CODE_ARG]))
        return real(fam, name, grid, block, args, *rest, **kw)
    monkeypatch.setattr(family, "launch", logged)
    return codes


def _kinds(eng) -> set:
    return {f.kind for ex in eng.backend._executables.values() for f in ex.fusions.values()}


def _fused_vs_apart(model, n: int = 1, ts=None, kv_dtype: str | None = None, kv: str | None = None, steps: int = 3):
    """Logits of the same teacher-forced run (3 decode steps: eager, captured, replayed) with
    fuse_qkv_rope True and False: (fused engine, its logits, unfused engine, its logits)."""
    runs = {}
    for fuse in (True, False):
        kw = {"kv_dtype": kv_dtype} if kv_dtype else {}
        eng, ref = engines(model, n, ts, kv, fuse_qkv_rope=fuse, **kw)
        runs[fuse] = (eng, teacher_forced(eng, ref, PROMPT, steps)[0])
    return (*runs[True], *runs[False])


def _decode_launches(eng) -> int:
    """Kernel launches of one single-token decode step on device 0."""
    _, ex = eng.plan_for(BatchSpec(1, eng.kv_span(40, 1), 1))
    return sum(isinstance(s, Launch) for sub in ex.steps for s in sub[0])


@pytest.mark.parametrize("spec, n, kv_dtype", [("llama-q4_1", 1, "f16"), ("llama-q4_1", 2, "bf16"),
                                               ("qwen2-neox-f32", 1, "f32"), ("qwen2-neox-f32", 2, "f16")])
def test_qkv_rope_kv_fusion_decodes_as_the_kernels_apart(synth_factory, cache_codes, spec, n, kv_dtype):
    """fuse_qkv_rope=True (norm + q/k/v + RoPE + K/V cache rows in one launch per layer) decodes
    to the logits and greedy tokens of fuse_qkv_rope=False (today's matvec_multi, rope pair and
    set_rows pair), eagerly and through captured CUDA graphs; the fused kernel of the weight type
    is what runs, told the cache type by its code."""
    require("emulator")
    model = load_model(synth_factory(QKV_SPECS[spec])[0])
    fused, got, apart, want = _fused_vs_apart(model, n, (1, 1) if n > 1 else None, kv_dtype=kv_dtype)
    for a, b in zip(got, want):
        assert rel_err(a, b) < 1e-5
    assert_same_greedy(got, want, 0.0)
    assert FusionKind.QKV_ROPE_KV in _kinds(fused) and FusionKind.QKV_ROPE_KV not in _kinds(apart)
    assert _qkv_launches(fused) == {f"qkv_rope_kv_{spec.rsplit('-', 1)[1]}"}      # the weight type
    assert cache_codes == {CACHE_CODES[kv_dtype]}
    assert not _qkv_launches(apart)


@pytest.mark.parametrize("spec, kv, n", [("llama-q4_1", "q8_0", 1), ("llama-q4_1", "q4_0", 2),
                                         ("llama-q4_k-v-q6_k", "q5_1", 1)])
def test_qkv_rope_kv_fusion_on_quantized_caches(synth_factory, cache_codes, spec, kv, n):
    """A quantized cache (its blocks quantized in the launch by the warp drawing a group's last
    ticket) and a Q4_K_M-like layer (v in Q6_K): the greedy tokens and, within the cache's
    rounding, the logits of fuse_qkv_rope=False (matvec_multi, rope, the quantizing set_rows), on
    one device and on two; the fused kernel of the cache type and weight pair is what runs."""
    require("emulator")
    model = load_model(synth_factory(QKV_SPECS[spec])[0])
    fused, got, apart, want = _fused_vs_apart(model, n, (1, 2) if n > 1 else None, kv=kv, steps=2)
    for a, b in zip(got, want):
        assert rel_err(a, b) < 1e-4
    assert_same_greedy(got, want, 1e-4)
    assert FusionKind.QKV_ROPE_KV in _kinds(fused) and FusionKind.QKV_ROPE_KV not in _kinds(apart)
    wtypes = {"llama-q4_1": "q4_1", "llama-q4_k-v-q6_k": "q4_k_q6_k"}[spec]
    assert _qkv_launches(fused) == {f"qkv_rope_kv_{wtypes}"} and cache_codes == {CACHE_CODES[kv]}
    assert not _qkv_launches(apart)


def test_a_quantized_cache_layer_is_five_launches(synth_factory):
    """Issue 44's budget: a standard layer decodes in 5 dependent launches (norm + q/k/v + RoPE + KV
    write; attention merging its splits; output projection + residual; norm + gate/up + GLU; down
    + residual) with a q8_0 cache and with a Q4_K_M-like mix (v in Q6_K): 2 layers minus 1 layer."""
    require("emulator")
    for spec, kv in (("llama-q4_1", "q8_0"), ("llama-q4_k-v-q6_k", "f16")):
        per_model = []
        for n_layer in (1, 2):
            model = load_model(synth_factory(replace(QKV_SPECS[spec], n_layer=n_layer))[0])
            eng, _ = engines(model, kv=kv)
            per_model.append(_decode_launches(eng))
        assert per_model[1] - per_model[0] == 5, (spec, kv, per_model)


@pytest.mark.parametrize("n", [1, 2])
def test_quantized_cache_scratch_is_declared(synth_factory, monkeypatch, n):
    """The staging row and counters a quantized cache's fused launch asks for fit what `workspace`
    declared (so `_presize` allocated them once): the family's WORKSPACE_OPS (SET_ROWS) at work."""
    require("emulator")

    asked = record_scratch_requests(monkeypatch)
    model = load_model(synth_factory(QKV_SPECS["llama-q4_1"])[0])
    eng, _ = engines(model, n, (1, 2) if n > 1 else None, kv="q4_1")
    plan, ex = eng.plan_for(BatchSpec(1, eng.kv_span(40, 1), 1))
    with eng.backend.rt.kernels():
        needs = [eng.backend._scratch_needs(plan, d) for d in range(n)]
    qkv = [(key, count) for key, count in asked if key.startswith("qkv_")]
    assert {key for key, _ in qkv} == {"qkv_stage", "qkv_ticket"}
    assert all(any(count <= need[key][0] for need in needs if key in need) for key, count in qkv)
    assert not ex._retired


def test_qkv_rope_kv_fallback_runs_the_nodes_at_the_fusion(synth_factory, monkeypatch):
    """When the fused kernel refuses, the fusion's nodes run one by one at its position (the
    first product): the buffers they write there (`early`) and x (`keep`) are live, results equal."""
    require("emulator")
    from metatp.backends.cuda import ops as cuda_ops

    def refuse(ex, d, f):
        raise ValueError("layout not supported by the fused kernel")
    model = load_model(synth_factory(QKV_SPECS["llama-q4_1"])[0])
    eng, ref = engines(model, n=2, ts=(1, 2), kv_dtype="f32")
    monkeypatch.setitem(cuda_ops.FUSION_ROWS, FusionKind.QKV_ROPE_KV,
                        replace(cuda_ops.FUSION_ROWS[FusionKind.QKV_ROPE_KV], run=refuse))
    got, want = teacher_forced(eng, ref, PROMPT, 2)
    for a, b in zip(got, want):
        assert rel_err(a, b) < 1e-4
    assert FusionKind.QKV_ROPE_KV in _kinds(eng)
    assert not _qkv_launches(eng)


@pytest.mark.parametrize("spec, kt, fused", [("llama-q4_1", "f16", True), ("llama-q4_1", "q4_0", True),
                                             ("llama-q4_1", "q5_0", True), ("llama-q5_0-v-q8_0", "f16", True),
                                             ("llama-mixed-refused", "f16", False)])
def test_qkv_rope_kv_finder_takes_every_cache_type_and_the_paired_weights(synth_factory, spec, kt, fused):
    """Every cache type is fused (a quantized one's heads are whole blocks); q/k and v weights of
    types with no paired kernel (Q4_1 + Q8_0) are refused: matvec_multi and the set_rows pair run."""
    require("emulator")
    model = load_model(synth_factory(QKV_SPECS[spec])[0])
    eng, _ = engines(model, kv=kt)
    _, ex = eng.plan_for(BatchSpec(1, eng.kv_span(10, 1), 1))
    kinds = [f.kind for f in ex.fusions.values()]
    assert (kinds.count(FusionKind.QKV_ROPE_KV) == QKV_SPECS[spec].n_layer) is fused
    assert (FusionKind.SET_ROWS_PAIR in kinds) is not fused


def test_qkv_rope_kv_launcher_refuses_what_it_has_no_kernel_for():
    """An unpaired weight mix and a quantized cache whose heads are not whole blocks, by name."""
    require("emulator")
    from metatp.backends.cuda.kernels.qkv_rope import qkv_rope_kv
    from metatp.backends.cuda.launch import using
    from metatp.testing.cuda_emulator import Emulator

    w = np.zeros((64, 64), np.float32)
    kw = dict(ne0=64, n_head=1, n_head_kv=1, n_dims=16, neox=False, freq_base=1e4)
    args = (np.zeros(64, np.float32), np.zeros((1, 32), np.float32))
    idx = (np.zeros(1, np.int32), np.zeros(1, np.int32))
    with using(Emulator()):
        with pytest.raises(UnsupportedOpError, match="q/k f32 with v f16"):
            qkv_rope_kv([(w, 256)] * 3, "f32", *args, np.zeros((4, 32), np.float32), np.zeros((4, 32), np.float32),
                        *idx, head_dim=32, v_qtype="f16", **kw)
        with pytest.raises(ValueError, match="blocks of 32"):
            cache = np.zeros((4, 34), np.uint8)
            qkv_rope_kv([(w, 256)] * 3, "f32", *args[:1], np.zeros((2, 16), np.float32), cache, cache, *idx,
                        head_dim=16, cache_type="q8_0", **kw)


def test_cache_codes_name_every_cache_type():
    """cuda/qkv_rope.cu's MT_QKV_CACHE_CODES (read by the launcher) has one distinct code per cache type."""
    assert set(CACHE_CODES) == set(CACHE_TYPES)
    assert sorted(CACHE_CODES.values()) == list(range(len(CACHE_TYPES)))


def test_an_unknown_cache_code_writes_nan_to_q_and_nothing_to_the_caches(monkeypatch):
    """The launcher refuses a cache type with no code; a kernel handed a code outside the table
    (the launcher's table patched) writes no cache row and NaN to every q value: never silently
    nothing."""
    require("emulator")
    from metatp.backends.cuda.kernels import qkv_rope as family
    from metatp.backends.cuda.launch import using
    from metatp.testing.cuda_emulator import Emulator

    with pytest.raises(UnsupportedOpError, match="not q8_1"):
        family.entry_point("f32", "f32", "q8_1")
    rng = np.random.default_rng(0)
    w = rng.standard_normal((64, 64)).astype(np.float32)
    x = rng.standard_normal(64).astype(np.float32)
    q = np.zeros((2, 32), np.float32)
    k_cache, v_cache = np.ones((4, 32), np.float32), np.ones((4, 32), np.float32)
    idx = (np.zeros(1, np.int32), np.zeros(1, np.int32))
    monkeypatch.setitem(family.CACHE_CODES, "f32", len(CACHE_TYPES))
    with using(Emulator()):
        family.qkv_rope_kv([(w, 256)] * 3, "f32", x, q, k_cache, v_cache, *idx, ne0=64, n_head=2, n_head_kv=1,
                           head_dim=32, n_dims=32, neox=False, freq_base=1e4)
    assert np.isnan(q).all()
    assert (k_cache == 1).all() and (v_cache == 1).all()
