"""`LLM(backend="cupy")` on the CPU emulator of the CUDA sources: the GPU probe answers yes and the
backend's runtime is the given `EmuRuntime`, so the engine, scheduler and server run the cupy
backend's real code paths on a machine without a GPU (tests/cuda)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

import pytest

from metatp.testing import EmuRuntime


def record_launches(rt: EmuRuntime, record: Callable[[str], object]) -> None:
    """`record(name)` for each kernel `rt` runs from now on, eagerly or in a replayed graph (the
    emulator's before_launch); the runtime's own hook (its fault injection) still runs after it."""
    inner = rt.emu.before_launch

    def seen(name: str) -> None:
        record(name)
        if inner is not None:
            inner(name)
    rt.emu.before_launch = seen


def record_scratch_requests(monkeypatch) -> list[tuple[str, int]]:
    """(key, element count) of every scratch buffer a cupy executable asks for from now on (the test's
    `monkeypatch` undoes it): what a plan's handlers request, to hold against `workspace`'s needs."""
    from metatp.backends.cuda.executable import CupyExecutable

    asked: list[tuple[str, int]] = []
    original = CupyExecutable.scratch_buffer

    def logged(self, d, key, count, dtype):
        asked.append((key, count))
        return original(self, d, key, count, dtype)
    monkeypatch.setattr(CupyExecutable, "scratch_buffer", logged)
    return asked


@contextmanager
def on_emulator(rt: EmuRuntime, env: dict[str, str] | None = None) -> Iterator[None]:
    """Inside: `LLM(backend="cupy")` runs on `rt`; `env` sets environment variables for as long."""
    import metatp.backends as backends
    import metatp.backends.cuda.backend as cuda_backend

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(backends, "gpu_probe", lambda: (True, ""))
        mp.setattr(cuda_backend, "CupyRuntime", lambda: rt)
        for name, value in (env or {}).items():
            mp.setenv(name, value)
        yield
