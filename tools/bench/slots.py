"""The setups of a group and their runs in lock step: one process, or one process per device
under mpiexec (the split rows on every rank; the -sm none baseline and llama.cpp on rank 0 while
the other ranks wait asleep)."""

from __future__ import annotations

import time
from dataclasses import dataclass

from metatp.tools.bench.config import BenchConfig
from metatp.tools.bench.setups import setup_layout, setup_llama_cpp
from metatp.tools.bench.timing import AllreduceTimer, draw, measure

__all__ = ["Slot", "check_world", "make_slot", "compare_slot", "shared_vocab", "run_slot", "mpi_fields"]


# ---------------------------------------------------------------- one process per device (mpiexec)


@dataclass
class Slot:
    """One setup of a group. Under MPI a tensor-parallel layout runs on every rank ("world"); the
    single-device baseline and llama.cpp run on rank 0 alone ("root"; engine None elsewhere)."""

    engine: object | None
    base: dict | None
    layout: tuple | None              # None: llama.cpp
    scope: str = "world"
    timer: AllreduceTimer | None = None


def wait_asleep(world) -> None:
    """A barrier that sleeps instead of spinning: the ranks idling while rank 0 runs alone leave
    it the CPU (MPICH's blocking calls busy-poll)."""
    if world is None:
        return
    req = world.comm.Ibarrier()
    while not req.Test():
        time.sleep(0.002)


def on_root(world, build):
    """build() on rank 0 alone (None on the other ranks, which wait asleep). A MetatpError it
    raises is raised on every rank, marked as every rank's, so rank 0 prints it once and no rank
    is left waiting for it."""
    from metatp.backends.distributed import every_rank
    from metatp.ir.errors import MetatpError

    if world is None:
        return build()
    result, err = None, None
    if world.is_root:
        try:
            result = build()
        except MetatpError as e:
            err = e
    wait_asleep(world)
    if world.comm.bcast(err is not None, root=0):
        raise every_rank(err if err is not None else MetatpError("rank 0 failed"))
    return result


def check_world(cfg: BenchConfig, world) -> None:
    """Under mpiexec the world size is the device count: every --devices and -ts must say so, and
    -sm must include tensor or layer (the -sm none baseline joins on rank 0). Errors every rank raises."""
    from metatp.backends.distributed import every_rank
    from metatp.ir.errors import ConfigError

    for n in cfg.n_devices:
        world.layout_for(n, "tensor", None)
    for ts in cfg.tensor_split:
        if ts is not None:
            world.layout_for(None, "tensor", ts)
    if not {"tensor", "layer", "layer,tensor"} & set(cfg.split_mode):
        raise every_rank(ConfigError(
            f"mpiexec started {world.size} processes but -sm is {','.join(cfg.split_mode)}: under mpiexec "
            "bench measures -sm tensor or -sm layer across the processes (the -sm none baseline runs on "
            "rank 0); add -sm tensor or -sm layer, or run -sm none without mpiexec"))


def make_slot(cfg: BenchConfig, lay: tuple, world) -> Slot:
    if world is None:
        return Slot(*setup_layout(cfg, *lay), lay)
    if lay[1] == "none":
        built = on_root(world, lambda: setup_layout(cfg, *lay))
        return Slot(*(built or (None, None)), lay, scope="root")
    eng, base = setup_layout(cfg, *lay, distributed="mpi")
    coll = eng.backend.collective if hasattr(eng, "backend") else None
    if lay[1] == "layer" and coll is not None:      # no all-reduce: time the sends / receives of the hidden state
        coll = coll.send_recv
    timer = AllreduceTimer(coll) if hasattr(coll, "seconds") else None
    return Slot(eng, base, lay, timer=timer)


def compare_slot(cfg: BenchConfig, model_path: str | None, world) -> Slot:
    built = on_root(world, lambda: setup_llama_cpp(cfg, model_path))
    return Slot(*(built or (None, None)), None, scope="world" if world is None else "root")


def shared_vocab(slots: list[Slot], world) -> int:
    """The vocabulary size, rank 0's (the others may hold no engine in this group)."""
    vocab = next((s.engine.model.hparams.n_vocab for s in slots if s.layout is not None and s.engine is not None),
                 None)
    return vocab if world is None else world.comm.bcast(vocab, root=0)


def run_slot(slot: Slot, test, depth_ids, rng, vocab: int, world) -> float | None:
    """One run of a test on a slot, in lock step: every rank draws the same tokens; a root slot
    runs on rank 0 while the others wait (asleep) for it."""
    if slot.engine is None:
        draw(test, rng, vocab)
        ts = None
    elif slot.timer is not None:
        ts = measure(slot.engine, test, depth_ids, rng, vocab, slot.timer)
    else:
        ts = measure(slot.engine, test, depth_ids, rng, vocab)
    if world is not None and slot.scope == "root":
        wait_asleep(world)
    return ts


def mpi_fields(slot: Slot, test: tuple[int, int, int], reps: int) -> dict:
    """Mean MPI_Allreduce wall time per call (us) and per token (ms) over the timed runs; for a
    -sm layer row the same of its sends / receives (copy_*)."""
    t = slot.timer
    out = {"allreduce_us_per_call": None, "allreduce_ms_per_token": None, "copy_us_per_call": None,
           "copy_ms_per_token": None}
    if t is None or t.calls == 0:
        return out
    kind = "copy" if slot.layout is not None and slot.layout[1] == "layer" else "allreduce"
    tokens = (test[0] or test[1]) * reps
    return dict(out, **{f"{kind}_us_per_call": t.seconds / t.calls * 1e6,
                        f"{kind}_ms_per_token": t.seconds / tokens * 1e3})
