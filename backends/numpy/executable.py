"""The numpy backend's executable: a Plan bound to host arrays, run as closures.

The walk, binding and reading are the shared `PlanExecutor`'s. What is numpy's own:
- buffers are numpy arrays (an arena per device; views are numpy views of it);
- each node becomes one closure over preallocated arrays (`kernels.kernel_for`);
- the runner goes node by node across the simulated devices (they are independent inside a
  subgraph, so any interleaving is valid), turning one node's int8 matmuls on every device
  into one compiled call; with `parallel_devices=True` devices run side by side instead;
- a mirrored value identical on every device is computed once, by device 0, and read by the
  others (`PlanFacts.shared_mirrored`);
- a process that owns some devices only (`NumpyBackend(devices=...)`, one MPI rank) binds and
  runs those; its collective reduces across processes and gathers split values for `read`.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import numpy as np

from metatp.backends.numpy import native
from metatp.backends.numpy.codes import AffineWeight
from metatp.backends.executor import PlanExecutor
from metatp.backends.fusion import Fusion, FusionKind, matmul_group_fusion, norm_weight_fusion, select
from metatp.ir.dtypes import np_shape
from metatp.backends.numpy.kernels import Closure, kernel_for, quantize_q8_blocks, rms_norm_mul, round_f16
from metatp.ir.errors import UnsupportedOpError
from metatp.ir.ops import Op
from metatp.ir.tensor import Flag, GGMLType, Tensor, row_bytes
from metatp.passes.plan import Local, Plan

if TYPE_CHECKING:
    from metatp.backends.numpy.backend import NumpyBackend

__all__ = ["NumpyExecutable", "host_dtype", "host_shape", "BYTE_TYPES"]

_DTYPES = {GGMLType.F32: np.float32, GGMLType.I32: np.int32, GGMLType.F16: np.float16}
# KV-cache types kept as their bytes: a row of ne0 values is row_bytes(type, ne0) uint8 (the
# compiled kernels and gguf.quants read and write them)
BYTE_TYPES = frozenset({GGMLType.BF16, GGMLType.Q8_0, GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1})


def host_dtype(t: Tensor) -> np.dtype:
    """The numpy dtype of an activation, input or KV-cache tensor (weights are stored apart)."""
    if t.type in BYTE_TYPES:
        return np.dtype(np.uint8)
    try:
        return np.dtype(_DTYPES[t.type])
    except KeyError:
        raise UnsupportedOpError(
            f"numpy backend: tensor {t.name!r} of type {t.type.name} must be a weight (dequantized on upload)") from None


def host_shape(t: Tensor, ne) -> tuple[int, int, int, int]:
    """The numpy shape of a slice of local shape `ne`: a byte type's innermost axis is the bytes
    of ne[0] values (whole blocks: the graph views whole head rows)."""
    if t.type not in BYTE_TYPES:
        return np_shape(ne)
    try:
        return (ne[3], ne[2], ne[1], row_bytes(t.type, ne[0]))
    except ValueError as e:
        raise UnsupportedOpError(f"numpy backend: {t.name!r}: {e}") from None


def _run_all(closures: list[Closure]) -> None:
    for f in closures:
        f()


class _DeviceContext:
    """What kernels may ask the backend while building closures for device `d`."""

    def __init__(self, backend: NumpyBackend, d: int, step_memo: dict, plan_memo: dict) -> None:
        self.backend = backend
        self.d = d
        self._memo = step_memo
        self._plan_memo = plan_memo
        self.use_kernels = backend.use_kernels

    def persistent(self, key, make):
        """A value made once per prepared plan and shared by every node that asks (e.g. a buffer
        that per-step tables are written into, so compiled kernels can hold its address)."""
        hit = self._plan_memo.get(key)
        if hit is None:
            hit = self._plan_memo[key] = make()
        return hit

    def per_step(self, key, make):
        """A value computed once per run and shared by every node that asks (e.g. rope tables)."""
        hit = self._memo.get(key)
        if hit is None:
            hit = self._memo[key] = make()
        return hit

    def is_weight(self, t: Tensor) -> bool:
        return bool(t.flags & Flag.WEIGHT) and t.view_src is None and t.ne[2] == 1 and t.ne[3] == 1

    def transposed(self, t: Tensor) -> np.ndarray:
        return self.backend.transposed(t, self.d)

    def packed(self, t: Tensor) -> AffineWeight | None:
        """The weight as int8 codes when the compiled kernel may read it, else None."""
        return self.backend.packed(t, self.d) if self.backend.use_kernels else None

    def encoded_only(self, t: Tensor) -> bool:
        return self.backend.encoded_only(t)

    def slab(self) -> np.ndarray:
        return self.backend.slab(self.d)

    @property
    def kernel_threads(self) -> int:
        return self.backend.kernel_threads

    def row_threads(self, n_rows: int) -> int:
        return self.backend.row_threads(n_rows)

    def activation_rounding(self, w: Tensor):
        """None in exact mode; else how llama.cpp's CPU backend rounds the other matmul operand."""
        if self.backend.numerics not in ("llamacpp", "q8") or not self.is_weight(w) or w.type == GGMLType.F32:
            return None

        return round_f16 if w.type in (GGMLType.F16, GGMLType.BF16) else quantize_q8_blocks


