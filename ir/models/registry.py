"""Every supported architecture, in one table: its builder and what differs about it.

Adding an architecture is one module under `ir/models/` (built from `blocks`) and one row here.
"""

from __future__ import annotations

from metatp.ir.errors import UnsupportedArchitectureError
from metatp.ir.graph import Graph
from metatp.ir.models import gemma3, llama, moe, parallel, phi3
from metatp.ir.models.common import ArchSpec, BatchSpec, ModelTensors
from metatp.ir.ops import RopeMode

__all__ = ["ARCHS", "SUPPORTED_ARCHITECTURES", "arch_spec"]


def _llama_or_mixtral(t: ModelTensors, spec: BatchSpec, arch: ArchSpec) -> Graph:
    """`llama` files with `llama.expert_count` > 0 are Mixtral-style MoE models."""
    return moe.build_moe(t, spec, arch) if t.hp.n_expert > 0 else llama.build_llama(t, spec, arch)


_NORMAL, _NEOX = RopeMode.NORMAL, RopeMode.NEOX

# rope: llama.cpp's llama_model_rope_type; normalise_expert_weights: build_moe_ffn's norm_w
ARCHS: dict[str, ArchSpec] = {a.name: a for a in (
    ArchSpec("llama", _llama_or_mixtral, _NORMAL, normalise_expert_weights=True),
    ArchSpec("mistral", llama.build_llama, _NORMAL),
    ArchSpec("qwen2", llama.build_llama, _NEOX),
    ArchSpec("qwen3", llama.build_llama, _NEOX),
    ArchSpec("qwen2moe", moe.build_moe, _NEOX, normalise_expert_weights=False),
    ArchSpec("qwen3moe", moe.build_moe, _NEOX, normalise_expert_weights=True),
    ArchSpec("phi3", phi3.build_phi3, _NEOX),
    ArchSpec("command-r", parallel.build_command_r, _NORMAL),
    ArchSpec("gemma3", gemma3.build_gemma3, _NEOX, hparams_fixup=gemma3.hparams_fixup),
)}

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(sorted(ARCHS))


def arch_spec(arch: str) -> ArchSpec:
    try:
        return ARCHS[arch]
    except KeyError:
        raise UnsupportedArchitectureError(
            f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}") from None
