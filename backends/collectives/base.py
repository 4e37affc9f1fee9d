"""The collective interface an executor calls between subgraphs.

An executor binds buffers once (when a Plan is prepared) and runs the returned step on every
forward pass, so the interface is "prepare, then call": a runner can resolve pointers, pick a
compiled path and allocate temporaries up front. Buffers are given per device of a `Group`
that this process drives: all of them when devices are simulated in one process (numpy, CuPy's
devices in one process), one when a process drives one device (`mpi.MpiCollective`; GPU ranks:
`cuda.nccl.NcclCollective`). This package is device-independent: device collectives live with
their backend and implement `Collective` there (`cuda.collective.DeviceCollective`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence, runtime_checkable

__all__ = ["Step", "Group", "Collective", "AllGather"]

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
    same bits.

    `stream`: where a device collective issues the step (a GPU rank's device stream, so the
    call is captured with the kernels); host collectives take None and ignore it."""

    name: str

    def prepare_allreduce(self, bufs: Sequence[Any], active: Sequence[bool] | None = None,
                          stream: Any = None) -> Step:
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
