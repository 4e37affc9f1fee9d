"""Starting real `mpiexec` runs from the tests (tests/mpi/): this machine only, oversubscribed.

`mpiexec(n, cmd)` runs `cmd` on n ranks; `cli(...)` is `python -m metatp.cli ...` in one
process or under `mpiexec -n n`; `check_ok` and `error_lines` read what came back.
"""

from __future__ import annotations

import os
import subprocess
import sys

# one kernel thread per rank, and oversubscribed ranks yield the CPU while they wait in a
# collective (MPICH: MPIR_CVAR_ENABLE_HEAVY_YIELD; Open MPI: mpi_yield_when_idle)
MPI_ENV = {"OPENBLAS_NUM_THREADS": "1", "METATP_NUM_THREADS": "1",
           "MPIR_CVAR_ENABLE_HEAVY_YIELD": "1", "OMPI_MCA_mpi_yield_when_idle": "1"}


def mpiexec(n: int, cmd: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    """`mpiexec -n n cmd...` on this machine, output captured."""
    return subprocess.run(["mpiexec", "-n", str(n), *cmd], capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, **MPI_ENV))


def cli(*args: str, n: int | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """`metatp ARGS` in one process, or under `mpiexec -n n` on this machine."""
    cmd = [sys.executable, "-m", "metatp.cli", *args]
    if n is not None:
        return mpiexec(n, cmd, timeout=timeout)
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=dict(os.environ, **MPI_ENV))


def check_ok(r: subprocess.CompletedProcess) -> None:
    assert r.returncode == 0, f"failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"


def error_lines(r: subprocess.CompletedProcess) -> list[str]:
    """The `metatp: error: ...` lines of the run's stderr (one error: one line, printed once)."""
    return [line for line in r.stderr.splitlines() if line.startswith("metatp: error:")]
