"""Pipeline and tensor-parallel sizes (vLLM's P and T) -> llama.cpp's (n_devices, split_mode, tensor_split).

One mapping for the command line (`--pp` / `--tp` beside `-sm layer,tensor`) and the Python API
(`LLM(pipeline_parallel_size=P, tensor_parallel_size=T)`), so the two cannot drift apart; only
the spellings in the errors differ (`Spellings`).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

from metatp.ir.errors import ConfigError

__all__ = ["Spellings", "FLAGS", "KEYWORDS", "parallel_layout"]


@dataclass(frozen=True)
class Spellings:
    """How the caller spells each setting, so an error names what the user wrote."""

    pp: str
    tp: str
    ts: str
    n: str
    sm: str


FLAGS = Spellings(pp="--pp", tp="--tp", ts="-ts", n="--devices / mpiexec -n", sm="-sm")
KEYWORDS = Spellings(pp="pipeline_parallel_size", tp="tensor_parallel_size", ts="tensor_split", n="n_devices",
                     sm="split_mode")


def parallel_layout(n: int | None, mode: str | None, ts: tuple[float, ...] | None, pp: int | None, tp: int | None,
                    say: Spellings = FLAGS) -> tuple[int | None, str | None, tuple[float, ...] | None]:
    """(n_devices, split_mode, tensor_split) with the sizes applied.

    No mode: the sizes choose it (T > 1 alone: tensor over T devices; P > 1 alone: layer over P;
    both: layer,tensor over P*T). A given mode, device count or -ts that contradicts the sizes is
    a ConfigError naming both. Under layer,tensor a missing size is derived from the device count
    or -ts, whose length is the tensor group's size (equal shares by default: that is how
    `DeviceLayout` knows T)."""
    if pp is None and tp is None:
        return n, mode, ts
    for name, v in ((say.pp, pp), (say.tp, tp)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, numbers.Integral)):
            raise ConfigError(f"{name} must be an integer >= 1, got {v!r}")
        if v is not None and v < 1:
            raise ConfigError(f"{name} must be >= 1, got {v}")
    pp = None if pp is None else int(pp)
    tp = None if tp is None else int(tp)
    if n is not None and (isinstance(n, bool) or not isinstance(n, numbers.Integral)):
        raise ConfigError(f"{say.n} must be an integer >= 1, got {n!r}")
    if mode is None:
        stages, group = pp or 1, tp or 1
        mode = ("layer,tensor" if stages > 1 and group > 1 else "tensor" if group > 1 else
                "layer" if stages > 1 else "none")
    if mode == "layer,tensor":
        return _staged(n, ts, pp, tp, say)
    if mode in ("none", "tensor", "layer"):
        return _one_kind(n, mode, ts, pp or 1, tp or 1, say)
    return n, mode, ts          # an unknown mode: DeviceLayout names it


def _one_kind(n: int | None, mode: str, ts: tuple[float, ...] | None, pp: int, tp: int,
              say: Spellings) -> tuple[int, str, tuple[float, ...] | None]:
    """-sm none, tensor or layer: at most one of the sizes may be above 1, and it is the device count."""
    allowed = {"none": (), "tensor": ("tp",), "layer": ("pp",)}[mode]
    for key, v in (("pp", pp), ("tp", tp)):
        if v > 1 and key not in allowed:
            raise ConfigError(f"{getattr(say, key)} {v} contradicts {say.sm} {mode}: "
                              + ("both sizes above 1 need layer,tensor" if allowed else
                                 "one device has no stages or tensor groups"))
    size, name = (tp, say.tp) if mode == "tensor" else (pp, say.pp)
    if n is not None and n != size:
        raise ConfigError(f"{name} is {size} but {say.n} gives {n} devices")
    if ts is not None and len(ts) != size:
        raise ConfigError(f"{say.ts} has {len(ts)} shares but {name} is {size} (one share per device)")
    return size, mode, ts


def _staged(n: int | None, ts: tuple[float, ...] | None, pp: int | None, tp: int | None,
            say: Spellings) -> tuple[int, str, tuple[float, ...]]:
    """-sm layer,tensor: P stages of T devices; -ts one share per device of a tensor group."""
    if tp is None:
        tp = len(ts) if ts else None
        if tp is None and n is not None and n % pp == 0:
            tp = n // pp
        if tp is None:
            raise ConfigError(f"{say.pp} {pp}: give {say.tp} T too (devices per stage)")
    if ts is not None and len(ts) != tp:
        raise ConfigError(f"{say.ts} has {len(ts)} shares but {say.tp} is {tp}: under {say.sm} layer,tensor "
                          f"{say.ts} gives each device of a tensor group its share")
    if pp is None:
        if n is None or n % tp:
            raise ConfigError(f"{say.tp} {tp}: give {say.pp} P too (stages)" if n is None else
                              f"{say.tp} {tp} does not divide the {n} devices into stages; give {say.pp} P")
        pp = n // tp
    if n is not None and n != pp * tp:
        raise ConfigError(f"{say.pp} {pp} x {say.tp} {tp} is {pp * tp} devices, but {say.n} gives {n}")
    return pp * tp, "layer,tensor", ts if ts is not None else (1.0,) * tp
