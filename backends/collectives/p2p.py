"""Copies between processes: one process per device under -sm layer.

A layer plan hands a value (the residual stream at a device boundary) from the device that
computed it to the next one (`passes.plan.Transfer`). In one process that is a copy between two
buffers (`PlanExecutor.transfer_step`); when the two devices belong to different processes it
is a send on the source's process and a receive on the destination's (`SendRecv`), prepared
once per plan like the all-reduce. The receiver knows shape and dtype from the plan: its own
buffer of the value is the receive buffer.

Every process walks the same plan in the same order, and each copy is a pair (one sender, one
receiver) posted in that order on both sides, so blocking sends and receives cannot deadlock:
the earliest copy not done yet has both its ends waiting on it. The copies travel on a
duplicate of the world communicator, apart from the all-reduces and rank 0's posts.

`broadcast` gives a value only one process holds (the logits, on the last layer's device) to
every process, as `AllGather` does for a vocabulary-split one.

Pipelined steps (`metatp.pipeline`) run several passes back to back; there a send must not hold
its rank until the next stage takes it, so inside `deferred_sends` a send is an `Isend` whose
request (and staging copy) is kept until `complete_sends`, which the pipeline calls before any
sent buffer can be written again. The order of posts is unchanged, so the pairing above holds.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Iterator, Protocol, runtime_checkable

import numpy as np

from metatp.backends.collectives.base import Step

__all__ = ["SendRecv", "MpiSendRecv"]


@runtime_checkable
class SendRecv(Protocol):
    """Point-to-point copies between the devices of processes (device d is driven by process d).

    Implementations subclass this class; `defers_sends` declares whether `deferred_sends` makes
    sends non-blocking (default: no, and `deferred_sends` changes nothing)."""

    #: can sends be deferred (`deferred_sends`), so that passes pipeline (`metatp.pipeline`)?
    defers_sends: bool = False

    def prepare_send(self, buf: Any, dst: int) -> Step:
        """A step sending this device's `buf` to device `dst` (which runs the matching receive)."""
        ...

    def prepare_recv(self, buf: Any, src: int) -> Step:
        """A step receiving device `src`'s value into `buf` (same shape and dtype as the sender's)."""
        ...

    def broadcast(self, buf: Any, root: int) -> None:
        """Device `root`'s `buf` into every process's `buf` (same shape and dtype everywhere)."""
        ...

    @contextmanager
    def deferred_sends(self) -> Iterator[None]:
        """Inside: sends do not wait for their receivers, and are all complete on leaving (the
        default: sends block anyway, so nothing changes)."""
        yield


class MpiSendRecv(SendRecv):
    """`SendRecv` over MPI: `Send` / `Recv` of host buffers on a duplicate of `comm` (rank = device).

    `calls` / `seconds` / `bytes` count the copies run and the wall time spent in them on this
    process (a receive includes waiting for the sender); `recv_seconds` is the part spent in
    receives and `bcast_seconds` the time in `broadcast` (both mostly waiting for the stage
    before: the pipeline bubble, `metatp.tools.pipeline_bench`)."""

    TAG = 0x6C70      # the tag of layer-split copies (on the duplicated communicator)
    defers_sends = True

    def __init__(self, comm: Any) -> None:
        self.comm = comm.Dup()          # collective: every rank makes its collective at the same point
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.calls = 0
        self.seconds = 0.0
        self.bytes = 0
        self.recv_seconds = 0.0
        self.bcast_seconds = 0.0
        self.deferred = False               # sends are Isends until complete_sends (deferred_sends)
        self._pending: list[tuple[Any, np.ndarray]] = []

    def _peer(self, d: int, what: str) -> int:
        if not 0 <= d < self.size or d == self.rank:
            raise ValueError(f"{what}: device {d} is not another rank of a world of {self.size}")
        return int(d)

    def prepare_send(self, buf: np.ndarray, dst: int) -> Step:
        """Send `buf` to rank `dst`; a strided buffer goes through a contiguous copy."""
        peer, comm, clock = self._peer(dst, "send"), self.comm, time.perf_counter
        tag, nbytes = self.TAG, buf.nbytes

        def step() -> None:
            t0 = clock()
            if self.deferred:       # the data (or its contiguous copy) must live until the Isend completes
                data = np.ascontiguousarray(buf)
                self._pending.append((comm.Isend(data, dest=peer, tag=tag), data))
            else:
                comm.Send(np.ascontiguousarray(buf), dest=peer, tag=tag)
            self.calls += 1
            self.bytes += nbytes
            self.seconds += clock() - t0
        return step

    def prepare_recv(self, buf: np.ndarray, src: int) -> Step:
        """Receive rank `src`'s value into `buf` (a strided buffer: into a contiguous one, then copied)."""
        peer, comm, clock = self._peer(src, "receive"), self.comm, time.perf_counter
        tag, nbytes = self.TAG, buf.nbytes
        staged = not buf.flags.c_contiguous
        work = np.empty(buf.shape, buf.dtype) if staged else buf

        def step() -> None:
            t0 = clock()
            comm.Recv(work, source=peer, tag=tag)
            if staged:
                np.copyto(buf, work)
            self.calls += 1
            self.bytes += nbytes
            took = clock() - t0
            self.seconds += took
            self.recv_seconds += took
        return step

    @contextmanager
    def deferred_sends(self) -> Iterator[None]:
        """Sends posted inside are non-blocking; every one is complete when the block ends
        (also when it raises: a buffer is never rewritten under a pending send)."""
        self.deferred = True
        try:
            yield
        finally:
            self.deferred = False
            self.complete_sends()

    def complete_sends(self) -> None:
        """Wait for every pending Isend (each completes once its receiver has posted the receive)."""
        pending, self._pending = self._pending, []
        if pending:
            t0 = time.perf_counter()
            type(pending[0][0]).Waitall([req for req, _ in pending])
            self.seconds += time.perf_counter() - t0

    def broadcast(self, buf: np.ndarray, root: int) -> None:
        """Rank `root`'s `buf` on every rank, by one MPI_Bcast (in place where contiguous)."""
        t0 = time.perf_counter()
        if not buf.flags.c_contiguous:
            work = np.ascontiguousarray(buf)
            self.comm.Bcast(work, root=int(root))
            np.copyto(buf, work)
        else:
            self.comm.Bcast(buf, root=int(root))
        self.bcast_seconds += time.perf_counter() - t0
