"""The numpy backend: runs a Plan on N simulated devices in one process.

Each device owns buffers holding only its slice of every tensor. This module is the weight
storage policy (float32, a transposed copy for BLAS, or int8 codes the compiled kernels read)
over the base's leaf store; `executable` binds a Plan to buffers and runs it as closures.

A process may own only some of the layout's devices (`devices=[rank]` under MPI, see
`backends.distributed`): it then stores, allocates and runs only those devices' slices, and
its `collective` spans the other processes.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from metatp.backends.numpy import native
from metatp.backends.numpy.codes import (AFFINE_TYPES, AffineWeight, affine_blocks, affine_bytes, encodable,
                                          adjacent, grouped_affine_blocks)
from metatp.backends.base import Backend, BackendInfo, WeightSource
from metatp.backends.collectives.host import HostCollective
from metatp.backends.collectives.wire import WireThresholds
from metatp.ir.dtypes import np_shape
from metatp.backends.numpy.executable import NumpyExecutable, host_dtype, host_shape
from metatp.ir.errors import ConfigError, SplitError, UnsupportedOpError
from metatp.ir.ops import Op
from metatp.ir.tensor import Flag, GGMLType, Tensor, type_size
from metatp.passes.plan import DeviceLayout, Plan
from metatp.backends.slicing import device_slices, split_raw

__all__ = ["NumpyBackend", "NumpyExecutable", "KV_SPAN_FLOOR"]

# cache cells a few-token pass attends over at least (`NumpyBackend.kv_span_floor`): past it the
# span grows by KV_PAD again (a mask of 64 rows x 4096 cells is 1 MB; the attention's scratch
# per plan grows with the span too)
KV_SPAN_FLOOR = 4096


class NumpyBackend(Backend):
    """N simulated devices; leaf buffers (weights, KV cache) persist across plans.

    allreduce: a mode of `collectives.ALLREDUCE_MODES` run on the host: "auto" (the butterfly),
    "butterfly", "ring", or llama.cpp's "none" / "internal" (both the butterfly here); the
    device-only "nccl" raises ConfigError.

    numerics (checked by `backends.registry`): "exact", float32 throughout; "llamacpp" (alias
    "q8"), round activations before quantized/f16 matmuls as llama.cpp's CPU backend does (Q8
    blocks with an f16 scale) and, for few-token steps on int8 codes, take integer dot products
    as it does (the fastest CPU mode). Its f16 KV cache is not emulated: rounding K/V alone
    moved our logits further from llama.cpp's.

    parallel_devices: run the simulated devices side by side in threads. kernel_threads: the
    compiled kernels' thread count (None: `native.default_threads()`, METATP_NUM_THREADS or the
    CPUs this process may use, shared among the MPI ranks on the machine); the most a parallel
    region takes: while other processes keep CPUs busy it takes the CPUs they leave
    (`native.adaptive_threads`, csrc/threads.c; METATP_ADAPTIVE_THREADS=0: always this count),
    since every region waits for its slowest thread. The bits never depend on it.

    devices: the devices this process owns (default: all of the layout's); a strict subset
    needs a `collective` spanning the processes that own the others (`MpiCollective`)."""

    name = "numpy"
    spanning = "collectives.mpi.MpiCollective"

    def __init__(self, layout: DeviceLayout | None = None, numerics: str = "exact", parallel_devices: bool = False,
                 cpu_kernels: bool | None = None, allreduce: str = "auto", kernel_threads: int | None = None,
                 devices: Sequence[int] | None = None, collective=None, batch_invariant: bool = False) -> None:
        self.numerics = numerics
        if batch_invariant and cpu_kernels is False:     # pure numpy: BLAS sums depend on the pass's rows
            raise ConfigError("batch_invariant=True needs the compiled CPU kernels (cpu_kernels=False was given)")
        if batch_invariant:
            cpu_kernels = True          # their per-row sums are what makes a row's bits its own
        self.parallel_devices = parallel_devices
        # few-token matmuls read int8-coded weights through the compiled kernel (None: when it builds)
        if cpu_kernels and not native.available():
            raise ConfigError(f"cpu_kernels=True but the CPU kernel is unavailable: {native.kernel_info()}")
        self.use_kernels = cpu_kernels is not False and native.available()    # False: never built
        self.kernel_threads = kernel_threads if kernel_threads is not None else native.default_threads()
        super().__init__(layout, devices, collective)
        # the all-reduce between subgraphs ("auto": the butterfly); its compiled path, when the
        # mode has one, gives the schedule's bits, so cpu_kernels changes speed, not results
        if collective is None:
            self.collective = HostCollective(allreduce, use_kernels=self.use_kernels)
        self.allreduce = self.collective.name
        self.wire = "f32"               # simulated devices (and MPI ranks) reduce in float32
        self._encoded_only: set[Tensor] = set()     # weights with no float32 copy (int8 codes only)
        self._whole_codes: dict[tuple, AffineWeight] = {}   # GGUF data -> its codes, when not split
        self._slabs: dict[int, np.ndarray] = {}     # per device: where long prompts dequantize codes
        self._pool = None
        self._packed: list[dict[Tensor, AffineWeight]] = [{} for _ in range(self.n)]
        self._transposed: list[dict[Tensor, np.ndarray]] = [{} for _ in range(self.n)]

    @property
    def allreduce_strategy(self) -> str:
        """The all-reduce that runs ("none" on one device), named as CupyBackend names its own."""
        return "none" if self.n == 1 else self.allreduce

    def describe(self) -> BackendInfo:
        return BackendInfo(name=self.name, n_devices=self.n, owned=tuple(self.owned),
                           allreduce=self.allreduce_strategy, wire=self.wire, wire_thresholds=WireThresholds(),
                           kernels=native.kernel_info() if self.use_kernels else "off",
                           kernel_threads=self.kernel_threads,
                           options=(("numerics", self.numerics), ("parallel_devices", self.parallel_devices)))

    # ---------------------------------------------------------------- leaf data
    def upload(self, t: Tensor, full: np.ndarray, plan: Plan) -> None:
        """Store a leaf's value, split into per-device slices as the plan says."""

        parts = device_slices(np.ascontiguousarray(full), t, plan.of(t), self.n)
        self._encoded_only.discard(t)
        only_matmul = self._only_matmul_weight(t, plan)
        for d in self.owned:
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
        return plan.facts.only_src0_of(t, ops)

    def upload_encoded(self, t: Tensor, raw: np.ndarray, ggml_type: GGMLType, plan: Plan) -> bool:
        """Keep a matmul weight from its GGUF blocks as int8 codes + per-block float32 scale and
        offset (~1.25 bytes a weight instead of 4) and no float32 copy: few-token steps read the
        codes, long prompts dequantize slabs of them for BLAS. False (nothing stored) when the
        weight is not such a weight or a split cuts its quant blocks: then `upload` it.
        Mirrored slices share one copy."""
        if not self.keeps_encoded(t, ggml_type, plan):
            return False

        try:
            parts = split_raw(raw, t, GGMLType(ggml_type), plan.of(t), self.n)
        except SplitError:
            return False
        made: dict[int, AffineWeight] = {}
        whole = self.whole_encoded(t, plan)
        key = (np.asarray(raw).__array_interface__["data"][0], np.asarray(raw).nbytes, int(ggml_type))
        if whole and key in self._whole_codes:
            made[id(parts[0])] = self._whole_codes[key]      # the tied lm head reuses the embedding's codes
        for d in self.owned:
            part = parts[d]
            ne = plan.of(t).local[d].ne
            self._transposed[d].pop(t, None)
            # nothing reads the float32 view of an encoded-only weight: a zero-stride stand-in
            # gives the executor its shape without memory
            self.leaf[d][t] = np.broadcast_to(np.zeros((), np.float32), np_shape(ne))
            if ne[0] * ne[1] == 0:
                self._packed[d].pop(t, None)
                continue
            aw = made.get(id(part))
            if aw is None:
                aw = made[id(part)] = self._kernel_layout(part.reshape(ne[1], -1), ggml_type, ne[0])
            self._packed[d][t] = aw
            self.slab(d)        # made now, as the plan counts it (its pages are touched only by long prompts)
        if whole and made:
            self._whole_codes[key] = next(iter(made.values()))
        elif len(made) > 1:
            # this process's device slices end to end, in the order the node's grouped product reads them
            moved = dict(zip(made, adjacent(list(made.values()))))
            for d in self.owned:
                if t in self._packed[d]:
                    self._packed[d][t] = moved[id(parts[d])]
        self._encoded_only.add(t)
        return True

    def groups_rows(self) -> bool:
        """With llama.cpp numerics every few-token product is the integer kernel's, which reads
        4- and 8-bit codes fastest in groups of 8 rows (`group_rows`: 1.19x -> 1.5x llama.cpp's
        decode, measured on the default model). The float kernel of exact mode reads that layout
        in 512-bit builds (a step of 16 tokens ~2.5x faster than row-major: docs/performance.md);
        other builds' float kernel reads row-major codes."""
        return self.numerics in ("llamacpp", "q8") or (self.use_kernels and native.float_row_groups())

    def row_threads(self, n_rows: int) -> int:
        """Threads for a row kernel (norm, activation, add, rope) over a pass of `n_rows` tokens:
        the kernel threads, except in a pass whose products go through dequantization + BLAS
        (exact numerics on row-major codes, past MAX_ROWS tokens), where OpenBLAS's threads, still
        spinning after each product, took the cores: pp512 exact on the AVX2 build fell from ~560
        to ~210 t/s with the rows shared."""
        if self.groups_rows() or n_rows <= native.MAX_ROWS:
            return self.kernel_threads
        return 1

    def _kernel_layout(self, raw: np.ndarray, ggml_type: GGMLType, k: int) -> AffineWeight:
        """The weight's codes in the layout this backend's kernels read."""
        if self.groups_rows():
            return grouped_affine_blocks(raw, ggml_type, k)
        return affine_blocks(raw, ggml_type, k)

    def store_weight(self, t: Tensor, source: WeightSource, plan: Plan) -> None:
        """Int8 codes when the kernels read this weight so (`upload_encoded`), else float32."""
        if not self.upload_encoded(t, source.raw, source.ggml_type, plan):
            self.upload(t, source.dequantize(), plan)

    def whole_encoded(self, t: Tensor, plan: Plan) -> bool:
        """Does every device hold the whole weight (one device, or mirrored)? Then one set of
        codes serves every device and every leaf with the same GGUF data (a tied lm head)."""
        st = plan.of(t).state
        return self.n == 1 or st.is_mirrored

    def storage_key(self, t: Tensor, plan: Plan, source: str):
        """Weights with equal keys share one stored copy (count it once), or None."""
        if len(self.owned) < self.n:
            return None     # one device here: the engine's once-for-all-devices count would miss it on others
        if self.keeps_encoded(t, t.type, plan) and self.whole_encoded(t, plan):
            return ("codes", source)
        return None

    def encoded_only(self, t: Tensor) -> bool:
        return t in self._encoded_only

    def slab(self, d: int) -> np.ndarray:
        """Device d's buffer for dequantized weight slabs (one per device, reused by every matmul)."""
        s = self._slabs.get(d)
        if s is None:
            s = self._slabs[d] = np.empty(native.DEQUANT_CHUNK, np.float32)
        return s

    def workspace_bytes(self, plan: Plan) -> list[int]:
        """Per device: bytes beyond weights, KV and the plan's buffers (the dequantization slab, on
        the devices that hold int8 codes: `upload_encoded` makes it there only; -sm layer)."""
        enc = [False] * self.n
        for t in plan.graph.leaves:
            if t.flags & Flag.WEIGHT and self.keeps_encoded(t, t.type, plan):
                for d, loc in enumerate(plan.of(t).local):
                    enc[d] = enc[d] or bool(loc.ne[0] * loc.ne[1])
        return [native.DEQUANT_CHUNK * 4 if e else 0 for e in enc]

    def packed(self, t: Tensor, d: int) -> AffineWeight | None:
        return self._packed[d].get(t)

    def _only_matmul_weight(self, t: Tensor, plan: Plan) -> bool:
        return self._read_only_as_weight(t, plan, (Op.MUL_MAT,))

    def weight_bytes(self, t: Tensor, local_ne: tuple[int, ...], plan: Plan) -> int:
        """Bytes this backend keeps for a weight slice of local shape `local_ne` (f32, one or two layouts)."""
        n = int(np.prod(local_ne)) * 4
        if not (t.flags & Flag.WEIGHT):
            return n
        if self.keeps_encoded(t, t.type, plan):
            return affine_bytes(t.type, int(np.prod(local_ne[1:])), local_ne[0], grouped=self.groups_rows()) if n else 0
        if self._only_matmul_weight(t, plan):
            return n
        mm = any(node.op is Op.MUL_MAT and node.src[0] is t for node in plan.facts.readers_with_views.get(t, []))
        return 2 * n if mm else n

    def memory_budget(self) -> tuple[int | None, bool]:
        """(bytes available, shared by all devices?): simulated devices share the host's memory;
        a process owning one device of several is checked for its own device (ranks may sit on
        different machines)."""
        shared = len(self.owned) == self.n
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024, shared
        except OSError:
            pass
        return None, shared

    def step_rows(self) -> int:
        """The compiled kernels take steps of up to MAX_ROWS rows, each row's sums in an order
        that does not depend on the others (longer steps go to BLAS, which is not so)."""
        return native.MAX_ROWS if self.use_kernels else 16

    def kv_page(self) -> int:
        return native.ATTN_CHUNK

    def kv_span_floor(self, n_rows: int) -> int:
        """A few-token pass attends over the first KV_SPAN_FLOOR cells at least: its compiled
        attention reads only the cells its rows see (the visible length), so a longer span costs
        only the mask (~10 us a step of 16 rows at 4096 cells), and the plans of a decode no
        longer change with its depth (a server taking 16 requests compiled one each time the
        cells in use crossed another 256, ~50-170 ms each). Longer passes keep the span in use."""
        return KV_SPAN_FLOOR if self.use_kernels and n_rows <= self.step_rows() else 0

    def kv_itemsize(self, t: Tensor) -> int:
        """Bytes per element of a float KV cache as stored (f32 4, f16/bf16 2); for a quantized
        cache the bytes of one block (the memory plan counts those caches by their blocks)."""
        return type_size(t.type)

    def new_leaf(self, d: int, t: Tensor, ne: tuple[int, ...]) -> np.ndarray:
        """Zeros written now (as llama.cpp clears its KV buffer), not calloc's untouched pages: a
        decode step would otherwise take the page faults of the cells it first writes (a step of
        16 sequences spent ~1.6 ms of ~24 writing its K/V rows into fresh pages)."""
        leaf = np.empty(host_shape(t, ne), dtype=host_dtype(t))
        leaf.fill(0)
        return leaf

    def zero_leaf(self, d: int, value: np.ndarray) -> None:
        value.fill(0)

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

    def leaf_bytes(self) -> list[int]:
        """Bytes of the stored leaves per device: float32 values, transposed weights, int8 codes
        and the dequantization slab (the base adds the prepared plans' buffers)."""
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
            n += self._slabs[d].nbytes if d in self._slabs else 0
            out.append(n)
        return out

    # ---------------------------------------------------------------- plans
    def make_executable(self, plan: Plan) -> NumpyExecutable:
        return NumpyExecutable(self, plan)

    def pool(self):
        """Worker threads for the owned devices but the first (it runs on the caller's thread), or None."""
        if not self.parallel_devices or len(self.owned) == 1:
            return None
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(max_workers=len(self.owned) - 1, thread_name_prefix="metatp-dev")
        return self._pool


def _aliases(a: np.ndarray, others) -> bool:
    """Is `a` a view of one of `others` (a weight kept only in its transposed layout)?"""
    return a.base is not None and any(np.may_share_memory(a, o) for o in others if o.size == a.size)
