"""NCCL on CUDA devices, both ways a process may drive them.

- `NcclGroup`: the GPUs one process drives (ncclCommInitAll), one grouped call per all-reduce,
  and the per-call fallback to a copy-and-add schedule (`collective.DeviceCollective` runs it).
  NCCL needs every device on its own GPU. Under allreduce="nccl" anything that keeps it from
  working is an error; under "auto" it falls back to the schedule with one warning at set-up,
  and a call that fails at run time falls back for that call (three failures: for good).
- `NcclCollective`: one GPU per MPI rank, NCCL bootstrapped over MPI. MPI starts the processes
  and carries the one thing NCCL cannot make alone: rank 0 draws `nccl.get_unique_id()` and
  broadcasts it; every rank then joins `NcclCommunicator(n, uid, rank)` on the GPU of its local
  rank. Sums run on the device, in place, on the caller's stream (the cupy backend's device
  stream, so they sit inside its captured CUDA graph: ncclAllReduce is capturable since NCCL
  2.9; where capture fails the backend runs the step eagerly). The wire is FP32, or BF16 above
  llama.cpp's element thresholds (`wire.wire_dtype`), converted with the backend's own kernels
  (`wire_cast.wire_steps`, round to nearest even): halving the bytes of large prefill tensors
  at a cost in exactness; decode vectors stay FP32. Split values (the vocabulary-split logits)
  are read on the host, so `allgather` goes over MPI (`MpiCollective`) rather than NCCL.
  Under -sm layer the hidden state goes from rank to rank by ncclSend / ncclRecv on the device
  stream (`send_recv`, `p2p.NcclSendRecv`); under -sm layer,tensor each stage's tensor group
  all-reduces on an NCCL communicator of its own (`split_groups`, `for_devices`).

Every device call goes through a runtime (`runtime.CupyRuntime` by default): tests hand in
`testing.EmuRuntime`, whose communicator stand-in (`testing.mpi_nccl`) sums over MPI, so the
wiring (id broadcast, pointers, stream) runs under `mpiexec` without a GPU. The MPI-rank path
never ran on a GPU (no session had one): see docs/gpu-results.md for what did run.
"""

from __future__ import annotations

import warnings
from typing import Any, Sequence

import numpy as np

from metatp.backends.collectives.base import Collective, Group, Step
from metatp.backends.collectives.wire import WireThresholds, wire_dtype
from metatp.backends.cuda.wire_cast import wire_steps
from metatp.backends.cuda.launch import device_ptr
from metatp.backends.cuda.p2p import NcclSendRecv
from metatp.ir.errors import BackendUnavailableError, CollectiveError, ConfigError, MetatpError

__all__ = ["NcclGroup", "NcclCollective", "nccl_unique_id", "local_gpu", "cupy_runtime"]

_GIVE_UP_AFTER = 3


class NcclGroup:
    """One communicator per device of this process, or none (`comms is None`)."""

    def __init__(self, rt: Any, gpus: Sequence[int], required: bool) -> None:
        self.rt = rt
        self.failures = 0
        self.comms: list | None = None
        n = len(gpus)
        if len(set(gpus)) != n:
            if required:
                raise ConfigError(f"allreduce='nccl' needs {n} distinct GPUs; devices share GPUs "
                                  "(NCCL cannot use one GPU twice): use 'butterfly', 'ring' or 'auto'")
            return
        try:
            self.comms = rt.nccl_comms(list(gpus))
        except Exception as e:  # noqa: BLE001
            if required:
                raise
            warnings.warn(f"NCCL init failed ({type(e).__name__}: {e}); using the copy-and-add all-reduce",
                          stacklevel=4)
            return
        if self.comms is None and required:
            raise ConfigError("allreduce='nccl' but NCCL is not available (pip install nvidia-nccl-cu12/13)")

    @property
    def active(self) -> bool:
        return bool(self.comms)

    def calls(self, ptrs: Sequence[int], count: int, wire: str, streams: Sequence[Any]) -> list[tuple]:
        """The grouped call's arguments: (comm, ptr, count, dtype, stream) per device."""
        assert self.comms is not None
        return [(c, p, count, wire, s) for c, p, s in zip(self.comms, ptrs, streams)]

    def allreduce(self, calls: list[tuple], capturing: bool) -> bool:
        """Run one grouped all-reduce; False when it failed and the caller must use its schedule.
        Inside a graph capture a failure propagates (the capture is abandoned, not patched), and
        so does NCCL's own error (a CollectiveError: the communicators are broken, the device failed)."""
        try:
            self.rt.nccl_allreduce(calls)
            return True
        except CollectiveError:
            raise
        except Exception as e:  # noqa: BLE001 - per-call fallback
            if capturing:
                raise
            self.failures += 1
            if self.failures >= _GIVE_UP_AFTER:
                warnings.warn(f"NCCL failed {self.failures} times ({e}); using the copy-and-add all-reduce "
                              "from now on", stacklevel=3)
                self.comms = None
            return False


