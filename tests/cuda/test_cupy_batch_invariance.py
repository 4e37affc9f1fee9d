"""Batch invariance on the cupy backend (issue 46 item 5), on the CPU emulator (and the bits alone vs
batched on a GPU when one is present: the order of a real GPU's work is what the emulator cannot show).

`LLM(backend="cupy", batch_invariant=True)`: one sequence's logits -- every prompt row and 4
decode steps -- are the same bits alone and in a step of 8 sequences of other lengths, whatever
its place among them. What makes it so (kernels/matvec.py `matmul_path`, kernels/attn.py
`attention_splits`): every MUL_MAT runs the tiled mmq kernel (its per-row sum is one FMA chain
in a fixed order, for any token count), no cuBLAS and no one-token fusion; attention runs the
split-KV decode kernel for every row count over 128-key chunks at absolute cells, always merged
(in split-index order, inside the decode launch or by the merge kernel after it: the same bits),
and sequences start on such a chunk (`kv_page`). Norms, RoPE and the KV writes are per row
already (the test would show it otherwise). Without the option the same run gives other bits
(on the emulator deterministically: an 11-row pass runs mmq, a pass of the batch's ~90 rows
dequantize + GEMM in f16).
"""

from __future__ import annotations

import warnings
from collections import Counter
from contextlib import contextmanager

import numpy as np
import pytest

from metatp import LLM
from metatp.api import batch_invariant_requested
from metatp.backends.cuda.kernels.attn import BATCH_INVARIANT_KV_CHUNK
from metatp.ir.errors import ConfigError
from metatp.testing import EmuRuntime
from metatp.testing.synth import SynthSpec
from support.batch_invariance import PROMPT, STEPS, sequence_logits
from support.emulated_gpu import on_emulator
from support.require import requires


SPEC = SynthSpec(n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, tied=False, seed=5, default_type="Q8_0",
                 n_ctx_train=4096)     # the `path` fixture (tests/conftest.py)




def emulated_llm(path: str, rt: EmuRuntime, **options) -> LLM:
    with on_emulator(rt), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return LLM(path, backend="cupy", n_ctx=1024, n_batch=256, max_num_seqs=8, **options)


@contextmanager
def counting(rt: EmuRuntime):
    """The kernels launched inside (by name, eager or replayed) and the cuBLAS GEMMs ("gemm")."""
    seen: Counter = Counter()
    trip, gemm = rt.emu.before_launch, rt.gemm

    def before(name: str) -> None:
        seen[name] += 1
        if trip is not None:
            trip(name)

    def counted_gemm(*args, **kw):
        seen["gemm"] += 1
        return gemm(*args, **kw)
    rt.emu.before_launch, rt.gemm = before, counted_gemm
    try:
        yield seen
    finally:
        rt.emu.before_launch, rt.gemm = trip, gemm


@pytest.fixture(scope="module")
def batchinv_runs(path):
    """{invariant: (alone, batched at 3, batched at 0, kernel counts of the batched run)}."""
    runs = {}
    for invariant in (True, False):
        rt = EmuRuntime()
        llm = emulated_llm(path, rt, batch_invariant=invariant)
        alone = sequence_logits(llm, batched=False)
        with counting(rt) as seen:
            batched = sequence_logits(llm, batched=True)
        first = sequence_logits(llm, batched=True, at=0)
        runs[invariant] = (alone, batched, first, seen)
    return runs


@requires("emulator")
def test_a_sequence_gets_the_same_logits_bits_alone_and_in_a_batch_of_8(batchinv_runs):
    alone, batched, first, _ = batchinv_runs[True]
    assert len(alone) == STEPS + 1 and alone[0].shape[0] == len(PROMPT)
    for a, b, c in zip(alone, batched, first):
        assert a.tobytes() == b.tobytes() and a.tobytes() == c.tobytes()


