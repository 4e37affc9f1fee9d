"""The collective interface an executor calls between subgraphs.

An executor binds buffers once (when a Plan is prepared) and runs the returned step on every
forward pass, so the interface is "prepare, then call": a runner can resolve pointers, pick a
compiled path and allocate temporaries up front. Buffers are given per device of a `Group`
that this process drives: all of them when devices are simulated in one process (numpy, CuPy's
devices in one process), one when a process drives one device (`mpi.MpiCollective`; GPU ranks:
`cuda.nccl.NcclCollective`). This package is device-independent: device collectives live with
their backend and implement `Collective` there (`cuda.collective.DeviceCollective`).

Besides the all-reduce, a collective declares what else it can do, with defaults meaning "not
supported" (every collective subclasses `Collective`, so the executor and the engine read
these instead of probing): `for_devices` (a collective over a subset of its devices, the stage
groups of -sm layer,tensor) and `send_recv` (point-to-point copies between processes, -sm layer
across processes; `p2p.SendRecv`, which declares whether its sends can be deferred).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence, runtime_checkable

if TYPE_CHECKING:
    from metatp.backends.collectives.p2p import SendRecv

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
    call is captured with the kernels); host collectives take None and ignore it.

    Implementations subclass this class and so inherit the capability defaults below."""

    name: str
    #: point-to-point copies between this process's devices and the others' (-sm layer across
    #: processes), or None: this collective has none
    send_recv: SendRecv | None = None

    def prepare_allreduce(self, bufs: Sequence[Any], active: Sequence[bool] | None = None,
                          stream: Any = None) -> Step:
        ...

    def for_devices(self, devices: Sequence[int]) -> Collective | None:
        """The collective summing over `devices` only (-sm layer,tensor: one stage's tensor
        group); None: this collective cannot sum over a subset (the default)."""
        return None


@runtime_checkable
class AllGather(Protocol):
    """Every device's slice of a tensor, on every process: how a process that owns some devices
    reads a split value whole (the vocabulary-split logits). Only a collective spanning several
    processes needs it; in one process the executor reads every device's buffer itself."""

    def allgather(self, local: Sequence[Any], counts: Sequence[int]) -> list[Any]:
        """`local`: this process's devices' slices (`group.local` order); `counts[i]`: elements
        of device `group.devices[i]`'s slice. Returns every device's slice, flat, in group order."""
        ...