# ---------------------------------------------------------------- one GPU per MPI rank
def cupy_runtime():
    """The CuPy runtime with NCCL, or a BackendUnavailableError saying what is missing."""
    try:
        import cupy  # noqa: F401
        from cupy.cuda import nccl
    except ImportError as e:
        raise BackendUnavailableError(f"NCCL between GPU ranks needs cupy with NCCL ({e}); "
                                      'pip install "metatp[cuda]" and nvidia-nccl-cu12') from None
    if not getattr(nccl, "available", True):
        raise BackendUnavailableError("cupy was built without NCCL: pip install nvidia-nccl-cu12")
    from metatp.backends.cuda.runtime import CupyRuntime

    return CupyRuntime()


def nccl_unique_id(comm: Any, runtime: Any = None) -> bytes:
    """Rank 0's NCCL unique id on every rank (MPI bcast): the id NCCL ranks meet by (128 bytes;
    cupy < 14 gave a tuple of ints, which travels the same way)."""
    uid = None
    if comm.Get_rank() == 0:
        rt = runtime if runtime is not None else cupy_runtime()
        uid = rt.nccl_unique_id()
    return comm.bcast(uid, root=0)


def _gpu_problem(local: int, n_local: int, rt: Any) -> tuple[str, str] | None:
    """(error kind, message) when this machine cannot give each local rank its own GPU."""
    try:
        n_gpus = int(rt.n_gpus())
    except Exception as e:  # noqa: BLE001 - no driver, or no device: cupy's CUDARuntimeError
        return "unavailable", f"NCCL between GPU ranks: no CUDA GPU is visible here ({type(e).__name__}: {e})"
    if n_gpus == 0:
        return "unavailable", "NCCL between GPU ranks: no CUDA GPU is visible here"
    if n_local > n_gpus:
        return "config", (f"{n_local} ranks on this machine but {n_gpus} GPU(s): run one rank per GPU "
                          f"(at most {n_gpus} per machine, e.g. mpiexec -n N -ppn {n_gpus} or a hostfile "
                          f"with slots={n_gpus})")
    return None


def local_gpu(comm: Any, runtime: Any = None) -> int:
    """The GPU this rank drives: its index among the ranks on its machine. Every rank checks its
    machine and they compare notes (one allgather), so a machine with fewer GPUs than ranks is
    one error on every rank (NCCL refuses two ranks on one GPU), never a hang in NCCL's set-up."""
    from mpi4py import MPI

    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    local, n_local = node.Get_rank(), node.Get_size()
    node.Free()
    problem = None
    try:
        rt = runtime if runtime is not None else cupy_runtime()
        problem = _gpu_problem(local, n_local, rt)
    except MetatpError as e:
        problem = "unavailable", str(e)
    seen = comm.allgather(problem)
    bad = [(r, p) for r, p in enumerate(seen) if p is not None]
    if bad:
        rank, (kind, msg) = bad[0]
        where = "" if comm.Get_size() == 1 else f"rank {rank}: "
        err = (ConfigError if kind == "config" else BackendUnavailableError)(where + msg)
        err.every_rank = True          # type: ignore[attr-defined] - every rank raises it; rank 0 reports
        raise err
    return local


