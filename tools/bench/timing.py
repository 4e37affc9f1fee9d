"""One timed run of a test (a prompt, or n decode steps) and the MPI time spent inside it."""

from __future__ import annotations

import resource
import time

import numpy as np

__all__ = ["AllreduceTimer", "time_prompt", "time_gen", "peak_rss", "draw", "measure"]


class AllreduceTimer:
    """The MPI collective's call count and seconds summed over the timed regions only (not the
    warm-up, the reset or the depth prefill), from `MpiCollective.calls` / `.seconds`."""

    def __init__(self, collective) -> None:
        self.collective = collective
        self.calls = 0
        self.seconds = 0.0
        self._mark = (0, 0.0)

    def begin(self) -> None:
        self._mark = (self.collective.calls, self.collective.seconds)

    def end(self) -> None:
        self.calls += self.collective.calls - self._mark[0]
        self.seconds += self.collective.seconds - self._mark[1]

    def reset(self) -> None:
        self.calls, self.seconds = 0, 0.0


def time_prompt(eng, tokens: list[int], depth: list[int], timer: AllreduceTimer | None = None) -> float:
    eng.reset()
    if depth:
        eng.forward(depth)
    if timer:
        timer.begin()
    t0 = time.perf_counter()
    eng.forward(tokens)
    dt = time.perf_counter() - t0
    if timer:
        timer.end()
    return dt


def time_gen(eng, n_gen: int, depth: list[int], first: int, timer: AllreduceTimer | None = None) -> float:
    eng.reset()
    eng.forward(depth or [first])
    tok = first
    if timer:
        timer.begin()
    t0 = time.perf_counter()
    for _ in range(n_gen):
        tok = int(np.argmax(eng.forward([tok])))
    dt = time.perf_counter() - t0
    if timer:
        timer.end()
    return dt


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def draw(test: tuple[int, int, int], rng, vocab: int) -> list[int]:
    """The random tokens one run of a test feeds (the prompt, or the first decode token)."""
    n_prompt = test[0]
    if n_prompt:
        return [int(x) for x in rng.integers(0, vocab, n_prompt)]
    return [int(rng.integers(0, vocab))]


def measure(eng, test: tuple[int, int, int], depth_ids: list[int], rng, vocab: int,
             timer: AllreduceTimer | None = None) -> float:
    """tokens/s of one run of a test."""
    n_prompt, n_gen, _ = test
    toks = draw(test, rng, vocab)
    if n_prompt:
        return n_prompt / time_prompt(eng, toks, depth_ids, timer)
    return n_gen / time_gen(eng, n_gen, depth_ids, toks[0], timer)
