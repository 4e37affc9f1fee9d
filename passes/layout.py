"""Chunk-layout algebra: where each device's chunks of a split tensor sit in flat element order.

Shared by the split rules (`passes/rules.py`: reshape / view / copy states) and lowering
(`passes/lower.py`: per-device strides and offsets), so both read one definition of a layout.

A *round* is one pass over the devices along the split axis: `(chunk length per device,
repeats)`. A state's rounds, scaled by the elements inside one position of the axis, give its
pattern in flat elements; a reshape or view keeps the flat order, so moving a split through it
is re-reading that pattern along the new dims (`reshape_state`), possibly clipped to a window
(`clip_rounds`). Everything here is pure arithmetic on shapes and states: no graph, no pass.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import Sequence

from metatp.ir.errors import SplitError
from metatp.ir.tensor import Tensor, block_size, contiguous_nb, type_size
from metatp.passes.state import SplitState

__all__ = ["Rounds", "rounds", "merge_rounds", "from_rounds", "same_layout", "reshape_state", "inner_size",
           "clip_rounds", "local_start", "ViewMode", "ViewAnalysis", "ViewError", "analyze_view",
           "elements_to_bytes", "bytes_to_elements", "base_offset", "owner_only", "local_ne", "local_contiguous_nb"]

Rounds = list[tuple[tuple[int, ...], int]]   # [(per-device chunk lengths, repeats)] in layout order


# ---------------------------------------------------------------- rounds


def merge_rounds(rs: Rounds) -> Rounds:
    """Drop empty rounds and merge consecutive equal ones (the canonical form of a pattern)."""
    out: Rounds = []
    for vec, c in rs:
        if c == 0:
            continue
        if out and out[-1][0] == vec:
            out[-1] = (vec, out[-1][1] + c)
        else:
            out.append((vec, c))
    return out


def rounds(st: SplitState, scale: int = 1) -> Rounds:
    """The state's chunk rounds in canonical form; chunk lengths times `scale`."""
    return merge_rounds([(tuple(x * scale for x in seg), nr) for seg, nr in zip(st.ne, st.nr)])


def from_rounds(axis: int, rs: Rounds) -> SplitState:
    return SplitState.segmented(axis, [(vec, c) for vec, c in rs])


def same_layout(a: SplitState, b: SplitState) -> bool:
    """Same axis and every device holds the same chunks (stronger than llama.cpp's `equal`)."""
    if a.axis != b.axis:
        return False
    return not a.is_split or rounds(a) == rounds(b)


def inner_size(ne: Sequence[int], axis: int) -> int:
    """Elements inside one position of `axis` (the product of the dims below it)."""
    n = 1
    for k in range(axis):
        n *= ne[k]
    return n


