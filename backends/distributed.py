"""One process per device: the MPI world, and what every rank must agree on before and while running.

`mpiexec -n N metatp generate ... -sm tensor` (or `mpiexec -n N python script.py` with
`LLM(...)`) starts N copies of the same program. Each one is a *rank*: it owns device `rank`
of an N-device layout, stores only that device's weight slices and KV heads (the numpy
backend's `devices=[rank]`), walks only that device's part of every plan, and sums the
partial results between subgraphs through MPI (`collectives.mpi.MpiCollective`; GPU ranks:
NCCL, `cuda.nccl.NcclCollective`). Under -sm layer a rank holds its layers' weights and KV
cache and computes only those; the hidden state goes from rank to rank by MPI send / receive
(`collectives.p2p.MpiSendRecv`) and the last rank's logits are broadcast to all. The backend
itself is made by its registry entry (`registry.BackendEntry.create`), as in one process, with
the rank's device and collective.

Ranks run in lock step: every rank makes the same forward calls with the same inputs, or a
collective waits forever. So, once at start, the ranks check that they agree on the world size
vs `--devices` and on the model file (size + sha256 of its head and tail); and while running,
rank 0 alone tokenizes, schedules and samples and posts every step to the others (`post`,
`next_post`; `metatp.lockstep`, `metatp.mpi_calls`), which replay it: a seed of None, a prompt
read on rank 0 only or a different numpy on another machine cannot make the ranks drift apart,
and no step needs an agreement of its own.

An error that only one rank hits ends every rank (`abort`, `MPI_Abort`) instead of leaving
the others waiting inside a collective; an error every rank finds (a bad flag, the model check)
is reported by rank 0 only (`every_rank`, `should_report`). A rank that dies is the launcher's
to clean up; one that goes silent (stopped, frozen) is found by a heartbeat between the ranks,
which also checks at start that every rank runs the same metatp (`backends.watchdog`).
"""

from __future__ import annotations

import hashlib
import os
import socket
import sys
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from metatp.backends.rank_errors import every_rank, first_disagreeing
from metatp.ir.errors import BackendUnavailableError, ConfigError, MetatpError

__all__ = ["DISTRIBUTED_MODES", "World", "launched_world_size", "launched_rank", "init_world", "model_digest", "every_rank",
           "first_disagreeing", "should_report", "current_world", "finish_error", "process_memory", "mpi_wiring",
           "nccl_wiring"]

DISTRIBUTED_MODES = ("auto", "none", "mpi")

# What MPI launchers put in each process's environment: MPICH / Intel MPI (hydra: PMI_*),
# Open MPI (OMPI_COMM_WORLD_*), MVAPICH. Read without importing mpi4py (which starts MPI).
_SIZE_VARS = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")
_RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK")

_INSTALL_HINT = 'pip install "metatp[mpi]" (mpi4py and an MPI library, e.g. pip install mpi4py mpich)'

# Bytes of the model file's head and tail that the identity check hashes (with its size): the
# head holds the GGUF header, metadata and tensor table; the whole file would take seconds per GB.
_HEAD_BYTES = 16 << 20
_TAIL_BYTES = 1 << 20


def launched_world_size() -> int | None:
    """The number of processes an MPI launcher started this one among, or None (not under mpiexec)."""
    for var in _SIZE_VARS:
        value = os.environ.get(var)
        if value and value.strip().isdigit():
            return int(value)
    return None


def launched_rank() -> int | None:
    """This process's rank as the MPI launcher set it, or None (not under mpiexec)."""
    for var in _RANK_VARS:
        value = os.environ.get(var)
        if value and value.strip().isdigit():
            return int(value)
    return None


def should_report(err: BaseException, world: World | None) -> bool:
    """Print this error here? Always in one process; under MPI an error every rank found (or an
    interrupt, which the launcher passes to every rank) is printed by rank 0 only (the launcher's
    rank when MPI itself could not start), one that only this rank hit by this rank."""
    if not (getattr(err, "every_rank", False) or isinstance(err, KeyboardInterrupt)):
        return True
    rank = world.rank if world is not None else launched_rank()
    return rank is None or rank == 0