class NumpyExecutable(PlanExecutor):
    """A plan bound to buffers: per subgraph, closures per device and in node-major order."""

    backend: NumpyBackend

    def __init__(self, backend: NumpyBackend, plan: Plan) -> None:
        self._step_memo: dict = {}
        plan_memo: dict = {}
        self._ctxs = {d: _DeviceContext(backend, d, self._step_memo, plan_memo) for d in backend.owned}
        super().__init__(backend, plan)
        self.node_major = [self._node_major(items) for items in self.walked]
        self._serial = self._serial_step()

    # ---------------------------------------------------------------- memory
    def bind_inputs(self) -> None:
        """One zero array per INPUT leaf: inputs are mirrored and read-only, so one array
        serves every device."""
        self.inputs: dict[Tensor, np.ndarray] = {}
        for t in self.plan.graph.leaves:
            if t.flags & Flag.INPUT:
                arr = np.zeros(np_shape(t.ne), dtype=host_dtype(t))
                self.inputs[t] = arr
                for d in self.devices:
                    self.arrays[d][t] = arr

    def shares_mirrored(self) -> bool:
        """Simulated devices share the host's memory: device 0 computes mirrored values for all
        (not when they run side by side in threads)."""
        return not self.backend.parallel_devices

    def itemsize(self, t: Tensor) -> int:
        return host_dtype(t).itemsize

    def new_arena(self, d: int, nbytes: int) -> np.ndarray:
        arena = np.zeros(max(nbytes, 1), dtype=np.uint8)
        self.buffer_bytes[d] = arena.nbytes
        return arena

    def place(self, d: int, arena: np.ndarray, offset: int, node: Tensor, loc: Local) -> np.ndarray:
        return np.ndarray(host_shape(node, loc.ne), dtype=host_dtype(node), buffer=arena, offset=offset)

    def own_buffer(self, d: int, node: Tensor, loc: Local) -> np.ndarray:
        arr = np.zeros(host_shape(node, loc.ne), dtype=host_dtype(node))
        self.buffer_bytes[d] += arr.nbytes
        return arr

    def view(self, d: int, node: Tensor, loc: Local) -> np.ndarray:
        """The numpy view of `node`: local shape/strides/offset into its source's buffer."""
        root = self.arrays[d][node.view_src]
        if loc.nelements == 0:
            return np.empty(np_shape(loc.ne), dtype=root.dtype)
        byte_rows = node.type in BYTE_TYPES
        if ((node.type not in _DTYPES and not byte_rows) or host_dtype(node) != root.dtype
                or (byte_rows and node.type != node.view_src.type)):
            raise UnsupportedOpError(f"numpy backend: view {node.name!r} of a {node.type.name} tensor is not supported")
        # a byte type's innermost axis is bytes (stride 1); its rows step by the view's strides
        strides = (loc.nb[3], loc.nb[2], loc.nb[1], 1 if byte_rows else loc.nb[0])
        return np.ndarray(host_shape(node, loc.ne), dtype=root.dtype, buffer=root, offset=loc.offs,
                          strides=strides)

    def host_value(self, d: int, t: Tensor) -> np.ndarray:
        return self.arrays[d][t]

    # ---------------------------------------------------------------- work
    def find_fusions(self) -> list[Fusion]:
        """RMS_NORM(x) * w (w a weight row) -> one closure at the MUL; the norm's buffer is
        never written. x must still be live at the MUL (the closure reads it there). The weight
        products of one x (q, k, v; gate, up) -> one compiled call at the first."""
        return select(self, [_norm_fusion, _matmul_group])

    def fused_steps(self, d: int, fusion: Fusion) -> list:
        if fusion.kind is FusionKind.MATMUL_GROUP:
            return self._group_steps(d, fusion)
        a = self.arrays[d]
        node, rms = fusion.at, fusion.absorbed[0]
        x = a[rms.src[0]]
        return [rms_norm_mul(x, a[node.src[1]], rms.params["eps"], a[node], self.backend.use_kernels,
                             self.backend.row_threads(x.shape[-2] if x.ndim >= 2 else 1))]

    def _group_steps(self, d: int, fusion: Fusion) -> list:
        """The products of one x as one compiled call (one parallel region, its rows shared out
        over every product; a q8 call rounds x to Q8 blocks once for all): each product's
        results are the bits it gives alone. Products some other way (BLAS) run in turn."""
        steps = [f for m in fusion.parts["members"] for f in self.node_steps(d, m)]
        if len(steps) > 1 and all(native.is_qmatmul(f) for f in steps):
            return [native.group_qmatmul(steps)]
        return steps

    def node_steps(self, d: int, node: Tensor) -> list:
        a = self.arrays[d]
        srcs = [a[s] if s is not None else None for s in node.src]
        f = kernel_for(node)(node, a[node], srcs, self._ctxs[d])
        return [f] if f is not None else []

    def zero_fill_step(self, d: int, node: Tensor):
        return functools.partial(self.arrays[d][node].fill, 0)

    def transfer_step(self, node: Tensor, src: int, dst: int):
        """-sm layer: simulated devices copy between their own buffers."""
        return functools.partial(np.copyto, self.arrays[dst][node], self.arrays[src][node])

    @staticmethod
    def _node_major(items) -> list[Closure]:
        """One subgraph's closures node by node across devices; one node's int8 matmuls on every
        device become one compiled call with one parallel region, and so do its attentions (under
        -sm tensor these fixed per-call costs are what grew with N, and a device's share of a
        layer's attention alone stayed on one thread at depths where the layer used two)."""
        order: list[Closure] = []
        for item in items:
            at_node = [f for d in sorted(item.per_device) for f in item.per_device[d]]
            if len(at_node) > 1 and all(native.is_qmatmul(f) for f in at_node):
                at_node = [native.group_qmatmul(at_node)]
            elif len(at_node) > 1:
                at_node = _grouped_attention(at_node) or at_node
            order.extend(at_node)
        return order

    def _serial_step(self) -> list[Closure]:
        """The whole step on the caller's thread: every subgraph's closures (node-major), its
        all-reduce and its copies between devices (-sm layer) in plan order, each run of
        consecutive compiled calls (matmul groups, rope, KV writes, attention, norms, adds, a
        compiled all-reduce) joined into one ctypes call (`cpu_kernels.batch`), across subgraph
        boundaries: a decode step is one call (a copy between devices ends a run). Same calls
        in the same order: the same bits."""
        out: list[Closure] = []
        run: list[Closure] = []

        def flush() -> None:
            if run:
                out.append(native.batch(run))
                run.clear()

        for order, reduce, moves in zip(self.node_major, self.reductions, self.transfers):
            for f in order + ([reduce] if reduce is not None else []) + moves:
                if native.batchable(f):
                    run.append(f)
                else:
                    flush()
                    out.append(f)
        flush()
        return out

    # ---------------------------------------------------------------- running
    def set_input(self, t: Tensor, value: np.ndarray) -> None:
        self.inputs[t][...] = np.asarray(value).reshape(self.inputs[t].shape)

    def run(self, inputs: dict[Tensor, np.ndarray] | None = None) -> None:
        for t, v in (inputs or {}).items():
            self.set_input(t, v)
        self._step_memo.clear()
        pool = self.backend.pool()
        if pool is None:
            for f in self._serial:
                f()
            return
        for per_dev, reduce, moves in zip(self.steps, self.reductions, self.transfers):
            # simulated devices run side by side: numpy releases the GIL inside BLAS
            first, *rest = self.devices
            futures = [pool.submit(_run_all, per_dev[d]) for d in rest]
            _run_all(per_dev[first])
            for fut in futures:
                fut.result()
            if reduce is not None:
                reduce()
            _run_all(moves)


