"""`metatp serve` under mpiexec: what is refused, the world an LLM is served over, and the
follower ranks (ranks > 0 run rank 0's steps until it posts STOP)."""

from __future__ import annotations

import signal
import time
from typing import TYPE_CHECKING

from metatp.ir.errors import ConfigError
from metatp.lockstep import follow

if TYPE_CHECKING:
    from metatp.api import LLM


MPI_REFUSAL = ("mpiexec started {n} processes but this LLM is not spread over them (distributed='none'?): "
               "every process would serve on one port; drop distributed='none', or run without mpiexec")

# after SIGINT/SIGTERM, how long a follower rank waits for rank 0's STOP before it gives up
FOLLOWER_GRACE_S = 20.0


def refuse_mpi(llm: "LLM | None" = None) -> None:
    """What serving under mpiexec still refuses, as a ConfigError every rank raises (rank 0
    reports it): an LLM not spread over the launcher's processes (each would serve the whole
    model on the same port). Serving an LLM whose world is the launched one is supported (rank
    0 serves, the others follow); a backend that cannot run under MPI is refused when the LLM
    is built. Without `llm` (the CLI, before the model is read) there is nothing to refuse."""
    from metatp.backends.distributed import every_rank, launched_world_size

    size = launched_world_size()
    if llm is None or size is None or size <= 1:
        return
    world = getattr(llm, "world", None)
    if world is None or world.size != size:
        raise every_rank(ConfigError(MPI_REFUSAL.format(n=size)))


def served_world(llm: "LLM"):
    """`llm`'s MPI world when it spans several processes, else None (one process: as ever)."""
    refuse_mpi(llm)
    world = getattr(llm, "world", None)
    return world if world is not None and world.size > 1 else None


def follow_steps(llm: "LLM") -> int:
    """A rank > 0 of `mpiexec ... metatp serve`: run rank 0's steps until it posts STOP (returns
    the steps run). SIGINT/SIGTERM (the launcher passes them to every rank) only start a grace
    period: rank 0 stops the server and posts STOP; if it has not within FOLLOWER_GRACE_S, a
    ConfigError ends this rank (and the job) rather than leaving it waiting."""
    world = served_world(llm)
    if world is None or world.is_root:
        raise ConfigError("follow_steps runs on the ranks > 0 of an MPI world; rank 0 serves (serve)")
    signalled: list[float] = []

    def note(signum, frame) -> None:
        if not signalled:
            signalled.append(time.monotonic())

    def on_wait(waited: float) -> None:
        if signalled and time.monotonic() - signalled[0] > FOLLOWER_GRACE_S:
            raise ConfigError(f"rank {world.rank}: rank 0 did not stop the server within {FOLLOWER_GRACE_S:.0f} s "
                              "of the interrupt; ending every rank")
    previous = {s: signal.signal(s, note) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        return follow(llm.engine, world, on_wait)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
