"""The all-reduce between processes: MPI itself (one process per device, CPU ranks).

Each rank owns device `rank` of the group and holds only its buffer; the sum is one
`MPI_Allreduce` in place, float32 on the wire (latency-bound decode vectors gain nothing from
BF16, and FP32 keeps the reduction exact to float rounding). A rank whose slice was empty
(`active` False for it) fills its buffer with zeros first: it may hold garbage, even NaN.

MPI's own algorithm (recursive doubling / reduce-scatter + all-gather in MPICH and Open MPI)
gives every rank the same bits, as the `Collective` contract asks; the order of the additions
may differ from the in-process butterfly's, so results match the simulated run to float
rounding, not bit for bit.

Under -sm layer nothing is all-reduced: the copies between the ranks' devices are `send_recv`
(`p2p.MpiSendRecv`, on its own duplicate of the communicator), made here so that every rank
makes it at the same point. Under -sm layer,tensor each stage's tensor group all-reduces on a
communicator of its own (`split_groups`: one MPI_Comm_split, every rank at the same point; a
group's collective is `for_devices`).
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import numpy as np

from metatp.backends.collectives.base import Collective, Group, Step
from metatp.backends.collectives.p2p import MpiSendRecv
from metatp.ir.errors import ConfigError

__all__ = ["MpiCollective"]


class MpiCollective(Collective):
    """Allreduce / Allgatherv over an mpi4py communicator; this rank owns device `comm.rank`.

    Implements `Collective` and `AllGather` for a group of one device per rank; `send_recv` is
    its `p2p.SendRecv` (the copies of a layer split)."""

    name = "mpi"

    def __init__(self, comm: Any) -> None:
        from mpi4py import MPI

        self._mpi = MPI
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.group = Group(tuple(range(self.size)), (self.rank,))
        # all-reduces run and their wall time on this rank: each step from its zero fill / staging
        # copy to the end of MPI_Allreduce, so waiting for the slowest rank counts (`metatp bench`
        # under mpiexec reports seconds / calls); allgather is not counted
        self.calls = 0
        self.seconds = 0.0
        self.send_recv = MpiSendRecv(comm)
        self.groups: dict[tuple[int, ...], MpiCollective] = {}

    def _local_flag(self, active: Sequence[bool] | None) -> bool:
        if active is None:
            return True
        if len(active) != self.size:
            raise ValueError(f"active has {len(active)} entries for a group of {self.size} ranks")
        return bool(active[self.rank])

    def prepare_allreduce(self, bufs: Sequence[np.ndarray], active: Sequence[bool] | None = None,
                          stream: Any = None) -> Step:
        """One step: zero this rank's buffer if it computed nothing, then Allreduce in place.
        A non-contiguous buffer (a strided view) is staged through a contiguous copy (`stream`:
        unused, host buffers)."""
        if len(bufs) != 1:
            raise ConfigError(f"the MPI collective drives one device per rank, got {len(bufs)} local buffers")
        buf = bufs[0]
        if buf.dtype != np.float32:
            raise ConfigError(f"the MPI all-reduce sums float32 buffers, got {buf.dtype}")
        on = self._local_flag(active)
        MPI, comm = self._mpi, self.comm
        if buf.size == 0 or self.size == 1:
            return (lambda: None) if on or buf.size == 0 else (lambda: buf.fill(0))
        staged = not buf.flags.c_contiguous
        work = np.empty(buf.shape, np.float32) if staged else buf

        clock = time.perf_counter

        def step() -> None:
            t0 = clock()
            if not on:
                work.fill(0)
            elif staged:
                np.copyto(work, buf)
            comm.Allreduce(MPI.IN_PLACE, work, op=MPI.SUM)
            if staged:
                np.copyto(buf, work)
            self.calls += 1
            self.seconds += clock() - t0
        return step

    def allreduce(self, bufs: Sequence[np.ndarray], active: Sequence[bool] | None = None) -> None:
        self.prepare_allreduce(bufs, active)()

    def split_groups(self, groups: Sequence[Sequence[int]]) -> None:
        """A communicator per group of ranks (disjoint; ranks in group order), by one
        Comm.Split that every rank calls at the same point. Its collective: `for_devices`."""
        key = tuple(tuple(int(r) for r in g) for g in groups)
        if all(g in self.groups for g in key):
            return
        mine = [i for i, g in enumerate(key) if self.rank in g]
        color = mine[0] if mine else self._mpi.UNDEFINED
        sub = self.comm.Split(color, key=key[mine[0]].index(self.rank) if mine else 0)
        for i, g in enumerate(key):
            self.groups[g] = _GroupCollective(sub, self) if i in mine else _Elsewhere(g)

    def for_devices(self, devices: Sequence[int]) -> Any:
        """The collective of one group made by `split_groups` (a ConfigError for any other set)."""
        group = tuple(int(d) for d in devices)
        if group == tuple(range(self.size)):
            return self
        if group not in self.groups:
            raise ConfigError(f"no communicator for ranks {list(group)}: split_groups makes them at start "
                              f"(made: {[list(g) for g in self.groups]})")
        return self.groups[group]

    def allgather(self, local: Sequence[np.ndarray], counts: Sequence[int]) -> list[np.ndarray]:
        """Every rank's slice (flat, rank order) on every rank, by one Allgatherv."""
        if len(local) != 1 or len(counts) != self.size:
            raise ValueError(f"allgather: {len(local)} local slices and {len(counts)} counts for {self.size} ranks")
        mine = np.ascontiguousarray(local[0]).reshape(-1)
        counts = [int(c) for c in counts]
        if mine.size != counts[self.rank]:
            raise ValueError(f"allgather: rank {self.rank} holds {mine.size} elements, counts say {counts[self.rank]}")
        displs = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(int).tolist()
        out = np.empty(sum(counts), mine.dtype)
        mpi_type = self._mpi._typedict[mine.dtype.char]
        self.comm.Allgatherv(mine, [out, counts, displs, mpi_type])
        return [out[d:d + c] for d, c in zip(displs, counts)]


class _GroupCollective(MpiCollective):
    """One tensor group's all-reduce on its own communicator; its calls and seconds also count
    on the world's collective (what `metatp bench` reports under mpiexec)."""

    def __init__(self, comm: Any, world: MpiCollective) -> None:
        super().__init__(comm)
        self.world = world

    def prepare_allreduce(self, bufs: Sequence[np.ndarray], active: Sequence[bool] | None = None,
                          stream: Any = None) -> Step:
        step, world = super().prepare_allreduce(bufs, active, stream), self.world

        def counted() -> None:
            calls, seconds = self.calls, self.seconds
            step()
            world.calls += self.calls - calls
            world.seconds += self.seconds - seconds
        return counted


class _Elsewhere(Collective):
    """A group this rank is not in: it never prepares that group's all-reduce."""

    name = "mpi"

    def __init__(self, group: tuple[int, ...]) -> None:
        self.group = group

    def prepare_allreduce(self, bufs, active=None, stream=None) -> Step:
        raise ValueError(f"this rank is not in the group of ranks {list(self.group)}")
