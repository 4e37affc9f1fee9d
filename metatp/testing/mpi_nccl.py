"""A stand-in for `cupy.cuda.nccl.NcclCommunicator` that really reduces over MPI (tests only).

With `EmuRuntime` device memory is host memory, so a rank's "device pointer" can be read and
written on the host: `MpiNcclComm.allReduce(sendbuf, recvbuf, count, datatype, op, stream)`
takes exactly cupy's arguments, reads `count` elements at `sendbuf`, sums them over
`MPI.COMM_WORLD` and writes the sum at `recvbuf`. Under `mpiexec -n N` the cupy backend on the
emulator then runs the real multi-process wiring: the unique id drawn by rank 0 and broadcast
over MPI (every rank must hold the same bytes, or the stand-in refuses, as NCCL would hang),
one GPU per local rank, the buffer pointers and the stream the backend hands to NCCL.

What it records (`calls`, `streams`) lets a test check those arguments. It is not NCCL: no
rings or trees, no device memory, no asynchrony (the sum happens when the emulator runs the
work, in issue order, also when a captured graph is replayed).
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from metatp.ir.dtypes import bf16_bits_to_f32, f32_to_bf16_bits

__all__ = ["MpiNcclComm", "NCCL_FLOAT32", "NCCL_BFLOAT16", "NCCL_SUM", "fake_unique_id"]

# cupy.cuda.nccl's constants (nccl.h: ncclFloat32 = 7, ncclBfloat16 = 9, ncclSum = 0)
NCCL_FLOAT32, NCCL_BFLOAT16, NCCL_SUM = 7, 9, 0
NCCL_FLOAT16 = 6
_ITEMSIZE = {NCCL_FLOAT16: 2, NCCL_FLOAT32: 4, NCCL_BFLOAT16: 2}


def fake_unique_id() -> bytes:
    """128 random bytes, the size of a real `ncclUniqueId`."""
    import os

    return os.urandom(128)


class MpiNcclComm:
    """One rank of an n-rank "NCCL" communicator over MPI, met by unique id: the ranks holding
    one id form it (a split of MPI.COMM_WORLD by the id, so every rank of the world must make
    its communicator at the same point, as -sm layer,tensor's groups do; ranks in id order)."""

    def __init__(self, n_ranks: int, uid: Any, rank: int, comm: Any = None) -> None:
        self.n_ranks, self.rank = int(n_ranks), int(rank)
        uid = bytes(uid)
        if len(uid) != 128:
            raise ValueError(f"NCCL unique id of {len(uid)} bytes (want 128)")
        if comm is None:
            from mpi4py import MPI

            comm = MPI.COMM_WORLD.Split(int.from_bytes(uid[:3], "little"), key=self.rank)
        self.comm = comm
        seen = comm.allgather((uid, self.n_ranks, self.rank))
        if any(u != uid for u, _, _ in seen):
            raise RuntimeError("ranks hold different NCCL unique ids (the broadcast over MPI did not happen)")
        if sorted(r for _, _, r in seen) != list(range(self.n_ranks)) or any(n != self.n_ranks for _, n, _ in seen):
            raise RuntimeError(f"NCCL ranks {[r for _, _, r in seen]} / sizes do not form a group of {self.n_ranks}")
        self.calls: list[tuple[int, int, int, int, int, int]] = []
        self.p2p: list[tuple[str, int, int, int, int]] = []    # (send|recv, peer, count, type, stream)
        self.streams: set[int] = set()
        self.destroyed = False

    def allReduce(self, sendbuf: int, recvbuf: int, count: int, datatype: int, op: int,  # noqa: N802 - cupy's name
                  stream: int) -> None:
        """Sum `count` elements at `sendbuf` over the ranks into `recvbuf` (host addresses)."""
        if self.destroyed:
            raise RuntimeError("allReduce on a destroyed communicator")
        if op != NCCL_SUM or datatype not in (NCCL_FLOAT32, NCCL_BFLOAT16):
            raise ValueError(f"stand-in NCCL sums float32 / bfloat16 only (datatype {datatype}, op {op})")
        if not isinstance(stream, int) or isinstance(stream, bool):
            raise TypeError(f"stream must be a raw stream handle (int), got {type(stream).__name__}")
        self.calls.append((int(sendbuf), int(recvbuf), int(count), int(datatype), int(op), int(stream)))
        self.streams.add(stream)
        from mpi4py import MPI

        bf16 = datatype == NCCL_BFLOAT16
        src = _host_view(sendbuf, count, np.uint16 if bf16 else np.float32)
        vals = bf16_bits_to_f32(src) if bf16 else np.array(src, copy=True)
        total = np.empty_like(vals)
        self.comm.Allreduce(vals, total, op=MPI.SUM)
        dst = _host_view(recvbuf, count, np.uint16 if bf16 else np.float32)
        dst[...] = f32_to_bf16_bits(total) if bf16 else total

    P2P_TAG = 0x6E63      # the stand-in's point-to-point messages

    def _p2p_check(self, what: str, count: int, datatype: int, peer: int, stream: int) -> int:
        if self.destroyed:
            raise RuntimeError(f"{what} on a destroyed communicator")
        if datatype not in _ITEMSIZE:
            raise ValueError(f"stand-in NCCL {what}: datatype {datatype} (float16 / bfloat16 / float32 only)")
        if not isinstance(stream, int) or isinstance(stream, bool):
            raise TypeError(f"stream must be a raw stream handle (int), got {type(stream).__name__}")
        if not 0 <= int(peer) < self.n_ranks or int(peer) == self.rank:
            raise ValueError(f"NCCL {what}: peer {peer} is not another rank of {self.n_ranks} (ncclInvalidArgument)")
        self.streams.add(stream)
        return int(count) * _ITEMSIZE[datatype]

    def send(self, sendbuf: int, count: int, datatype: int, peer: int, stream: int) -> None:
        """ncclSend: `count` elements at `sendbuf` to rank `peer` (with their count and type, so
        the receiver can refuse a mismatch NCCL would hang or corrupt on)."""
        nbytes = self._p2p_check("send", count, datatype, peer, stream)
        self.p2p.append(("send", int(peer), int(count), int(datatype), int(stream)))
        data = np.array(_host_view(sendbuf, nbytes, np.uint8), copy=True)
        self.comm.send((int(count), int(datatype)), dest=int(peer), tag=self.P2P_TAG)
        self.comm.Send(data, dest=int(peer), tag=self.P2P_TAG)

    def recv(self, recvbuf: int, count: int, datatype: int, peer: int, stream: int) -> None:
        """ncclRecv: rank `peer`'s `count` elements into `recvbuf` (the same count and type as
        its send, else an error)."""
        nbytes = self._p2p_check("recv", count, datatype, peer, stream)
        self.p2p.append(("recv", int(peer), int(count), int(datatype), int(stream)))
        sent = self.comm.recv(source=int(peer), tag=self.P2P_TAG)
        if sent != (int(count), int(datatype)):
            raise RuntimeError(f"NCCL recv of {count} elements of type {datatype} from rank {peer}, which sent "
                               f"{sent[0]} of type {sent[1]} (a mismatched send/recv pair)")
        data = np.empty(nbytes, np.uint8)
        self.comm.Recv(data, source=int(peer), tag=self.P2P_TAG)
        _host_view(recvbuf, nbytes, np.uint8)[...] = data

    def destroy(self) -> None:
        self.destroyed = True


def _host_view(ptr: int, count: int, dtype) -> np.ndarray:
    n = int(count) * np.dtype(dtype).itemsize
    buf = (ctypes.c_char * max(n, 1)).from_address(int(ptr))
    return np.frombuffer(buf, dtype=dtype, count=int(count))
