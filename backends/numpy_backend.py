"""The numpy backend: runs a Plan on N simulated devices in one process.

Each device owns buffers holding only its slice of every tensor. Preparing a plan turns every
node into a closure over preallocated arrays (views cost nothing: they are numpy views of the
owning buffer, built from the plan's per-device shapes, strides and offsets), so a decode step
is one pass over closures plus one all-reduce per subgraph boundary.
"""

from __future__ import annotations

import functools

import numpy as np

from metatp.backends import cpu_kernels as qkernel
from metatp.backends.affine_quant import AFFINE_TYPES, AffineWeight, affine_blocks, affine_bytes, encodable
from metatp.backends.collectives.host import HostCollective
from metatp.ir.errors import ConfigError, SplitError, UnsupportedOpError
from metatp.ir.ops import OPS, Op
from metatp.ir.tensor import Flag, GGMLType, Tensor
from metatp.backends.numpy_kernels import Closure, kernel_for, rms_norm_mul
from metatp.passes.memory import assign_offsets
from metatp.passes.plan import DeviceLayout, Local, Plan

__all__ = ["NumpyBackend", "NumpyExecutable"]

# "exact": float32 throughout. "llamacpp": round activations before quantized/f16 matmuls as
# llama.cpp's CPU backend does (Q8 blocks with an f16 scale), to compare logits with it. Its f16
# KV cache is not emulated: rounding K/V alone moved our logits further from llama.cpp's.
NUMERICS = ("exact", "llamacpp")

_DTYPES = {GGMLType.F32: np.float32, GGMLType.I32: np.int32, GGMLType.F16: np.float16}


def _dtype(t: Tensor) -> np.dtype:
    try:
        return np.dtype(_DTYPES[t.type])
    except KeyError:
        raise UnsupportedOpError(
            f"numpy backend: tensor {t.name!r} of type {t.type.name} must be a weight (dequantized on upload)") from None


def _shape(ne: tuple[int, ...]) -> tuple[int, int, int, int]:
    return (ne[3], ne[2], ne[1], ne[0])


def _view(root: np.ndarray, t: Tensor, loc: Local) -> np.ndarray:
    """The numpy view of `t` on one device: local shape/strides/offset into its root buffer."""
    itemsize = root.itemsize
    if loc.nelements == 0:
        return np.empty(_shape(loc.ne), dtype=root.dtype)
    if t.type not in _DTYPES or np.dtype(_DTYPES[t.type]).itemsize != itemsize:
        raise UnsupportedOpError(f"numpy backend: view {t.name!r} of a {t.type.name} tensor is not supported")
    return np.ndarray(_shape(loc.ne), dtype=root.dtype, buffer=root, offset=loc.offs,
                      strides=tuple(reversed(loc.nb)))


