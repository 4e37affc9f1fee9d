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
