"""One sequence's logits alone and among 7 others (the batch-invariance tests of both backends)."""

from __future__ import annotations

import numpy as np

from metatp import LLM
from metatp.engine import StepItem

PROMPT = [5, 17, 3, 99, 42, 8, 61, 7, 23, 150, 11]
OTHERS = [[3 + i] * (2 + 4 * i) for i in range(7)]       # 2..26 tokens: the batch's other lengths
STEPS = 4           # decode steps: each one a pass of all 8 sequences (the emulator's seconds)


def sequence_logits(llm: LLM, batched: bool, at: int = 3) -> list[np.ndarray]:
    """PROMPT's logits (every row), then STEPS greedy decode steps' logits: alone, or with the 7
    OTHERS prefilled in the same pass and decoding beside it (it at place `at` among them)."""
    eng = llm.engine
    before = [eng.new_sequence() for _ in OTHERS[:at]] if batched else []     # cells before its own
    seq = eng.new_sequence()
    others = before + ([eng.new_sequence() for _ in OTHERS[at:]] if batched else [])
    items = [StepItem(o, list(p), "last") for o, p in zip(others, OTHERS)]
    items.insert(at if batched else 0, StepItem(seq, list(PROMPT), "all"))
    mine = at if batched else 0
    got = [eng.run(items)[mine]]
    token = int(np.argmax(got[0][-1]))
    for t in range(STEPS):
        step = [StepItem(o, [7 + (t + i) % 50], "last") for i, o in enumerate(others)]
        step.insert(mine, StepItem(seq, [token], "last"))
        out = eng.run(step)[mine]
        got.append(out)
        token = int(np.argmax(out))
    if batched and at:
        assert int(seq.cells[0]) >= at * llm.backend.kv_page()       # its cells after the first ones' pages
    for s in [seq] + others:
        eng.free(s)
    assert eng.cells.n_used == 0
    return got
