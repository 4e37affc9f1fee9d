"""GPU ranks under mpiexec: the cupy backend owning device `rank`, NCCL bootstrapped over MPI.

Without a GPU (CI): every rank runs the cupy backend on the CPU kernel emulator (`EmuRuntime`,
one emulated GPU per local rank) and its NCCL communicator is the test stand-in
`metatp/testing/mpi_nccl.MpiNcclComm`, which really sums over MPI. So `mpiexec -n 2` runs the
real wiring: `LLM(backend="cupy", distributed="mpi")`, the local GPU check, the unique id drawn by rank 0
and broadcast, the communicator handed each buffer's pointer and the device stream, the calls
captured into the decode step's CUDA graph and replayed. Logits are checked against one process
(the numpy backend, and the emulated cupy backend with both devices in one process).

On a GPU (marked `gpu`): one rank, real NCCL, the same run against the single-process cupy run.
Skips with a reason where mpi4py / mpiexec, g++ (the emulator), or a GPU is missing.
"""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

from support.helpers import assert_close
from support.require import requires
from support.mpi import check_ok, error_lines, mpiexec
from metatp.testing.synth import SynthSpec

PROMPT = [1, 17, 42, 99, 7, 250, 3, 64]
SYNTH = SynthSpec(n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, n_vocab=300, seed=3,
                  types={"gate": "Q4_0", "up": "Q4_0", "down": "Q8_0"})
EXACT = ("--kv-dtype", "f32", "--matmul-dtype", "f32")     # comparable with the numpy backend at 1e-5


def _gpu_missing() -> str | None:
    from metatp.backends.cuda.runtime import gpu_probe

    ok, why = gpu_probe()
    if not ok:
        return f"no usable CUDA GPU ({why})"
    try:
        from cupy.cuda import nccl
    except Exception as e:  # noqa: BLE001
        return f"cupy's NCCL is not importable ({type(e).__name__})"
    return None if getattr(nccl, "available", False) else "cupy has no NCCL (pip install nvidia-nccl-cu12)"


needs_mpi = requires("mpi")
needs_emu = requires("emulator")


