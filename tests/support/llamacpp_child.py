"""A stand-in for batched-bench's llama.cpp child process that dies as a miscompiled ggml does
(SIGILL in an AMX matmul) once it is asked for its first timed run."""

from __future__ import annotations

import os
import signal


def crashing_child(conn, model_path: str, n_threads: int, n_batch: int) -> None:
    conn.send(("ready", "stand-in"))
    conn.recv()
    os.kill(os.getpid(), signal.SIGILL)
