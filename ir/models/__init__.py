"""Model graph builders, one module per architecture family, and the registry that picks one."""

from __future__ import annotations

from typing import Any, Callable

from metatp.ir.errors import UnsupportedArchitectureError
from metatp.ir.models.common import BatchSpec, ModelTensors
from metatp.ir.graph import Graph

__all__ = ["BatchSpec", "ModelTensors", "build_graph", "check_architecture", "prepare_hparams",
           "SUPPORTED_ARCHITECTURES"]

Builder = Callable[[ModelTensors, BatchSpec], Graph]


def _build_llama_or_mixtral(t: ModelTensors, spec: BatchSpec) -> Graph:
    """`llama` files with `llama.expert_count` > 0 are Mixtral-style MoE models."""
    from metatp.ir.models import llama, moe

    return moe.build_moe(t, spec) if t.hp.n_expert > 0 else llama.build_llama(t, spec)


def _builders() -> dict[str, Builder]:
    from metatp.ir.models import gemma3, llama, moe, parallel, phi3

    return {
        "llama": _build_llama_or_mixtral,
        "mistral": llama.build_llama,
        "qwen2": llama.build_llama,
        "qwen3": llama.build_llama,
        "qwen2moe": moe.build_moe,
        "qwen3moe": moe.build_moe,
        "phi3": phi3.build_phi3,
        "command-r": parallel.build_command_r,
        "gemma3": gemma3.build_gemma3,
    }


def _hparams_fixups() -> dict[str, Callable[[Any, dict[str, Any]], None]]:
    """Per architecture: what llama.cpp's loader hard-codes rather than reads (e.g. gemma3's SWA pattern)."""
    from metatp.ir.models import gemma3

    return {"gemma3": gemma3.hparams_fixup}


SUPPORTED_ARCHITECTURES: tuple[str, ...] = (
    "command-r", "gemma3", "llama", "mistral", "phi3", "qwen2", "qwen2moe", "qwen3", "qwen3moe")


def check_architecture(arch: str) -> None:
    if arch not in _builders():
        raise UnsupportedArchitectureError(
            f"unsupported architecture {arch!r}; supported: {', '.join(sorted(_builders()))}")


def prepare_hparams(hp: Any, metadata: dict[str, Any]) -> None:
    """Complete `hp` with the architecture's hard-coded facts (idempotent; a no-op for most)."""
    fix = _hparams_fixups().get(hp.arch)
    if fix is not None:
        fix(hp, metadata)


def build_graph(tensors: ModelTensors, spec: BatchSpec) -> Graph:
    """The forward graph for one batch of `spec.n_tokens` tokens on top of `spec.n_kv` cached ones."""
    check_architecture(tensors.hp.arch)
    prepare_hparams(tensors.hp, tensors.model.metadata)
    return _builders()[tensors.hp.arch](tensors, spec)