def model_digest(path: str | os.PathLike) -> str:
    """size + sha256 of the file's first 16 MiB and last 1 MiB: enough to tell two models (or
    two quantizations, or a truncated copy) apart without reading gigabytes on every rank."""
    size = os.path.getsize(path)
    h = hashlib.sha256(size.to_bytes(8, "little"))
    with open(path, "rb") as f:
        h.update(f.read(_HEAD_BYTES))
        if size > _HEAD_BYTES:
            f.seek(max(_HEAD_BYTES, size - _TAIL_BYTES))
            h.update(f.read(_TAIL_BYTES))
    return f"{size}:{h.hexdigest()}"


@dataclass
class World:
    """This process's place among the ranks of one MPI job (one device per rank)."""

    comm: Any
    rank: int
    size: int
    host: str = field(default_factory=socket.gethostname)
    _collective: Any = None
    _local_rank: int | None = None

    @property
    def is_root(self) -> bool:
        return self.rank == 0

    @property
    def local_rank(self) -> int:
        """This rank's index among the ranks on its machine (which GPU it drives)."""
        if self._local_rank is None:
            from mpi4py import MPI

            node = self.comm.Split_type(MPI.COMM_TYPE_SHARED)
            self._local_rank = node.Get_rank()
            node.Free()
        return self._local_rank

    @property
    def devices(self) -> list[int]:
        """The devices of the layout this process owns."""
        return [self.rank]

    # ---------------------------------------------------------------- checks at start
    def layout_for(self, n_devices: int | None, split_mode: str | None,
                   tensor_split: Sequence[float] | None) -> tuple[int, str]:
        """(n_devices, split_mode) for this world: the device count is the world size; an
        explicit count or -ts that disagrees is an error every rank raises. Several processes
        split by tensor (the default) or by layer (-sm layer: each rank its layers, the hidden
        state sent from rank to rank)."""
        n = self.size if n_devices is None else n_devices
        if split_mode == "layer,tensor":          # -ts has one share per device of a tensor group
            if tensor_split is not None and (not tensor_split or self.size % len(tensor_split)):
                raise every_rank(ConfigError(
                    f"-ts has {len(tensor_split)} shares (--tp) but mpiexec started {self.size} processes: "
                    "--pp x --tp must be the number of processes"))
        elif tensor_split is not None and len(tensor_split) != self.size:
            raise every_rank(ConfigError(
                f"-ts has {len(tensor_split)} shares but mpiexec started {self.size} processes "
                f"(one per device): give {self.size} shares or run mpiexec -n {len(tensor_split)}"))
        if n != self.size:
            raise every_rank(ConfigError(
                f"--devices {n} but mpiexec started {self.size} processes: the world size is the device "
                f"count (one process per device); run mpiexec -n {n} or drop --devices"))
        if self.size > 1 and split_mode not in (None, "tensor", "layer", "layer,tensor"):
            raise every_rank(ConfigError(
                f"mpiexec started {self.size} processes but split_mode is {split_mode!r}: "
                "several processes split the model with -sm tensor or -sm layer (or -sm layer,tensor)"))
        if self.size > 1:
            return n, split_mode or "tensor"
        return n, split_mode or "none"

    def check_model(self, path: str | os.PathLike) -> str:
        """Every rank maps the same model file (compared by `model_digest`, paths may differ
        between machines); returns the digest."""
        mine = model_digest(path)
        seen = self.comm.allgather((mine, self.host, str(path)))
        r = first_disagreeing(seen)
        if r is not None:
            raise every_rank(ConfigError(
                f"ranks disagree on the model file: rank 0 on {seen[0][1]} has {seen[0][2]} "
                f"({_short_digest(seen[0][0])}) but rank {r} on {seen[r][1]} has {seen[r][2]} "
                f"({_short_digest(seen[r][0])}); give every rank the same GGUF"))
        return mine

    def agree_seed(self, seed: int | None) -> int | None:
        """Rank 0's seed on every rank (None on rank 0: one it draws), so that every rank's LLM
        starts from the same random state (only rank 0 samples; this keeps the ranks alike)."""
        if self.rank == 0 and seed is None:
            seed = int(np.random.SeedSequence().entropy % (1 << 63))
        return self.comm.bcast(seed, root=0)

    # ---------------------------------------------------------------- parts
    def collective(self, kind: str = "mpi", **options):
        """The all-reduce and gather between the ranks' devices (one of each kind per world):
        "mpi" (CPU ranks: MPI_Allreduce), or "nccl" (GPU ranks: NCCL bootstrapped over MPI, on
        this rank's local GPU; `options` as `cuda.nccl.NcclCollective` takes them, used
        when it is first made)."""
        made = self._collective if isinstance(self._collective, dict) else {}
        self._collective = made
        if kind not in made:
            if kind == "mpi":
                from metatp.backends.collectives.mpi import MpiCollective

                made[kind] = MpiCollective(self.comm)
            elif kind == "nccl":
                from metatp.backends.cuda.nccl import NcclCollective

                made[kind] = NcclCollective(self.comm, **options)
            else:
                raise ConfigError(f"unknown collective {kind!r}; choose mpi or nccl")
        return made[kind]

    # ---------------------------------------------------------------- faults
    def abort(self, code: int = 1) -> None:
        """End every rank now (an error only this rank hit; the others may be inside a collective).
        The pause lets the launcher forward this rank's last lines before the abort tears the job
        down (MPICH's hydra drops them otherwise, now and then)."""
        import time

        sys.stdout.flush()
        sys.stderr.flush()
        time.sleep(0.25)
        self.comm.Abort(code)

    def quiet(self) -> None:
        """Non-root ranks keep warnings to themselves (rank 0 prints them once for all)."""
        if self.rank != 0:
            import warnings

            warnings.simplefilter("ignore")

    # ---------------------------------------------------------------- rank 0 posts, the others follow
    POST_TAG = 0x6D74          # the MPI tag of rank 0's posts (apart from every collective's traffic)

    def post(self, message: Any) -> None:
        """Rank 0: send `message` (any picklable object) to every other rank, in order. Point to
        point rather than MPI_Bcast, so that a rank waiting for the next one can sleep (`next_post`)."""
        for r in range(1, self.size):
            self.comm.send(message, dest=r, tag=self.POST_TAG)

    def next_post(self, on_wait: Any = None, max_sleep: float = 0.02) -> Any:
        """Ranks > 0: rank 0's next `post`. MPICH's blocking receive and MPI_Bcast busy-wait (a
        whole core per waiting rank, for as long as a server idles), so this probes and sleeps,
        longer the longer nothing comes, up to `max_sleep` (an idle rank wakes 50 times a second;
        the first step after a pause starts at most that late). `on_wait(seconds waited)` is called
        between probes; it may raise to give up."""
        import time

        start = time.monotonic()
        delay = 0.0
        while not self.comm.Iprobe(source=0, tag=self.POST_TAG):
            waited = time.monotonic() - start
            if on_wait is not None:
                on_wait(waited)
            delay = 0.0 if waited < 0.002 else min(max_sleep, max(2 * delay, 1e-4))
            time.sleep(delay)
        return self.comm.recv(source=0, tag=self.POST_TAG)


