"""The decode kernel choices one gpu_check run compares (issue 44): sets of cupy backend options.

One GPU call must say what this round's kernels bought, so the shapes and profile sections
measure each model shape under several option sets side by side: "before" (this round's old
kernels: the separate split-KV merge launch, norm/q/k/v/RoPE/KV write apart), "default" (the
backend's defaults: the new kernels), "q8" (int8 dot products) and "pdl" (programmatic dependent
launch). A tree whose cupy backend does not take a variant's options (an older tree, or an option
that did not land) skips that variant with an info row instead of failing: the registry is asked
at run time, never assumed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from metatp.ir.errors import ConfigError

DEFAULT = "default"


@dataclass(frozen=True)
class Variant:
    """One option set: its name in the rows (`[q8]`), the cupy options, what it stands for, and
    whether the profile section times its kernels one by one."""

    name: str
    options: dict[str, Any] = field(default_factory=dict)
    why: str = ""
    profiled: bool = True

    def suffix(self) -> str:
        """'' for the default variant (its rows keep the names docs/gpu-results.md and issue 44 use),
        else ' [name]'."""
        return "" if self.name == DEFAULT else f" [{self.name}]"


VARIANTS = (
    Variant(DEFAULT, {}, "the cupy backend's defaults: this round's kernels"),
    Variant("before", {"attn_merge": False, "fuse_qkv_rope": False},
            "this round's old kernels: split-KV merge as its own launch, norm/q/k/v/RoPE/KV write apart"),
    Variant("q8", {"numerics": "q8"}, "int8 dot products (dp4a) on Q8_1 activations"),
    Variant("pdl", {"pdl": True}, "programmatic dependent launch (when the backend has the option)", profiled=False),
)
VARIANT_NAMES = tuple(v.name for v in VARIANTS)


def by_names(names: tuple[str, ...] | list[str]) -> tuple[Variant, ...]:
    """The variants named, in the table's order; an unknown name is a ConfigError naming the known ones."""
    unknown = [n for n in names if n not in VARIANT_NAMES]
    if unknown:
        raise ConfigError(f"unknown variant {', '.join(unknown)}; gpu_check knows {', '.join(VARIANT_NAMES)}")
    return tuple(v for v in VARIANTS if v.name in names)


def refusal(variant: Variant, backend: str = "cupy") -> str | None:
    """Why this tree's `backend` cannot run `variant` (an option it does not declare, or a value it
    refuses), or None when it can."""
    from metatp.backends.registry import backend_entry

    entry = backend_entry(backend)
    missing = [k for k in variant.options if k not in entry.options]
    if missing:
        return f"this tree's {backend} backend has no option {', '.join(missing)}"
    try:
        entry.check(dict(variant.options))
    except ConfigError as e:
        return str(e)
    return None


def runnable(variants: tuple[Variant, ...]) -> tuple[tuple[Variant, ...], dict[str, str]]:
    """(the variants this tree can run, {name: why not} for the others)."""
    refused = {v.name: why for v in variants if (why := refusal(v)) is not None}
    return tuple(v for v in variants if v.name not in refused), refused


__all__ = ["DEFAULT", "Variant", "VARIANTS", "VARIANT_NAMES", "by_names", "refusal", "runnable"]