def reshape_state(rs: Rounds, dst_ne: Sequence[int], max_dim: int = 3, prefer_inner: int | None = None
                  ) -> SplitState | None:
    """Express a flat chunk pattern along the dims of a new shape.

    `rs` describes one block of the source in flat elements; the whole tensor is that block
    repeated. Returns the state along the first dst dim b (<= max_dim) whose inner product
    divides every chunk and whose block is a whole number of pattern periods; None if none.
    `prefer_inner`: try first the dim whose inner product equals it (keeps the axis of a
    reshape that does not touch the split dims)."""
    block = sum(sum(vec) * c for vec, c in rs)
    period = sum(rs[0][0]) if len(rs) == 1 else block
    if period == 0:
        return None
    candidates = list(range(max_dim + 1))
    if prefer_inner is not None:
        inner = 1
        for b in range(max_dim + 1):
            if inner == prefer_inner:
                candidates.remove(b)
                candidates.insert(0, b)
                break
            inner *= dst_ne[b]
    for b in candidates:
        inner = inner_size(dst_ne, b)           # elements per position of dst dim b
        span = inner * dst_ne[b]                # elements per step of dst dim b+1
        if span == 0 or span % period:
            continue
        if any(x % inner for vec, _ in rs for x in vec):
            continue
        if len(rs) == 1:
            segs: Rounds = [(tuple(x // inner for x in rs[0][0]), span // period)]
        else:
            segs = merge_rounds([(tuple(x // inner for x in vec), c) for vec, c in rs] * (span // block))
        return from_rounds(b, segs)
    return None


def clip_rounds(rs: Rounds, start: int, length: int) -> Rounds:
    """The rounds of the flat window [start, start+length) of one block."""
    out: Rounds = []
    pos = 0
    end = start + length
    for vec, c in rs:
        width = sum(vec)
        for _ in range(c):
            if pos + width <= start:
                pos += width
                continue
            if pos >= end:
                break
            clipped = []
            p = pos
            for x in vec:
                lo, hi = max(p, start), min(p + x, end)
                clipped.append(max(0, hi - lo))
                p += x
            out.append((tuple(clipped), 1))
            pos += width
        if pos >= end:
            break
    return merge_rounds(out)


def local_start(row_rounds: Rounds, start: int, j: int) -> int:
    """How many of device j's elements precede flat position `start` in a source row."""
    n = 0
    pos = 0
    for vec, c in row_rounds:
        for _ in range(c):
            for k, x in enumerate(vec):
                if pos >= start:
                    return n
                if k == j:
                    n += max(0, min(x, start - pos))
                pos += x
    return n


def owner_only(st: SplitState | None) -> int | None:
    """The device holding a split tensor entirely (all others hold nothing), else None."""
    if st is None or not st.is_split:
        return None
    holders = [j for j, e in enumerate(st.extents()) if e]
    return holders[0] if len(holders) == 1 else None


# ---------------------------------------------------------------- bytes and offsets


class ViewError(SplitError):
    """A view window that cannot be expressed per device (the reason, without the node context)."""


def elements_to_bytes(t: Tensor, n: int) -> int:
    """Bytes of `n` elements of t's type; n must be whole quant blocks."""
    bs = block_size(t.type)
    if n % bs:
        raise ViewError(f"an offset of {n} elements is not a whole number of {t.type.name} blocks")
    return n // bs * type_size(t.type)


def bytes_to_elements(t: Tensor, nbytes: int) -> int | None:
    """Elements in `nbytes` of t's type; None when that is not on a block boundary."""
    ts = type_size(t.type)
    if nbytes % ts:
        return None
    return nbytes // ts * block_size(t.type)


def base_offset(t: Tensor) -> int:
    """t's byte offset into the memory it aliases (0 for a tensor with its own memory)."""
    return t.view_offs if t.view_src is not None else 0


def local_ne(t: Tensor, st: SplitState, j: int) -> tuple[int, int, int, int]:
    """Device j's shape of t: the split dim gets j's extent."""
    if not st.is_split:
        return t.ne
    ne = list(t.ne)
    ne[st.axis] = st.extent(j)
    return tuple(ne)


def local_contiguous_nb(t: Tensor, ne: Sequence[int]) -> tuple[int, int, int, int]:
    """Contiguous byte strides of a device slice `ne` of t; SplitError if it cuts a quant block."""
    try:
        return contiguous_nb(t.type, ne)
    except ValueError as e:
        raise SplitError(f"tensor {t.name!r}: device slice {list(ne)} is not whole {t.type.name} blocks "
                         f"({e})") from None


# ---------------------------------------------------------------- views


class ViewMode(str, enum.Enum):
    SAME = "same"          # the source is not split, or the view is the source itself
    WINDOW = "window"      # view dims 0..inner_dims cover a contiguous flat range of one source row
    DIRECT = "direct"      # view dim `dim` walks the source's split axis with its stride


@dataclass
class ViewAnalysis:
    """Where a VIEW sits in its split source (shared by the VIEW rule and its lowering).

    WINDOW: view dims 0..inner_dims are contiguous and cover a flat range of one source row
    (the source's dims 0..src_axis); DIRECT: view dim `dim` walks the source's split axis with
    its stride (dims below stay inside one position, dims above step whole rows)."""

    state: SplitState
    mode: ViewMode = ViewMode.SAME
    src_axis: int = 0          # split axis of the source
    dim: int = 0               # split dim of the view
    inner_dims: int = 0        # window: view dims 0..inner_dims are contiguous
    row_bytes: int = 0         # bytes of one source row at level src_axis (src.nb[src_axis+1])
    outer_rows: int = 0        # whole source rows skipped by the offset
    start: int = 0             # window: flat element offset in the row; direct: first position
    within: int = 0            # direct: bytes into the first position
    row_rounds: Rounds | None = None   # the row's chunk pattern (window: flat elements; direct: positions)
    identical: bool = False    # same shape/strides/offset as the source


def _contiguous_prefix(node: Tensor) -> int:
    """The last dim d such that view dims 0..d are laid out contiguously (size-1 dims pass)."""
    try:
        cnb = contiguous_nb(node.type, node.ne)
    except ValueError:
        return -1
    d = -1
    for i in range(4):
        if node.ne[i] == 1 or node.nb[i] == cnb[i]:
            d = i
        else:
            break
    return d


def _outer_dims_step_rows(node: Tensor, first: int, row_bytes: int) -> bool:
    return all(node.ne[i] == 1 or (row_bytes and node.nb[i] % row_bytes == 0) for i in range(first, 4))


def _row_bytes(src: Tensor, axis: int) -> int:
    return src.nb[axis + 1] if axis < 3 else src.nb[3] * src.ne[3]


def _window_view(node: Tensor, src: Tensor, st: SplitState, rel: int) -> ViewAnalysis:
    a = st.axis
    row_bytes = _row_bytes(src, a)
    inner = inner_size(src.ne, a)
    rowlen = inner * src.ne[a]
    outer_rows, w = divmod(rel, row_bytes)
    start = bytes_to_elements(src, w)
    if start is None:
        raise ViewError(f"offset {rel} is not on an element boundary")
    d = _contiguous_prefix(node)
    if d < 0:
        raise ViewError("the view's inner dims are not contiguous")
    length = math.prod(node.ne[: d + 1])
    if not _outer_dims_step_rows(node, d + 1, row_bytes):
        raise ViewError("the view's outer dims do not step whole rows of the split source")
    row_rounds = rounds(st, inner)
    if length <= rowlen:
        if start + length > rowlen:
            raise ViewError("the window crosses a row of the split source")
        rs = clip_rounds(row_rounds, start, length)
    else:
        if start or length % rowlen:
            raise ViewError("the window spans a partial row of the split source")
        rs = merge_rounds(row_rounds * (length // rowlen))
    out = reshape_state(rs, node.ne, max_dim=d) if rs else None
    if out is None:
        raise ViewError(f"the window cannot be split along a dim of {list(node.ne)} without cutting a device's chunk")
    return ViewAnalysis(out, ViewMode.WINDOW, a, out.axis, d, row_bytes, outer_rows, start, 0, row_rounds)


def _direct_view(node: Tensor, src: Tensor, st: SplitState, rel: int) -> ViewAnalysis:
    a = st.axis
    step = src.nb[a]
    row_bytes = _row_bytes(src, a)
    dims = [i for i in range(4) if node.ne[i] > 1 and node.nb[i] == step]
    if len(dims) != 1:
        raise ViewError("no view dim walks the split axis")
    i = dims[0]
    if any(node.ne[k] > 1 and node.nb[k] >= step for k in range(i)):
        raise ViewError("the view's inner dims leave one position of the split axis")
    if not _outer_dims_step_rows(node, i + 1, row_bytes):
        raise ViewError("the view's outer dims do not step whole rows of the split source")
    outer_rows, w = divmod(rel, row_bytes)
    p0, within = divmod(w, step)
    span = sum((node.ne[k] - 1) * node.nb[k] for k in range(i)) + type_size(node.type)
    if within + span > step or p0 + node.ne[i] > src.ne[a]:
        raise ViewError("the view leaves the split source")
    pos_rounds = rounds(st)
    rs = clip_rounds(pos_rounds, p0, node.ne[i])
    out = from_rounds(i, rs)
    return ViewAnalysis(out, ViewMode.DIRECT, a, i, i, row_bytes, outer_rows, p0, within, pos_rounds)


def analyze_view(node: Tensor, src: Tensor, st: SplitState) -> ViewAnalysis:
    """The view's state and the numbers lowering needs; raises ViewError for windows that
    cannot be expressed per device."""
    if not st.is_split:
        return ViewAnalysis(st)
    rel = node.view_offs - base_offset(src)
    if node.ne == src.ne and node.nb == src.nb and rel == 0:
        return ViewAnalysis(st, identical=True)
    if src.nb != contiguous_nb(src.type, src.ne):
        raise ViewError(f"views into the non-contiguous split tensor {src.name!r} are not supported; "
                        f"make it contiguous first")
    try:
        return _window_view(node, src, st, rel)
    except ViewError as first:
        try:
            return _direct_view(node, src, st, rel)
        except ViewError:
            raise first from None
