"""Lock step under MPI: rank 0 schedules, samples and posts every step, the other ranks replay it.

One mechanism for every entry point. Rank 0's scheduler *leads* (`Leader`): before each step it
posts the step to the other ranks as a `StepBatch` -- the KV cell operations since the last step
and the step's items -- and those ranks, which never run a scheduler, run exactly the same
`Engine.run` (`Follower`). Tokens are sampled on rank 0 only, so no step needs an agreement of
its own. Between the steps rank 0 posts what a call every rank makes returned (`CallPost`:
`metatp.mpi_calls` for `LLM.generate`, `score`, the completions and their streams): a follower
waiting for its call's output runs every step that comes before it. A server's followers run
steps until rank 0 posts `STOP` (`follow`).
"""

from __future__ import annotations

import collections
import os
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from metatp.engine import Engine, StepItem
from metatp.ir.errors import MetatpError
from metatp.kv_cells import KVCells, SeqCells

if TYPE_CHECKING:
    from metatp.backends.distributed import World

__all__ = ["StepBatch", "CallPost", "STOP", "Leader", "Follower", "LockStepError", "follow", "follower_for"]


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


@dataclass(frozen=True)
class CallPost:
    """What rank 0 posts about call number `call` of the calls every rank makes (`mpi_calls`):
    kind "stream" (it returned a stream; its items follow), "item" (the stream's next item),
    "end" (it returned `value`; a stream: it ended) or "error" (it raised `value`). `ops`: the
    cell operations since the last step, so that the caches agree at every call boundary."""

    call: int
    kind: str
    value: Any = None
    ops: tuple[tuple[Any, ...], ...] = ()


class Leader:
    """Rank 0's side under MPI: records cell operations, posts each step and each call's outputs.

    It listens to rank 0's cache (`KVCells.listener`): every cell operation the others must
    replay lands in `ops`, and goes out with the next step or call post."""

    def __init__(self, world: "World", cells: KVCells | None = None) -> None:
        self.world = world
        self.ops: list[tuple[Any, ...]] = []
        self.closed = False
        if cells is not None:
            cells.listener = self.ops.append

    def run(self, engine: Engine, items: list[StepItem]) -> list[np.ndarray | None]:
        """Post the step, then run it here. Any failure ends every rank: the followers may be
        inside a collective of this step, and a step that failed here cannot be replayed there."""
        batch = StepBatch(tuple(self.ops), tuple((it.seq.id, it.seq.n_past, tuple(int(t) for t in it.tokens),
                                                  it.logits) for it in items))
        self.ops.clear()
        try:
            if self.closed:
                raise LockStepError("the other ranks have stopped following (a server stopped leading them)")
            self.world.post(batch)
            return engine.run(items)
        except Exception as e:  # noqa: BLE001 -- reported once, then every rank ends
            _end_every_rank(e, "in a step on rank 0")
            raise                           # not reached: finish_error aborts the MPI job

    def post_call(self, call: int, kind: str, value: Any = None) -> None:
        """Post a `CallPost` (with the cell operations recorded since the last step)."""
        if self.closed:
            raise LockStepError("the other ranks have stopped following (a server stopped leading them)")
        msg = CallPost(call, kind, value, tuple(self.ops))
        self.ops.clear()
        self.world.post(msg)

    def stop(self) -> None:
        """Post STOP once: the followers free their cells and return."""
        if not self.closed:
            self.closed = True
            self.world.post(STOP)


