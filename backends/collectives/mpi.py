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
makes it at the same point.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import numpy as np

from metatp.backends.collectives.base import Group, Step
from metatp.backends.collectives.p2p import MpiSendRecv
from metatp.ir.errors import ConfigError

__all__ = ["MpiCollective"]


class MpiCollective:
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
