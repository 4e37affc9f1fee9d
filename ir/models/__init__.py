"""Model graph builders, one module per architecture family; `registry.ARCHS` picks one."""

from __future__ import annotations

from typing import Any

from metatp.ir.graph import Graph
from metatp.ir.models.common import ArchSpec, BatchSpec, ModelTensors
from metatp.ir.models.registry import ARCHS, SUPPORTED_ARCHITECTURES, arch_spec

__all__ = ["ArchSpec", "BatchSpec", "ModelTensors", "build_graph", "check_architecture", "prepare_hparams",
           "SUPPORTED_ARCHITECTURES", "ARCHS"]


def check_architecture(arch: str) -> None:
    """Raise UnsupportedArchitectureError naming the supported ones unless `arch` is one."""
    arch_spec(arch)


def prepare_hparams(hp: Any, metadata: dict[str, Any]) -> None:
    """Complete `hp` with the architecture's hard-coded facts (the loader calls this once)."""
    fix = arch_spec(hp.arch).hparams_fixup
    if fix is not None:
        fix(hp, metadata)


def build_graph(tensors: ModelTensors, spec: BatchSpec) -> Graph:
    """The forward graph for one batch of `spec.n_tokens` tokens on top of `spec.n_kv` cached ones."""
    arch = arch_spec(tensors.hp.arch)
    return arch.build(tensors, spec, arch)
