"""-sm layer equals one device on every architecture (the synthetic models of test_archs.py, with
enough layers that every device gets some) and on the default model: logits within 1e-5
relative, the same greedy tokens."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from metatp import LLM, SamplingParams
from metatp.passes.layer_split import layer_devices
from test_archs import CASES, IDS

# uneven shares; with 4 layers (gemma3: 6) they use every device and put layer boundaries between
# sliding-window layers and before gemma3's global layer 5
SPLITS = {2: [1.0, 2.0], 3: [2.0, 1.0, 1.0], 4: [1.0, 1.0, 2.0, 1.0]}


def _spec(name: str):
    spec = CASES[name].spec
    return spec if spec.n_layer >= 4 else dataclasses.replace(spec, n_layer=4)


def _rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.fixture(scope="module")
def single(synth_factory):
    """name -> (path, one device's logits over IDS, its greedy continuation of IDS[:4])."""
    cache: dict = {}

    def get(name: str):
        if name not in cache:
            path = str(synth_factory(_spec(name))[0])
            llm = LLM(path, n_ctx=64, backend="numpy")
            cache[name] = (path, llm.score(IDS), _greedy(llm))
        return cache[name]
    return get


def _greedy(llm: LLM) -> list[int]:
    return llm.generate([IDS[:4]], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0].outputs[0].token_ids


@pytest.mark.parametrize("n", list(SPLITS))
@pytest.mark.parametrize("name", list(CASES))
def test_layer_split_matches_single_device(single, name, n):
    path, ref, ref_ids = single(name)
    llm = LLM(path, n_ctx=64, backend="numpy", n_devices=n, split_mode="layer", tensor_split=SPLITS[n])
    assert _rel_err(llm.score(IDS), ref) < 1e-5
    assert _greedy(llm) == ref_ids
    devs = layer_devices(_spec(name).n_layer, SPLITS[n])
    plan = next(iter(llm.engine._plans.values()))[0]
    assert len(set(devs)) == n and plan.reductions == []
    assert len(plan.transfers) == sum(a != b for a, b in zip([0] + devs, devs))


def test_default_model_layer_split_matches_single_device(default_llm):
    """The default model (30 layers) over 2, 3 and 4 devices, equal and uneven shares."""
    ids = default_llm.tokenizer.encode("The capital of France is a city where")
    ref = default_llm.score(ids)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    ref_ids = default_llm.generate([ids], params)[0].outputs[0].token_ids
    for n_devices, tensor_split in [(2, None), (3, [1, 2, 1]), (4, [2, 1, 1, 3])]:
        llm = LLM(str(default_llm.model_path), n_ctx=512, backend="numpy", n_devices=n_devices, split_mode="layer",
                  tensor_split=tensor_split)
        assert _rel_err(llm.score(ids), ref) < 1e-5, (n_devices, tensor_split)
        assert llm.generate([ids], params)[0].outputs[0].token_ids == ref_ids, (n_devices, tensor_split)
        assert len(set(llm.engine._plans[next(iter(llm.engine._plans))][0].stats["layer_devices"])) == n_devices
