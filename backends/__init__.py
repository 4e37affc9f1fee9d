"""Backends run a Plan. `create_backend` picks one by name ("auto": cupy when a GPU is usable)."""

from __future__ import annotations

from metatp.backends.cuda.runtime import gpu_available, gpu_probe
from metatp.backends.registry import BACKENDS as _REGISTERED, backend_entry, rank_backend_entry
from metatp.ir.errors import BackendUnavailableError, ConfigError

__all__ = ["BACKENDS", "gpu_available", "gpu_probe", "resolve_backend_name", "create_backend"]

BACKENDS = ("auto", *_REGISTERED)


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


def create_backend(name: str, layout, world=None, **options):
    """A backend instance for `layout` (a passes.plan.DeviceLayout) with `options` checked
    against the backend's table in `backends.registry` (None: the backend's default). `world`
    (`distributed.World`, one process per device): this rank's backend, owning device `rank`
    ("auto" is numpy there), wired by its registry entry (`BackendEntry.create`)."""
    if world is not None:
        return rank_backend_entry(name, layout, world).create(layout, options, world)
    return backend_entry(resolve_backend_name(name)).create(layout, options)
