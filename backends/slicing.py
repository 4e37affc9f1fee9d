"""Full arrays <-> per-device slices, following a tensor's split state (set_tensor / get_tensor).

numpy arrays have shape reversed(ne): ggml dim `a` is numpy axis `ndim-1-a` of the 4-D view.
Along a split axis the full tensor is, for each segment s, for each repeat r < nr[s], for each
device j, device j's chunk; device j's slice is its chunks in that order (`SplitState.chunks`).
"""

from __future__ import annotations

import numpy as np

from metatp.ir.dtypes import np_shape
from metatp.ir.errors import SplitError
from metatp.ir.tensor import GGMLType, Tensor, block_size, type_size
from metatp.passes.plan import TensorPlan

__all__ = ["split_array", "gather_array", "device_slices", "local_raw_shape", "split_raw"]


def _as4d(a: np.ndarray, ne) -> np.ndarray:
    return a.reshape(np_shape(ne))


def _local_ne(t: Tensor, tp: TensorPlan, st, j: int) -> tuple[int, int, int, int]:
    """Device j's shape: the plan's lowered Local, or (before lowering) from the state."""
    if tp.local:
        return tp.local[j].ne
    ne = list(t.ne)
    ne[st.axis] = st.extent(j)
    return tuple(ne)


def split_array(full: np.ndarray, tensor: Tensor, tplan: TensorPlan, n_devices: int) -> list[np.ndarray]:
    """Per-device slices of a leaf's full value (any shape with the tensor's element count); each
    slice has the 4-D numpy shape reversed(local ne).

    split: each device gets its chunks; MIRRORED: a copy each; PARTIAL: the full value on the
    owner device (`tplan.owner`, default 0) and zeros elsewhere, so the sum is exact."""
    st = tplan.state
    f4 = _as4d(np.asarray(full), tensor.ne)
    if st.is_mirrored:
        return [np.array(f4, copy=True) if _holds(tplan, j) else _empty(tplan, j, f4) for j in range(n_devices)]
    if st.is_partial:
        owner = tplan.owner if tplan.owner is not None else 0
        return [(np.array(f4, copy=True) if j == owner else np.zeros_like(f4)) if _holds(tplan, j)
                else _empty(tplan, j, f4) for j in range(n_devices)]
    ax = 3 - st.axis
    parts = []
    for j in range(n_devices):
        ne = _local_ne(tensor, tplan, st, j)
        parts.append(np.empty(np_shape(ne), dtype=f4.dtype))
    for j, g, loc, length in st.chunks():
        _copy_chunk(parts[j], loc, f4, g, length, ax)
    return parts


def _holds(tplan: TensorPlan, j: int) -> bool:
    """Does device j hold a copy of a mirrored / partial leaf? Not where its Local is empty
    (-sm layer,tensor: another stage's weights); a plan before lowering: every device."""
    return not tplan.local or bool(tplan.local[j].nelements) or tplan.tensor.nelements == 0


def _empty(tplan: TensorPlan, j: int, full: np.ndarray) -> np.ndarray:
    return np.empty(np_shape(tplan.local[j].ne), full.dtype)


def _copy_chunk(dst: np.ndarray, at: int, src: np.ndarray, start: int, length: int, axis: int) -> None:
    """dst[at:at+length] = src[start:start+length] along numpy axis `axis` of 4-D arrays."""
    d = [slice(None)] * 4
    s = [slice(None)] * 4
    d[axis] = slice(at, at + length)
    s[axis] = slice(start, start + length)
    dst[tuple(d)] = src[tuple(s)]


def gather_array(parts: list[np.ndarray], tensor: Tensor, tplan: TensorPlan) -> np.ndarray:
    """The full value from per-device buffers, as they are after a step (the sync state: a
    reduced node reads as MIRRORED). split: chunks put back in place; MIRRORED: device 0's copy;
    PARTIAL: the sum over the devices that computed it (the others hold exact zeros)."""
    st = tplan.sync_state
    shape = np_shape(tensor.ne)
    if st.is_mirrored:
        return np.array(parts[0], copy=True).reshape(shape)
    if st.is_partial:
        active = [j for j in range(len(parts)) if tplan.compute[j]]
        out = np.zeros(shape, dtype=parts[0].dtype)
        for j in active:
            out += parts[j].reshape(shape)
        return out
    ax = 3 - st.axis
    out = np.empty(shape, dtype=parts[0].dtype)
    p4 = [np.asarray(p).reshape(np_shape(_local_ne(tensor, tplan, st, j))) for j, p in enumerate(parts)]
    for j, g, loc, length in st.chunks():
        _copy_chunk(out, g, p4[j], loc, length, ax)
    return out


def device_slices(full: np.ndarray, tensor, tplan, n_devices: int) -> list[np.ndarray]:
    """A leaf's full host value (any shape with the right element count) -> one array per device,
    as the plan splits it. What every backend's upload starts with."""
    shape = np_shape(tensor.ne)
    if full.shape != shape and full.size == tensor.nelements:
        full = full.reshape(shape)
    if n_devices == 1:
        return [full]
    return split_array(full, tensor, tplan, n_devices)


def local_raw_shape(t: GGMLType, ne) -> tuple[int, int, int, int]:
    """numpy shape of a (local) weight's GGUF bytes: (ne3, ne2, ne1, bytes per row)."""
    bs, ts = block_size(t), type_size(t)
    return (ne[3], ne[2], ne[1], ne[0] // bs * ts)


def split_raw(raw: np.ndarray, tensor: Tensor, ggml_type: GGMLType, tplan: TensorPlan,
              n_devices: int) -> list[np.ndarray]:
    """Per-device slices of a weight's raw bytes, as the plan splits it (whole quant blocks
    along ne0: the split table guarantees block-aligned cuts). Each part is uint8 with numpy
    shape (ne3, ne2, ne1, row bytes) of the device's local shape."""
    ggml_type = GGMLType(ggml_type)
    bs, ts = block_size(ggml_type), type_size(ggml_type)
    full = np.ascontiguousarray(raw).view(np.uint8).reshape(local_raw_shape(ggml_type, tensor.ne))
    st = tplan.state
    if st.is_mirrored or n_devices == 1:
        return [full if _holds(tplan, j) else full[..., :0] for j in range(n_devices)]
    if st.is_partial:
        owner = tplan.owner if tplan.owner is not None else 0
        return [(full if j == owner else np.zeros_like(full)) if _holds(tplan, j) else full[..., :0]
                for j in range(n_devices)]
    parts = [np.empty(local_raw_shape(ggml_type, tplan.local[j].ne), dtype=np.uint8)
             for j in range(n_devices)]
    ax = 3 - st.axis
    for j, g, loc, length in st.chunks():
        if st.axis == 0:
            if g % bs or loc % bs or length % bs:
                raise SplitError(f"{tensor.name}: split of ne0 at {g}+{length} is not whole "
                                 f"{ggml_type.name} blocks of {bs}")
            g, loc, length = g // bs * ts, loc // bs * ts, length // bs * ts
        _copy_chunk(parts[j], loc, full, g, length, ax)
    return parts
