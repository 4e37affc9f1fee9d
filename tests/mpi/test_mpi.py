"""One process per device, for real: pytest starts `mpiexec -n 2` / `-n 3` (oversubscribed, loopback).

Each run is `tests/support/mpi_worker.py` on every rank. Checked against the single-process numpy
backend: logits at every prompt position (N ranks vs N simulated devices, same -ts) and the
greedy tokens (vs one device); each rank holds its own slices only and its resident memory is
what the memory plan predicts; the start-up errors are one line, printed once; a rank that
fails ends every rank. NCCL: the unique id travels over MPI (no GPU needed); the all-reduce
itself runs only where cupy sees GPUs.

Skips with a reason where mpi4py or mpiexec is missing (`pip install "metatp[mpi]"`).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from support.helpers import assert_close
from support.require import requires
from support.mpi import check_ok, cli, error_lines, mpiexec
from metatp.testing.synth import SynthSpec

WORKER = Path(__file__).resolve().parents[1] / "support" / "mpi_worker.py"
PROMPT = [1, 17, 42, 99, 7, 250, 3, 64]


needs_mpi = requires("mpi")


def mpirun(n: int, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """`mpiexec -n n python tests/support/mpi_worker.py args...` on this machine only."""
    return mpiexec(n, [sys.executable, str(WORKER), *args], timeout=timeout)


def reference(path: Path, ts: tuple[float, ...] | None, n_ctx: int = 256, n_gen: int = 32, prompt=PROMPT):
    """(prompt logits on len(ts) simulated devices, greedy tokens on one device) in this process."""
    from metatp.backends.numpy.backend import NumpyBackend
    from metatp.engine import Engine
    from metatp.ir.loader import load_model
    from metatp.passes.plan import DeviceLayout

    model = load_model(path)
    split = DeviceLayout(len(ts), "tensor", ts)
    logits = Engine(model, n_ctx, split, NumpyBackend(split)).forward(prompt, all_logits=True)
    one = DeviceLayout()
    eng = Engine(model, n_ctx, one, NumpyBackend(one))
    last, tokens = eng.forward(prompt), []
    for _ in range(n_gen):
        tokens.append(int(np.argmax(last)))
        last = eng.forward([tokens[-1]])
    return logits, tokens


def run_ranks(tmp_path: Path, path: Path, ts: tuple[float, ...], n_gen: int = 32, prompt=PROMPT):
    out = tmp_path / f"out-{'-'.join(str(int(x)) for x in ts)}"
    out.mkdir()
    r = mpirun(len(ts), "--model", str(path), "-ts", ",".join(str(x) for x in ts), "--out", str(out),
               "--n-gen", str(n_gen), "--prompt", ",".join(map(str, prompt)))
    check_ok(r)
    res = np.load(out / "result.npz")
    mem = [json.loads((out / f"mem{k}.json").read_text()) for k in range(len(ts))]
    return res, mem


def test_owning_some_devices_needs_a_collective():
    """A process that owns device 1 of 2 cannot sum with the in-process collective."""
    from metatp.backends.numpy.backend import NumpyBackend
    from metatp.ir.errors import ConfigError
    from metatp.passes.plan import DeviceLayout

    layout = DeviceLayout(2, "tensor")
    with pytest.raises(ConfigError, match="collective spanning the other processes"):
        NumpyBackend(layout, devices=[1])
    with pytest.raises(ConfigError, match="distinct device indices"):
        NumpyBackend(layout, devices=[2])
    assert NumpyBackend(layout).owned == [0, 1]


def _check_own_slices(mem: list[dict]) -> None:
    """Each rank holds every weight and KV leaf for its device and nothing for the others."""
    for facts in mem:
        r = facts["rank"]
        assert facts["held_leaves"][str(r)] == facts["n_leaves"]
        assert all(v == 0 for d, v in facts["held_leaves"].items() if int(d) != r), facts["held_leaves"]
        assert all(b == 0 for d, b in enumerate(facts["allocated"]) if d != r), facts["allocated"]


SYNTH = SynthSpec(n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, n_vocab=300, seed=3,
                  types={"gate": "Q4_0", "up": "Q4_0", "down": "Q8_0"})


@needs_mpi
@pytest.mark.parametrize("ts", [(1.0, 1.0), (3.0, 1.0), (1.0, 2.0, 1.0)], ids=["2:1,1", "2:3,1", "3:1,2,1"])
def test_ranks_match_single_process_synthetic(synth_factory, tmp_path, ts):
    path, _ = synth_factory(SYNTH)
    res, mem = run_ranks(tmp_path, path, ts)
    logits, tokens = reference(path, ts)
    assert_close(res["logits"], logits, f"logits at every prompt position, -ts {ts}", rtol=1e-5)
    assert res["tokens"].tolist() == tokens
    _check_own_slices(mem)


@needs_mpi
@pytest.mark.slow
def test_ranks_match_single_process_default_model(default_model, tmp_path):
    path = default_model
    ts = (1.0, 2.0, 1.0)
    prompt = [1, 504, 3575, 282, 4649, 314, 253, 1345]
    res, mem = run_ranks(tmp_path, path, ts, prompt=prompt)
    logits, tokens = reference(path, ts, prompt=prompt)
    assert_close(res["logits"], logits, "default model logits, 3 ranks -ts 1,2,1", rtol=1e-5)
    assert res["tokens"].tolist() == tokens
    _check_own_slices(mem)
    for facts in mem:   # RSS this rank gained by loading and running vs the plan for its device
        grew = facts["rss_after"]["anon"] - facts["rss_before"]["anon"]
        want = facts["plan_weights"] + facts["plan_kv"] + facts["plan_compute"]
        assert abs(grew - want) <= 0.10 * want, (facts["rank"], grew, want)


@needs_mpi
def test_world_size_must_match_devices(synth_factory):
    path, _ = synth_factory(SYNTH)
    r = mpirun(2, "--model", str(path), "--devices", "3", timeout=60)
    assert r.returncode != 0
    lines = error_lines(r)
    assert len(lines) == 1 and "--devices 3 but mpiexec started 2 processes" in lines[0], r.stderr


@needs_mpi
def test_tensor_split_must_match_world(synth_factory):
    path, _ = synth_factory(SYNTH)
    r = mpirun(2, "--model", str(path), "-ts", "1,2,1", timeout=60)
    assert r.returncode != 0
    lines = error_lines(r)
    assert len(lines) == 1 and "-ts has 3 shares but mpiexec started 2 processes" in lines[0], r.stderr


@needs_mpi
def test_ranks_must_agree_on_the_model(synth_factory, tmp_path):
    a, _ = synth_factory(SYNTH)
    b, _ = synth_factory(SynthSpec(**{**SYNTH.__dict__, "seed": 4}))
    shutil.copy(a, tmp_path / "m0.gguf")
    shutil.copy(b, tmp_path / "m1.gguf")
    r = mpirun(2, "--model", str(tmp_path / "m{rank}.gguf"), timeout=60)
    assert r.returncode != 0
    lines = error_lines(r)
    assert len(lines) == 1 and "ranks disagree on the model file" in lines[0] and "rank 1" in lines[0], r.stderr


@needs_mpi
def test_mpi4py_missing_is_one_line(synth_factory):
    path, _ = synth_factory(SYNTH)
    r = mpirun(2, "--model", str(path), "--no-mpi4py", timeout=60)
    assert r.returncode != 0
    lines = error_lines(r)
    assert len(lines) == 1 and "mpi4py cannot be imported" in lines[0] and "metatp[mpi]" in lines[0], r.stderr


@needs_mpi
def test_one_failing_rank_ends_every_rank(synth_factory):
    path, _ = synth_factory(SYNTH)
    t0 = time.monotonic()
    r = mpirun(3, "--model", str(path), "-ts", "1,1,1", "--fail-rank", "1", "--fail-after", "3", timeout=60)
    assert r.returncode != 0
    assert time.monotonic() - t0 < 30
    assert r.stderr.count("rank 1 fails on purpose") == 1, r.stderr


@needs_mpi
def test_api_under_mpiexec_follows_rank_0(synth_factory, tmp_path):
    """`LLM(distributed="mpi")` batching several prompts: ranks given other prompts and seeds
    still run rank 0's (same passes, same tokens, all stop together), and greedy tokens match
    one process on one device."""
    from support.mpi_worker import API_PROMPTS

    from metatp.api import LLM
    from metatp.sampling import SamplingParams

    path, _ = synth_factory(SYNTH)
    r = mpirun(2, "--api", "--model", str(path), "-ts", "3,1", "--n-ctx", "128", "--n-gen", "10",
               "--out", str(tmp_path))
    check_ok(r)
    facts = [json.loads((tmp_path / f"api{k}.json").read_text()) for k in range(2)]
    assert facts[0]["size"] == 2
    for k in ("greedy", "sampled", "passes"):
        assert facts[1][k] == facts[0][k], k
    one = LLM(str(path), n_ctx=128, distributed="none")
    want = one.generate(API_PROMPTS, SamplingParams(max_tokens=10, temperature=0))
    assert facts[0]["greedy"] == [o.outputs[0].token_ids for o in want]
    assert all(len(ids) == 10 for ids in facts[0]["greedy"])


@needs_mpi
def test_cli_generate_under_mpiexec(synth_factory):
    """`mpiexec -n 2 metatp generate -ts 3,1` prints once, the single-device run's text; a
    --devices that disagrees with the world is one line."""
    path, _ = synth_factory(SYNTH)
    flags = ["-m", str(path), "-p", "hello world", "-n", "12", "--temp", "0", "-c", "128"]
    one = cli("generate", *flags)
    assert one.returncode == 0, one.stderr
    two = cli("generate", *flags, "-ts", "3,1", n=2)
    assert two.returncode == 0, two.stderr
    assert two.stdout == one.stdout
    bad = cli("generate", *flags, "--devices", "3", n=2)
    assert bad.returncode == 1 and len(error_lines(bad)) == 1, bad.stderr


# ---------------------------------------------------------------- NCCL (GPU ranks)


def _nccl_missing() -> str | None:
    try:
        from cupy.cuda import nccl
    except Exception as e:      # cupy absent, or no CUDA runtime to load
        return f"cupy is not importable ({type(e).__name__})"
    if not getattr(nccl, "available", False):
        return "cupy has no NCCL (pip install nvidia-nccl-cu12)"
    return None


def _gpus() -> int:
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:
        return 0


@needs_mpi
@requires("nccl", why=_nccl_missing())
def test_nccl_unique_id_travels_over_mpi():
    r = mpirun(2, "--model", "-", "--nccl-uid", timeout=60)
    check_ok(r)
    assert "nccl uid agreed on 2 ranks" in r.stdout


@needs_mpi
@requires("nccl", why=_nccl_missing())
@pytest.mark.skipif(_gpus() > 0, reason="needs no GPU (a GPU is visible here)")
def test_nccl_without_a_gpu_is_one_line():
    r = mpirun(1, "--model", "-", "--nccl-allreduce", timeout=60)
    assert r.returncode != 0
    lines = error_lines(r)
    assert len(lines) == 1 and "no CUDA GPU is visible" in lines[0], r.stderr


@needs_mpi
@pytest.mark.gpu
@requires("nccl", why=_nccl_missing())
@requires("gpu")
def test_nccl_allreduce_between_gpu_ranks():
    n = min(2, _gpus())
    r = mpirun(n, "--model", "-", "--nccl-allreduce", timeout=120)
    check_ok(r)
    assert f"nccl all-reduce ok on {n} rank(s)" in r.stdout
