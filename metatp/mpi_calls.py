"""The calls every rank makes alike under MPI: rank 0 runs them, the other ranks follow and get rank 0's results.

A program started by `mpiexec -n N python script.py` runs the same `LLM` calls on every rank.
Under MPI only rank 0 schedules and samples (`metatp.lockstep`): on rank 0 a call such as
`generate` runs as in one process, its scheduler posting every step; on a rank > 0 the same
call runs no scheduler -- it replays the steps rank 0 posts until rank 0 posts that the call
ended, with its result, and returns that result. So every rank returns rank 0's outputs (the
same text, token ids, request ids and timings), computed from rank 0's arguments: the other
ranks' prompts and seeds are not read.

Results travel once, at the end of a call (`CallPost` "end"): a follower needs nothing of a
call until it returns, so one message per call beats one per step. A call that returns a
stream (`create_completion(stream=True)`) posts "stream" when it returns and then each item
as rank 0's caller takes it, so a follower's loop yields the same chunks in step with rank 0.
An error rank 0's call raises is posted and raised on every rank, marked as one every rank
hit (`every_rank`): it is printed once, by rank 0, and ends no job by MPI_Abort.

Calls are numbered in the order a rank makes them, so the ranks must make them in the same
order (as a program every rank runs alike does); a follower waiting for one call's output
keeps what comes for another (two streams read in turn). A call made inside another call on
rank 0 is part of it and is not posted.
"""

from __future__ import annotations

import functools
import pickle
import sys
import threading
from typing import TYPE_CHECKING, Any, Callable, Iterator, TypeVar

from metatp.ir.errors import MetatpError
from metatp.lockstep import CallPost, LockStepError, follower_for

if TYPE_CHECKING:
    from metatp.backends.distributed import World

__all__ = ["MpiCalls", "mirrored"]

T = TypeVar("T")


class MpiCalls:
    """One LLM's calls under an MPI world of several ranks (see the module doc)."""

    def __init__(self, llm: Any, world: "World") -> None:
        self.world = world
        self.n_calls = 0
        self._inside = threading.local()        # rank 0: depth of calls being run (nested ones are not posted)
        if world.rank == 0:
            self.leader = llm.scheduler.lead(world)
            self.follower = None
        else:
            self.leader = None
            self.follower = follower_for(llm.engine, world)

    def call(self, run: Callable[[], T]) -> T:
        """`run()` on rank 0, its result (or error) on every rank; a stream it returns is followed."""
        if self.leader is not None and getattr(self._inside, "depth", 0):
            return run()
        call = self.n_calls
        self.n_calls += 1
        if self.leader is None:
            return self._follow(call)
        try:
            value = self._lead(run)
        except Exception as e:
            self.leader.post_call(call, "error", _portable(e))
            raise
        if isinstance(value, Iterator):
            self.leader.post_call(call, "stream")
            return self._lead_stream(call, value)
        self.leader.post_call(call, "end", value)
        return value

    def _lead(self, run: Callable[[], T]) -> T:
        self._inside.depth = getattr(self._inside, "depth", 0) + 1
        try:
            return run()
        finally:
            self._inside.depth -= 1

    def _lead_stream(self, call: int, items: Iterator) -> Iterator:
        """Rank 0's stream: each item posted as the caller takes it, then its end (or error)."""
        post = self.leader.post_call
        try:
            while True:
                try:
                    item = self._lead(lambda: next(items))
                except StopIteration:
                    break
                post(call, "item", item)
                yield item
        except GeneratorExit:               # the caller stopped listening: the followers' streams end too
            if not _finalized():             # (a stream left open until exit closes after MPI has ended)
                post(call, "end")
            raise
        except Exception as e:
            post(call, "error", _portable(e))
            raise
        finally:
            close = getattr(items, "close", None)
            if close is not None:           # its requests are cancelled now, not at garbage collection
                close()
        post(call, "end")

    def _follow(self, call: int) -> Any:
        msg = self.follower.next_for(call)
        if msg.kind == "error":
            raise msg.value
        if msg.kind == "stream":
            return self._follow_stream(call)
        if msg.kind != "end":
            raise LockStepError(f"rank {self.world.rank}: call {call} got a {msg.kind!r} post where its result was due")
        return msg.value

    def _follow_stream(self, call: int) -> Iterator:
        """A rank > 0's stream: rank 0's items, running the steps that come between them."""
        ended = False
        try:
            while True:
                msg: CallPost = self.follower.next_for(call)
                if msg.kind == "item":
                    yield msg.value
                    continue
                ended = True
                if msg.kind == "error":
                    raise msg.value
                return
        finally:
            if not ended:
                self.follower.drop(call, ended)


def mirrored(method: Callable[..., T]) -> Callable[..., T]:
    """An LLM method every rank calls alike: under MPI it runs on rank 0 and returns rank 0's
    result on every rank (`MpiCalls.call`); in one process it is the method itself."""
    @functools.wraps(method)
    def call(self, *args: Any, **kwargs: Any) -> T:
        calls = getattr(self, "_mpi_calls", None)
        if calls is None:
            return method(self, *args, **kwargs)
        return calls.call(lambda: method(self, *args, **kwargs))
    return call


def _finalized() -> bool:
    """Has MPI ended in this process (a stream's last close, from garbage collected at exit)?"""
    mpi = sys.modules.get("mpi4py.MPI")          # not imported: MPI was never started here
    return mpi is not None and bool(mpi.Is_finalized())


def _portable(e: BaseException) -> BaseException:
    """`e` marked as raised on every rank (`every_rank`: rank 0 alone reports it), or, when it
    cannot be pickled, a MetatpError with its type and message for the other ranks."""
    e.every_rank = True                 # type: ignore[attr-defined]
    try:
        pickle.loads(pickle.dumps(e))
    except Exception:  # noqa: BLE001 -- any exception type may come here
        copy = MetatpError(f"{type(e).__name__}: {e}")
        copy.every_rank = True          # type: ignore[attr-defined]
        return copy
    return e
