"""The leaf store every backend keeps: per owned device, the stored value of each persistent
leaf (weights and the KV cache), and which devices this process owns.

A backend supplies what a buffer is (`new_leaf`: zero-filled memory of a leaf's local shape;
`zero_leaf`: clear one in place); the store decides which devices hold what, and counts it.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any, Sequence

from metatp.ir.errors import ConfigError, MemoryPlanError
from metatp.ir.tensor import Flag, Tensor
from metatp.passes.plan import Plan

__all__ = ["owned_devices", "LeafStore"]


def owned_devices(n: int, devices: Sequence[int] | None, collective: Any, spanning: str) -> list[int]:
    """The layout's devices this process owns (all by default); a strict subset needs a
    collective spanning the other processes (`spanning` names the one to use)."""
    owned = list(range(n)) if devices is None else sorted(int(d) for d in devices)
    if not owned or len(set(owned)) != len(owned) or not all(0 <= d < n for d in owned):
        raise ConfigError(f"devices={list(devices or [])}: must be distinct device indices of 0..{n - 1}")
    if len(owned) < n and collective is None:
        raise ConfigError(f"this process owns devices {owned} of {n}: the all-reduce needs a collective "
                          f"spanning the other processes ({spanning})")
    return owned


class LeafStore:
    """`leaf[d][t]`: device d's stored value of leaf t, for the devices in `owned` (a part of
    `Backend`, whose `synchronize` it calls)."""

    n: int
    owned: list[int]
    leaf: list[dict[Tensor, Any]]

    def init_store(self, n: int, owned: list[int]) -> None:
        self.n = n
        self.owned = owned
        self.leaf = [{} for _ in range(n)]

    @abstractmethod
    def new_leaf(self, d: int, t: Tensor, ne: tuple[int, ...]) -> Any:
        """Zero-filled memory on device d for leaf `t` of local shape `ne` (the KV cache)."""

    @abstractmethod
    def zero_leaf(self, d: int, value: Any) -> None:
        """Overwrite device d's stored value with zeros (queued work is fine: `reset_kv` waits)."""

    def has(self, t: Tensor) -> bool:
        """Is leaf `t` (a weight or the KV cache) stored?"""
        return t in self.leaf[self.owned[0]]

    def allocate_leaf(self, t: Tensor, plan: Plan) -> None:
        """Zero-filled per-device buffers for a persistent leaf (the KV cache)."""
        tp = plan.of(t)
        for d in self.owned:
            try:
                self.leaf[d][t] = self.new_leaf(d, t, tuple(tp.local[d].ne))
            except MemoryError:     # the plan fitted a budget this machine does not have
                raise MemoryPlanError(f"device {d}: cannot allocate {t.name} (ne {list(tp.local[d].ne)}): "
                                      "the memory budget is larger than the memory this machine can give; lower "
                                      "n_ctx or the memory budget") from None

    def reset_kv(self) -> None:
        """Zero the KV cache (a new sequence starts)."""
        for d in self.owned:
            for t, a in self.leaf[d].items():
                if t.flags & Flag.KV_CACHE:
                    self.zero_leaf(d, a)
        self.synchronize()  # type: ignore[attr-defined] - the Backend's

    def leaf_bytes(self) -> list[int]:
        """Bytes of the stored leaves per device."""
        return [sum(int(a.nbytes) for a in self.leaf[d].values()) for d in range(self.n)]
