"""The weight/KV split table: how every weight and KV-cache leaf is spread over the devices.

One row per tensor family (llama.cpp's `llama_meta_device_get_split_state`):
column-parallel weights (q/k/v, ffn up/gate, the output head) split along ne[1], row-parallel
weights (attn_output, ffn_down) along ne[0], the KV cache along whole heads, and the rest
mirrored. A tensor that matches no row raises `SplitError` naming it: an unknown tensor is a
question for a human, not something to guess.

Granularity (elements per indivisible unit along the split axis):
- attention tensors are cut in units of `h_g` KV heads (with their n_gqa query heads), where
  `h_g = lcm(eq, bp) / eq`, `eq = n_gqa * head_dim_k`, and `bp` is the block size of
  attn_output's type doubled while `bp < 128 and bp * n_dev < eq` (llama.cpp's `gq`). Every
  attention tensor of a layer (q, k, v, fused qkv, biases, sinks, attn_output, KV cache) gets
  the same number of KV heads per device, so they stay proportional by construction. Two
  extensions over llama.cpp, both no-ops when head_dim_v == head_dim_k and the cache is F32/F16:
  `h_g` is raised until attn_output's rows per granule (n_gqa*head_dim_v*h_g) and the KV cache's
  (head_dim*h_g) are whole quant blocks;
- FFN tensors use `lcm(block size of ffn_down's type, 128)`;
- the output head uses 1.

Shares (`split_sizes`), better than llama.cpp's floor-and-give-the-rest-to-the-last-device:
integer arithmetic only, largest-remainder. With `U = total // g` whole granules and a tail of
`total % g` elements, device j's ideal share in granules is `x_j = total*w_j / (g*W)` (exact,
integer numerators). Every device first gets `floor(x_j)` granules; the `L = U - sum(floor)`
leftover granules go to the devices with the largest fractional parts of `x_j`, ties broken
by the rotation priority `(n-1+rot) % n, (n-2+rot) % n, ...` (llama.cpp's remainder device
first); the tail, if any, goes to the next device in that same order. Then every device is within
one granule of its ideal share (`|size_j - total*w_j/W| < g`), the sizes sum to `total`
exactly, devices with weight 0 get nothing, and every share but the tail device's is a
multiple of `g` (the tail is a whole number of heads/blocks). The rotation is counted per layer class
(`is_swa`), so the device that absorbs ties moves from layer to layer.

Requires: a validated `DeviceLayout` and the model's head geometry (`ModelDims`).
Ensures: for every weight / KV leaf a state whose extents sum to the tensor's size along the
split axis, with every device's share whole granules (all but at most one device) and whole
heads / quant blocks; `propagate.check_leaf_state` re-checks each one.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Callable, Iterable, Sequence

from metatp.ir.errors import SplitError
from metatp.ir.ops import Op
from metatp.ir.tensor import Tensor, block_size
from metatp.passes.plan import DeviceLayout
from metatp.passes.state import SplitState

__all__ = ["AttnDims", "ModelDims", "SplitRow", "SplitTable", "split_sizes", "integer_weights",
           "FFN_ALIGN"]

FFN_ALIGN = 128   # FFN cuts are multiples of lcm(quant block, 128), as in llama.cpp


# ---------------------------------------------------------------- share arithmetic


def integer_weights(ratios: Sequence[float] | None, n: int) -> list[int]:
    """`tensor_split` ratios as exact, coprime integers (None: equal shares)."""
    if ratios is None:
        return [1] * n
    fr = [Fraction(x) for x in ratios]          # exact for any finite float
    den = math.lcm(*(f.denominator for f in fr))
    ints = [int(f * den) for f in fr]
    g = math.gcd(*ints) or 1
    return [i // g for i in ints]


def rotation_priority(n: int, rotation: int) -> list[int]:
    """Devices in the order they absorb leftovers: llama.cpp's remainder device first."""
    return [(n - 1 + rotation - k) % n for k in range(n)]


