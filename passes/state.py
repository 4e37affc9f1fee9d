"""SplitState: how one tensor is spread over N devices (the compiler's core vocabulary).

- axis 0..3: each device holds contiguous chunks along that ggml dim;
- MIRRORED: every device holds the whole tensor;
- PARTIAL: every device holds a full-shape tensor; the true value is the sum over devices.

Along a split axis the full tensor is laid out as: for each segment s, for each repeat r < nr[s],
for each device j, device j's chunk of ne[s][j] elements. A device's local tensor is its chunks
concatenated in (s, r) order. Fused QKV is segments ((q per device), 1), ((kv per device), 2):
device j holds [Q_j | K_j | V_j].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

__all__ = ["SplitState", "MIRRORED", "PARTIAL", "AXIS_NAMES"]

MIRRORED = 10
PARTIAL = 11
AXIS_NAMES = {0: "AXIS_0", 1: "AXIS_1", 2: "AXIS_2", 3: "AXIS_3", MIRRORED: "MIRRORED", PARTIAL: "PARTIAL"}


@dataclass(frozen=True)
class SplitState:
    axis: int
    ne: tuple[tuple[int, ...], ...] = ()   # ne[s][j]: elements of segment s on device j
    nr: tuple[int, ...] = ()               # nr[s]: repeats of segment s along the axis

    # ---------------------------------------------------------------- constructors
    @staticmethod
    def mirrored() -> SplitState:
        return _MIRRORED

    @staticmethod
    def partial() -> SplitState:
        return _PARTIAL

    @staticmethod
    def split(axis: int, per_device: Sequence[int], nr: int = 1) -> SplitState:
        if axis not in (0, 1, 2, 3):
            raise ValueError(f"split axis must be 0..3, got {axis}")
        return SplitState(axis, (tuple(int(x) for x in per_device),), (int(nr),))

    @staticmethod
    def segmented(axis: int, segments: Sequence[tuple[Sequence[int], int]]) -> SplitState:
        """segments: [(per-device elements, repeats), ...]."""
        if axis not in (0, 1, 2, 3):
            raise ValueError(f"split axis must be 0..3, got {axis}")
        return SplitState(axis, tuple(tuple(int(x) for x in pd) for pd, _ in segments),
                          tuple(int(r) for _, r in segments))

    # ---------------------------------------------------------------- queries
    @property
    def is_split(self) -> bool:
        return self.axis in (0, 1, 2, 3)

    @property
    def is_mirrored(self) -> bool:
        return self.axis == MIRRORED

    @property
    def is_partial(self) -> bool:
        return self.axis == PARTIAL

    @property
    def n_segments(self) -> int:
        return len(self.ne) if self.is_split else 1

    @property
    def n_devices(self) -> int:
        return len(self.ne[0]) if self.is_split else 0

    def extent(self, j: int) -> int:
        """Elements device j holds along the split axis."""
        return sum(seg[j] * r for seg, r in zip(self.ne, self.nr))

    def extents(self) -> tuple[int, ...]:
        return tuple(self.extent(j) for j in range(self.n_devices))

    def total(self) -> int:
        return sum(sum(seg) * r for seg, r in zip(self.ne, self.nr))

    def equal(self, other: SplitState) -> bool:
        """llama.cpp's split_states_equal: same axis and same per-device totals."""
        if self.axis != other.axis:
            return False
        return not self.is_split or self.extents() == other.extents()

    def chunks(self) -> Iterator[tuple[int, int, int, int]]:
        """(device, global start, local start, length) of every chunk along the axis."""
        n = self.n_devices
        g = 0
        local = [0] * n
        for seg, r in zip(self.ne, self.nr):
            for _ in range(r):
                for j in range(n):
                    if seg[j]:
                        yield j, g, local[j], seg[j]
                    g += seg[j]
                    local[j] += seg[j]

    def with_extents(self, axis: int, per_device: Sequence[int]) -> SplitState:
        return SplitState.split(axis, per_device)

    def __str__(self) -> str:
        if not self.is_split:
            return AXIS_NAMES[self.axis]
        if self.n_segments == 1 and self.nr[0] == 1:
            return f"AXIS_{self.axis}{list(self.ne[0])}"
        segs = " ".join(f"{list(seg)}x{r}" for seg, r in zip(self.ne, self.nr))
        return f"AXIS_{self.axis}{{{segs}}}"


_MIRRORED = SplitState(MIRRORED)
_PARTIAL = SplitState(PARTIAL)
