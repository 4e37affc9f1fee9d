"""split_mode="layer": which device runs each layer, and each graph node.

The layer rule is llama.cpp's (`llama_model::load_tensors`, every layer offloaded): the shares
(-ts, equal by default) become cumulative split points normalised to 1, in float32; the
n_layer repeating layers and the output layer are n_layer + 1 slots, and slot `il` goes to the
first device whose split point is greater than il / (n_layer + 1) (an upper bound). The output
layer (final norm, lm head) is slot n_layer. llama.cpp keeps the input layer (the token
embeddings) on the CPU; here it stays on device 0.

Nodes follow the weights and KV cache they read (`place_nodes`): a node reading a layer's
weight or cache runs on that layer's device, one reading only other nodes as early as its
sources allow, and a weight-free node is moved to the device of its readers when that copies
no more bytes (the rms_norm that opens a layer runs on that layer's device, so exactly the
residual stream crosses each boundary).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from metatp.ir.errors import ConfigError, SplitError
from metatp.ir.graph import Graph
from metatp.ir.ops import Op
from metatp.ir.tensor import Flag, Tensor

__all__ = ["layer_devices", "graph_n_layer", "leaf_slot", "place_nodes"]


def layer_devices(n_layer: int, shares: Sequence[float]) -> list[int]:
    """Device of each layer 0..n_layer-1, then of the output layer (a list of n_layer + 1).

    llama.cpp's arithmetic exactly (float32 cumulative sums, float32 division), so ties on a
    split point fall as they do there: 3 equal shares over 2 layers put layer 1 on device 1."""
    if n_layer < 0:
        raise ConfigError(f"n_layer must be >= 0, got {n_layer}")
    ts = np.asarray(list(shares), dtype=np.float32)
    if ts.ndim != 1 or ts.size == 0 or not np.all(np.isfinite(ts)) or (ts < 0).any() or ts.sum() <= 0:
        raise ConfigError(f"tensor_split must be finite shares >= 0 with a positive one, got {list(shares)}")
    cum = np.cumsum(ts, dtype=np.float32)
    splits = cum / cum[-1]
    slots = n_layer + 1
    out = []
    for il in range(slots):
        x = np.float32(il) / np.float32(slots)
        out.append(int(np.searchsorted(splits, x, side="right")))
    return out


def graph_n_layer(graph: Graph, hparams=None) -> int:
    """The model's layer count (hparams, else the highest `blk.N` / `_lN` leaf + 1)."""
    if hparams is not None:
        return int(hparams.n_layer)
    layers = [t.layer for t in graph.leaves if t.layer is not None]
    return max(layers) + 1 if layers else 0


def leaf_slot(t: Tensor, n_layer: int) -> int | None:
    """The slot a leaf pins its readers to: 0 the input layer (token embeddings), 1 + il layer
    il (its weights and KV cache), n_layer + 1 the output layer; None for a leaf every layer
    may read (step inputs, rope frequency factors)."""
    if t.flags & Flag.INPUT:
        return None
    il = t.layer
    if il is not None:
        if not 0 <= il < n_layer:
            raise SplitError(f"layer split: leaf {t.name!r} names layer {il} of a {n_layer}-layer model")
        return il + 1
    if t.flags & Flag.WEIGHT:
        if t.name.startswith("token_embd"):
            return 0
        if t.name.startswith("output"):
            return n_layer + 1
    return None


def _slot_device(slots: list[int]) -> list[int]:
    """Device of each slot: 0 the input layer, then the layers, then the output layer."""
    return [0] + slots


def place_nodes(graph: Graph, n_layer: int, slots: list[int]) -> dict[Tensor, int]:
    """The device every node runs on (pure views included: where their source is computed;
    the plan builder places their memory where they are read)."""
    dev_of_slot = _slot_device(slots)
    dev: dict[Tensor, int] = {}
    pinned: set[Tensor] = set()
    readers: dict[Tensor, list[Tensor]] = {}
    for n in graph.nodes:
        d = 0
        for s in _deps(n):
            if s.op is Op.NONE:
                slot = leaf_slot(s, n_layer)
                if slot is not None:
                    d = max(d, dev_of_slot[slot])
                    pinned.add(n)
            else:
                d = max(d, dev[s])
                readers.setdefault(s, []).append(n)
        dev[n] = d
    outputs = set(graph.outputs)
    for _ in range(len(graph.nodes) * len(slots)):      # nodes only move forward: this ends
        if not _pull_forward(graph, dev, pinned, readers, outputs):
            break
    return dev


def _deps(n: Tensor) -> list[Tensor]:
    out = [s for s in n.src if s is not None]
    if n.view_src is not None and n.view_src not in out:
        out.append(n.view_src)
    return out


def _pull_forward(graph: Graph, dev: dict[Tensor, int], pinned: set[Tensor], readers: dict[Tensor, list[Tensor]],
                  outputs: set[Tensor]) -> bool:
    """Move each weight-free node whose readers all sit on one later device there, when the
    values it reads that would newly be copied there are no more bytes than its own copy.

    A tie moves too: the rms_norm opening a layer and the last layer's row selection both read
    the residual stream, and only once both have moved is the residual the one value copied."""
    moved = False
    for n in reversed(graph.nodes):
        if n in pinned or n in outputs or not readers.get(n):
            continue
        targets = {dev[r] for r in readers[n]}
        if len(targets) != 1:
            continue
        e = targets.pop()
        if e <= dev[n]:
            continue
        srcs = [s for s in _deps(n) if s.op is not Op.NONE]
        added = sum(s.nbytes for s in srcs
                    if dev[s] != e and not any(dev[r] == e for r in readers[s] if r is not n))
        if added <= n.nbytes:
            dev[n] = e
            moved = True
    return moved
