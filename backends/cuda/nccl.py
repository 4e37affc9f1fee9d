"""NCCL between GPUs driven by one process: communicator set-up (ncclCommInitAll), one grouped
call per all-reduce, and the per-call fallback to a copy-and-add schedule.

(The multi-process runner, one GPU per MPI rank, is `metatp.backends.collectives.nccl`.)

NCCL needs every device on its own GPU. Under allreduce="nccl" anything that keeps it from
working is an error; under "auto" it falls back to the schedule with one warning at set-up, and
a call that fails at run time falls back for that call (three failures: for good).
"""

from __future__ import annotations

import warnings
from typing import Any, Sequence

from metatp.ir.errors import ConfigError

__all__ = ["NcclGroup"]

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
        Inside a graph capture a failure propagates (the capture is abandoned, not patched)."""
        try:
            self.rt.nccl_allreduce(calls)
            return True
        except Exception as e:  # noqa: BLE001 - per-call fallback
            if capturing:
                raise
            self.failures += 1
            if self.failures >= _GIVE_UP_AFTER:
                warnings.warn(f"NCCL failed {self.failures} times ({e}); using the copy-and-add all-reduce "
                              "from now on", stacklevel=3)
                self.comms = None
            return False
