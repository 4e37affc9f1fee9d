"""The cupy option `mmq_tensor_cores`: the tiled many-token kernel's products on the tensor cores from
f16 tiles (`mmq_h_<type>_t<TT>`, cuda/mmq.cu) end to end on the emulator. The kernel's own checks
against float64 are metatp/testing/kernel_checks/mmq.py's `mmq_h` group; here: a prompt's products
take it, the logits are the cuBLAS path's (the same f16 rounding of both operands, f32 sums) and close
to the numpy backend's exact ones, and the option is refused where it cannot hold.

One layer of mixed weight types (K-quants, legacy quants, F16), as the int8 path's test.
"""

from __future__ import annotations

import warnings

import pytest

from metatp.backends.cuda.backend import CupyBackend
from metatp.backends.numpy.backend import NumpyBackend
from metatp.engine import Engine
from metatp.ir.errors import ConfigError
from metatp.passes import DeviceLayout
from metatp.testing import EmuRuntime
from metatp.testing.oracles import rel_err
from metatp.testing.synth import SynthSpec
from support.emulated_gpu import record_launches
from support.require import requires

RUNTIMES = [pytest.param("emu", marks=requires("emulator"), id="emulator"),
            pytest.param("gpu", marks=[pytest.mark.gpu, requires("gpu")], id="gpu")]

SPEC = SynthSpec(n_layer=1, n_embd=256, n_head=4, n_head_kv=2, n_ff=512, n_vocab=320, seed=11,
                 types={"q": "Q4_K", "k": "Q4_0", "v": "Q8_0", "o": "Q6_K", "gate": "F16", "up": "Q5_K",
                        "down": "Q4_1", "embd": "Q8_0"})       # the `synth_model` fixture (tests/conftest.py)
PROMPT = [5, 17, 42, 99, 3, 250, 7, 8, 9, 10, 11, 12]
#: the prompt's 12-token products: q, k, v, o (the layer's FFN and the head multiply the last token only)
PROMPT_KERNELS = {f"mmq_h_{t}_t16" for t in ("q4_k", "q4_0", "q8_0", "q6_k")}


def _cupy(model, n_devices: int = 1, compute_capability: int = 90, kind: str = "emu", **kw):
    """A cupy engine on the emulator (or the GPU: `kind` "gpu") and the set of kernel names it launches
    (filled as it runs; the emulator's only)."""
    lay = DeviceLayout(n_devices, "tensor" if n_devices > 1 else "none", None)
    rt = EmuRuntime(compute_capability=compute_capability) if kind == "emu" else None
    launched: set[str] = set()
    if rt is not None:
        record_launches(rt, launched.add)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Engine(model, 512, lay, CupyBackend(lay, runtime=rt, kv_dtype="f32", **kw)), launched


@pytest.mark.parametrize("kind", RUNTIMES)
@pytest.mark.parametrize("n_devices", [1, 2])
def test_prompt_products_on_the_tensor_cores_match_the_cublas_path(synth_model, n_devices, kind):
    """A 12-token prompt with the tiled kernel's range over it: every weight product of the prompt runs
    mmq_h (none the f32 tiles), and the logits are the dequantize + cuBLAS path's (both round the
    weight and the activations to f16 and sum in f32) within f32 rounding, close to the exact numpy
    logits, with the same greedy token. Two devices: weights split along rows or along ne0. On a GPU
    the two sum in their own orders (the tensor cores', cuBLAS's): 1e-4."""
    eng, ran = _cupy(synth_model, n_devices, kind=kind, mmq_max_tokens=64, mmq_tensor_cores=True)
    got = eng.forward(PROMPT)
    gemm, gemm_ran = _cupy(synth_model, n_devices, kind=kind, mmq_max_tokens=8)
    via_cublas = gemm.forward(PROMPT)
    if kind == "emu":
        assert PROMPT_KERNELS <= ran and not {n for n in ran if n.startswith("mmq_") and not n.startswith("mmq_h_")}
        assert not {n for n in gemm_ran if n.startswith("mmq_")}
    assert rel_err(got, via_cublas) < (1e-5 if kind == "emu" else 1e-4)
    lay = DeviceLayout(1, "none", None)
    exact = Engine(synth_model, 512, lay, NumpyBackend(lay)).forward(PROMPT)
    assert 1e-5 < rel_err(got, exact) < 1e-2          # the f16 rounding shows, and no more than that
    assert int(got.argmax()) == int(exact.argmax())


@requires("emulator")
def test_without_the_option_the_tiled_kernel_keeps_f32(synth_model):
    """The default: the same prompt on the f32 tiles (mmq_<type>_t16), logits as exact as numpy's."""
    eng, ran = _cupy(synth_model, mmq_max_tokens=64)
    got = eng.forward(PROMPT)
    assert {n.replace("mmq_h_", "mmq_") for n in PROMPT_KERNELS} <= ran
    assert not {n for n in ran if n.startswith("mmq_h_")}
    lay = DeviceLayout(1, "none", None)
    assert rel_err(got, Engine(synth_model, 512, lay, NumpyBackend(lay)).forward(PROMPT)) < 1e-5


@requires("emulator")
def test_the_option_is_refused_where_it_cannot_hold(synth_model):
    """Below sm_80 (no f16 mma.sync m16n8k16) and beside batch invariance (whose products keep one FMA
    chain in a fixed order): a ConfigError naming the option, not a trap or a silent fallback."""
    with pytest.raises(ConfigError, match=r"mmq_tensor_cores=True needs compute capability 8\.0.*sm_75"):
        _cupy(synth_model, compute_capability=75, mmq_tensor_cores=True)
    with pytest.raises(ConfigError, match="mmq_tensor_cores=True with batch_invariant=True"):
        _cupy(synth_model, mmq_tensor_cores=True, batch_invariant=True)
    eng, _ = _cupy(synth_model, compute_capability=80, mmq_tensor_cores=True)
    assert ("mmq_tensor_cores", True) in eng.backend.describe().options
