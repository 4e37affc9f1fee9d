"""Lock step under MPI for a served model: rank 0 posts every step, the other ranks replay it.

A server only hears requests on rank 0, so its scheduler *leads* (`Leader`): before each step it
posts the step to the other ranks as a `StepBatch` -- the KV cell operations since the last step
and the step's items -- and those ranks, which have no scheduler, run exactly the same
`Engine.run` (`follow`) until rank 0 posts `STOP`. Tokens are sampled on rank 0 only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from metatp.engine import Engine, StepItem
from metatp.ir.errors import MetatpError
from metatp.kv_cells import SeqCells

if TYPE_CHECKING:
    from metatp.backends.distributed import World

__all__ = ["StepBatch", "STOP", "Leader", "LockStepError", "follow"]


class LockStepError(MetatpError):
    """A follower rank got a step it cannot run as rank 0 did (the ranks have drifted apart)."""


STOP = "stop"          # rank 0's last post: the server has stopped, the followers return


@dataclass(frozen=True)
class StepBatch:
    """One step as rank 0 posts it to the other ranks (`Scheduler.lead`, `follow`).

    `ops`: the KV cell operations since the previous step, in order: ("take", seq id, int32
    cells, positions it begins with) for an admitted sequence, ("grow", seq id, int32 cells) for cells a running one takes
    on demand, ("free", seq id) for one that ended or was preempted, ("cache", cells) and
    ("uncache", cells) for the prefix cache's blocks kept and evicted. `items`: the step's
    StepItems as (seq id, its n_past before the step, token ids, logits mode). Positions, pass
    rows, padding cells and masks all follow from these in `Engine.run`, the same on every rank;
    n_past travels only to catch ranks that drifted apart."""

    ops: tuple[tuple[Any, ...], ...]
    items: tuple[tuple[int, int, tuple[int, ...], str], ...]


class Leader:
    """Rank 0's side of a served model under MPI: records cell operations, posts each step."""

    def __init__(self, world: "World") -> None:
        self.world = world
        self.ops: list[tuple[Any, ...]] = []
        self.closed = False

    def run(self, engine: Engine, items: list[StepItem]) -> list[np.ndarray | None]:
        """Post the step, then run it here. Any failure ends every rank: the followers may be
        inside a collective of this step, and a step that failed here cannot be replayed there."""
        batch = StepBatch(tuple(self.ops), tuple((it.seq.id, it.seq.n_past, tuple(int(t) for t in it.tokens),
                                                  it.logits) for it in items))
        self.ops.clear()
        try:
            if self.closed:
                raise LockStepError("the other ranks have stopped following (the server is stopping)")
            self.world.post(batch)
            return engine.run(items)
        except Exception as e:  # noqa: BLE001 -- reported once, then every rank ends
            from metatp.backends.distributed import finish_error

            what = f"error: {e}" if isinstance(e, MetatpError) else f"internal error: {type(e).__name__}: {e}"
            finish_error(e, f"metatp: {what} (in a served step on rank 0; ending every rank)", 1)
            raise                           # not reached: finish_error aborts the MPI job

    def stop(self) -> None:
        """Post STOP once: the followers free their cells and return."""
        if not self.closed:
            self.closed = True
            self.world.post(STOP)


def follow(engine: Engine, world: "World", on_wait: Callable[[float], None] | None = None) -> int:
    """A rank > 0 of a served model: run every step rank 0 posts (`StepBatch`) with the same
    Engine.run calls, until rank 0 posts STOP. Waits without spinning (`World.next_post`;
    `on_wait` is called while it waits and may raise to give up). Returns the steps run."""
    seqs: dict[int, SeqCells] = {}
    steps = 0
    try:
        while True:
            msg = world.next_post(on_wait)
            if isinstance(msg, str) and msg == STOP:
                return steps
            if not isinstance(msg, StepBatch):
                raise LockStepError(f"rank {world.rank} got a {type(msg).__name__} from rank 0 where a step was due")
            engine.run(_replay(engine, seqs, msg, world.rank))
            steps += 1
    finally:
        for seq in seqs.values():
            engine.free(seq)


def _replay(engine: Engine, seqs: dict[int, SeqCells], batch: StepBatch, rank: int) -> list[StepItem]:
    """Apply a StepBatch's cell operations to this rank's cache; its items as this rank's StepItems."""
    for op in batch.ops:
        if op[0] == "take":
            seqs[op[1]] = engine.cells.adopt(op[1], op[2])
            seqs[op[1]].n_past = op[3]          # positions it begins with (a prefix cache hit)
        elif op[0] == "grow" and op[1] in seqs:
            engine.cells.extend(seqs[op[1]], op[2])
        elif op[0] == "free" and op[1] in seqs:
            engine.free(seqs.pop(op[1]))
        elif op[0] == "cache":              # the prefix cache keeps these cells (metatp.prefix_cache)
            engine.cells.cache(op[1])
        elif op[0] == "uncache":
            engine.cells.uncache(op[1])
        else:
            raise LockStepError(f"rank {rank} cannot apply rank 0's cell operation {op[:2]!r}")
    items = []
    for seq_id, n_past, tokens, logits in batch.items:
        seq = seqs.get(seq_id)
        if seq is None or seq.n_past != n_past:
            have = "no such sequence" if seq is None else f"{seq.n_past} positions"
            raise LockStepError(f"rank {rank} is out of step with rank 0: sequence {seq_id} has {have} here "
                                f"but {n_past} on rank 0")
        if n_past + len(tokens) > seq.capacity:     # cells are rank 0's choice, never taken here
            raise LockStepError(f"rank {rank}: sequence {seq_id} has {seq.capacity} cells but its step needs "
                                f"{n_past + len(tokens)}; rank 0 posted no growth for it")
        items.append(StepItem(seq, list(tokens), logits))
    return items
