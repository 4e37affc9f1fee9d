"""Step 6: one GPU rank under MPI with NCCL, in a subprocess bounded in time.

The rank (`metatp.testing.mpi_rank`, started as `python3 scripts/gpu_check --mpi-rank ...`, under
`mpiexec -n 1` where it is on PATH, else as an MPI singleton) builds its backend with
`backends.create_backend("cupy", layout, world=world)`, generates greedy tokens on a small synthetic model, compares
them with the single-process cupy run and drives the collective's step. With --emulate: the
kernel emulator, NCCL replaced by the test stand-in that sums over MPI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from scripts.gpu_check.config import SMOLLM2_TYPES, Budget, Config
from scripts.gpu_check.report import Report

MPI_SMOKE_SECONDS = 150.0
MPI_SPEC = dict(n_layer=2, n_embd=192, n_head=6, n_head_kv=3, n_ff=256, n_vocab=512, seed=5,
                types=dict(SMOLLM2_TYPES))
PACKAGE_DIR = Path(__file__).resolve().parent      # runnable: `python3 scripts/gpu_check ...`


def _mpi_missing() -> str | None:
    try:
        import mpi4py  # noqa: F401
        from mpi4py import MPI  # noqa: F401 - loads the MPI library
    except Exception as e:  # noqa: BLE001 - ImportError, or mpi4py without an MPI library
        return f"mpi4py not usable ({type(e).__name__}: {e}); carry the mpi4py and mpich wheels (docs/gpu-results.md)"
    return None


def mpi_command(args: list[str]) -> list[str]:
    """One rank of the MPI step: under mpiexec when it is on PATH, else an MPI singleton
    (mpi4py starts MPI itself in a lone process)."""
    import shutil

    rank = [sys.executable, str(PACKAGE_DIR), "--mpi-rank", *args]
    exe = shutil.which("mpiexec")
    return [exe, "-n", "1", *rank] if exe else rank


def section_mpi(rep: Report, cfg: Config, budget: Budget, workdir: Path | None) -> None:
    missing = _mpi_missing()
    if missing is not None:
        rep.add("mpi", "1-rank MPI+NCCL smoke", f"skipped: {missing}", None if cfg.emulate else False)
        return
    limit = min(MPI_SMOKE_SECONDS, budget.left() - 10)
    if limit < 30:
        rep.add("mpi", "1-rank MPI+NCCL smoke", "skipped (time budget)", None)
        return
    from metatp.testing.synth import SynthSpec, write_synthetic_gguf

    folder = workdir or Path(tempfile.mkdtemp(prefix="metatp-gpu-check-mpi-"))
    folder.mkdir(parents=True, exist_ok=True)
    path, out = folder / "mpi-smoke.gguf", folder / "mpi-smoke"
    write_synthetic_gguf(path, SynthSpec(**MPI_SPEC))
    args = ["--model", str(path), "--out", str(out), "--smoke", "--n-gen", "8", "--n-ctx", "128"]
    if cfg.emulate:
        args.append("--emulate")
    cmd = mpi_command(args)
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=limit, env=env)
    except subprocess.TimeoutExpired:
        rep.add("mpi", "1-rank MPI+NCCL smoke", f"timed out after {limit:.0f} s", False)
        return
    dt = time.perf_counter() - t0
    how = "mpiexec -n 1" if "mpiexec" in Path(cmd[0]).name else "MPI singleton"
    if r.returncode != 0:
        tail = (r.stderr.strip().splitlines() or ["(no output)"])[-1]
        rep.add("mpi", f"1-rank MPI+NCCL smoke ({how})", f"exit {r.returncode}: {tail}"[:300], False)
        rep.details.append(f"### mpi: 1-rank smoke\n```\n{' '.join(cmd)}\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}```")
        return
    _rank_rows(rep, cfg, out, how, dt)


def _rank_rows(rep: Report, cfg: Config, out: Path, how: str, dt: float) -> None:
    """The rows from what the rank wrote: the world, the tokens, the collective's step."""
    smoke = json.loads((out / "smoke.json").read_text())
    facts = json.loads((out / "rank0.json").read_text())
    nccl = "NCCL stand-in over MPI (emulated)" if cfg.emulate else "NCCL"
    rep.add("mpi", f"world + {nccl} communicator ({how})",
            f"rank 0 of {facts['size']} on GPU {facts['gpu']}, unique id broadcast over MPI, in {dt:.1f} s", True)
    ok = smoke["same_tokens"] and smoke["logits_rel_err"] <= 1e-5
    rep.add("mpi", "greedy tokens vs single-process cupy",
            f"{len(smoke['tokens'])} tokens {'same' if smoke['same_tokens'] else 'DIFFERENT'}, logits max rel err "
            f"{smoke['logits_rel_err']:.1e}; decode graph: {', '.join(facts['graph_modes'])}", ok)
    coll = facts.get("collective", {})
    bad = [k for k, v in coll.items() if not v]
    rep.add("mpi", "collective step (f32/bf16 wire, eager/graph, inactive rank)",
            f"{len(coll) - len(bad)}/{len(coll)} ok" + (f"; failing: {', '.join(bad)}" if bad else ""),
            bool(coll) and not bad)