def _short_digest(d: str) -> str:
    size, _, h = d.partition(":")
    return f"{size} bytes, sha256 {h[:12]}"


_WORLD: World | None = None


def init_world(distributed: str | None = "auto") -> World | None:
    """The MPI world, or None for one process holding every device.

    "auto": MPI when a launcher started this process among several (`launched_world_size() > 1`);
    "mpi": MPI even for one process; "none"/None: never. mpi4py missing under mpiexec is a
    BackendUnavailableError naming the install command."""
    global _WORLD
    if distributed is None or distributed == "none":
        return None
    if distributed not in DISTRIBUTED_MODES:
        raise ConfigError(f"distributed must be one of {', '.join(DISTRIBUTED_MODES)}, got {distributed!r}")
    size = launched_world_size()
    if distributed == "auto" and (size is None or size <= 1):
        return None
    if _WORLD is not None:
        return _WORLD
    try:
        from mpi4py import MPI
    except ImportError as e:
        where = f"mpiexec started {size} processes" if size else "distributed='mpi'"
        raise every_rank(BackendUnavailableError(
            f"{where} but mpi4py cannot be imported ({e}); {_INSTALL_HINT}")) from None
    comm = MPI.COMM_WORLD
    _WORLD = World(comm, comm.Get_rank(), comm.Get_size())
    _install_abort_hook(_WORLD)
    from metatp.backends.watchdog import watch

    watch(_WORLD)           # the same metatp on every rank; a heartbeat ends the job if a rank goes silent
    return _WORLD