class NumpyBackend:
    """N simulated devices; leaf buffers (weights, KV cache) persist across plans.

    allreduce: a mode of `collectives.ALLREDUCE_MODES` run on the host: "auto" (the butterfly),
    "butterfly", "ring", or llama.cpp's "none" / "internal" (both the butterfly here); the
    device-only "nccl" raises ConfigError."""

    name = "numpy"

    def __init__(self, layout: DeviceLayout | None = None, numerics: str = "exact", threads: bool = False,
                 cpu_kernels: bool | None = None, allreduce: str = "auto") -> None:
        if numerics not in NUMERICS:
            raise ConfigError(f"numerics must be one of {', '.join(NUMERICS)}, got {numerics!r}")
        self.numerics = numerics
        self.threads = threads          # run the simulated devices in parallel threads
        # few-token matmuls read int8-coded weights through the compiled kernel (None: when it builds)
        if cpu_kernels and not qkernel.available():
            raise ConfigError(f"cpu_kernels=True but the CPU kernel is unavailable: {qkernel.kernel_info()}")
        self.use_kernels = cpu_kernels is not False and qkernel.available()    # False: never built
        self.kernel_threads = qkernel.default_threads()
        # the all-reduce between subgraphs ("auto": the butterfly); its compiled path, when the
        # mode has one, gives the schedule's bits, so cpu_kernels changes speed, not results
        self.collective = HostCollective(allreduce, use_kernels=self.use_kernels)
        self.allreduce = self.collective.name
        self.wire = "f32"               # simulated devices reduce in float32
        self._encoded_only: set[Tensor] = set()     # weights with no float32 copy (int8 codes only)
        self._whole_codes: dict[tuple, AffineWeight] = {}   # GGUF data -> its codes, when not split
        self._slabs: dict[int, np.ndarray] = {}     # per device: where long prompts dequantize codes
        self._pool = None
        self.layout = layout or DeviceLayout()
        self.n = self.layout.n_devices
        self._packed: list[dict[Tensor, AffineWeight]] = [{} for _ in range(self.n)]
        self.leaf: list[dict[Tensor, np.ndarray]] = [{} for _ in range(self.n)]
        self._transposed: list[dict[Tensor, np.ndarray]] = [{} for _ in range(self.n)]
        self._executables: dict[int, NumpyExecutable] = {}
        self._readers_of: tuple[Plan | None, dict] = (None, {})

    @property
    def allreduce_strategy(self) -> str:
        """The all-reduce that runs ("none" on one device), named as CupyBackend names its own."""
        return "none" if self.n == 1 else self.allreduce

    # ---------------------------------------------------------------- leaf data
    def upload(self, t: Tensor, full: np.ndarray, plan: Plan) -> None:
        """Store a leaf's value, split into per-device slices as the plan says."""
        from metatp.backends.slicing import device_slices

        parts = device_slices(np.ascontiguousarray(full), t, plan.of(t), self.n)
        self._encoded_only.discard(t)
        only_matmul = self._only_matmul_weight(t, plan)
        for d in range(self.n):
            part = np.ascontiguousarray(parts[d])
            self._transposed[d].pop(t, None)
            self._packed[d].pop(t, None)         # new values: an int8 copy comes from upload_encoded
            if only_matmul:
                # read only as mul_mat's src0: keep just the (in, out) layout the kernel wants
                wt = np.ascontiguousarray(part.reshape(part.shape[-2], part.shape[-1]).T)
                self._transposed[d][t] = wt
                self.leaf[d][t] = wt.T.reshape(part.shape)   # a strided view of the same memory
            else:
                self.leaf[d][t] = part if part.flags.writeable else part.copy()   # no read-only memmaps

    def keeps_encoded(self, t: Tensor, ggml_type: GGMLType, plan: Plan) -> bool:
        """Is this weight kept as codes (instead of float32)? Those read only as a matmul's
        weight or an embedding table (GET_ROWS), of a type the kernels read."""
        if not (self.use_kernels and GGMLType(ggml_type) in AFFINE_TYPES):
            return False
        local = plan.of(t).local
        if local and not all(encodable(ggml_type, loc.ne[0]) for loc in local if loc.ne[0] * loc.ne[1]):
            return False            # a device's rows would not be whole blocks for the kernels
        return self._read_only_as_weight(t, plan, (Op.MUL_MAT, Op.GET_ROWS))

    def _read_only_as_weight(self, t: Tensor, plan: Plan, ops: tuple[Op, ...]) -> bool:
        """A 2-D weight whose every reader takes it, unviewed, as src0 of one of `ops` (and only there)."""
        if not (t.flags & Flag.WEIGHT) or t.ne[2] != 1 or t.ne[3] != 1:
            return False
        readers = self._readers(t, plan)
        return bool(readers) and all(
            n.view_src is None and n.src[0] is t and n.op in ops and not any(s is t for s in n.src[1:])
            for n in readers)

    def upload_encoded(self, t: Tensor, raw: np.ndarray, ggml_type: GGMLType, plan: Plan) -> bool:
        """Keep a matmul weight from its GGUF blocks as int8 codes + per-block float32 scale and
        offset (~1.25 bytes a weight instead of 4) and no float32 copy: few-token steps read the
        codes, long prompts dequantize slabs of them for BLAS. False (nothing stored) when the
        weight is not such a weight or a split cuts its quant blocks: then `upload` it.
        Mirrored slices share one copy."""
        if not self.keeps_encoded(t, ggml_type, plan):
            return False
        from metatp.backends.slicing import split_raw

        try:
            parts = split_raw(raw, t, GGMLType(ggml_type), plan.of(t), self.n)
        except SplitError:
            return False
        made: dict[int, AffineWeight] = {}
        whole = self.whole_encoded(t, plan)
        key = (np.asarray(raw).__array_interface__["data"][0], np.asarray(raw).nbytes, int(ggml_type))
        if whole and key in self._whole_codes:
            made[id(parts[0])] = self._whole_codes[key]      # the tied lm head reuses the embedding's codes
        for d, part in enumerate(parts):
            ne = plan.of(t).local[d].ne
            self._transposed[d].pop(t, None)
            # nothing reads the float32 view of an encoded-only weight: a zero-stride stand-in
            # gives the executor its shape without memory
            self.leaf[d][t] = np.broadcast_to(np.zeros((), np.float32), _shape(ne))
            if ne[0] * ne[1] == 0:
                self._packed[d].pop(t, None)
                continue
            aw = made.get(id(part))
            if aw is None:
                aw = made[id(part)] = affine_blocks(part.reshape(ne[1], -1), ggml_type, ne[0])
            self._packed[d][t] = aw
        if whole and made:
            self._whole_codes[key] = next(iter(made.values()))
        self._encoded_only.add(t)
        return True

    def whole_encoded(self, t: Tensor, plan: Plan) -> bool:
        """Does every device hold the whole weight (one device, or mirrored)? Then one set of
        codes serves every device and every leaf with the same GGUF data (a tied lm head)."""
        st = plan.of(t).state
        return self.n == 1 or st.is_mirrored

    def storage_key(self, t: Tensor, plan: Plan, source: str):
        """Weights with equal keys share one stored copy (count it once), or None."""
        if self.keeps_encoded(t, t.type, plan) and self.whole_encoded(t, plan):
            return ("codes", source)
        return None

    def encoded_only(self, t: Tensor) -> bool:
        return t in self._encoded_only

    def slab(self, d: int) -> np.ndarray:
        """Device d's buffer for dequantized weight slabs (one per device, reused by every matmul)."""
        s = self._slabs.get(d)
        if s is None:
            s = self._slabs[d] = np.empty(qkernel.DEQUANT_CHUNK, np.float32)
        return s

    def workspace_bytes(self, plan: Plan) -> list[int]:
        """Per device: bytes beyond weights, KV and the plan's buffers (the dequantization slab)."""
        enc = any(self.keeps_encoded(t, t.type, plan) for t in plan.graph.leaves if t.flags & Flag.WEIGHT)
        return [qkernel.DEQUANT_CHUNK * 4 if enc else 0] * self.n

    def packed(self, t: Tensor, d: int) -> AffineWeight | None:
        return self._packed[d].get(t)

    def _readers(self, t: Tensor, plan: Plan) -> list[Tensor]:
        """Nodes of the plan that read t (directly or as a view); one graph walk per plan."""
        if self._readers_of[0] is not plan:
            readers = plan.graph.consumers()
            for n in plan.graph.nodes:
                if n.view_src is not None and n not in readers.get(n.view_src, []):
                    readers.setdefault(n.view_src, []).append(n)
            self._readers_of = (plan, readers)
        return self._readers_of[1].get(t, [])

    def _only_matmul_weight(self, t: Tensor, plan: Plan) -> bool:
        return self._read_only_as_weight(t, plan, (Op.MUL_MAT,))

    def storage_bytes(self, t: Tensor, local_ne: tuple[int, ...], plan: Plan) -> int:
        """Bytes this backend keeps for a weight slice of local shape `local_ne` (f32, one or two layouts)."""
        n = int(np.prod(local_ne)) * 4
        if not (t.flags & Flag.WEIGHT):
            return n
        if self.keeps_encoded(t, t.type, plan):
            return affine_bytes(t.type, int(np.prod(local_ne[1:])), local_ne[0]) if n else 0
        if self._only_matmul_weight(t, plan):
            return n
        mm = any(node.op is Op.MUL_MAT and node.src[0] is t for node in self._readers(t, plan))
        return 2 * n if mm else n

    def memory_budget(self) -> tuple[int | None, bool]:
        """(bytes available, shared by all devices?): simulated devices share the host's memory."""
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024, True
        except OSError:
            pass
        return None, True

    def has(self, t: Tensor) -> bool:
        return t in self.leaf[0]

    def allocate_leaf(self, t: Tensor, plan: Plan) -> None:
        """Zero-filled per-device buffers for a persistent leaf (the KV cache)."""
        tp = plan.of(t)
        for d in range(self.n):
            self.leaf[d][t] = np.zeros(_shape(tp.local[d].ne), dtype=_dtype(t))

    def transposed(self, t: Tensor, d: int) -> np.ndarray:
        """A weight stored (in, out)-contiguous for `x @ Wt` (made once, kept)."""
        if t in self._encoded_only:
            raise UnsupportedOpError(f"numpy backend: {t.name!r} is kept as int8 codes only; no float32 layout")
        cache = self._transposed[d]
        wt = cache.get(t)
        if wt is None:
            w = self.leaf[d][t]
            wt = np.ascontiguousarray(w.reshape(w.shape[-2], w.shape[-1]).T)
            cache[t] = wt
        return wt

    def allocated_bytes(self) -> list[int]:
        """Bytes held per device (leaves, transposed weights, and prepared plans' buffers)."""
        out = []
        seen: set[int] = set()      # an int8-coded weight mirrored on every device is one object
        for d in range(self.n):
            owned = [a for t, a in self.leaf[d].items()
                     if t not in self._encoded_only and not _aliases(a, self._transposed[d].values())]
            n = sum(a.nbytes for a in owned) + sum(a.nbytes for a in self._transposed[d].values())
            for aw in self._packed[d].values():
                if id(aw) not in seen:
                    seen.add(id(aw))
                    n += aw.nbytes
            n += max((ex.buffer_bytes[d] for ex in self._executables.values()), default=0)
            n += self._slabs[d].nbytes if d in self._slabs else 0
            out.append(n)
        return out

    # ---------------------------------------------------------------- plans
    def prepare(self, plan: Plan) -> NumpyExecutable:
        ex = self._executables.get(id(plan))
        if ex is None or ex.plan is not plan:
            ex = NumpyExecutable(self, plan)
            self._executables[id(plan)] = ex
        return ex

    def pool(self):
        """Worker threads for devices 1..n-1 (device 0 runs on the caller's thread), or None."""
        if not self.threads or self.n == 1:
            return None
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(max_workers=self.n - 1, thread_name_prefix="metatp-dev")
        return self._pool

    def release(self, plan: Plan) -> None:
        """Forget a plan's executable and its buffers."""
        ex = self._executables.get(id(plan))
        if ex is not None and ex.plan is plan:
            del self._executables[id(plan)]

    def reset_kv(self) -> None:
        for d in range(self.n):
            for t, a in self.leaf[d].items():
                if t.flags & Flag.KV_CACHE:
                    a.fill(0)


