"""Two engines compared along one token path: a backend measured against a reference engine
(tests/cuda/test_cupy_backend.py; `scripts/gpu_check`'s model step runs the same loop)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["teacher_forced"]


def teacher_forced(eng, ref, prompt: Sequence[int], steps: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Prefill `prompt` on both engines, then feed both `steps` decode tokens chosen greedily by
    the reference, so that one engine's small errors never steer the path; returns the last-row
    logits of every step, (engine's, reference's)."""
    got, want = [eng.forward(prompt)], [ref.forward(prompt)]
    for _ in range(steps):
        tok = int(np.argmax(want[-1]))
        got.append(eng.forward([tok]))
        want.append(ref.forward([tok]))
    return got, want
