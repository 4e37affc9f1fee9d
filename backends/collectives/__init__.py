"""Collectives: the all-reduce between subgraphs, device-independent.

- `base`: the interface an executor calls (`Collective.prepare_allreduce`, `AllGather`, `Group`);
- `schedule`: algorithms as data (`butterfly_schedule`, `ring_schedule`), the mode table
  `ALLREDUCE_MODES` and the byte counts `metatp dump` / `metatp bench` report;
- `wire`: FP32 / BF16 on the wire (llama.cpp's thresholds);
- `host`: the runner for devices simulated in one process (numpy, plus the C butterfly);
- `mpi`: one process per device (CPU ranks): MPI_Allreduce in place, Allgatherv for split reads;
  under -sm layer,tensor each stage's group all-reduces on its own communicator (`split_groups`).
- `p2p`: copies between processes (-sm layer under mpiexec): MPI send / receive, a broadcast of the logits.

Device collectives live with their backend: `cuda.collective.DeviceCollective` (the GPUs of one
process) and `cuda.nccl.NcclCollective` (GPU ranks: ncclAllReduce, its unique id broadcast over MPI).

A new algorithm is one schedule function and one row of `ALLREDUCE_MODES`.
"""

from metatp.backends.collectives.base import AllGather, Collective, Group, Step
from metatp.backends.collectives.host import HostCollective, allreduce, host_mode, prepare_schedule, run_schedule
from metatp.backends.collectives.schedule import (ALIASES, ALLREDUCE_MODES, MODE_NAMES, Mode, Schedule, Transfer,
                                                  TransferOp, allreduce_bytes, butterfly_schedule, bytes_moved,
                                                  bytes_per_rank, check_schedule, resolve_mode, ring_schedule,
                                                  schedule_for)
from metatp.backends.collectives.mpi import MpiCollective
from metatp.backends.collectives.wire import WIRE_MODES, WireThresholds, wire_dtype

__all__ = ["AllGather", "Collective", "Group", "MpiCollective", "Step", "HostCollective", "allreduce", "host_mode",
           "prepare_schedule", "run_schedule", "ALIASES", "ALLREDUCE_MODES", "MODE_NAMES", "Mode", "Schedule",
           "Transfer", "TransferOp", "allreduce_bytes", "butterfly_schedule", "bytes_moved", "bytes_per_rank",
           "check_schedule", "resolve_mode", "ring_schedule", "schedule_for", "WIRE_MODES", "WireThresholds",
           "wire_dtype"]
