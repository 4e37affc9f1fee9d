"""A ggml-style tensor: shape `ne`, byte strides `nb`, the op that makes it and its sources.

Shapes follow ggml: `ne[0]` is the innermost, contiguous dimension. A numpy array holding a
tensor with `ne=[a, b, c, d]` has shape `(d, c, b, a)`.
"""

from __future__ import annotations

import enum
import itertools
from typing import Any, Sequence

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as GGMLType

__all__ = ["GGMLType", "Flag", "Tensor", "block_size", "type_size", "row_bytes", "contiguous_nb"]


class Flag(enum.IntFlag):
    NONE = 0
    INPUT = 1        # filled by the runtime every step (token ids, positions, masks)
    OUTPUT = 2       # read back by the runtime (logits)
    WEIGHT = 4       # a model parameter from the GGUF file
    KV_CACHE = 8     # persistent state written by SET_ROWS


def block_size(t: GGMLType) -> int:
    """Elements per quantisation block (1 for plain types)."""
    return GGML_QUANT_SIZES[GGMLType(t)][0]


def type_size(t: GGMLType) -> int:
    """Bytes per quantisation block (bytes per element for plain types)."""
    return GGML_QUANT_SIZES[GGMLType(t)][1]


def row_bytes(t: GGMLType, ne0: int) -> int:
    """Bytes of one row of `ne0` elements of type `t`."""
    bs = block_size(t)
    if ne0 % bs:
        raise ValueError(f"row of {ne0} elements is not a whole number of {GGMLType(t).name} blocks ({bs})")
    return ne0 // bs * type_size(t)


def contiguous_nb(t: GGMLType, ne: Sequence[int]) -> tuple[int, int, int, int]:
    """ggml's strides for a contiguous tensor of type `t` and shape `ne`."""
    nb0 = type_size(t)
    nb1 = row_bytes(t, ne[0])
    nb2 = nb1 * ne[1]
    nb3 = nb2 * ne[2]
    return (nb0, nb1, nb2, nb3)


_ids = itertools.count()


class Tensor:
    """One node or leaf of a graph, shaped like `ggml_tensor`.

    Identity matters (graphs are DAGs of these objects), so equality is `is` and the
    hash is a per-process id.
    """

    __slots__ = ("id", "name", "op", "src", "params", "type", "ne", "nb", "view_src", "view_offs", "flags")

    def __init__(
        self,
        name: str,
        op: Any,
        src: Sequence[Tensor | None] = (),
        params: dict | None = None,
        type: GGMLType = GGMLType.F32,
        ne: Sequence[int] = (1, 1, 1, 1),
        nb: Sequence[int] | None = None,
        view_src: Tensor | None = None,
        view_offs: int = 0,
        flags: Flag = Flag.NONE,
    ) -> None:
        ne4 = tuple(int(x) for x in ne) + (1,) * (4 - len(ne))
        if len(ne4) != 4 or any(x < 0 for x in ne4):
            raise ValueError(f"tensor {name!r}: bad shape {tuple(ne)}")
        self.id = next(_ids)
        self.name = name
        self.op = op
        self.src = tuple(src)
        self.params = dict(params or {})
        self.type = GGMLType(type)
        self.ne = ne4
        self.nb = tuple(int(x) for x in nb) if nb is not None else contiguous_nb(self.type, ne4)
        # ggml keeps view_src pointing at the tensor that owns the memory
        if view_src is not None and view_src.view_src is not None:
            view_offs += view_src.view_offs
            view_src = view_src.view_src
        self.view_src = view_src
        self.view_offs = int(view_offs)
        self.flags = Flag(flags)

    def __hash__(self) -> int:
        return self.id

    def __eq__(self, other: object) -> bool:
        return self is other

    def __repr__(self) -> str:
        return f"Tensor({self.name!r}, {self.op.name}, ne={list(self.ne)}, {self.type.name})"

    @property
    def nelements(self) -> int:
        return self.ne[0] * self.ne[1] * self.ne[2] * self.ne[3]

    @property
    def nbytes(self) -> int:
        """Bytes spanned in memory (ggml_nbytes)."""
        if any(x == 0 for x in self.ne):
            return 0
        bs = block_size(self.type)
        n = self.ne[0] * self.nb[0] // bs
        for i in range(1, 4):
            n += (self.ne[i] - 1) * self.nb[i]
        return n

    @property
    def n_dims(self) -> int:
        """Number of dimensions up to the last one that is not 1 (at least 1)."""
        for i in (3, 2, 1):
            if self.ne[i] > 1:
                return i + 1
        return 1

    @property
    def is_contiguous(self) -> bool:
        return self.nb == contiguous_nb(self.type, self.ne)

    @property
    def is_view(self) -> bool:
        return self.view_src is not None

    @property
    def is_leaf(self) -> bool:
        return len(self.src) == 0 and self.view_src is None

    @property
    def layer(self) -> int | None:
        """The layer index a tensor belongs to, from `blk.N.` / `_lN` names (None if global)."""
        name = self.name
        if name.startswith("blk."):
            head = name[4:].split(".", 1)[0]
            return int(head) if head.isdigit() else None
        if "_l" in name:
            tail = name.rsplit("_l", 1)[1]
            return int(tail) if tail.isdigit() else None
        return None