class NcclCollective(Collective):
    """ncclAllReduce between GPU ranks; this rank owns device `comm.rank` of the group.

    `wire`: "f32", "bf16" or "auto" (BF16 above the thresholds). `gpu`: the GPU this rank drives
    (default: its local rank, `local_gpu`). `runtime`: the device API (default CuPy's)."""

    name = "nccl"

    def __init__(self, comm: Any, wire: str = "f32", thresholds: WireThresholds = WireThresholds(),
                 gpu: int | None = None, runtime: Any = None) -> None:
        wire_dtype(2, 0, wire)          # validates the mode
        self.rt = runtime if runtime is not None else cupy_runtime()
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.group = Group(tuple(range(self.size)), (self.rank,))
        self.wire, self.thresholds = wire, thresholds
        self.gpu = local_gpu(comm, self.rt) if gpu is None else int(gpu)
        uid = nccl_unique_id(comm, self.rt)
        with self.rt.device(self.gpu):
            self.nccl = self.rt.nccl_rank_comm(self.size, uid, self.rank)
        self._wire_bufs: dict[int, Any] = {}
        self._stream = None
        self._host = None
        self.send_recv = NcclSendRecv(self)          # -sm layer: ncclSend / ncclRecv between the ranks
        self.groups: dict[tuple[int, ...], Any] = {}

    def split_groups(self, groups: Sequence[Sequence[int]]) -> None:
        """-sm layer,tensor: an NCCL communicator per group of ranks (each stage's tensor group),
        made by every rank at the same point: one MPI Comm_split, then the group's own unique id
        (drawn by its first rank, broadcast on the split communicator) and ncclCommInitRank.
        The groups must cover every rank once (NCCL's set-up waits for all of a group)."""
        key = tuple(tuple(int(r) for r in g) for g in groups)
        if all(g in self.groups for g in key):
            return
        flat = sorted(r for g in key for r in g)
        if flat != list(range(self.size)):
            raise ConfigError(f"NCCL groups {[list(g) for g in key]} must cover ranks 0..{self.size - 1} once")
        mine = next(i for i, g in enumerate(key) if self.rank in g)
        sub = self.comm.Split(mine, key=key[mine].index(self.rank))
        made = NcclCollective(sub, self.wire, self.thresholds, gpu=self.gpu, runtime=self.rt)
        for i, g in enumerate(key):
            self.groups[g] = made if i == mine else _Elsewhere(g)

    def for_devices(self, devices: Sequence[int]) -> Any:
        """The collective of one group made by `split_groups` (a ConfigError for any other set)."""
        group = tuple(int(d) for d in devices)
        if group == tuple(range(self.size)):
            return self
        if group not in self.groups:
            raise ConfigError(f"no NCCL communicator for ranks {list(group)}: split_groups makes them at start "
                              f"(made: {[list(g) for g in self.groups]})")
        return self.groups[group]

    def host(self) -> Any:
        """The MPI collective over the same ranks, for values read on the host (made at the
        first collective call that needs it: every rank reaches it at the same point)."""
        if self._host is None:
            from metatp.backends.collectives.mpi import MpiCollective

            self._host = MpiCollective(self.comm)
        return self._host

    def _wire_buffer(self, n: int):
        """The BF16 wire buffer for n elements (one per size: reductions on one stream run in order)."""
        buf = self._wire_bufs.get(n)
        if buf is None:
            with self.rt.device(self.gpu):
                buf = self._wire_bufs[n] = self.rt.empty((n,), np.uint16)
        return buf

    def default_stream(self):
        """The stream steps prepared without one run on (this collective's own)."""
        if self._stream is None:
            self._stream = self.rt.new_stream(self.gpu)
        return self._stream

    def prepare_allreduce(self, bufs: Sequence[Any], active: Sequence[bool] | None = None, stream=None) -> Step:
        """One step on `stream`: zero this rank's buffer if it computed nothing, then sum in place
        (through a BF16 wire buffer above the threshold). Pointers are resolved here, once."""
        rt = self.rt
        if len(bufs) != 1:
            raise ConfigError(f"the NCCL collective drives one GPU per rank, got {len(bufs)} local buffers")
        buf = bufs[0]
        if buf.dtype != np.float32 or not buf.flags.c_contiguous:
            raise ConfigError(f"the NCCL all-reduce sums contiguous float32 buffers, got {buf.dtype}")
        if active is not None and len(active) != self.size:
            raise ValueError(f"active has {len(active)} entries for a group of {self.size} ranks")
        on = True if active is None else bool(active[self.rank])
        st = stream if stream is not None else self.default_stream()
        n = int(buf.size)
        if n == 0:
            return lambda: None
        flat = buf.reshape(-1)
        wire = wire_dtype(self.size, n, self.wire, self.thresholds)
        target = self._wire_buffer(n) if wire == "bf16" else flat
        pre, post = wire_steps(rt, self.gpu, st, flat, target, on, wire)
        call = (self.nccl, device_ptr(target), n, wire, st)
        ctx = rt.context(self.gpu, st)

        def step() -> None:
            with ctx:
                for s in pre:
                    s()
                rt.nccl_allreduce([call])
                for s in post:
                    s()
        return step

    def allreduce(self, bufs: Sequence[Any], active: Sequence[bool] | None = None) -> None:
        """Sum now and wait (buffers written by other streams first: the GPU is synchronized)."""
        self.rt.device_synchronize(self.gpu)
        self.prepare_allreduce(bufs, active)()
        self.rt.synchronize(self.default_stream())

    def allgather(self, local: Sequence[np.ndarray], counts: Sequence[int]) -> list[np.ndarray]:
        """Host slices from every rank (logits are read on the host): over MPI."""
        return self.host().allgather(local, counts)

    def close(self) -> None:
        """Free the NCCL communicators, the groups' too (before MPI_Finalize)."""
        for g in self.groups.values():
            if isinstance(g, NcclCollective) and g is not self:
                g.close()
        self.groups = {}
        if self.nccl is not None:
            self.nccl.destroy()
            self.nccl = None


class _Elsewhere(Collective):
    """A group this rank is not in: it never prepares that group's all-reduce."""

    name = "nccl"

    def __init__(self, group: tuple[int, ...]) -> None:
        self.group = group

    def prepare_allreduce(self, bufs, active=None, stream=None) -> Step:
        raise ValueError(f"this rank is not in the group of ranks {list(self.group)}")
