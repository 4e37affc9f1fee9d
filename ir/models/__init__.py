"""Model graph builders, one module per architecture family, and the registry that picks one."""

from __future__ import annotations

from typing import Callable

from metatp.ir.errors import UnsupportedArchitectureError
from metatp.ir.models.common import BatchSpec, ModelTensors
from metatp.ir.graph import Graph

__all__ = ["BatchSpec", "ModelTensors", "build_graph", "check_architecture", "SUPPORTED_ARCHITECTURES"]


def _builders() -> dict[str, Callable[[ModelTensors, BatchSpec], Graph]]:
    from metatp.ir.models import llama

    return {
        "llama": llama.build_llama,
        "mistral": llama.build_llama,
        "qwen2": llama.build_llama,
        "qwen3": llama.build_llama,
    }


SUPPORTED_ARCHITECTURES: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3")


def check_architecture(arch: str) -> None:
    if arch not in _builders():
        raise UnsupportedArchitectureError(
            f"unsupported architecture {arch!r}; supported: {', '.join(sorted(_builders()))}")


def build_graph(tensors: ModelTensors, spec: BatchSpec) -> Graph:
    """The forward graph for one batch of `spec.n_tokens` tokens on top of `spec.n_kv` cached ones."""
    check_architecture(tensors.hp.arch)
    return _builders()[tensors.hp.arch](tensors, spec)
