"""Element-type conversions and the ggml-shape convention, written once.

bfloat16 has no numpy dtype: it travels as uint16 bit patterns. ggml's `ne[0]` is the innermost
dimension, so a tensor with `ne=[a, b, c, d]` is a numpy array of shape `(d, c, b, a)`.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

__all__ = ["bf16_bits_to_f32", "f32_to_bf16_bits", "np_shape"]


def bf16_bits_to_f32(b: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> float32, exactly."""
    return (np.asarray(b, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """ggml's f32 -> bf16 (round to nearest even, NaN quieted) as uint16 bit patterns."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    r = ((u + (0x7FFF + ((u >> 16) & 1))) >> 16).astype(np.uint16)
    return np.where(nan, ((u >> 16) | 64).astype(np.uint16), r).astype(np.uint16)


def np_shape(ne: Sequence[int]) -> tuple[int, int, int, int]:
    """The numpy shape of a 4-dim ggml `ne` (ne[0] innermost, so last)."""
    return (ne[3], ne[2], ne[1], ne[0])
