"""Pipelined steps under `mpiexec` (metatp.pipeline): the stages of -sm layer (and -sm layer,tensor)
work on different micro-batches at once, ranks really in parallel (oversubscribed on 2 cores here).

`metatp pipeline-bench` on every rank runs 8 sequences (a prefill step of short prompts, then
decode steps of all 8) once per micro-batch count M and writes every M's logits: they must be
M=1's bit for bit (the few-token path; quantized weights), and M=1's must be the simulated
in-process run's (as tests/mpi/test_mpi_layer.py has it for one sequence). A rank lost in a
pipelined step (Isends in flight) still ends every rank within the bound, with one line.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from support.mpi import FaultJob, check_ok, cli, error_lines
from support.require import requires
from metatp.testing.synth import SynthSpec

needs_mpi = requires("mpi")

SPEC = SynthSpec(n_layer=4, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, tied=False, seed=31, default_type="Q8_0",
                 n_ctx_train=4096, types={"gate": "Q4_0"})      # the `path` fixture (tests/conftest.py)
BENCH = ["-npl", "8", "-npp", "6", "-ntg", "3", "-r", "1", "--backend", "numpy"]


def _pipelined(path: str, tmp_path, n: int, micros: str, *layout: str) -> tuple[dict, dict]:
    out = tmp_path / f"out-{n}-{'-'.join(layout)}"
    r = cli("pipeline-bench", "-m", path, *BENCH, "--micro-batches", micros, "--out", str(out), *layout,
            n=n, timeout=300)
    check_ok(r)
    facts = json.loads((out / "pipeline.json").read_text())
    logits = np.load(out / "logits.npz")
    return facts, {k: logits[k] for k in logits.files}


def _simulated(path: str, **layout) -> np.ndarray:
    """The same steps in one process on simulated devices, one pass after another."""
    from metatp.api import LLM
    from metatp.tools.pipeline_bench import drive

    llm = LLM(path, n_ctx=1024, backend="numpy", distributed="none", **layout)
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(1, llm.model.hparams.n_vocab, 6)] for _ in range(8)]
    return np.concatenate(drive(llm.engine, prompts, 3, 1)["logits"])


@needs_mpi
@pytest.mark.parametrize("n,ts,micros", [(2, "1,2", "1,2,4"), (3, "1,1,1", "1,3")], ids=["2-ranks", "3-ranks"])
def test_micro_batches_under_mpiexec_keep_the_bits(path, tmp_path, n, ts, micros):
    facts, logits = _pipelined(path, tmp_path, n, micros, "-sm", "layer", "-ts", ts)
    assert facts["ranks"] == n and facts["sequences"] == 8
    assert all(r["identical"] for r in facts["rows"]), facts["rows"]
    for m in micros.split(","):
        np.testing.assert_array_equal(logits[f"m{m}"], logits["m1"])
    want = _simulated(path, n_devices=n, split_mode="layer", tensor_split=[float(x) for x in ts.split(",")])
    np.testing.assert_array_equal(logits["m1"], want)
    # every rank but the first waited for its input; the wait was measured
    waits = {r["rank"]: r["wait_input_pct"] for r in facts["rows"] if r["micro_batches"] == 1}
    assert waits[0] == 0 and all(waits[k] > 0 for k in range(1, n))


@needs_mpi
def test_micro_batches_under_layer_tensor(path, tmp_path):
    """-sm layer,tensor --pp 2 --tp 2 on 4 ranks: 2 micro-batches give M=1's bits."""
    facts, logits = _pipelined(path, tmp_path, 4, "1,2", "-sm", "layer,tensor", "--pp", "2", "--tp", "2")
    assert all(r["identical"] for r in facts["rows"]), facts["rows"]
    np.testing.assert_array_equal(logits["m2"], logits["m1"])


@needs_mpi
@pytest.mark.parametrize("sig,rank,line", [("SIGKILL", 1, "EXIT STRING: Killed (signal 9)"),
                                           ("SIGSTOP", 0, "rank 0 (pid")], ids=["SIGKILL-rank1", "SIGSTOP-rank0"])
def test_a_rank_lost_in_a_pipelined_step_ends_every_rank(path, tmp_path, sig, rank, line):
    """The fault lands at the rank's 40th send / receive, inside a step of 2 micro-batches
    (sends in flight): every rank ends within the bound, with one line saying why."""
    from test_rank_faults import FAST, _ended, _one_line

    args = ["pipeline-bench", "-m", path, "-sm", "layer", "-npl", "2", "-npp", "4", "-ntg", "300", "-r", "1",
            "--micro-batches", "2", "--backend", "numpy"]
    job = FaultJob(args, tmp_path, n=2, env={**FAST, "FAULT": f"{sig}:{rank}:40"})
    try:
        t = job.wait_fault(120)
        _one_line(_ended(job, t, f"pipeline-bench --micro-batches 2, {sig} on rank {rank}"), line, sig)
    finally:
        job.kill()


def test_a_bad_micro_batch_count_is_one_error_line(path):
    r = cli("generate", "-m", path, "-p", "hi", "-n", "2", "--backend", "numpy", "--micro-batches", "0")
    assert r.returncode == 1
    assert error_lines(r) == ["metatp: error: --micro-batches must be from 1 to 64, got 0"]
