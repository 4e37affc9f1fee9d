"""Memory planning: per-device bytes for weights, KV cache and compute buffers, from a Plan.

Computed before any weight is loaded, so a configuration that cannot fit is refused with a
message that says what would fit (llama.cpp's `--fit`, which its tensor mode lacks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from metatp.ir.ops import Op
from metatp.ir.tensor import Flag, Tensor, block_size, row_bytes
from metatp.passes.plan import Plan
from metatp.ir.errors import ConfigError

__all__ = ["MemoryPlan", "plan_memory", "fit_context", "assign_offsets", "parse_bytes", "format_bytes"]

# bytes a backend keeps for one weight: (tensor, local ne, plan) -> bytes
WeightBytes = Callable[[Tensor, tuple[int, ...], Plan], int]
# bytes per element a backend stores for a KV-cache leaf (the cupy backend keeps an F32 cache as f16)
KvItemsize = Callable[[Tensor], int]

_ITEM = {"F32": 4, "F16": 2, "BF16": 2, "I32": 4}


def _nelements(ne: tuple[int, ...]) -> int:
    n = 1
    for x in ne:
        n *= x
    return n


@dataclass
class MemoryPlan:
    """Per-device byte counts (index = device)."""

    weights: list[int]
    kv: list[int]
    compute: list[int]
    kv_per_token: list[int]      # KV bytes per context token, per device
    n_ctx: int
    host: int = 0                # host bytes of the engine's per-cell tables and step masks (not in totals)

    @property
    def n_devices(self) -> int:
        return len(self.weights)

    def total(self, d: int) -> int:
        return self.weights[d] + self.kv[d] + self.compute[d]

    def totals(self) -> list[int]:
        return [self.total(d) for d in range(self.n_devices)]

    def as_dict(self) -> dict:
        return {"n_ctx": self.n_ctx, "weights": self.weights, "kv": self.kv, "compute": self.compute,
                "kv_per_token": self.kv_per_token, "total": self.totals()}


def plan_memory(plan: Plan, weight_bytes: WeightBytes, n_ctx: int, workspace: list[int] | None = None,
                kv_itemsize: KvItemsize | None = None, host: int = 0) -> MemoryPlan:
    """Bytes per device for `plan` (use the largest batch plan: compute buffers scale with it).
    `workspace`: per-device bytes a backend needs beyond the plan's buffers (counted as compute).
    `kv_itemsize`: bytes per element of the KV cache as the backend stores it (default: the
    graph type's size). `host`: bytes the caller keeps in host memory that grow with n_ctx
    (kept apart: they count against a device's budget only where the device is the host)."""
    n = plan.n_devices
    weights, kv, compute, kv_tok = [0] * n, [0] * n, [0] * n, [0] * n
    for t in plan.graph.leaves:
        tp = plan.of(t)
        for d in range(n):
            loc = tp.local[d]
            if t.flags & Flag.WEIGHT:
                weights[d] += weight_bytes(t, loc.ne, plan)
            elif t.flags & Flag.KV_CACHE:
                if block_size(t.type) > 1:       # a quantized cache is its blocks on every backend
                    b = row_bytes(t.type, loc.ne[0]) * loc.ne[1] * loc.ne[2] * loc.ne[3] if loc.ne[0] else 0
                else:
                    item = kv_itemsize(t) if kv_itemsize else _ITEM.get(t.type.name, 4)
                    b = _nelements(loc.ne) * item
                kv[d] += b
                kv_tok[d] += b // max(t.ne[1], 1)
            else:
                compute[d] += _nelements(loc.ne) * _ITEM.get(t.type.name, 4)
    for d in range(n):
        compute[d] += assign_offsets(plan, d, lambda t: _ITEM.get(t.type.name, 4))[1]
        compute[d] += workspace[d] if workspace else 0
    return MemoryPlan(weights, kv, compute, kv_tok, n_ctx, host)


def fit_context(plan_for_ctx: Callable[[int], MemoryPlan], fits: Callable[[MemoryPlan], bool],
                n_ctx_max: int, granule: int = 256) -> int:
    """The largest n_ctx (a multiple of `granule`, or n_ctx_max) whose memory plan fits; 0 if none.

    Binary search over whole granules: buffers grow with the attended length too, so every
    candidate is planned for real rather than extrapolated."""
    if fits(plan_for_ctx(n_ctx_max)):
        return n_ctx_max
    lo, hi = 0, (n_ctx_max - 1) // granule          # candidates k * granule, k in 1..hi
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(plan_for_ctx(mid * granule)):
            lo = mid
        else:
            hi = mid - 1
    return lo * granule


_UNITS = {"": 1, "B": 1, "K": 2**10, "KB": 10**3, "KIB": 2**10, "M": 2**20, "MB": 10**6, "MIB": 2**20,
          "G": 2**30, "GB": 10**9, "GIB": 2**30, "T": 2**40, "TB": 10**12, "TIB": 2**40}


def parse_bytes(text: str | int) -> int:
    """'8GiB', '512M', '1.5GB' or an int -> bytes."""

    if isinstance(text, int) and not isinstance(text, bool):
        if text <= 0:
            raise ConfigError(f"memory budget must be positive, got {text}")
        return text
    s = str(text).strip().upper().replace(" ", "")
    num = s.rstrip("KMGTIB")
    unit = s[len(num):]
    try:
        value = float(num)
    except ValueError:
        raise ConfigError(f"cannot read memory size {text!r} (e.g. 8GiB, 512MB)") from None
    if unit not in _UNITS or not value > 0:        # `not >`: NaN is refused too
        raise ConfigError(f"cannot read memory size {text!r} (e.g. 8GiB, 512MB)")
    size = value * _UNITS[unit]
    if not math.isfinite(size) or size < 1:
        raise ConfigError(f"memory size {text!r} must be from 1 byte to a finite size (e.g. 8GiB, 512MB)")
    return int(size)


def format_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


# ---------------------------------------------------------------- buffer reuse

ALIGN = 64


def _owner(t: Tensor) -> Tensor:
    return t.view_src if t.view_src is not None else t


def owns_buffer(node: Tensor) -> bool:
    """Nodes that need memory of their own (views, CPY and SET_ROWS write into their source)."""
    return node.view_src is None


def assign_offsets(plan: Plan, d: int, itemsize: Callable[[Tensor], int],
                   keep: set[Tensor] | None = None,
                   live_until: dict[Tensor, int] | None = None,
                   born_at: dict[Tensor, int] | None = None) -> tuple[dict[Tensor, int], int]:
    """Offsets of every buffer-owning node of device d in one arena, reusing dead buffers.

    A buffer lives from its node until the last node that reads it or any view of it; graph
    outputs and `keep` live to the end, `live_until` extends chosen buffers, and `born_at` starts
    chosen ones at an earlier node (outputs a fusion writes at its position, before their own).
    A node's output is placed before its dying inputs are freed, so no kernel ever writes over
    memory it still reads. Best-fit over a free list, like ggml-alloc. Returns (offsets, arena
    size)."""
    nodes = plan.graph.nodes
    keep = set(keep or ()) | {_owner(t) for t in plan.graph.outputs}
    last: dict[Tensor, int] = {}
    for i, n in enumerate(nodes):
        for s in n.src:
            if s is not None:
                last[_owner(s)] = i
        if n.view_src is not None:
            last[n.view_src] = max(last.get(n.view_src, -1), i)
    for t, i in (live_until or {}).items():      # callers that read a buffer late (shared mirrored nodes)
        last[t] = max(last.get(t, -1), i)
    dying: dict[int, list[Tensor]] = {}
    for t, i in last.items():
        if t.op is not Op.NONE and t not in keep:
            dying.setdefault(i, []).append(t)
    born_at = born_at or {}
    early: dict[int, list[Tensor]] = {}
    for t, i in born_at.items():
        early.setdefault(i, []).append(t)
    free: list[tuple[int, int]] = []          # (offset, size)
    offsets: dict[Tensor, int] = {}
    sizes: dict[Tensor, int] = {}
    top = 0
    for i, n in enumerate(nodes):
        for t in ([n] if owns_buffer(n) and n not in born_at else []) + early.get(i, []):
            size = -(-max(_nelements(plan.of(t).local[d].ne) * itemsize(t), 1) // ALIGN) * ALIGN
            best = None
            for k, (off, sz) in enumerate(free):
                if sz >= size and (best is None or sz < free[best][1]):
                    best = k
            if best is None:
                offsets[t] = top
                top += size
            else:
                off, sz = free.pop(best)
                offsets[t] = off
                if sz > size:
                    free.append((off + size, sz - size))
            sizes[t] = size
        for t in dying.get(i, ()):
            if t in offsets:
                free.append((offsets[t], sizes[t]))
        if len(free) > 1:
            free = _coalesce(free)
    return offsets, top


def _coalesce(free: list[tuple[int, int]]) -> list[tuple[int, int]]:
    free.sort()
    out = [free[0]]
    for off, sz in free[1:]:
        o, s = out[-1]
        if o + s == off:
            out[-1] = (o, s + sz)
        else:
            out.append((off, sz))
    return out