def _grouped_attention(at_node: list[Closure]) -> list[Closure] | None:
    """One node's attention kernels on every device as one closure (one compiled call with the
    same per-step preparation, the shared visible length), or None if they are not all such."""
    kernels = [getattr(f, "kernel", None) for f in at_node]
    prepares = {getattr(f, "prepare", None) for f in at_node}
    if not all(native.is_attention(k) for k in kernels) or len(prepares) != 1 or len(at_node) > 64:
        return None
    group = native.group_attention(kernels)
    prepare = prepares.pop()

    def run() -> None:
        if prepare is not None:
            prepare()
        group()
    run.kernel, run.prepare = group, prepare     # for cpu_kernels.batch
    return [run]


def _matmul_group(ex: NumpyExecutable, node: Tensor, taken) -> list[Fusion]:
    """The weight products of x = `node` (q, k and v; gate and up) run at the first one: a step
    of 16 tokens made 7 compiled matmul calls a layer, each with its own parallel region and its
    own rounding of x. Values device 0 computes for all (`shared`) are left alone."""
    def accept(mm: Tensor) -> bool:
        return bool(mm.src[0].flags & Flag.WEIGHT) and mm not in ex.shared
    return matmul_group_fusion(ex.facts, node, taken, accept, native.MAX_GROUP_ITEMS)


def _norm_fusion(ex: NumpyExecutable, node: Tensor, taken) -> list[Fusion]:
    """The norm x weight closure reads x at the MUL: x must still be live there (nothing is
    kept alive for it)."""
    return norm_weight_fusion(ex, node, (Op.RMS_NORM,),
                              lambda mul, norm: () if ex.facts.read_after(norm.src[0], mul) else None)
