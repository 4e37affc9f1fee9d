"""-sm layer and -sm layer,tensor across GPU ranks under mpiexec, emulated (no GPU in CI).

Every rank runs the cupy backend on the CPU kernel emulator (`EmuRuntime`, one emulated GPU per
rank, tests/mpi/gpu_layer_rank.py); NCCL is the MPI stand-in (`metatp.testing.mpi_nccl`), whose
ncclSend / ncclRecv move the hidden state over MPI with the count and type checked on both ends
and whose sub-communicators (one per stage's tensor group) sum each group only. The logits at
every prompt position must be one device's within 1e-5 relative, and the greedy tokens the same;
the facts each rank writes show the copies on the device stream, in plan order, and the
group all-reduces on the group's own communicator. Oversubscribed on 2 cores: bounded time.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from support.helpers import assert_close
from support.mpi import check_ok, mpiexec
from support.require import requires
from metatp.testing.synth import SynthSpec

pytestmark = [requires("mpi"), requires("emulator")]

RANK = Path(__file__).with_name("gpu_layer_rank.py")
SPEC = SynthSpec(n_layer=3, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, n_vocab=300, seed=3,
                 types={"gate": "Q4_0", "up": "Q4_0", "down": "Q8_0"})     # the `path` fixture
PROMPT = [1, 17, 42, 99, 7, 250, 3, 64]
N_GEN = 4


def _ranks(tmp_path: Path, path: str, n: int, *args: str):
    out = tmp_path / "out"
    r = mpiexec(n, [sys.executable, str(RANK), "--model", path, "--out", str(out), "--n-gen", str(N_GEN),
                    "--prompt", ",".join(map(str, PROMPT)), *args], timeout=420)
    check_ok(r)
    return np.load(out / "result.npz"), [json.loads((out / f"rank{k}.json").read_text()) for k in range(n)]


def _one_device(path: str):
    """(logits at every prompt position, greedy tokens) on one numpy device."""
    from metatp import LLM, SamplingParams

    llm = LLM(path, n_ctx=64, backend="numpy", cache_type_k="f32", cache_type_v="f32")
    out = llm.generate([PROMPT], SamplingParams(max_tokens=N_GEN, temperature=0.0, ignore_eos=True))
    return llm.score(PROMPT), list(out[0].outputs[0].token_ids)


def test_layer_split_over_two_gpu_ranks(path, tmp_path):
    """-ts 1,2: rank 0 holds one layer and ncclSends the hidden state once per forward; rank 1
    receives it on its device stream (inside the replayed decode graph) and holds the rest."""
    res, facts = _ranks(tmp_path, path, 2, "-sm", "layer", "-ts", "1,2")
    want, want_tokens = _one_device(path)
    assert_close(res["logits"], want, "-sm layer on 2 GPU ranks (emulated) vs one device", rtol=1e-5)
    assert res["tokens"].tolist() == want_tokens
    forwards = 2 + N_GEN - 1           # the scored prompt, the generate prefill, its decode steps
    assert facts[0]["p2p"] == [["send", 1]] * forwards and facts[1]["p2p"] == [["recv", 0]] * forwards
    for f in facts:
        r = f["rank"]
        assert f["held"][str(r)] > 0 and f["held"][str(1 - r)] == 0
        assert f["p2p_streams"] == [f["stream"]] and f["world_allreduces"] == 0
        assert "whole" in f["graph_modes"]


def test_layer_tensor_2x2_over_four_gpu_ranks(path, tmp_path):
    """--pp 2 --tp 2: ranks 0,1 and 2,3 are the stages' tensor groups, each all-reducing on its
    own communicator of 2; rank t of stage 0 sends to rank t of stage 1."""
    res, facts = _ranks(tmp_path, path, 4, "-sm", "layer,tensor", "-ts", "1,1")
    want, want_tokens = _one_device(path)
    assert_close(res["logits"], want, "-sm layer,tensor 2x2 on 4 GPU ranks (emulated) vs one device", rtol=1e-5)
    assert res["tokens"].tolist() == want_tokens
    forwards = 2 + N_GEN - 1
    for f in facts:
        r = f["rank"]
        peer = r + 2 if r < 2 else r - 2
        assert f["p2p"] == [["send" if r < 2 else "recv", peer]] * forwards
        assert f["group_sizes"] == [2] and f["world_allreduces"] == 0 and f["group_allreduces"] > 0
        assert f["p2p_streams"] == [f["stream"]]
    assert facts[0]["group_allreduces"] == facts[1]["group_allreduces"]
    assert facts[2]["group_allreduces"] == facts[3]["group_allreduces"]
