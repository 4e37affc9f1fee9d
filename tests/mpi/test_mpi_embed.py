"""`LLM.embed` under a real `mpiexec -n 2` (-sm tensor and -sm layer, one process per device):
rank 0 leads the embedding requests' steps (their passes end at the final hidden state on every
rank), every rank returns rank 0's embeddings, and they are what one process gives with the same split."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from support.mpi import check_ok, mpiexec
from support.require import requires
from metatp.testing.synth import SynthSpec

DRIVER = Path(__file__).with_name("embed_rank.py")
SPEC = SynthSpec(n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, seed=9)


@requires("mpi")
@pytest.mark.parametrize("split_mode", ["tensor", "layer"])
def test_every_rank_returns_rank_0s_embeddings(path, tmp_path, split_mode):
    sys.path.insert(0, str(DRIVER.parent))
    try:
        from embed_rank import INPUTS
    finally:
        sys.path.pop(0)
    from metatp.api import LLM
    from metatp.sampling import SamplingParams

    check_ok(mpiexec(2, [sys.executable, str(DRIVER), path, split_mode, str(tmp_path)], timeout=300))
    facts = [json.loads((tmp_path / f"rank{k}.json").read_text()) for k in range(2)]
    assert facts[1] == facts[0] and facts[0]["used"] == 0
    one = LLM(path, n_ctx=128, backend="numpy", n_devices=2, split_mode=split_mode)
    np.testing.assert_allclose(np.array(facts[0]["vectors"]), np.array(one.embed(INPUTS)), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(facts[0]["answer"]["data"][0]["embedding"], one.embed(INPUTS[-1]), rtol=1e-5,
                               atol=1e-6)
    greedy = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    assert facts[0]["tokens"] == one.generate([[1, 17, 42]], greedy)[0].outputs[0].token_ids
