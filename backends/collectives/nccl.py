"""The all-reduce between GPU ranks: NCCL, bootstrapped over MPI (one GPU per local rank).

MPI starts the processes and carries the one thing NCCL cannot make alone: rank 0 draws
`nccl.get_unique_id()` and broadcasts it; every rank then joins `NcclCommunicator(n, uid, rank)`
on the GPU of its local rank. Sums run on the device, on the caller's stream (so they can sit
inside a captured CUDA graph: ncclAllReduce is capturable since NCCL 2.9). The wire is FP32,
or BF16 above llama.cpp's element thresholds (`wire.wire_dtype`): a BF16 reduction casts
in, reduces, and casts back (round to nearest even), halving the bytes of large prefill
tensors at a cost in exactness; decode vectors stay FP32.

Split values (the vocabulary-split logits) are read on the host, so `allgather` goes over MPI
(`MpiCollective`) rather than NCCL.

Never ran on a GPU in this repository's CI (no GPU there); `tests/test_mpi.py` runs it under
`mpiexec` where cupy sees GPUs and skips otherwise.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from metatp.backends.collectives.base import Group, Step
from metatp.backends.collectives.wire import WireThresholds, wire_dtype
from metatp.ir.errors import BackendUnavailableError, ConfigError

__all__ = ["nccl_unique_id", "local_gpu", "NcclCollective"]

# bf16 round-to-nearest-even and back, as raw uint16 bits (cupy has no bfloat16 dtype)
_TO_BF16 = ("float32 x", "uint16 y",
            "unsigned int u = __float_as_uint(x);"
            "y = (u & 0x7fffffff) > 0x7f800000 ? (unsigned short)((u >> 16) | 0x40)"
            " : (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);", "metatp_to_bf16")
_FROM_BF16 = ("uint16 y", "float32 x", "x = __uint_as_float(((unsigned int)y) << 16);", "metatp_from_bf16")


def _nccl():
    """cupy's NCCL bindings, or a BackendUnavailableError saying what is missing."""
    try:
        import cupy
        from cupy.cuda import nccl
    except ImportError as e:
        raise BackendUnavailableError(f"NCCL between GPU ranks needs cupy with NCCL ({e}); "
                                      'pip install "metatp[cuda]" and nvidia-nccl-cu12') from None
    if not getattr(nccl, "available", True):
        raise BackendUnavailableError("cupy was built without NCCL: pip install nvidia-nccl-cu12")
    return cupy, nccl


def nccl_unique_id(comm: Any) -> bytes:
    """Rank 0's `nccl.get_unique_id()` on every rank (MPI bcast): the id NCCL ranks meet by
    (128 bytes; cupy < 14 gave a tuple of ints, which travels the same way)."""
    uid = None
    if comm.Get_rank() == 0:
        _, nccl = _nccl()
        uid = nccl.get_unique_id()
    return comm.bcast(uid, root=0)


def local_gpu(comm: Any) -> int:
    """The GPU this rank drives: its index among the ranks on its machine. More ranks on one
    machine than GPUs is an error (NCCL refuses two ranks on one GPU)."""
    from mpi4py import MPI

    cupy, _ = _nccl()
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    local, n_local = node.Get_rank(), node.Get_size()
    node.Free()
    try:
        n_gpus = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:          # no driver, or no device: cupy's CUDARuntimeError
        raise BackendUnavailableError(f"NCCL between GPU ranks: no CUDA GPU is visible here ({e})") from None
    if n_gpus == 0:
        raise BackendUnavailableError("NCCL between GPU ranks: no CUDA GPU is visible here")
    if n_local > n_gpus:
        raise ConfigError(f"{n_local} ranks on this machine but {n_gpus} GPU(s): run one rank per GPU "
                          f"(mpiexec -n {n_gpus} per machine, e.g. with a hostfile)")
    return local


class NcclCollective:
    """ncclAllReduce between GPU ranks; this rank owns device `comm.rank` of the group.

    `wire`: "f32", "bf16" or "auto" (BF16 above the thresholds). `stream`: the cupy stream the
    steps run on (default: the current one when the step is prepared)."""

    name = "nccl"

    def __init__(self, comm: Any, wire: str = "f32", thresholds: WireThresholds = WireThresholds(),
                 gpu: int | None = None) -> None:
        cupy, nccl = _nccl()
        self._cupy, self._nccl = cupy, nccl
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.group = Group(tuple(range(self.size)), (self.rank,))
        self.wire, self.thresholds = wire, thresholds
        self.gpu = local_gpu(comm) if gpu is None else gpu
        cupy.cuda.Device(self.gpu).use()
        uid = nccl_unique_id(comm)
        self.nccl = nccl.NcclCommunicator(self.size, uid, self.rank)
        self._to_bf16 = self._from_bf16 = None
        self._host = None

    def _casts(self):
        if self._to_bf16 is None:
            ek = self._cupy.ElementwiseKernel
            self._to_bf16, self._from_bf16 = ek(*_TO_BF16), ek(*_FROM_BF16)
        return self._to_bf16, self._from_bf16

    def prepare_allreduce(self, bufs: Sequence[Any], active: Sequence[bool] | None = None, stream=None) -> Step:
        """One step on `stream`: zero this rank's buffer if it computed nothing, then sum in place
        (through a BF16 copy above the wire threshold)."""
        cupy, nccl = self._cupy, self._nccl
        if len(bufs) != 1:
            raise ConfigError(f"the NCCL collective drives one GPU per rank, got {len(bufs)} local buffers")
        buf = bufs[0]
        if buf.dtype != np.float32 or not buf.flags.c_contiguous:
            raise ConfigError(f"the NCCL all-reduce sums contiguous float32 buffers, got {buf.dtype}")
        if active is not None and len(active) != self.size:
            raise ValueError(f"active has {len(active)} entries for a group of {self.size} ranks")
        on = True if active is None else bool(active[self.rank])
        st = stream if stream is not None else cupy.cuda.get_current_stream()
        n, comm = buf.size, self.nccl
        if n == 0:
            return lambda: None
        if wire_dtype(self.size, n, self.wire, self.thresholds) == "bf16":
            to_bf16, from_bf16 = self._casts()
            half = cupy.empty(n, cupy.uint16)
            flat = buf.reshape(-1)

            def step_bf16() -> None:
                with st:
                    if not on:
                        buf.fill(0)
                    to_bf16(flat, half)
                    comm.allReduce(half.data.ptr, half.data.ptr, n, nccl.NCCL_BFLOAT16, nccl.NCCL_SUM, st.ptr)
                    from_bf16(half, flat)
            return step_bf16

        def step() -> None:
            with st:
                if not on:
                    buf.fill(0)
                comm.allReduce(buf.data.ptr, buf.data.ptr, n, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, st.ptr)
        return step

    def allreduce(self, bufs: Sequence[Any], active: Sequence[bool] | None = None) -> None:
        self.prepare_allreduce(bufs, active)()
        self._cupy.cuda.get_current_stream().synchronize()

    def allgather(self, local: Sequence[np.ndarray], counts: Sequence[int]) -> list[np.ndarray]:
        """Host slices from every rank (logits are read on the host): over MPI."""
        if self._host is None:
            from metatp.backends.collectives.mpi import MpiCollective

            self._host = MpiCollective(self.comm)
        return self._host.allgather(local, counts)

    def close(self) -> None:
        """Free the NCCL communicator (before MPI_Finalize)."""
        if self.nccl is not None:
            self.nccl.destroy()
            self.nccl = None