@pytest.mark.gpu
@requires("gpu")
def test_on_the_gpu_a_sequence_gets_the_same_logits_bits_alone_and_in_a_batch_of_8(path):
    """The same run on a real GPU: the sequence's logits (prompt rows and decode steps) alone, then among 7
    others at two places, bit for bit."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        llm = LLM(path, backend="cupy", n_ctx=1024, n_batch=256, max_num_seqs=8, batch_invariant=True)
    alone = sequence_logits(llm, batched=False)
    for at in (3, 0):
        batched = sequence_logits(llm, batched=True, at=at)
        assert len(batched) == len(alone)
        for a, b in zip(alone, batched):
            assert a.tobytes() == b.tobytes()


@requires("emulator")
def test_without_the_option_a_batch_changes_the_bits(batchinv_runs):
    alone, batched, _, _ = batchinv_runs[False]
    assert any(a.tobytes() != b.tobytes() for a, b in zip(alone, batched))
    # the greedy tokens still agree (within float rounding of each other)
    np.testing.assert_allclose(batched[0], alone[0], rtol=1e-2, atol=1e-2)


@requires("emulator")
def test_the_invariant_run_takes_one_matmul_kernel_and_the_decode_attention(batchinv_runs):
    seen = batchinv_runs[True][3]
    names = set(seen)
    assert seen["gemm"] == 0
    assert not any(n.startswith(("matvec_", "attn_prefill_")) for n in names), names
    assert any(n.startswith("mmq_") for n in names) and any(n.startswith("attn_decode_") for n in names)
    assert "attn_merge_f32" not in seen          # always split, merged inside the decode launch (attn_merge)
    default = batchinv_runs[False][3]
    assert any(n.startswith("matvec_") for n in default)     # the default decode: matvec + its fusions


@requires("emulator")
def test_the_merge_kernel_after_the_decode_launch_gives_the_same_bits(path, batchinv_runs):
    """attn_merge=False: attn_merge_f32 merges the splits (the same arithmetic, split-index order)."""
    rt = EmuRuntime()
    llm = emulated_llm(path, rt, batch_invariant=True, backend_options={"attn_merge": False})
    with counting(rt) as seen:
        apart = sequence_logits(llm, batched=False)
    assert seen["attn_merge_f32"] > 0
    for a, b in zip(batchinv_runs[True][0], apart):
        assert a.tobytes() == b.tobytes()


@requires("emulator")
def test_batch_invariant_pages_the_cache_at_the_attention_chunk(path):
    rt = EmuRuntime()
    assert emulated_llm(path, rt, batch_invariant=True).backend.kv_page() == BATCH_INVARIANT_KV_CHUNK
    llm = emulated_llm(path, rt)
    assert llm.backend.kv_page() == 1 and llm.backend.batch_invariant is False


@requires("emulator")
def test_batch_invariant_keeps_the_wire_type_fixed():
    """wire "auto" chooses by message size (the pass's rows): under batch invariance it is f32."""
    from metatp.backends import create_backend
    from metatp.passes.plan import DeviceLayout

    with on_emulator(EmuRuntime(n_gpus=2)):
        assert create_backend("cupy", DeviceLayout(2, "tensor"), batch_invariant=True).wire == "f32"
        assert create_backend("cupy", DeviceLayout(2, "tensor"), batch_invariant=True, wire="bf16").wire == "bf16"
        assert create_backend("cupy", DeviceLayout(2, "tensor")).wire == "auto"


@requires("emulator")
def test_the_environment_spellings_turn_it_on(monkeypatch):
    for name in ("METATP_BATCH_INVARIANT", "VLLM_BATCH_INVARIANT"):
        monkeypatch.delenv("METATP_BATCH_INVARIANT", raising=False)
        monkeypatch.delenv("VLLM_BATCH_INVARIANT", raising=False)
        assert batch_invariant_requested(None) is False
        monkeypatch.setenv(name, "1")
        assert batch_invariant_requested(None) is True
        assert batch_invariant_requested(False) is False      # the keyword wins
        monkeypatch.setenv(name, "0")
        assert batch_invariant_requested(None) is False
    with pytest.raises(ConfigError, match="batch_invariant"):
        batch_invariant_requested("yes")


def _mul_mat(tokens: int, weight: bool = True):
    from metatp.ir import ops as ir_ops
    from metatp.ir.tensor import Flag, GGMLType

    w = ir_ops.new_tensor("w", (64, 32, 1), GGMLType.F32, Flag.WEIGHT if weight else Flag.INPUT)
    return ir_ops.mul_mat(w, ir_ops.new_tensor("x", (64, tokens, 1), GGMLType.F32, Flag.INPUT))


@requires("emulator")
@pytest.mark.parametrize("tokens", [1, 2, 8, 9, 16, 17, 64, 512])
def test_every_token_count_takes_the_tiled_kernel(tokens):
    from metatp.backends.cuda.kernels.matvec import matmul_path

    assert matmul_path(_mul_mat(tokens), gemm_available=True, batch_invariant=True) == "mmq"
    assert matmul_path(_mul_mat(tokens), gemm_available=True, mmq_tokens=(9, 8), batch_invariant=True) == "mmq"
    assert matmul_path(_mul_mat(tokens, weight=False), gemm_available=True, batch_invariant=True) == "general"


@requires("emulator")
@pytest.mark.parametrize("n_kv", [1, 127, 128, 129, 256, 300, 4096])
@pytest.mark.parametrize("tokens", [1, 4, 5, 64])
def test_attention_chunks_are_fixed_and_always_merged(n_kv, tokens):
    from metatp.backends.cuda.kernels.attn import attention_splits, decode_splits

    splits = attention_splits(8, 2, tokens, n_kv, batch_invariant=True)
    assert splits is not None and splits >= 2                  # the decode kernel, merged, for any row count
    got, chunk = decode_splits(2, 8, tokens, n_kv, splits, BATCH_INVARIANT_KV_CHUNK)
    assert chunk == BATCH_INVARIANT_KV_CHUNK and got == splits and got * chunk >= n_kv
    if tokens > 4:
        assert attention_splits(8, 2, tokens, n_kv) is None      # the default: the prefill kernel


@requires("emulator")
def test_two_devices_tensor_split_alone_equals_batched(path):
    """-sm tensor over 2 emulated GPUs: the all-reduces sum per element in a fixed order on an f32
    wire, so a row's bits stay its own there too."""
    llm = emulated_llm(path, EmuRuntime(n_gpus=2), batch_invariant=True, n_devices=2)
    alone = sequence_logits(llm, batched=False)
    batched = sequence_logits(llm, batched=True)
    assert all(a.tobytes() == b.tobytes() for a, b in zip(alone, batched))
