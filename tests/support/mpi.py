"""Starting real `mpiexec` runs from the tests (tests/mpi/): this machine only, oversubscribed.

`mpiexec(n, cmd)` runs `cmd` on n ranks; `cli(...)` is `python -m metatp.cli ...` in one
process or under `mpiexec -n n`; `check_ok` and `error_lines` read what came back. `FaultJob`
runs a job with a fault injected in one rank (tests/support/rank_fault.py); `fault_lines` reads
why it ended.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

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


# ---------------------------------------------------------------- faults across ranks (tests/mpi/test_rank_faults.py)
FAULT_SCRIPT = Path(__file__).with_name("rank_fault.py")

# the lines that tell a user why a job ended: ours, the launcher's for a rank that died, and
# the launcher's for a host it cannot reach
FAULT_MARKS = ("metatp: error:", "metatp: internal error:", "EXIT STRING:", "Could not resolve hostname")


def fault_lines(text: str) -> list[str]:
    """The lines of a job's output that say why it ended (one fault: one line, printed once)."""
    return [line for line in text.splitlines() if any(m in line for m in FAULT_MARKS)]


def alive(pid: int) -> bool:
    """Is `pid` a process that has not ended (a zombie has)?"""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class FaultJob:
    """`mpiexec [mpiexec_args] -n n python tests/support/rank_fault.py ARGS` in a session of its
    own, output (both streams) in `out/job.log`; `env` sets the fault (see rank_fault.py). The
    ranks' pids and the fault's time come back through files in `out`."""

    def __init__(self, args: list[str], out: Path, n: int = 2, env: dict[str, str] | None = None,
                 mpiexec_args: tuple[str, ...] = (), cwd: Path | None = None) -> None:
        out.mkdir(parents=True, exist_ok=True)
        self.out, self.log = out, out / "job.log"
        full_env = {**os.environ, **MPI_ENV, "PYTHONUNBUFFERED": "1", "FAULT_DIR": str(out), **(env or {})}
        cmd = ["mpiexec", *mpiexec_args, "-n", str(n), sys.executable, str(FAULT_SCRIPT), *args]
        self.started = time.time()
        with open(self.log, "wb") as f:
            self.proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=full_env, cwd=cwd,
                                         start_new_session=True)

    def pids(self) -> list[int]:
        return [int(p.read_text()) for p in sorted(self.out.glob("pid*")) if p.read_text().strip()]

    def fault_time(self) -> float | None:
        f = self.out / "fault"
        text = f.read_text().strip() if f.exists() else ""      # empty: the rank is still writing it
        return float(text) if text else None

    def wait_fault(self, timeout: float) -> float:
        """The time the fault was injected (waits for it; fails the test with the log if it never comes)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            t = self.fault_time()
            if t is not None:
                return t
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError(f"the fault was not injected (mpiexec: {self.proc.poll()}):\n{self.text()[-3000:]}")

    def wait_end(self, timeout: float) -> float | None:
        """When mpiexec and every rank had ended (time.time()), or None if not within `timeout`."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None and not any(alive(p) for p in self.pids()):
                return time.time()
            time.sleep(0.05)
        return None

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def states(self) -> str:
        """Which of mpiexec and the ranks are still there, and in what state (for a failure's message)."""
        def state(pid: int) -> str:
            try:
                with open(f"/proc/{pid}/stat") as f:
                    return f.read().rsplit(")", 1)[1].split()[0]
            except OSError:
                return "gone"
        ranks = ", ".join(f"rank {i} pid {p}: {state(p)}" for i, p in enumerate(self.pids()))
        return f"mpiexec: {'running' if self.proc.poll() is None else f'exited {self.proc.returncode}'}; {ranks}"

    def kill(self) -> None:
        """End whatever is left (the job's own session: mpiexec and every rank)."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=30)
        for pid in self.pids():
            if alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