def _aliases(a: np.ndarray, others) -> bool:
    """Is `a` a view of one of `others` (a weight kept only in its transposed layout)?"""
    return a.base is not None and any(np.may_share_memory(a, o) for o in others if o.size == a.size)


def _run_all(closures: list[Closure]) -> None:
    for f in closures:
        f()


class _DeviceContext:
    """What kernels may ask the backend while building closures for device `d`."""

    def __init__(self, backend: NumpyBackend, d: int, step_memo: dict, plan_memo: dict | None = None) -> None:
        self.backend = backend
        self.d = d
        self._memo = step_memo
        self._plan_memo = {} if plan_memo is None else plan_memo
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

    def activation_rounding(self, w: Tensor):
        """None in exact mode; else how llama.cpp's CPU backend rounds the other matmul operand."""
        if self.backend.numerics != "llamacpp" or not self.is_weight(w) or w.type == GGMLType.F32:
            return None
        from metatp.backends.numpy_kernels import quantize_q8_blocks, round_f16

        return round_f16 if w.type in (GGMLType.F16, GGMLType.BF16) else quantize_q8_blocks


class NumpyExecutable:
    """A plan bound to buffers: per device, per subgraph, a list of closures."""

    def __init__(self, backend: NumpyBackend, plan: Plan) -> None:
        if plan.n_devices != backend.n:
            raise ValueError(f"plan is for {plan.n_devices} devices, backend has {backend.n}")
        self.backend = backend
        self.plan = plan
        n = backend.n
        graph = plan.graph
        self.arrays: list[dict[Tensor, np.ndarray]] = [{} for _ in range(n)]
        self.inputs: dict[Tensor, np.ndarray] = {}
        self.buffer_bytes = [0] * n
        for t in graph.leaves:
            if t.flags & Flag.INPUT:
                arr = np.zeros(_shape(t.ne), dtype=_dtype(t))
                self.inputs[t] = arr
                for d in range(n):
                    self.arrays[d][t] = arr     # inputs are mirrored and read-only: one array serves all
            elif t.flags & Flag.KV_CACHE:
                if not backend.has(t):
                    backend.allocate_leaf(t, plan)
                for d in range(n):
                    self.arrays[d][t] = backend.leaf[d][t]
            else:
                if not backend.has(t):
                    raise UnsupportedOpError(f"numpy backend: leaf {t.name!r} has no data (upload it first)")
                for d in range(n):
                    self.arrays[d][t] = backend.leaf[d][t]
        self.steps: list[list[list[Closure]]] = []    # [subgraph][device] -> closures
        self.shared = self._shared_mirrored() if n > 1 and not backend.threads else set()
        for d in range(n):
            self._bind_device(d)
        self._step_memo: dict = {}
        plan_memo: dict = {}
        fused = self._fusable_norms()            # MUL node -> the RMS_NORM it absorbs
        absorbed = set(fused.values())
        # Closures in two orders: per device (the threaded mode runs devices side by side) and
        # node by node across devices (the default: devices are independent inside a subgraph,
        # so any interleaving is valid, and one node's int8 matmuls on all devices become one
        # compiled call with one parallel region).
        self.node_major: list[list[Closure]] = []
        for sub in plan.subgraphs:
            ctxs = [_DeviceContext(backend, d, self._step_memo, plan_memo) for d in range(n)]
            per_dev: list[list[Closure]] = [[] for _ in range(n)]
            order: list[Closure] = []
            for i in range(sub.start, sub.end + 1):
                node = graph.nodes[i]
                at_node = []
                for d in range(n):
                    f = self._closure(node, d, ctxs[d], fused, absorbed)
                    if f is not None:
                        per_dev[d].append(f)
                        at_node.append(f)
                if len(at_node) > 1 and all(qkernel.is_qmatmul(f) for f in at_node):
                    order.append(qkernel.group_qmatmul(at_node))
                else:
                    order.extend(at_node)
            self.steps.append(per_dev)
            self.node_major.append(order)
        self._reduce = self._allreduce_closures()

    def _closure(self, node: Tensor, d: int, ctx: _DeviceContext, fused: dict, absorbed: set) -> Closure | None:
        """What device d runs for `node`, or None (a view, a value another device computed, an
        empty slice, or a norm fused into its multiply)."""
        if OPS[node.op].is_view and node.op not in (Op.CPY, Op.SET_ROWS):
            return None
        tp = self.plan.of(node)
        if d > 0 and node in self.shared:
            return None             # device 0 computed it; this device reads the same array
        if not tp.compute[d]:
            if tp.zero_fill is not None and tp.zero_fill[d]:
                return functools.partial(self.arrays[d][node].fill, 0)
            return None
        if node in absorbed:
            return None
        a = self.arrays[d]
        rms = fused.get(node)
        if rms is not None:
            return rms_norm_mul(a[rms.src[0]], a[node.src[1]], rms.params["eps"], a[node])
        srcs = [a[s] if s is not None else None for s in node.src]
        return kernel_for(node)(node, a[node], srcs, ctx)

    def _fusable_norms(self) -> dict[Tensor, Tensor]:
        """MUL nodes whose src0 is an RMS_NORM read by nothing else (and src1 a weight row) -> that norm.

        The pair runs as one closure; the norm's own buffer is never written."""
        plan, graph = self.plan, self.plan.graph
        sub_of = {}
        for k, sub in enumerate(plan.subgraphs):
            for i in range(sub.start, sub.end + 1):
                sub_of[graph.nodes[i]] = k
        readers = graph.consumers()
        out: dict[Tensor, Tensor] = {}
        for node in graph.nodes:
            if node.op is not Op.MUL or node.src[0].op is not Op.RMS_NORM:
                continue
            rms, w = node.src[0], node.src[1]
            if readers.get(rms) != [node] or not (w.flags & Flag.WEIGHT) or w.ne != (rms.ne[0], 1, 1, 1):
                continue
            if sub_of[rms] != sub_of[node] or plan.of(rms).state.is_partial or rms.flags & Flag.OUTPUT:
                continue
            if list(plan.of(rms).compute) != list(plan.of(node).compute):
                continue
            x = rms.src[0]
            x_root = x.view_src or x
            if x_root.op is not Op.NONE and not any(graph.index[r] > graph.index[node]
                                                    for r in readers.get(x, []) + readers.get(x_root, [])):
                continue   # the fused closure reads x at the MUL: x's memory must still be live there
            out[node] = rms
        return out

    def _shared_mirrored(self) -> set[Tensor]:
        """Nodes whose value is bit-identical on every simulated device: mirrored, computed everywhere,
        and reading only such values, mirrored leaves, or reduced (all-reduced) nodes. Device 0
        computes them once and the other devices read its array; the plan is unchanged."""
        plan, graph = self.plan, self.plan.graph
        reduced = {graph.nodes[r.node] for r in plan.reductions}
        same: set[Tensor] = {t for t in graph.leaves
                             if plan.of(t).state.is_mirrored and not (t.flags & Flag.KV_CACHE)}
        shared: set[Tensor] = set()
        for node in graph.nodes:
            tp = plan.of(node)
            if node.op in (Op.SET_ROWS, Op.CPY) or not (tp.state.is_mirrored and tp.sync_state.is_mirrored):
                continue
            if not all(tp.compute) or (node.view_src is not None and node.view_src not in same):
                continue
            if all(s is None or s in same or s in reduced for s in node.src):
                same.add(node)
                shared.add(node)
        return shared

    def _late_reads(self) -> dict[Tensor, int]:
        """Device 0 keeps each shared node until the end of the subgraph of its last reader: the
        other devices run that subgraph after device 0 has finished it."""
        plan, graph = self.plan, self.plan.graph
        end_of = {}
        for sub in plan.subgraphs:
            for i in range(sub.start, sub.end + 1):
                end_of[i] = sub.end
        late: dict[Tensor, int] = {}
        for i, node in enumerate(graph.nodes):
            for s in node.src:
                root = s.view_src or s if s is not None else None
                if root in self.shared:
                    late[root] = max(late.get(root, -1), end_of[i])
        return late

    def _bind_device(self, d: int) -> None:
        """Node arrays for device d: owners are placed in one arena (dead buffers reused), views map onto them."""
        arrays = self.arrays[d]
        plan = self.plan
        late = self._late_reads() if d == 0 and self.shared else None
        offsets, size = assign_offsets(plan, d, lambda t: _dtype(t).itemsize, live_until=late)
        arena = np.zeros(max(size, 1), dtype=np.uint8)
        self.buffer_bytes[d] = arena.nbytes
        for node in plan.graph.nodes:
            loc = plan.of(node).local[d]
            if d > 0 and node in self.shared:
                arrays[node] = self.arrays[0][node]
            elif node.view_src is not None:
                arrays[node] = _view(arrays[node.view_src], node, loc)
            else:
                arrays[node] = np.ndarray(_shape(loc.ne), dtype=_dtype(node), buffer=arena, offset=offsets[node])

    # ---------------------------------------------------------------- running
    def set_input(self, t: Tensor, value: np.ndarray) -> None:
        self.inputs[t][...] = np.asarray(value).reshape(self.inputs[t].shape)

    def run(self, inputs: dict[Tensor, np.ndarray] | None = None) -> None:
        for t, v in (inputs or {}).items():
            self.set_input(t, v)
        plan = self.plan
        n = self.backend.n
        self._step_memo.clear()
        pool = self.backend.pool()
        for sub, per_dev, order in zip(plan.subgraphs, self.steps, self.node_major):
            if pool is None:
                for f in order:
                    f()
            else:   # simulated devices run side by side: numpy releases the GIL inside BLAS
                futures = [pool.submit(_run_all, per_dev[d]) for d in range(1, n)]
                _run_all(per_dev[0])
                for fut in futures:
                    fut.result()
            if sub.reduction is not None and n > 1:
                self._reduce[sub.reduction.node]()

    def _allreduce_closures(self) -> dict[int, Closure]:
        """One prepared all-reduce per reduced node, by the backend's collective."""
        out = {}
        for sub in self.plan.subgraphs:
            if sub.reduction is None or self.backend.n == 1:
                continue
            node = self.plan.graph.nodes[sub.reduction.node]
            bufs = [self.arrays[d][node] for d in range(self.backend.n)]
            active = list(self.plan.of(node).compute)
            out[sub.reduction.node] = self.backend.collective.prepare_allreduce(bufs, active)
        return out

    def read(self, t: Tensor) -> np.ndarray:
        """The full value of `t` (gathered from slices; a PARTIAL value is summed)."""
        if self.backend.n == 1:
            return np.array(self.arrays[0][t], copy=True)
        from metatp.backends.slicing import gather_array

        return gather_array([self.arrays[d][t] for d in range(self.backend.n)], t, self.plan.of(t))
