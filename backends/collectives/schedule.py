"""All-reduce algorithms as data: rounds of transfers, and the table that names them.

A `Schedule` is what every backend lowers (the host runner in `host.py` runs it on numpy
arrays; a device backend turns each transfer into a peer copy plus an add, with events between
rounds) and what `metatp dump` / `metatp bench` bill. Its meaning:

- Before the first round, every inactive device's buffer is filled with zeros (a device whose
  slice was empty holds garbage, possibly NaN; multiplying by 0 would keep it).
- Rounds run in order. Within a round, every read happens before any write: a transfer reads
  the *source's* elements [start, start + length) as they were when the round began and adds
  them to (ADD) or stores them into (COPY) the same range of the destination.
- No two transfers of a round write overlapping ranges of one device.
- Afterwards every device holds the same bits.

Adding an algorithm is one schedule function `f(n_devices, n_elements) -> Schedule` and one row
in `ALLREDUCE_MODES`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable

from metatp.backends.collectives.wire import WireThresholds, wire_itemsize
from metatp.ir.errors import ConfigError

__all__ = ["TransferOp", "Transfer", "Schedule", "ScheduleFn", "butterfly_schedule", "ring_schedule",
           "Mode", "ALLREDUCE_MODES", "ALIASES", "MODE_NAMES", "mode_names", "resolve_mode", "schedule_for",
           "check_schedule", "bytes_moved", "bytes_per_rank", "allreduce_bytes", "chunk_bounds"]


class TransferOp(str, enum.Enum):
    """What the destination does with what it reads."""

    ADD = "add"
    COPY = "copy"


@dataclass(frozen=True)
class Transfer:
    """Device `dst` reads elements [start, start + length) of device `src` and adds them to its
    own (ADD) or takes them (COPY)."""

    dst: int
    src: int
    op: TransferOp
    start: int
    length: int


@dataclass(frozen=True)
class Schedule:
    """One all-reduce of `n_elements` over `n_devices`, as rounds of transfers (see the module
    docstring for the rules every backend relies on)."""

    name: str
    n_devices: int
    n_elements: int
    rounds: tuple[tuple[Transfer, ...], ...]


ScheduleFn = Callable[[int, int], Schedule]


def _schedule(name: str, n: int, n_elements: int, rounds: list[list[Transfer]]) -> Schedule:
    """Drop empty transfers (a chunk of zero elements) and the rounds they leave empty."""
    kept = tuple(tuple(t for t in rnd if t.length > 0) for rnd in rounds)
    return Schedule(name, n, n_elements, tuple(rnd for rnd in kept if rnd))


def _check_size(n: int, n_elements: int) -> None:
    if n < 1:
        raise ValueError(f"an all-reduce needs at least one device, got {n}")
    if n_elements < 0:
        raise ValueError(f"n_elements must be >= 0, got {n_elements}")


# ---------------------------------------------------------------- the algorithms


def butterfly_schedule(n: int, n_elements: int) -> Schedule:
    """llama.cpp's fallback for any n: fold the devices beyond the largest power of two p2 into
    0..n-p2-1, recursive doubling over p2 at distances p2/2 .. 1 (partners swap and add whole
    buffers), copy back to the folded devices. ceil(log2 n) rounds of adds."""
    _check_size(n, n_elements)
    if n == 1:
        return _schedule("butterfly", n, n_elements, [])
    p2 = 1 << (n.bit_length() - 1)
    whole = (0, n_elements)
    add, copy = TransferOp.ADD, TransferOp.COPY
    rounds: list[list[Transfer]] = []
    if n > p2:
        rounds.append([Transfer(j - p2, j, add, *whole) for j in range(p2, n)])
    off = p2 // 2
    while off >= 1:
        rounds.append([Transfer(j, j ^ off, add, *whole) for j in range(p2)])
        off //= 2
    if n > p2:
        rounds.append([Transfer(j, j - p2, copy, *whole) for j in range(p2, n)])
    return _schedule("butterfly", n, n_elements, rounds)


def chunk_bounds(n_elements: int, n_chunks: int) -> list[tuple[int, int]]:
    """(start, length) of n_chunks near-equal pieces; the first n_elements % n_chunks get one
    more element (numpy.array_split's rule)."""
    base, extra = divmod(n_elements, n_chunks)
    out, start = [], 0
    for c in range(n_chunks):
        length = base + (1 if c < extra else 0)
        out.append((start, length))
        start += length
    return out


def ring_schedule(n: int, n_elements: int) -> Schedule:
    """Reduce-scatter then all-gather around the ring 0 -> 1 -> ... -> n-1 -> 0, the buffer cut
    into n chunks. In reduce-scatter round s every device d adds its running sum of chunk
    (d - s) mod n into device d+1, so after n-1 rounds device d holds the full sum of chunk
    (d + 1) mod n; the all-gather passes the finished chunks on in n-1 copy rounds. Each rank
    sends 2(n-1)/n of the buffer: bandwidth-optimal, at 2(n-1) latencies."""
    _check_size(n, n_elements)
    chunks = chunk_bounds(n_elements, n)
    rounds: list[list[Transfer]] = []
    for op, first in ((TransferOp.ADD, 0), (TransferOp.COPY, 1)):
        for s in range(n - 1):
            rounds.append([Transfer((d + 1) % n, d, op, *chunks[(d + first - s) % n]) for d in range(n)])
    return _schedule("ring", n, n_elements, rounds)


# ---------------------------------------------------------------- the mode table


@dataclass(frozen=True)
class Mode:
    """One all-reduce choice. `schedule` is None for a library collective only a device backend
    can run (NCCL); `billed_as` is then the schedule whose bytes the communication bill charges
    for it."""

    name: str
    schedule: ScheduleFn | None
    summary: str
    billed_as: ScheduleFn | None = None

    @property
    def device_only(self) -> bool:
        return self.schedule is None

    def bill_schedule(self, n: int, n_elements: int) -> Schedule:
        fn = self.schedule or self.billed_as
        assert fn is not None, self.name
        return fn(n, n_elements)


ALLREDUCE_MODES: dict[str, Mode] = {
    "butterfly": Mode("butterfly", butterfly_schedule,
                      "fold to a power of two, recursive doubling, copy back (llama.cpp's fallback)"),
    "ring": Mode("ring", ring_schedule, "reduce-scatter + all-gather of n chunks around a ring"),
    "nccl": Mode("nccl", None, "ncclAllReduce, one GPU per device (device backends only)",
                 billed_as=ring_schedule),
}
# llama.cpp's spellings (GGML_CUDA_ALLREDUCE=nccl|internal|none): "none" runs the meta backend's
# fallback butterfly; "internal" is its own copy-and-add collective, which here is the butterfly
# (its 2-GPU kernel through host memory is not ported).
ALIASES: dict[str, str] = {"none": "butterfly", "internal": "butterfly"}
MODE_NAMES: tuple[str, ...] = ("auto", *ALLREDUCE_MODES, *ALIASES)   # for CLI choices and docs


def mode_names() -> tuple[str, ...]:
    """Every accepted option value, as the table holds them now."""
    return ("auto", *ALLREDUCE_MODES, *ALIASES)


def resolve_mode(name: str, auto: str = "butterfly") -> Mode:
    """The table row for an option value; "auto" means `auto` (each backend picks its own)."""
    if not isinstance(name, str) or name not in mode_names():
        raise ConfigError(f"allreduce must be one of {', '.join(mode_names())}, got {name!r}")
    if name == "auto":
        name = auto
    return ALLREDUCE_MODES[ALIASES.get(name, name)]


def schedule_for(name: str, n_devices: int, n_elements: int) -> Schedule:
    """The schedule a mode runs (or, for a device-only mode, the one it is billed as)."""
    return resolve_mode(name).bill_schedule(n_devices, n_elements)


# ---------------------------------------------------------------- checks and byte counts


def check_schedule(s: Schedule) -> None:
    """Raise ValueError unless `s` keeps the rules of the module docstring that a runner relies
    on (indices and ranges in bounds, no device reading itself, one writer per range)."""
    for k, rnd in enumerate(s.rounds):
        written: dict[int, list[tuple[int, int]]] = {}
        for t in rnd:
            if not (0 <= t.dst < s.n_devices and 0 <= t.src < s.n_devices) or t.dst == t.src:
                raise ValueError(f"{s.name} round {k}: bad devices in {t}")
            if t.start < 0 or t.length < 0 or t.start + t.length > s.n_elements:
                raise ValueError(f"{s.name} round {k}: range of {t} outside {s.n_elements} elements")
            for a, b in written.get(t.dst, []):
                if t.start < b and a < t.start + t.length:
                    raise ValueError(f"{s.name} round {k}: two writes overlap on device {t.dst}")
            written.setdefault(t.dst, []).append((t.start, t.start + t.length))


def bytes_moved(s: Schedule, wire: str = "f32", thresholds: WireThresholds = WireThresholds()) -> int:
    """Bytes sent over all links together for one all-reduce (wire "f32", "bf16" or "auto")."""
    size = wire_itemsize(s.n_devices, s.n_elements, wire, thresholds)
    return sum(t.length for rnd in s.rounds for t in rnd) * size


def bytes_per_rank(s: Schedule, wire: str = "f32", thresholds: WireThresholds = WireThresholds()) -> int:
    """Bytes on the busiest rank's link, round after round: per round the most any device sends
    or receives, summed over rounds. This is what bandwidth-time charges (rounds are sequential,
    transfers of a round run side by side); for the ring it is 2(n-1)/n of the buffer."""
    size = wire_itemsize(s.n_devices, s.n_elements, wire, thresholds)
    total = 0
    for rnd in s.rounds:
        sent = [0] * s.n_devices
        received = [0] * s.n_devices
        for t in rnd:
            sent[t.src] += t.length
            received[t.dst] += t.length
        total += max(max(sent), max(received))
    return total * size


def allreduce_bytes(mode: str, n_devices: int, n_elements: int, wire: str = "f32",
                    thresholds: WireThresholds = WireThresholds()) -> tuple[int, int]:
    """(bytes_per_rank, bytes_moved) of one all-reduce of n_elements by `mode` (a device-only
    mode: by the schedule it is billed as). What `metatp dump` and `metatp bench` report."""
    if n_devices < 2 or n_elements <= 0:
        return 0, 0
    s = schedule_for(mode, n_devices, n_elements)
    return bytes_per_rank(s, wire, thresholds), bytes_moved(s, wire, thresholds)
