"""What one `metatp bench` invocation measures (`BenchConfig`) and the layouts it expands to."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from metatp.tools.bench_comm import stage_layouts

__all__ = ["BenchConfig", "int_list", "bench_layouts", "context_size"]


@dataclass
class BenchConfig:
    model: str | None = None
    n_prompt: list[int] = field(default_factory=lambda: [512])
    n_gen: list[int] = field(default_factory=lambda: [128])
    n_depth: list[int] = field(default_factory=lambda: [0])
    repetitions: int = 5
    backend: str = "auto"
    n_devices: list[int] = field(default_factory=lambda: [1])
    split_mode: list[str] = field(default_factory=lambda: ["none"])
    tensor_split: list[tuple[float, ...] | None] = field(default_factory=lambda: [None])
    pp: int | None = None         # -sm layer,tensor rows: stages x devices per stage (bench_comm)
    tp: int | None = None
    seed: int = 0
    interleave: bool = False      # build every layout first, alternate repetitions between them
    numerics: list[str] = field(default_factory=lambda: ["exact"])
    compare: str | None = None    # "llama-cpp": the same tests through llama-cpp-python, interleaved
    # KV cache types (llama-bench's -ctk / -ctv); None: the backend's default (numpy f32, CuPy f16);
    # a -ctv of None follows -ctk
    cache_type_k: list[str | None] = field(default_factory=lambda: [None])
    cache_type_v: list[str | None] = field(default_factory=lambda: [None])


def int_list(text: str) -> list[int]:
    from metatp.ir.errors import ConfigError

    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"expected comma-separated integers, got {text!r}") from None
    if any(v < 0 for v in vals):
        raise ConfigError(f"values must be >= 0, got {text!r}")
    return vals


def bench_layouts(cfg: BenchConfig) -> list[tuple[int, str, tuple[float, ...] | None]]:
    """Distinct (n_devices, split_mode, tensor_split); a single-device baseline joins any tensor run."""
    out = []
    for n, sm, ts in itertools.product(cfg.n_devices, cfg.split_mode, cfg.tensor_split):
        if ts is not None:
            n = len(ts)
        if sm == "none":
            n, ts = 1, None
        key = (n, sm, ts)
        if key not in out:
            out.append(key)
    if any(sm != "none" for _, sm, _ in out) and (1, "none", None) not in out:
        out.insert(0, (1, "none", None))
    return stage_layouts(out, cfg.pp, cfg.tp)


def context_size(cfg: BenchConfig) -> int:
    return max([p + d for p in cfg.n_prompt for d in cfg.n_depth] + [g + d + 1 for g in cfg.n_gen for d in cfg.n_depth]
               + [16])
