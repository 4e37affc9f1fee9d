"""-sm layer,tensor on simulated numpy devices: P stages of T-device tensor groups equal one device
(logits within 1e-5 relative, the same greedy tokens) on several architectures (gemma3's
sliding-window layers, a MoE with the PARTIAL expert bias, phi3's fused projections), with
uneven -ts inside the groups, with a quantized KV cache, and on the default model. Its edge
cases are the two modes it is made of, bit for bit: P=2,T=1 is -sm layer over 2 devices and
P=1,T=2 is -sm tensor over 2."""

from __future__ import annotations

import numpy as np
import pytest

from metatp import LLM, SamplingParams
from metatp.testing.synth import SynthSpec

SPEC = SynthSpec(n_layer=5, n_embd=64, n_head=4, n_head_kv=2, head_dim=32, n_ff=128, n_vocab=300, tied=False, seed=3,
                 n_ctx_train=4096, types={"gate": "Q4_0", "up": "Q4_0", "down": "Q8_0"})   # the `path` fixture
ARCHS = {
    "gemma3": SynthSpec(arch="gemma3", n_layer=6, qk_norm=True, post_norms=True, sliding_window=4, rope_base=1e6,
                        head_dim=32, n_ff=512, norm_eps=1e-6, seed=27, types={"q": "Q5_0", "down": "Q6_K"}),
    "moe_down_bias": SynthSpec(arch="qwen3moe", n_layer=4, qk_norm=True, head_dim=32, n_expert=4, n_expert_used=3,
                               n_ff_exp=256, expert_down_bias=True, seed=26),
    "phi3": SynthSpec(arch="phi3", n_layer=4, fused_qkv=True, fused_up_gate=True, n_ff=512, tied=False, seed=21,
                      types={"qkv": "Q8_0", "o": "Q8_0", "up": "Q4_0"}),
}
IDS = [1, 17, 42, 99, 7, 250, 3, 64]


def _rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def _run(path: str, cache: str = "f32", **layout) -> tuple[np.ndarray, list[int]]:
    llm = LLM(path, n_ctx=64, backend="numpy", cache_type_k=cache, cache_type_v=cache, **layout)
    ids = llm.generate([IDS[:4]], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0].outputs[0].token_ids
    return llm.score(IDS), list(ids)


def _staged(pp: int, ts: list[float]) -> dict:
    return {"n_devices": pp * len(ts), "split_mode": "layer,tensor", "tensor_split": ts}


@pytest.mark.parametrize("pp, ts", [(2, [1.0, 1.0]), (2, [1.0, 3.0]), (3, [2.0, 1.0])], ids=["2x2", "2x2-ts1,3", "3x2"])
def test_stages_of_tensor_groups_match_one_device(path, pp, ts):
    ref, ref_ids = _run(path)
    got, ids = _run(path, **_staged(pp, ts))
    assert _rel_err(got, ref) < 1e-5 and ids == ref_ids and len(set(ids)) > 1


@pytest.mark.parametrize("name", list(ARCHS))
def test_architectures_match_one_device(synth_factory, name):
    path = str(synth_factory(ARCHS[name])[0])
    ref, ref_ids = _run(path)
    got, ids = _run(path, **_staged(2, [1.0, 1.0]))
    assert _rel_err(got, ref) < 1e-5, name
    assert ids == ref_ids, name


@pytest.mark.parametrize("cache", ["q8_0", "q4_0"])
def test_quantized_kv_cache(path, cache):
    ref, ref_ids = _run(path, cache)
    got, ids = _run(path, cache, **_staged(2, [1.0, 1.0]))
    assert _rel_err(got, ref) < 1e-5 and ids == ref_ids


def test_one_device_groups_are_the_layer_split_and_one_stage_the_tensor_split(path):
    layer, layer_ids = _run(path, n_devices=2, split_mode="layer")
    got, ids = _run(path, **_staged(2, [1.0]))
    np.testing.assert_array_equal(got, layer)
    assert ids == layer_ids
    tensor, tensor_ids = _run(path, n_devices=2, split_mode="tensor", tensor_split=[1.0, 3.0])
    got, ids = _run(path, **_staged(1, [1.0, 3.0]))
    np.testing.assert_array_equal(got, tensor)
    assert ids == tensor_ids


def test_default_model_two_stages_of_two(default_llm):
    ids = default_llm.tokenizer.encode("The capital of France is a city where")
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    ref, ref_ids = default_llm.score(ids), default_llm.generate([ids], params)[0].outputs[0].token_ids
    llm = LLM(str(default_llm.model_path), n_ctx=512, backend="numpy", **_staged(2, [1.0, 1.0]))
    assert _rel_err(llm.score(ids), ref) < 1e-5
    assert llm.generate([ids], params)[0].outputs[0].token_ids == ref_ids


def test_a_collective_without_groups_refuses_the_mode_by_name(synth_model):
    """A process whose collective cannot all-reduce over a stage's group only (one without
    `for_devices`) refuses the layer,tensor plan, naming it."""
    from metatp.backends.numpy.backend import NumpyBackend
    from metatp.engine import Engine
    from metatp.ir.errors import UnsupportedOpError
    from metatp.passes.plan import DeviceLayout

    from metatp.backends.collectives import Collective

    class Sums(Collective):          # an all-reduce over every device; for_devices left at its default (none)
        name = "sums"

        def prepare_allreduce(self, bufs, active=None, stream=None):
            return lambda: None

    layout = DeviceLayout(4, "layer,tensor", tp=2)
    eng = Engine(synth_model, 64, layout, NumpyBackend(layout, collective=Sums()))
    with pytest.raises(UnsupportedOpError, match="split_mode='layer,tensor'.*'sums'"):
        eng.forward([1, 2, 3])
