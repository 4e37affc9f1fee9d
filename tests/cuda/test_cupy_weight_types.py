"""Q5_0, Q5_1, Q2_K and Q3_K weights on the cupy backend: stored as their GGUF blocks (not
dequantized to f32 at load) and read raw by the kernels, with the numpy backend's logits and greedy
tokens in exact numerics and in numerics="q8" (int8 dot products: mmvq for the decode steps, the
int8 tensor-core mmq for the 12-token prompt).

On the kernel emulator (needs g++); the same model runs on a GPU through CuPy (marked ``gpu``).
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from metatp.backends.cuda.backend import CupyBackend
from metatp.backends.cuda.storage import RawWeight
from metatp.backends.numpy.backend import NumpyBackend
from metatp.engine import Engine
from metatp.ir.tensor import block_size, type_size
from metatp.passes import DeviceLayout
from metatp.testing import EmuRuntime
from metatp.testing.compare import teacher_forced
from metatp.testing.synth import SynthSpec
from metatp.testing.oracles import rel_err
from support.emulated_gpu import record_launches
from support.require import requires

RUNTIMES = [pytest.param("emu", marks=requires("emulator"), id="emulator"),
            pytest.param("gpu", marks=[pytest.mark.gpu, requires("gpu")], id="gpu")]

#: q/k/v share a type (one fused launch), gate/up too (gate/up + GLU); the token embedding is read
#: by GET_ROWS, the output by a plain product; rows of 256 and 512 (whole K-quant super-blocks)
SPEC = SynthSpec(n_layer=2, n_embd=256, n_head=4, n_head_kv=2, n_ff=512, n_vocab=300, seed=11, tied=False,
                 types={"q": "Q3_K", "k": "Q3_K", "v": "Q3_K", "o": "Q5_0", "gate": "Q5_1", "up": "Q5_1",
                        "down": "Q2_K", "output": "Q2_K", "embd": "Q5_1"})
PROMPT = [5, 17, 42, 99, 3, 250, 7, 8, 9, 10, 11, 12]
NEW_TYPES = ("q5_0", "q5_1", "q2_k", "q3_k")


def _engines(model, kind: str, numerics: str, ran: list[str]):
    """(cupy engine on one device, numpy engine) in `numerics`; the emulator's launches go to `ran`."""
    lay = DeviceLayout(1, "none")
    rt = EmuRuntime() if kind == "emu" else None
    if rt is not None:
        record_launches(rt, ran.append)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eng = Engine(model, 512, lay, CupyBackend(lay, runtime=rt, numerics=numerics, kv_dtype="f32",
                                                  matmul_dtype="f32"))
        ref = Engine(model, 512, lay, NumpyBackend(lay, numerics=numerics))
    return eng, ref


def _same_greedy(got, want, tol: float) -> None:
    """Same argmax, unless the reference's top two are closer than the numerical tolerance."""
    for i, (a, b) in enumerate(zip(got, want)):
        ia, ib = int(np.argmax(a)), int(np.argmax(b))
        if ia != ib:
            assert float(b[ib] - b[ia]) <= tol * np.abs(b).max(), f"step {i}: greedy token {ia} != {ib}"


@pytest.mark.parametrize("kind", RUNTIMES)
def test_new_weight_types_are_stored_raw_and_match_numpy(synth_model, kind):
    """Exact numerics: every Q5_0 / Q5_1 / Q2_K / Q3_K weight is kept as its blocks (the memory plan
    counts the blocks' bytes, not f32), and the logits are the numpy backend's."""
    model = synth_model
    ran: list[str] = []
    eng, ref = _engines(model, kind, "exact", ran)
    raw_bytes = sum(int(np.prod(w.ne)) // block_size(w.type) * type_size(w.type) for w in model.weights.values())
    assert eng.memory_plan().weights[0] == raw_bytes
    got, want = teacher_forced(eng, ref, PROMPT, 3)
    stored = [v for v in eng.backend.leaf[0].values() if isinstance(v, RawWeight)]
    assert {w.wtype for w in stored} >= set(NEW_TYPES)
    for a, b in zip(got, want):
        assert rel_err(a, b) < 1e-4
    _same_greedy(got, want, 0.0)
    if kind == "emu":
        for t in NEW_TYPES:
            assert any(n.endswith(t) or f"_{t}_" in n for n in ran), t
        assert {"matvec_swiglu_q5_1", "get_rows_q5_1", "mmq_q2_k_t16"} <= set(ran)
        assert any(n.startswith("qkv_rope_kv_q3_k") or n == "matvec_multi_q3_k" for n in ran)   # q/k/v: one launch


@pytest.mark.parametrize("kind", RUNTIMES)
def test_new_weight_types_q8_numerics_match_numpy_q8(synth_model, kind):
    """numerics="q8": the numpy backend's llama.cpp products (Q8_0 activations for Q5_0, Q8_1 for
    Q5_1, Q8_K for Q2_K / Q3_K) up to float order, with its greedy tokens; the int8 kernels of
    every new type run (decode: mmvq, the prompt: the int8 mmq)."""
    model = synth_model
    ran: list[str] = []
    eng, ref = _engines(model, kind, "q8", ran)
    got, want = teacher_forced(eng, ref, PROMPT, 3)
    errs = [rel_err(a, b) for a, b in zip(got, want)]
    assert max(errs) < 5e-3 and sum(e < 1e-5 for e in errs) >= len(errs) - 1, errs
    _same_greedy(got, want, 5e-3)
    if kind == "emu":
        assert {"mmvq_multi_q3_k", "mmvq_swiglu_q5_1", "mmvq_q2_k_x1", "mmvq_q5_0_x1"} <= set(ran)
        for t in NEW_TYPES:
            assert any(n.startswith(f"mmq_i8_{t}_t") for n in ran), t
        assert not any(n.startswith("matvec_") and any(t in n for t in NEW_TYPES) for n in ran)
