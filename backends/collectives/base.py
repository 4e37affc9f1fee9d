"""The collective interface an executor calls between subgraphs.

An executor binds buffers once (when a Plan is prepared) and runs the returned step on every
forward pass, so the interface is "prepare, then call": a runner can resolve pointers, pick a
compiled path and allocate temporaries up front. Buffers are given per device of a `Group`
that this process drives: all of them when devices are simulated in one process (numpy, CuPy's
virtual devices), one when a process drives one device (`mpi.MpiCollective`, `nccl.NcclCollective`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

__all__ = ["Step", "Group", "Collective", "AllGather", "PointToPoint"]

Step = Callable[[], None]


@dataclass(frozen=True)
class Group:
    """The devices one collective spans, in schedule order (ring order for the ring), and the
    ones this process drives (None: all of them, in one process)."""

    devices: tuple[int, ...]
    local: tuple[int, ...] | None = None

    @property
    def size(self) -> int:
        return len(self.devices)

    @property
    def all_local(self) -> bool:
        return self.local is None or tuple(self.local) == tuple(self.devices)


@runtime_checkable
class Collective(Protocol):
    """Sums a buffer in place across the devices of a group.

    `bufs[i]` is device `group.devices[i]`'s buffer (only the local ones, in `group.local`
    order, when not all are); every buffer has the same shape and dtype. `active` has one
    entry per device of the group even when only some buffers are local: `active[i]` False
    means device `group.devices[i]` computed nothing: its buffer may hold garbage (NaN),
    contributes zeros and is overwritten with the sum. After the step every device holds the
    same bits."""

    name: str

    def prepare_allreduce(self, bufs: Sequence[Any], active: Sequence[bool] | None = None) -> Step:
        ...


@runtime_checkable
class AllGather(Protocol):
    """Every device's slice of a tensor, on every process: how a process that owns some devices
    reads a split value whole (the vocabulary-split logits). Only a collective spanning several
    processes needs it; in one process the executor reads every device's buffer itself."""

    def allgather(self, local: Sequence[Any], counts: Sequence[int]) -> list[Any]:
        """`local`: this process's devices' slices (`group.local` order); `counts[i]`: elements
        of device `group.devices[i]`'s slice. Returns every device's slice, flat, in group order."""
        ...


@runtime_checkable
class PointToPoint(Protocol):
    """Send/receive between two devices, for layer split (each device runs a range of layers
    and hands the residual stream to the next). Interface only: no backend implements it yet.

    A send and its matching receive are prepared on their own devices (possibly in different
    processes); the pair completes when both steps have run, in either order."""

    def prepare_send(self, buf: Any, peer: int) -> Step:
        ...

    def prepare_recv(self, buf: Any, peer: int) -> Step:
        ...
