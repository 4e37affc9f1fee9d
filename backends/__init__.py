"""Backends run a Plan. `create_backend` picks one by name ("auto": cupy when a GPU is usable)."""

from __future__ import annotations

from metatp.ir.errors import BackendUnavailableError, ConfigError

BACKENDS = ("auto", "numpy", "cupy")


def gpu_available() -> bool:
    """True when cupy imports and sees at least one CUDA device."""
    try:
        import cupy
    except Exception:
        return False
    try:
        return bool(cupy.cuda.is_available())
    except Exception:
        return False


def resolve_backend_name(name: str) -> str:
    if name not in BACKENDS:
        raise ConfigError(f"unknown backend {name!r}; choose one of {', '.join(BACKENDS)}")
    if name == "auto":
        return "cupy" if gpu_available() else "numpy"
    if name == "cupy" and not gpu_available():
        try:
            import cupy  # noqa: F401
            why = "cupy is installed but no usable CUDA GPU was found"
        except Exception:
            why = "cupy is not installed (pip install 'metatp[cuda]')"
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

    return CupyBackend(layout)