class Follower:
    """A rank > 0: this rank's copies of rank 0's sequences, and the call outputs that came
    while it waited for another call's (`next_for`). One per engine (`follower_for`), so that a
    stream left open across calls keeps its cells."""

    def __init__(self, engine: Engine, world: "World") -> None:
        self._engine = weakref.ref(engine)       # weak: `follower_for`'s table must not keep engines alive
        self.world = world
        self.seqs: dict[int, SeqCells] = {}
        self.inbox: dict[int, collections.deque[CallPost]] = {}
        self.dropped: set[int] = set()           # calls whose caller stopped listening before their end
        self.serving = False                     # in `serve`: no caller here waits for a call's posts
        self.steps = 0

    @property
    def engine(self) -> Engine:
        engine = self._engine()
        if engine is None:
            raise LockStepError(f"rank {self.world.rank}: the engine this rank followed with is gone")
        return engine

    def next_for(self, call: int, on_wait: Callable[[float], None] | None = None) -> CallPost:
        """The next `CallPost` of `call`, running every step rank 0 posts until it comes."""
        while True:
            box = self.inbox.get(call)
            if box:
                return box.popleft()
            msg = self.world.next_post(on_wait)
            if isinstance(msg, str) and msg == STOP:
                raise LockStepError(f"rank {self.world.rank} waits for call {call} but rank 0 stopped leading")
            self._take(msg)

    def drop(self, call: int, ended: bool) -> None:
        """The caller of `call` stopped listening: its outputs still to come are discarded."""
        box = self.inbox.pop(call, ())
        if not ended and not any(m.kind in ("end", "error") for m in box):
            self.dropped.add(call)

    def serve(self, on_wait: Callable[[float], None] | None = None) -> int:
        """Run rank 0's steps until it posts STOP (a server); every sequence is freed then."""
        start, self.serving = self.steps, True
        try:
            while True:
                msg = self.world.next_post(on_wait)
                if isinstance(msg, str) and msg == STOP:
                    return self.steps - start
                self._take(msg)
        finally:
            self.serving = False
            for seq in self.seqs.values():
                self.engine.free(seq)
            self.seqs.clear()

    def _take(self, msg: Any) -> None:
        """Run a posted step, or file a call's post for its caller."""
        if isinstance(msg, StepBatch):
            try:                    # rank 0 may be inside this step's collectives already
                self.engine.run(_replay(self.engine, self.seqs, msg, self.world.rank))
            except Exception as e:  # noqa: BLE001 -- reported once, then every rank ends
                _end_every_rank(e, f"in a step rank 0 posted, on rank {self.world.rank}")
            self.steps += 1
        elif isinstance(msg, CallPost):
            try:
                _apply_ops(self.engine, self.seqs, msg.ops, self.world.rank)
            except Exception as e:  # noqa: BLE001 -- the ranks have drifted apart: every rank ends
                _end_every_rank(e, f"between steps, on rank {self.world.rank}")
            if self.serving:
                return                      # (a call rank 0's server made for itself: its ops only)
            if msg.call in self.dropped:
                if msg.kind in ("end", "error"):
                    self.dropped.discard(msg.call)
            else:
                self.inbox.setdefault(msg.call, collections.deque()).append(msg)
        else:
            raise LockStepError(f"rank {self.world.rank} got a {type(msg).__name__} from rank 0 where a step was due")


_FOLLOWERS: "weakref.WeakKeyDictionary[Engine, Follower]" = weakref.WeakKeyDictionary()


def follower_for(engine: Engine, world: "World") -> Follower:
    """This rank's one `Follower` of `engine` (made on first use)."""
    f = _FOLLOWERS.get(engine)
    if f is None or f.world is not world:
        f = _FOLLOWERS[engine] = Follower(engine, world)
    return f


def follow(engine: Engine, world: "World", on_wait: Callable[[float], None] | None = None) -> int:
    """A rank > 0 of a served model: run every step rank 0 posts (`StepBatch`) with the same
    Engine.run calls, until rank 0 posts STOP. Waits without spinning (`World.next_post`;
    `on_wait` is called while it waits and may raise to give up). Returns the steps run."""
    return follower_for(engine, world).serve(on_wait)


def _end_every_rank(e: BaseException, where: str) -> None:
    """A step failed on one rank: the others may be inside its collectives, so every rank ends
    (the error printed once, by this rank). In one process (tests) the error is raised."""
    from metatp.backends.distributed import current_world, finish_error

    what = f"error: {e}" if isinstance(e, MetatpError) else f"internal error: {type(e).__name__}: {e}"
    finish_error(e, f"metatp: {what} ({where}; ending every rank)", 1)     # MPI_Abort of every rank
    world = current_world()
    if world is not None and world.size > 1:
        os._exit(1)                     # MPICH's MPI_Abort returns: no traceback after the line
    raise e


def _apply_ops(engine: Engine, seqs: dict[int, SeqCells], ops: tuple, rank: int) -> None:
    """Rank 0's cell operations on this rank's cache, in order."""
    for op in ops:
        if op[0] == "take":
            seqs[op[1]] = engine.cells.adopt(op[1], op[2])
            seqs[op[1]].n_past = op[3]          # positions it begins with (a prefix cache hit)
        elif op[0] == "grow" and op[1] in seqs:
            engine.cells.extend(seqs[op[1]], op[2])
        elif op[0] == "rewind" and op[1] in seqs:      # speculative decoding's rejected positions
            seqs[op[1]].n_past = op[2]
        elif op[0] == "free" and op[1] in seqs:
            engine.free(seqs.pop(op[1]))
        elif op[0] == "cache":              # the prefix cache keeps these cells (metatp.prefix_cache)
            engine.cells.cache(op[1])
        elif op[0] == "uncache":
            engine.cells.uncache(op[1])
        else:
            raise LockStepError(f"rank {rank} cannot apply rank 0's cell operation {op[:2]!r}")


def _replay(engine: Engine, seqs: dict[int, SeqCells], batch: StepBatch, rank: int) -> list[StepItem]:
    """Apply a StepBatch's cell operations to this rank's cache; its items as this rank's StepItems."""
    _apply_ops(engine, seqs, batch.ops, rank)
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
