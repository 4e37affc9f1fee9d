"""Backends run a Plan. `create_backend` picks one by name ("auto": cupy when a GPU is usable)."""

from __future__ import annotations

from metatp.backends.cuda_kernels import gpu_available, gpu_probe
from metatp.ir.errors import BackendUnavailableError, ConfigError

__all__ = ["BACKENDS", "gpu_available", "gpu_probe", "resolve_backend_name", "create_backend"]

BACKENDS = ("auto", "numpy", "cupy")


def resolve_backend_name(name: str) -> str:
    """The backend `name` stands for here: "auto" is cupy only when a trivial kernel compiles and
    runs on the GPU (one warning, then numpy, when a GPU is seen but cannot compile)."""
    if name not in BACKENDS:
        raise ConfigError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
    if name == "auto":
        return "cupy" if gpu_available() else "numpy"
    if name == "cupy":
        ok, why = gpu_probe()
        if not ok:
            raise BackendUnavailableError(f"backend 'cupy' cannot run here: {why}; use backend='numpy'")
    return name


def create_backend(name: str, layout, numerics: str = "exact", cpu_kernels: bool | None = None):
    """A backend instance for `layout` (a passes.plan.DeviceLayout). `cpu_kernels` (numpy only):
    None uses the compiled decode kernels when they build, False never, True insists."""
    resolved = resolve_backend_name(name)
    if resolved == "numpy":
        from metatp.backends.numpy_backend import NumpyBackend

        return NumpyBackend(layout, numerics=numerics, cpu_kernels=cpu_kernels)
    from metatp.backends.cupy_backend import CupyBackend

    return CupyBackend(layout, numerics=numerics)
