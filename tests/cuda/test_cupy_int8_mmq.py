"""The cupy backend's int8 many-token path (numerics "q8": quantize + mmq_i8_<type>, cuda/mmq.cu) end to end
on the emulator, against the numpy backend's llama.cpp numerics (the same Q8 rounding and integer
block sums on the CPU).

One layer holding every weight type the int8 kernel takes (Q4_K, Q4_0, Q8_0, Q6_K, Q5_K, Q4_1).
(Deeper random synthetic models can overflow the f16 activation scales in both backends alike;
one layer keeps the comparison about the kernels.)
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from metatp.backends.cuda.backend import CupyBackend
from metatp.backends.numpy.backend import NumpyBackend
from metatp.engine import Engine
from metatp.passes import DeviceLayout
from metatp.testing import EmuRuntime
from metatp.testing.synth import SynthSpec
from metatp.testing.oracles import rel_err
from support.emulated_gpu import record_launches
from support.require import requires

pytestmark = requires("emulator")

SPEC = SynthSpec(n_layer=1, n_embd=256, n_head=4, n_head_kv=2, n_ff=512, n_vocab=320, seed=7,
                 types={"q": "Q4_K", "k": "Q4_0", "v": "Q8_0", "o": "Q6_K", "gate": "Q4_K", "up": "Q5_K",
                        "down": "Q4_1", "embd": "Q8_0"})       # the `synth_model` fixture (tests/conftest.py)
PROMPT = [5, 17, 42, 99, 3, 250, 7, 8, 9, 10, 11, 12]
INT8_KERNELS = {f"mmq_i8_{t}_t16" for t in ("q4_k", "q4_0", "q8_0", "q6_k", "q5_k", "q4_1")}
#: the prompt's 12-token products: q, k, v, o (the last layer keeps the output token's row only after
#: attention, so its FFN and the head multiply one token)
PROMPT_INT8_KERNELS = {f"mmq_i8_{t}_t16" for t in ("q4_k", "q4_0", "q8_0", "q6_k")}


def _cupy(model, n_devices: int = 1, compute_capability: int = 90, **kw):
    """A cupy engine on the emulator (n_devices: tensor parallel; GPUs of that compute capability),
    and the set of kernel names it launches (filled as it runs)."""
    lay = DeviceLayout(n_devices, "tensor" if n_devices > 1 else "none", None)
    rt = EmuRuntime(compute_capability=compute_capability)
    launched: set[str] = set()
    record_launches(rt, launched.add)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Engine(model, 512, lay, CupyBackend(lay, runtime=rt, kv_dtype="f32", **kw)), launched


def _numpy(model, numerics: str):
    lay = DeviceLayout(1, "none", None)
    return Engine(model, 512, lay, NumpyBackend(lay, numerics=numerics))


def test_q8_prefill_runs_the_int8_kernels_exact_mode_does_not(synth_model):
    """A 12-token prompt: every weight MUL_MAT of more than 8 tokens quantizes and runs mmq_i8 in q8
    numerics (one-token products keep the matvec kernel); exact numerics keeps the f32 paths (no q8
    kernel launched)."""
    eng, ran = _cupy(synth_model, numerics="q8")
    eng.forward(PROMPT)
    assert PROMPT_INT8_KERNELS <= ran and not (INT8_KERNELS - PROMPT_INT8_KERNELS) & ran
    assert {"q8_quantize_0", "q8_quantize_k"} <= ran
    eng, ran = _cupy(synth_model)
    eng.forward(PROMPT)
    assert ran and not {n for n in ran if n.startswith(("mmq_i8_", "q8_quantize_"))}


@pytest.mark.parametrize("prompt, n_devices", [(PROMPT[:1], 1), (PROMPT, 1), (PROMPT, 2)],
                         ids=["1 token", "12 tokens", "12 tokens on 2 devices"])
def test_q8_matches_numpy_llamacpp_numerics(synth_model, prompt, n_devices):
    """Batch invariance puts every count on the int8 kernel (one token too), so each product is
    the numpy backend's integer one: logits within f32 rounding of its llama.cpp numerics, while
    the exact numerics differ by the activation rounding (1e-2 here). Two devices: weights split
    along rows or along ne0 (each slice whole activation blocks: the same rounding, partial sums)."""
    eng, ran = _cupy(synth_model, n_devices, numerics="q8", batch_invariant=True)
    got = eng.forward(prompt)
    assert INT8_KERNELS <= ran
    want, exact = _numpy(synth_model, "llamacpp").forward(prompt), _numpy(synth_model, "exact").forward(prompt)
    assert rel_err(got, want) < 1e-5
    assert rel_err(exact, want) > 1e-3


def test_below_sm80_q8_keeps_its_rounding_without_tensor_cores_and_below_sm61_is_refused(synth_model):
    """mma's int8 shapes need sm_80: on an sm_75 GPU the 12-token products round x to its Q8 grid for
    the f32 tiles (or take the int8 dot kernel, Q4_1), no mmq_i8 launch, and the logits are still the
    numpy backend's llama.cpp numerics; without dp4a (sm_60) numerics "q8" is refused by name."""
    from metatp.ir.errors import ConfigError

    eng, ran = _cupy(synth_model, compute_capability=75, numerics="q8")
    got = eng.forward(PROMPT)
    assert ran and not {n for n in ran if n.startswith("mmq_i8_")}
    assert rel_err(got, _numpy(synth_model, "llamacpp").forward(PROMPT)) < 1e-4
    with pytest.raises(ConfigError, match=r"numerics='q8' needs int8 dot products \(dp4a, sm_61\+\); GPU 0 .*sm_60"):
        _cupy(synth_model, compute_capability=60, numerics="q8")
    assert _cupy(synth_model, compute_capability=60)[0] is not None        # exact numerics: any GPU


def test_int8_decision_and_refusals():
    """Which MUL_MATs take the int8 path, and what its launchers refuse (typed, by name)."""
    from metatp.backends.cuda.kernels import mmq
    from metatp.backends.cuda.launch import using
    from metatp.ir.errors import UnsupportedOpError
    from metatp.testing.cuda_emulator import Emulator

    use = mmq.use_int8_mmq
    assert not use("exact", "q4_k", 64, 256)
    assert not use("q8", "q4_k", 8, 256) and use("q8", "q4_k", 9, 256) and use("llamacpp", "q8_0", 512, 32)
    assert use("q8", "q6_k", 1, 256, batch_invariant=True)
    assert not use("q8", "f16", 64, 256) and not use("q8", "bf16", 64, 256)
    assert not use("q8", "q4_k", 64, 288) and use("q8", "q4_0", 64, 288)   # Q8_K needs whole 256-blocks
    with using(Emulator()):
        x, y = np.zeros((9, 256), np.float32), np.zeros((9, 4), np.float32)
        acts = mmq.q8_acts_empty(mmq.Q8_K, 9, 256)
        with pytest.raises(UnsupportedOpError, match="f16"):
            mmq.mmq_q8(np.zeros((4, 512), np.uint8), "f16", x, y, acts, ne0=256, n_rows=4)
        with pytest.raises(ValueError, match="isum"):
            mmq.q8_quantize(x, mmq.Q8_K, acts._replace(isum=np.zeros((9, 15), np.int32)), k=256)
        with pytest.raises(ValueError, match="256-blocks"):
            mmq.q8_acts_empty(mmq.Q8_K, 9, 288)
