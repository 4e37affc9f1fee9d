"""A `metatp serve` process under test: started on a free port of 127.0.0.1, its output in a log
file, ready once /health answers (tests/serving/test_serving.py runs one process,
tests/mpi/test_mpi_serving.py `mpiexec -n 2`; each adds what it inspects)."""

from __future__ import annotations

import importlib
import os
import socket
import subprocess
import time
from pathlib import Path

import pytest


def optional_import(name: str):
    """The module, or None where it is not installed: a module-level import for a test file
    whose tests are marked `requires("serve")` (the marker skips or fails them, instead of an
    import error at collection, which would stop the whole session)."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    """`cmd` (which serves on `self.port`) in a subprocess writing to `log`; `wait_ready` polls
    /health until it answers 200, failing the test (with the log's tail) if the process exits
    first or the time runs out."""

    name = "metatp serve"

    def __init__(self, cmd: list[str], *, log: Path, port: int, env: dict[str, str],
                 new_session: bool = False) -> None:
        self.port = port
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env},
                                         start_new_session=new_session)

    def wait_ready(self, timeout: float, poll: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"{self.name} exited with {self.proc.returncode}:\n{self.text()[-3000:]}")
            try:
                if httpx.get(self.base + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(poll)
        self.stop()
        pytest.fail(f"{self.name} did not come up within {timeout:.0f} s:\n{self.text()[-3000:]}")

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def client(self, key: str = "unused"):
        import openai

        return openai.OpenAI(base_url=self.base + "/v1", api_key=key, timeout=120, max_retries=0)

    def stop(self) -> None:
        """Terminate (then kill) the process."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=20)


class MetatpServe(ServeProcess):
    """`metatp serve -m MODEL --backend numpy -a m ARGS` on a free port, one kernel thread, ready
    once /health answers (within `ready` seconds)."""

    def __init__(self, model: str, *args: str, log: Path, ready: float = 120, alias: str | None = "m") -> None:
        import sys

        port = free_port()
        cmd = [sys.executable, "-m", "metatp", "serve", "-m", model, "--port", str(port), "--backend", "numpy",
               *(["-a", alias] if alias else []), *args]
        super().__init__(cmd, log=log, port=port, env={"METATP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
        self.wait_ready(ready, 0.2)


class LoopbackPosts:
    """Two ranks in one process: rank 0's posts (`metatp.lockstep`) kept for a follower to read
    back in order."""

    def __init__(self, rank: int, posts: list) -> None:
        self.rank, self.size, self.posts = rank, 2, posts

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    def post(self, message) -> None:
        self.posts.append(message)

    def next_post(self, on_wait=None):
        return self.posts.pop(0)


def record_steps(*engines) -> tuple[list, ...]:
    """Per engine, a log of its `run` calls: (the cell owner table before the step, the outputs)."""
    logs: tuple[list, ...] = tuple([] for _ in engines)
    for eng, log in zip(engines, logs):
        def recorded(items, run=eng.run, eng=eng, log=log):
            owners = eng.cells.owner.copy()
            outs = run(items)
            log.append((owners, outs))
            return outs
        eng.run = recorded
    return logs