def mpirun(n: int, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """`mpiexec -n n python -m metatp.testing.mpi_rank args...` on this machine."""
    return mpiexec(n, [sys.executable, "-m", "metatp.testing.mpi_rank", *args], timeout=timeout)


def _run_ranks(tmp_path: Path, path: Path, ts, *extra: str, n_gen: int = 8):
    out = tmp_path / "out"
    r = mpirun(len(ts), "--model", str(path), "-ts", ",".join(str(x) for x in ts), "--out", str(out),
               "--n-gen", str(n_gen), "--prompt", ",".join(map(str, PROMPT)), *extra)
    check_ok(r)
    facts = [json.loads((out / f"rank{k}.json").read_text()) for k in range(len(ts))]
    return np.load(out / "result.npz"), facts


def _reference(path: Path, backend, n_gen: int = 8):
    """(logits at every prompt position, greedy tokens) in this process on `backend`'s layout."""
    from metatp.engine import Engine
    from metatp.ir.loader import load_model

    eng = Engine(load_model(path), 128, backend.layout, backend)
    logits = eng.forward(PROMPT, all_logits=True)
    tokens, last = [], logits[-1]
    for _ in range(n_gen):
        tokens.append(int(np.argmax(last)))
        last = eng.forward([tokens[-1]])
    return logits, tokens


def _layout(n: int, ts=None):
    from metatp.passes.plan import DeviceLayout

    return DeviceLayout(n, "tensor" if n > 1 else "none", tuple(ts) if ts else None)


# ---------------------------------------------------------------- in-process contract checks


@needs_emu
def test_owning_one_device_needs_a_collective():
    from metatp.backends.cuda.backend import CupyBackend
    from metatp.testing import EmuRuntime
    from metatp.ir.errors import ConfigError

    lay = _layout(2)
    with pytest.raises(ConfigError, match="collective spanning the other processes"):
        CupyBackend(lay, runtime=EmuRuntime(), devices=[1])
    with pytest.raises(ConfigError, match="distinct device indices"):
        CupyBackend(lay, runtime=EmuRuntime(), devices=[2])
    with pytest.raises(ConfigError, match="one device per process"):
        CupyBackend(lay, runtime=EmuRuntime(), collective=object())
    with pytest.raises(ConfigError, match="gpus=\\[3\\]"):
        CupyBackend(lay, runtime=EmuRuntime(n_gpus=2), gpus=[3])
    be = CupyBackend(lay, runtime=EmuRuntime(n_gpus=2), devices=[1], collective=object(), gpus=[1])
    assert be.owned == [1] and be.devices[0] is None and be.devices[1].gpu == 1


def test_world_builds_cupy_instead_of_refusing():
    """The refusal of backend 'cupy' under mpiexec is gone; what still cannot work is one typed line."""
    from metatp.backends import create_backend
    from metatp.backends.distributed import World
    from metatp.ir.errors import ConfigError

    world = World(comm=None, rank=0, size=2)
    with pytest.raises(ConfigError, match="allreduce='ring'.*NCCL"):
        create_backend("cupy", _layout(2), world=world, allreduce="ring")
    with pytest.raises(ConfigError, match="cupy backend has no option 'threads'"):
        create_backend("cupy", _layout(2), world=world, threads=True)
    with pytest.raises(ConfigError, match="layout has 3 devices for 2 ranks"):
        create_backend("cupy", _layout(3), world=world)


# ---------------------------------------------------------------- mpiexec, emulated GPUs


@needs_mpi
@needs_emu
def test_two_emulated_gpu_ranks_match_one_process(synth_factory, tmp_path):
    """-ts 1,1 on 2 ranks (emulated GPU each, NCCL stand-in over MPI) vs one process: the numpy
    backend and the emulated cupy backend with both devices (in-process NCCL) give the same
    logits within 1e-5 relative at every prompt position and the same greedy tokens; the
    wiring is what NCCL needs (GPU = local rank, in place, on the device stream, in a graph)."""
    from metatp.backends.cuda.backend import CupyBackend
    from metatp.backends.numpy.backend import NumpyBackend
    from metatp.testing import EmuRuntime

    path, _ = synth_factory(SYNTH)
    res, facts = _run_ranks(tmp_path, path, (1, 1), "--emulate", *EXACT, "--check-collective")
    lay = _layout(2, (1, 1))
    ref_logits, ref_tokens = _reference(path, NumpyBackend(lay))
    assert_close(res["logits"], ref_logits, "2 GPU ranks (emulated) vs numpy, 2 devices", rtol=1e-5)
    assert res["tokens"].tolist() == ref_tokens
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cupy_one = CupyBackend(lay, runtime=EmuRuntime(n_gpus=2), kv_dtype="f32", matmul_dtype="f32")
    assert cupy_one.allreduce_strategy == "nccl"
    emu_logits, emu_tokens = _reference(path, cupy_one)
    assert_close(res["logits"], emu_logits, "2 GPU ranks vs emulated cupy, 2 GPUs in one process", rtol=1e-5)
    assert res["tokens"].tolist() == emu_tokens
    for f in facts:
        r = f["rank"]
        assert f["size"] == 2 and f["owned"] == [r] and f["gpu"] == f["local_rank"] == r
        assert f["strategy"] == "nccl"
        assert f["held"][str(r)] > 0 and f["held"][str(1 - r)] == 0 and f["allocated"][1 - r] == 0
        # 2 reductions per layer per forward (1 prompt + 8 decode steps), each on the device stream
        assert f["nccl_calls"] == 2 * SYNTH.n_layer * 9 and f["nccl_in_place"]
        assert f["nccl_streams"] == [f["stream"]]
        assert "whole" in f["graph_modes"]         # the decode step's NCCL calls replayed from its graph
        assert all(f["collective"].values()), f["collective"]


@needs_mpi
@needs_emu
def test_fewer_gpus_than_local_ranks_is_one_line(synth_factory, tmp_path):
    path, _ = synth_factory(SYNTH)
    r = mpirun(2, "--model", str(path), "-ts", "1,1", "--emulate", "--emu-gpus", "1", timeout=120)
    assert r.returncode != 0
    lines = error_lines(r)
    assert len(lines) == 1 and "2 ranks on this machine but 1 GPU(s)" in lines[0], r.stderr


# ---------------------------------------------------------------- a real GPU


@needs_mpi
@pytest.mark.gpu
@requires("gpu", why=_gpu_missing())
def test_one_gpu_rank_with_nccl_matches_single_process(synth_factory, tmp_path):
    """One rank, real NCCL over MPI: the same greedy tokens and logits as the single-process
    cupy backend, and the collective's step eagerly and in a CUDA graph."""
    path, _ = synth_factory(SYNTH)
    out = tmp_path / "out"
    r = mpirun(1, "--model", str(path), "--out", str(out), "--smoke", "--n-gen", "8", timeout=300)
    check_ok(r)
    smoke = json.loads((out / "smoke.json").read_text())
    facts = json.loads((out / "rank0.json").read_text())
    assert smoke["same_tokens"] and smoke["logits_rel_err"] <= 1e-5, smoke
    assert all(facts["collective"].values()), facts["collective"]