def current_world() -> World | None:
    """The world `init_world` started in this process, or None."""
    return _WORLD


def finish_error(err: BaseException, line: str, code: int) -> int:
    """How a command ends on an error under MPI (a no-op wrapper in one process): `line` is
    printed once (`should_report`); an error only this rank hit, or an interrupt, then aborts
    every rank, since the others may be waiting in a collective. Returns `code` otherwise."""
    world = _WORLD
    if should_report(err, world):
        print(line, file=sys.stderr, flush=True)
    if world is not None and world.size > 1 and (isinstance(err, KeyboardInterrupt)
                                                 or not getattr(err, "every_rank", False)):
        world.abort(code)
    return code


def _install_abort_hook(world: World) -> None:
    """An uncaught exception on one rank prints its traceback there and aborts every rank
    (as `python -m mpi4py` does), instead of MPI_Finalize waiting on ranks stuck in a collective."""
    previous = sys.excepthook
    if world.size == 1 or getattr(previous, "_metatp_abort", False):
        return

    def hook(kind, value, tb):
        previous(kind, value, tb)
        world.abort(1)
    hook._metatp_abort = True           # type: ignore[attr-defined]
    sys.excepthook = hook


def process_memory() -> dict[str, int]:
    """This process's resident memory in bytes from /proc/self/status: rss (all), anon (what it
    allocated), file (mapped file pages it touched, e.g. the GGUF), shmem (MPI's shared segments)."""
    keys = {"VmRSS": "rss", "RssAnon": "anon", "RssFile": "file", "RssShmem": "shmem", "VmHWM": "peak"}
    out: dict[str, int] = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                name, _, rest = line.partition(":")
                if name in keys:
                    out[keys[name]] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return out


# ---------------------------------------------------------------- backends on a rank
# How each backend is wired on an MPI rank: the registry entries name these (`rank_wiring`),
# and `BackendEntry.create(layout, options, world)` calls them. Each returns the options
# checked by the entry and how the rank drives its device (passed to the backend as they are).

def mpi_wiring(entry: Any, world: World, layout: Any, options: dict) -> tuple[dict, dict]:
    """A CPU rank (numpy): device `rank` of the layout, its sums over MPI (`MpiCollective`);
    under layer,tensor each stage's all-reduces on the group's own communicator."""
    allreduce = options.pop("allreduce", None)
    try:
        if allreduce not in (None, "auto"):
            raise ConfigError(f"allreduce={allreduce!r} picks the all-reduce of devices in one process; under "
                              "mpiexec the ranks reduce with MPI_Allreduce (leave allreduce='auto')")
        checked = entry.check(options)
    except MetatpError as e:
        raise every_rank(e) from None
    collective = world.collective()
    if layout.split_mode == "layer,tensor":
        collective.split_groups([layout.stage_devices(s) for s in range(layout.pp)])
    return checked, {"devices": world.devices, "collective": collective}


def nccl_wiring(entry: Any, world: World, layout: Any, options: dict) -> tuple[dict, dict]:
    """A GPU rank (cupy): one device, this rank's local GPU, NCCL between the ranks (its unique
    id broadcast over MPI). `runtime` in `options` is the device-API seam tests use
    (`EmuRuntime`); errors every rank finds alike (options, no GPU, fewer GPUs than local
    ranks) are reported once, by rank 0."""
    runtime = options.pop("runtime", None)
    allreduce = options.pop("allreduce", None)
    try:
        if allreduce not in (None, "auto", "nccl"):
            raise ConfigError(f"allreduce={allreduce!r} picks the all-reduce of devices in one process; "
                              "under mpiexec GPU ranks reduce with NCCL (leave allreduce='auto')")
        checked = entry.check(options)
        if runtime is None:
            from metatp.backends.cuda.nccl import cupy_runtime

            runtime = cupy_runtime()
    except MetatpError as e:
        raise every_rank(e) from None
    collective = world.collective("nccl", runtime=runtime, wire=checked.get("wire", "auto"))
    if layout.split_mode == "layer,tensor":  # each stage's all-reduces on the group's own NCCL communicator
        collective.split_groups([layout.stage_devices(s) for s in range(layout.pp)])
    return checked, {"runtime": runtime, "gpus": [collective.gpu], "devices": world.devices,
                     "collective": collective}