def split_sizes(total: int, granule: int, weights: Sequence[int], rotation: int = 0) -> list[int]:
    """Per-device sizes of `total` elements cut in multiples of `granule` (largest remainder)."""
    n = len(weights)
    W = sum(weights)
    if W <= 0:
        raise SplitError(f"tensor_split {list(weights)} has no positive entry")
    units, tail = divmod(total, granule)
    den = granule * W
    base = [total * w // den for w in weights]
    frac = [total * w % den for w in weights]          # numerators of the fractional parts
    leftover = units - sum(base)
    rank = {j: k for k, j in enumerate(rotation_priority(n, rotation))}
    order = sorted(range(n), key=lambda j: (-frac[j], rank[j]))
    sizes = [b * granule for b in base]
    for j in order[:leftover]:
        sizes[j] += granule
    if tail:
        sizes[order[leftover]] += tail
    return sizes


# ---------------------------------------------------------------- model geometry


@dataclass(frozen=True)
class AttnDims:
    """Attention geometry of one layer (what head granularity needs)."""

    n_head: int
    n_head_kv: int
    head_dim_k: int
    head_dim_v: int

    @property
    def n_gqa(self) -> int:
        return self.n_head // self.n_head_kv


@dataclass
class ModelDims:
    """The few hyper-parameters the table needs, from HParams or read off a graph."""

    n_layer: int
    attn: dict[int, AttnDims] = field(default_factory=dict)
    default_attn: AttnDims | None = None
    swa: dict[int, bool] = field(default_factory=dict)

    def attn_of(self, il: int | None) -> AttnDims | None:
        if il is not None and il in self.attn:
            return self.attn[il]
        return self.default_attn

    def is_swa(self, il: int) -> bool:
        return self.swa.get(il, False)

    @classmethod
    def from_hparams(cls, hp) -> ModelDims:
        attn = {il: AttnDims(hp.n_head, hp.n_head_kv[il], hp.head_dim_k, hp.head_dim_v) for il in range(hp.n_layer)}
        swa = {il: hp.is_swa(il) for il in range(hp.n_layer)}
        default = attn[0] if hp.n_layer else None
        return cls(hp.n_layer, attn, default, swa)

    @classmethod
    def from_graph(cls, tensors: Iterable[Tensor], nodes: Iterable[Tensor]) -> ModelDims:
        """Head geometry from FLASH_ATTN_EXT nodes (q [D,T,H], k [D,n_kv,Hkv], v [Dv,...]); the
        layer from the KV-cache leaf the K view reads (`cache_k_l{i}`)."""
        attn: dict[int, AttnDims] = {}
        seen: set[AttnDims] = set()
        for n in nodes:
            if n.op is not Op.FLASH_ATTN_EXT:
                continue
            q, k, v = n.src[0], n.src[1], n.src[2]
            dims = AttnDims(q.ne[2], k.ne[2], q.ne[0], v.ne[0])
            seen.add(dims)
            root = k.view_src or k
            if root.layer is not None:
                attn[root.layer] = dims
        layers = [t.layer for t in tensors if t.layer is not None]
        n_layer = max(layers) + 1 if layers else 0
        default = next(iter(seen)) if len(seen) == 1 else None
        return cls(n_layer, attn, default, {})


# ---------------------------------------------------------------- the table


@dataclass(frozen=True)
class SplitRow:
    """The table's decision for one tensor, with the numbers behind it (for dumps and tests)."""

    kind: str                                  # "split" | "mirrored" | "partial"
    axis: int = -1
    segments: tuple[tuple[int, int], ...] = ()  # (elements per repeat, repeats)
    granule: tuple[int, ...] = ()               # per segment: cut multiple
    unit: tuple[int, ...] = ()                  # per segment: indivisible unit (head width / quant block)
    rotation: int = 0
    why: str = ""


_MIRRORED_ROW = SplitRow("mirrored", why="replicated")
_PARTIAL_ROW = SplitRow("partial", why="PARTIAL expert bias")

_L = r"blk\.(\d+)\."
_MIRRORED_PATTERNS = [re.compile(p) for p in (
    r"token_embd\.weight", r"token_embd_norm\.(weight|bias)", r"output_norm\.(weight|bias)", r"rope_freqs\.weight",
    r"token_types\.weight", r"position_embd\.weight",
    _L + r"\w*norm\w*\.(weight|bias)",                 # attn_norm, ffn_norm, post norms (q/k norms are rows above)
    _L + r"ffn_gate_inp\.(weight|bias)",               # MoE router
    _L + r"\w+_shexp\.(weight|bias)",                  # shared experts
    _L + r"exp_probs_b(\.bias)?",
    _L + r"attn_output\.bias", _L + r"ffn_down\.bias",
    _L + r"layer_output_scale(\.weight)?",
)]


class SplitTable:
    """Split states for weight and KV-cache leaves, for one model geometry and device layout."""

    def __init__(self, layout: DeviceLayout, dims: ModelDims, tensors: Iterable[Tensor] = ()) -> None:
        self.layout = layout
        self.n = layout.n_devices
        self.weights = integer_weights(layout.tensor_split, self.n)
        self.dims = dims
        self.by_name: dict[str, Tensor] = {t.name: t for t in tensors}
        self._rotation = self._layer_rotations()
        self._head_granule: dict[int, int] = {}
        self._rows: list[tuple[re.Pattern, Callable[[Tensor, re.Match], SplitRow]]] = [
            (re.compile(_L + r"attn_(q|k|v)\.weight"), self._attn_proj),
            (re.compile(_L + r"attn_qkv\.weight"), self._attn_qkv),
            (re.compile(_L + r"attn_(q|k|v)\.bias"), self._attn_proj),
            (re.compile(_L + r"attn_qkv\.bias"), self._attn_qkv),
            (re.compile(_L + r"attn_(q|k)_norm\.weight"), self._attn_head_norm),
            (re.compile(_L + r"attn_sinks(\.weight)?"), self._attn_sinks),
            (re.compile(_L + r"attn_output\.weight"), self._attn_output),
            (re.compile(r"cache_(k|v)_l(\d+)"), self._kv_cache),
            (re.compile(_L + r"ffn_(up|gate)(_exps)?\.(weight|bias)"), self._ffn_in),
            (re.compile(_L + r"ffn_gate_up(_exps)?\.(weight|bias)"), self._ffn_gate_up),
            (re.compile(_L + r"ffn_down(_exps)?\.weight"), self._ffn_down),
            (re.compile(_L + r"ffn_down_exps\.bias"), lambda t, m: _PARTIAL_ROW),
            (re.compile(r"output\.(weight|bias)"), self._output),
        ]

    # ------------------------------------------------------------ public
    def row(self, t: Tensor) -> SplitRow:
        """The table row that applies to `t`, with its numbers."""
        for pat, fn in self._rows:
            m = pat.fullmatch(t.name)
            if m:
                return fn(t, m)
        if any(p.fullmatch(t.name) for p in _MIRRORED_PATTERNS):
            return _MIRRORED_ROW
        raise SplitError(f"split table: no row for tensor {t.name!r} (ne={list(t.ne)}, {t.type.name}); "
                         f"add a row to passes/split_table.py or mark it as an input")

    def state(self, t: Tensor) -> SplitState:
        """The SplitState of a weight / KV leaf (assume_sync does not matter for leaves)."""
        r = self.row(t)
        if r.kind == "mirrored":
            return SplitState.mirrored()
        if r.kind == "partial":
            return SplitState.partial()
        segs = [(split_sizes(size, g, self.weights, r.rotation), nr) for (size, nr), g in zip(r.segments, r.granule)]
        st = SplitState.segmented(r.axis, segs)
        if st.total() != t.ne[r.axis]:
            raise SplitError(f"split table: segments of {t.name!r} cover {st.total()} of {t.ne[r.axis]} elements "
                             f"along axis {r.axis}")
        return st

    # ------------------------------------------------------------ rotation
    def _layer_rotations(self) -> dict[int, int]:
        """rotation(il) = (number of earlier layers of the same class) % n."""
        rot: dict[int, int] = {}
        count: dict[bool, int] = {}
        for il in range(self.dims.n_layer):
            cls = self.dims.is_swa(il)
            rot[il] = count.get(cls, 0) % self.n
            count[cls] = count.get(cls, 0) + 1
        return rot

    def rotation(self, il: int | None) -> int:
        if il is None:
            return self.dims.n_layer % self.n
        return self._rotation.get(il, il % self.n)

    # ------------------------------------------------------------ attention
    def _attn(self, t: Tensor, il: int) -> AttnDims:
        a = self.dims.attn_of(il)
        if a is None:
            raise SplitError(f"split table: {t.name!r} is an attention tensor but the head geometry of layer {il} "
                             f"is unknown (pass hparams to compile_plan)")
        if a.n_head_kv <= 0 or a.n_head % a.n_head_kv:
            raise SplitError(f"split table: layer {il}: n_head={a.n_head} is not a multiple of n_head_kv={a.n_head_kv}")
        return a

    def _ref_block(self, name: str, fallback: Tensor | None = None) -> int:
        ref = self.by_name.get(name)
        if ref is None:
            return block_size(fallback.type) if fallback is not None else 1
        return block_size(ref.type)

    def heads_granule(self, t: Tensor, il: int) -> int:
        """KV heads per indivisible unit of layer il's attention tensors (llama.cpp's gq / eq)."""
        cached = self._head_granule.get(il)
        if cached is not None:
            return cached
        a = self._attn(t, il)
        blck = self._ref_block(f"blk.{il}.attn_output.weight", t if t.name.endswith("attn_output.weight") else None)
        eq = a.n_gqa * a.head_dim_k
        bp = blck
        while bp < 128 and bp * self.n < eq:
            bp *= 2
        h_g = math.lcm(eq, bp) // eq
        # attn_output rows are cut along n_gqa*head_dim_v per KV head: keep them whole quant blocks too
        h_g = math.lcm(h_g, blck // math.gcd(blck, a.n_gqa * a.head_dim_v))
        for cache in (f"cache_k_l{il}", f"cache_v_l{il}"):
            c = self.by_name.get(cache)
            if c is not None:
                width = a.head_dim_k if "_k_" in cache else a.head_dim_v
                cb = block_size(c.type)
                h_g = math.lcm(h_g, cb // math.gcd(cb, width))
        self._head_granule[il] = h_g
        return h_g

    def _head_row(self, t: Tensor, il: int, axis: int, widths: Sequence[tuple[int, int]], why: str) -> SplitRow:
        """A row cut in whole KV-head groups: `widths` = [(elements per KV head, repeats)] per segment."""
        a = self._attn(t, il)
        h_g = self.heads_granule(t, il)
        segs = tuple((a.n_head_kv * w, nr) for w, nr in widths)
        gran = tuple(h_g * w for w, _ in widths)
        unit = tuple(w for w, _ in widths)
        return SplitRow("split", axis, segs, gran, unit, self.rotation(il), why)

    def _attn_proj(self, t: Tensor, m: re.Match) -> SplitRow:
        il, which = int(m.group(1)), m.group(2)
        a = self._attn(t, il)
        axis = 1 if t.name.endswith(".weight") else 0
        width = {"q": a.n_gqa * a.head_dim_k, "k": a.head_dim_k, "v": a.head_dim_v}[which]
        return self._head_row(t, il, axis, [(width, 1)], f"attn_{which}: whole heads")

    def _attn_qkv(self, t: Tensor, m: re.Match) -> SplitRow:
        il = int(m.group(1))
        a = self._attn(t, il)
        axis = 1 if t.name.endswith(".weight") else 0
        q_w, k_w, v_w = a.n_gqa * a.head_dim_k, a.head_dim_k, a.head_dim_v
        want = a.n_head_kv * (q_w + k_w + v_w)
        if t.ne[axis] != want:
            raise SplitError(f"split table: fused {t.name!r} has {t.ne[axis]} rows, expected q+k+v = {want}")
        widths = [(q_w, 1), (k_w, 2)] if k_w == v_w else [(q_w, 1), (k_w, 1), (v_w, 1)]
        return self._head_row(t, il, axis, widths, "fused QKV: per-segment whole heads")

    def _attn_head_norm(self, t: Tensor, m: re.Match) -> SplitRow:
        if t.ne[1] == 1:
            return _MIRRORED_ROW
        il, which = int(m.group(1)), m.group(2)
        a = self._attn(t, il)
        per_kv = a.n_gqa if which == "q" else 1
        return self._head_row(t, il, 1, [(per_kv, 1)], f"per-head attn_{which}_norm")

    def _attn_sinks(self, t: Tensor, m: re.Match) -> SplitRow:
        il = int(m.group(1))
        return self._head_row(t, il, 0, [(self._attn(t, il).n_gqa, 1)], "attention sinks: one per q head")

    def _attn_output(self, t: Tensor, m: re.Match) -> SplitRow:
        il = int(m.group(1))
        a = self._attn(t, il)
        return self._head_row(t, il, 0, [(a.n_gqa * a.head_dim_v, 1)], "attn_output: row parallel, whole heads")

    def _kv_cache(self, t: Tensor, m: re.Match) -> SplitRow:
        which, il = m.group(1), int(m.group(2))
        a = self._attn(t, il)
        width = a.head_dim_k if which == "k" else a.head_dim_v
        return self._head_row(t, il, 0, [(width, 1)], f"KV cache {which}: whole heads")

    # ------------------------------------------------------------ FFN
    def _ffn_granule(self, il: int, exps: bool, t: Tensor) -> int:
        ref = f"blk.{il}.ffn_down{'_exps' if exps else ''}.weight"
        return math.lcm(self._ref_block(ref, t if t.name == ref else None), FFN_ALIGN)

    def _n_ff(self, il: int, exps: bool) -> int | None:
        down = self.by_name.get(f"blk.{il}.ffn_down{'_exps' if exps else ''}.weight")
        return down.ne[0] if down is not None else None

    def _ffn_in(self, t: Tensor, m: re.Match) -> SplitRow:
        il, which, exps = int(m.group(1)), m.group(2), bool(m.group(3))
        axis = 1 if t.name.endswith(".weight") else 0
        g = self._ffn_granule(il, exps, t)
        size = t.ne[axis]
        n_ff = self._n_ff(il, exps)
        if which == "up" and n_ff is not None and size == 2 * n_ff:     # Phi-3 style fused up+gate
            return SplitRow("split", axis, ((n_ff, 2),), (g,), (1,), self.rotation(il), "fused up+gate")
        return SplitRow("split", axis, ((size, 1),), (g,), (1,), self.rotation(il), f"ffn_{which}: column parallel")

    def _ffn_gate_up(self, t: Tensor, m: re.Match) -> SplitRow:
        il, exps = int(m.group(1)), bool(m.group(2))
        axis = 1 if t.name.endswith(".weight") else 0
        if t.ne[axis] % 2:
            raise SplitError(f"split table: fused {t.name!r} has an odd number of rows ({t.ne[axis]})")
        g = self._ffn_granule(il, exps, t)
        return SplitRow("split", axis, ((t.ne[axis] // 2, 2),), (g,), (1,), self.rotation(il), "fused gate_up")

    def _ffn_down(self, t: Tensor, m: re.Match) -> SplitRow:
        il, exps = int(m.group(1)), bool(m.group(2))
        g = self._ffn_granule(il, exps, t)
        return SplitRow("split", 0, ((t.ne[0], 1),), (g,), (block_size(t.type),), self.rotation(il),
                        "ffn_down: row parallel")

    # ------------------------------------------------------------ output head
    def _output(self, t: Tensor, m: re.Match) -> SplitRow:
        axis = 1 if m.group(1) == "weight" else 0
        return SplitRow("split", axis, ((t.ne[axis], 1),), (1,), (1,), self.rotation(None), "output head: vocab")
