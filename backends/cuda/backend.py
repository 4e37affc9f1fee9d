"""The CUDA backend: N devices on CuPy, one GPU each or several "virtual devices" sharing a GPU.

What is decided here: which GPU each device runs on (device d on ``gpus[d % len(gpus)]``), peer
access between the GPUs in use, how a weight is stored (its GGUF encoding when only the
matmul / get-rows kernels read it, else f32; a split cuts whole quant blocks), the KV cache's
storage type (the graph's cache type: f16 / bf16 16-bit, q8_0 / q4_0 / q4_1 / q5_0 / q5_1 raw
blocks; an F32 graph cache as `kv_dtype`, f16 by default), the all-reduce mode (NCCL set up
once, `nccl.NcclGroup`) and how much scratch memory a plan needs. Running a plan is `executable.CupyExecutable`'s.

A process may own only some of the layout's devices (`devices=[rank]` under MPI, one GPU per
rank, see `backends.distributed`): it stores, allocates and runs only those devices' slices,
places them on `gpus` in order (the k-th owned device on ``gpus[k % len(gpus)]``), and its
`collective` (NCCL between the processes, `cuda.nccl.NcclCollective`) spans the others.

``runtime``: the device API. `runtime.CupyRuntime` (the default) is CuPy 13/14; tests hand in
`metatp.testing.EmuRuntime` (the same calls on the CPU, kernels on the emulator).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from metatp.backends.base import Backend, BackendInfo, WeightSource
from metatp.backends.collectives.schedule import Mode, resolve_mode
from metatp.backends.collectives.wire import WireThresholds, wire_dtype
from metatp.backends.cuda import ops
from metatp.backends.cuda.executable import CupyExecutable
from metatp.backends.cuda.faults import allocating
from metatp.backends.cuda.kernels.attn import BATCH_INVARIANT_KV_CHUNK
from metatp.backends.cuda.kernels.mmq import MMQ_MAX_TOKENS, MMQ_MIN_TOKENS
from metatp.backends.cuda.launch import FAMILIES, device_ptr
from metatp.backends.cuda.nccl import NcclGroup
from metatp.backends.cuda.runtime import CupyRuntime
from metatp.backends.cuda.storage import (STORAGE, RawWeight, cache_storage, input_layout, raw_nb,
                                          weight_type_name)
from metatp.ir.dtypes import np_shape
from metatp.backends.slicing import device_slices, local_raw_shape, split_raw
from metatp.ir.errors import ConfigError, DeviceFaultError, UnsupportedOpError
from metatp.ir.ops import Op
from metatp.ir.tensor import Flag, GGMLType, Tensor, block_size, type_size
from metatp.passes.plan import DeviceLayout, Plan

__all__ = ["CupyBackend", "GRAPH_BUCKETS", "RAW_READERS"]

#: the ops whose kernels read a weight's raw GGUF blocks (as src0; MUL_MAT needs it 2-D)
RAW_READERS = (Op.MUL_MAT, Op.MUL_MAT_ID, Op.GET_ROWS)

#: the row counts a few-token pass pads to, as vLLM's cudagraph capture sizes (powers of two: few
#: plans to compile and graphs to keep; a decode step of B sequences replays the graph of the
#: first size >= B, its padding rows on scratch cells). The largest is `step_rows`: decode steps
#: of up to 256 sequences, and prompt chunks beside them, are one pass.
GRAPH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class Device:
    """One logical device: a GPU, its own stream, and the events its steps order with."""

    def __init__(self, rt, index: int, gpu: int) -> None:
        self.index = index
        self.gpu = gpu
        self.stream = rt.new_stream(gpu)
        self.ctx = rt.context(gpu, self.stream)
        self.ready = rt.new_event(gpu)      # all-reduce: "my buffer holds this round's value"
        self.read_done = rt.new_event(gpu)  # all-reduce: "I finished reading my partner's buffer"
        self.done = rt.new_event(gpu)       # end of step (joins the GPU's lead stream)
        self.fork = rt.new_event(gpu)       # start of step (recorded by the GPU's lead)
        self.inputs_copied = rt.new_event(gpu)
        self.shared_ready = rt.new_event(gpu)  # a GPU's lead computed the values it shares
        self.step_fork = rt.new_event(gpu)  # several GPUs, one graph: the first GPU's lead starts the others
        self.step_done = rt.new_event(gpu)  # ... and waits for them (recorded by each GPU's lead)
        self.sent = rt.new_event(gpu)       # -sm layer: "the value I hand on is computed" (source)
        self.received = rt.new_event(gpu)   # -sm layer: "I finished copying it" (destination)


class CupyBackend(Backend):
    """N devices on CuPy: one GPU each when there are enough, else virtual devices (several
    logical devices with their own stream and buffers on one GPU).

    cuda_graphs: capture a plan whose steps CUDA can capture (kernel launches; cuBLAS GEMMs where
    cuBLAS >= 12.2, `gemm_capturable`; no cupy op) on its second run and replay it: one graph per
    row bucket (GRAPH_BUCKETS). allreduce: "auto" (NCCL when every device is a distinct GPU and NCCL
    works, else the butterfly), "nccl", "butterfly", "ring" (or llama.cpp's "none" /
    "internal": the butterfly). wire: "auto" (FP32 below `wire_thresholds`, BF16 above),
    "f32" (exact), "bf16". kv_dtype: storage of an F32 graph KV cache ("f16"; a cache of
    another graph type is stored as that type, a quantized one as its blocks). matmul_dtype:
    operand type of the dequantize + cuBLAS path used above MATVEC_MAX_TOKENS tokens ("f16"; "f32" for
    exactness). gpus: the GPU ids to use (default all visible). multi_gpu_graphs: how a step
    over several GPUs is captured: "whole" (one graph spanning the GPUs, NCCL calls captured
    inside it; falls back to "segments" when that capture fails) or "segments" (one graph per
    subgraph and device, collectives run eagerly between them). mmq_min_tokens / mmq_max_tokens:
    the token counts (inclusive) a MUL_MAT runs the tiled many-token kernel for (default
    kernels.mmq.MMQ_MIN_TOKENS / MMQ_MAX_TOKENS; a max below the min turns it off).
    attn_merge / fuse_qkv_rope: decode kernel choices (see backends/registry.py).
    pdl: programmatic dependent launch (`cuda.pdl`): every PDL-ready kernel is launched with the
    programmatic stream serialization attribute, so it starts while the kernel before it ends
    (sm_90 and later, cuda-bindings' cuLaunchKernelEx; refused with BackendUnavailableError
    otherwise). Same kernels, same results; CUDA graphs capture the programmatic edges.
    batch_invariant: a row's bits do not depend on its batch-mates: every MUL_MAT runs the tiled
    kernel (no cuBLAS, no one-token fusions), attention the split-KV decode kernel over
    BATCH_INVARIANT_KV_CHUNK-key chunks at absolute cells, and sequences start on such a chunk
    (`kv_page`).

    devices: the devices this process owns (default: all of the layout's); a strict subset
    needs a `collective` spanning the processes that own the others (its `prepare_allreduce`
    takes this process's buffers and the device stream, `allgather` reads split values).

    numerics: "exact" (float32 products), or "q8" / "llamacpp" (the numpy backend's llama.cpp
    rounding on the GPU: products with a quantized weight round x to the weight type's Q8 blocks;
    up to MATVEC_MAX_TOKENS tokens they are int8 dot products, kernels/mmvq.py; above, x rounded to
    its Q8 grid then the f32 tiled kernel; f32 / f16 / bf16 weights and MUL_MAT_ID stay exact).

    precompile: compile every kernel module the plans may launch at once, in threads, before
    the first executable (`CupyRuntime.precompile`), not one by one at first launch.

    Option values are checked by `backends.registry`."""

    name = "cupy"
    spanning = "cuda.nccl.NcclCollective"

    def __init__(self, layout: DeviceLayout | None = None, numerics: str = "exact", *,
                 cuda_graphs: bool = True, allreduce: str = "auto", wire: str = "auto",
                 wire_thresholds: WireThresholds = WireThresholds(), kv_dtype: str = "f16",
                 matmul_dtype: str = "f16", gpus: Sequence[int] | None = None,
                 multi_gpu_graphs: str = "whole", runtime=None, devices: Sequence[int] | None = None,
                 collective=None, mmq_min_tokens: int | None = None, mmq_max_tokens: int | None = None,
                 batch_invariant: bool = False, attn_merge: bool = True, fuse_qkv_rope: bool = True,
                 pdl: bool = False, precompile: bool = True, mmq_tensor_cores: bool = False) -> None:
        requested = resolve_mode(allreduce, auto="nccl")
        super().__init__(layout, devices, collective)
        if collective is not None and len(self.owned) > 1:
            raise ConfigError(f"a collective spanning processes drives one device per process; this one owns "
                              f"devices {self.owned}")
        if self.collective is not None and allreduce not in ("auto", "nccl"):
            raise ConfigError(f"allreduce={allreduce!r}: a process owning devices {self.owned} of {self.n} sums "
                              f"with its collective ({getattr(collective, 'name', '?')}); leave allreduce='auto'")
        self.numerics = numerics
        self.cuda_graphs = bool(cuda_graphs)
        # "auto" picks the wire type by message size, which grows with the pass's rows: a row's
        # all-reduced sums would then depend on its batch-mates (an explicit "bf16" rounds alike)
        self.wire = "f32" if batch_invariant and wire == "auto" else wire
        self.wire_thresholds = wire_thresholds
        self.kv_dtype = kv_dtype
        self.matmul_dtype = matmul_dtype
        # the token counts a MUL_MAT runs the tiled many-token kernel for (kernels/mmq.py)
        self.mmq_min_tokens = MMQ_MIN_TOKENS if mmq_min_tokens is None else int(mmq_min_tokens)
        self.mmq_max_tokens = MMQ_MAX_TOKENS if mmq_max_tokens is None else int(mmq_max_tokens)
        # the tiled kernel's products on the tensor cores from f16 tiles (mmq_h_*), not f32 on the CUDA cores
        self.mmq_tensor_cores = bool(mmq_tensor_cores)
        if self.mmq_tensor_cores and batch_invariant:
            raise ConfigError("cupy backend: mmq_tensor_cores=True with batch_invariant=True: the batch-invariant "
                              "products keep the f32 tiles (one FMA chain a (row, token) in a fixed order; the tensor "
                              "cores' order inside a product is not specified); set one of them")
        self.multi_gpu_graphs = multi_gpu_graphs
        # one matmul kernel and fixed KV chunks for every row count (kernels/matvec.py, attn.py)
        self.batch_invariant = bool(batch_invariant)
        # decode kernel choices the GPU profile decides between (kernels/attn.py, matvec.py)
        self.attn_merge = bool(attn_merge)
        self.fuse_qkv_rope = bool(fuse_qkv_rope)
        self.rt = runtime if runtime is not None else CupyRuntime()
        n_gpus = self.rt.n_gpus()
        if n_gpus < 1:
            raise UnsupportedOpError("cupy backend: no CUDA device")
        self.gpus = list(gpus) if gpus is not None else list(range(n_gpus))
        if not self.gpus or not all(0 <= g < n_gpus for g in self.gpus):
            raise ConfigError(f"cupy backend: gpus={self.gpus} but {n_gpus} GPU(s) are visible (ids 0..{n_gpus - 1})")
        # device d of the layout, or None where another process owns it
        self.devices: list[Device | None] = [None] * self.n
        for k, d in enumerate(self.owned):
            self.devices[d] = Device(self.rt, d, self.gpus[k % len(self.gpus)])
        self.distinct_gpus = len({dev.gpu for dev in self.local_devices}) == len(self.owned)
        self.virtual = not self.distinct_gpus
        self.allreduce = allreduce
        self.nccl: NcclGroup | None = None
        self.group_nccl: dict[tuple[int, ...], NcclGroup | None] = {}   # layer,tensor: per stage group's GPUs
        if requested.device_only and self.n > 1 and self.collective is None:
            self.nccl = NcclGroup(self.rt, [dev.gpu for dev in self.local_devices], required=allreduce == "nccl")
        used = sorted({dev.gpu for dev in self.local_devices})
        self.int8_tensor_cores = self._check_capability(used)
        self.pdl = bool(pdl)
        if self.pdl:              # before any kernel is compiled: the runtime hands out launch-capable ones
            self.rt.enable_pdl(used)
        if len(used) > 1:        # also for virtual devices spread over several GPUs (gpus=[0, 1], 4 devices)
            self.rt.enable_peer_access(used)
        self._requested = requested
        self.precompile = bool(precompile)
        self._precompiled = False
        self.compile_seconds: dict[str, float] = {}

    @property
    def local_devices(self) -> list[Device]:
        """The devices this process owns, in layout order."""
        return [self.devices[d] for d in self.owned]

    @property
    def mode(self) -> Mode:
        """The all-reduce the executables run: NCCL while it works, else the requested schedule
        (the butterfly for "auto"/"nccl" without NCCL)."""
        if self._requested.device_only:
            return self._requested if self.nccl is not None and self.nccl.active else resolve_mode("butterfly")
        return self._requested

    @property
    def allreduce_strategy(self) -> str:
        if self.n == 1:
            return "none"
        return self.collective.name if self.collective is not None else self.mode.name

    def _check_capability(self, gpus: Sequence[int]) -> bool:
        """What the options need of the GPUs, refused by name below it: numerics "q8" dp4a (sm_61+; its
        many-token products use the int8 tensor-core mmq from sm_80 on and x rounded to its Q8 grid + the
        f32 mmq below: the same rounding), mmq_tensor_cores the f16 mma.sync m16n8k16 (sm_80+). Returns
        whether every GPU has int8 tensor cores."""
        caps = {gpu: self.rt.capability(gpu) for gpu in gpus}

        def below(cc: int) -> int | None:
            return next((gpu for gpu, c in caps.items() if c < cc), None)
        gpu = below(61)
        if self.numerics in ("q8", "llamacpp") and gpu is not None:
            raise ConfigError(f"numerics={self.numerics!r} needs int8 dot products (dp4a, sm_61+); GPU {gpu} "
                              f"({self.rt.gpu_name(gpu)}) is sm_{caps[gpu]}; use numerics='exact'")
        gpu = below(80)
        if self.mmq_tensor_cores and gpu is not None:
            raise ConfigError(f"cupy backend: mmq_tensor_cores=True needs compute capability 8.0 (f16 mma.sync "
                              f"m16n8k16); GPU {gpu} ({self.rt.gpu_name(gpu)}) is sm_{caps[gpu]}")
        return gpu is None

    def describe(self) -> BackendInfo:
        return BackendInfo(name=self.name, n_devices=self.n, owned=tuple(self.owned),
                           allreduce=self.allreduce_strategy, wire=self.wire, wire_thresholds=self.wire_thresholds,
                           kernels="cuda (nvrtc)", kernel_threads=None,
                           options=(("cuda_graphs", self.cuda_graphs), ("kv_dtype", self.kv_dtype),
                                    ("matmul_dtype", self.matmul_dtype), ("multi_gpu_graphs", self.multi_gpu_graphs),
                                    ("gpus", tuple(self.gpus)), ("virtual", self.virtual),
                                    ("batch_invariant", self.batch_invariant), ("attn_merge", self.attn_merge),
                                    ("fuse_qkv_rope", self.fuse_qkv_rope), ("pdl", self.pdl),
                                    ("mmq_tensor_cores", self.mmq_tensor_cores),
                                    ("numerics", self.numerics)))

    @property
    def fault(self) -> DeviceFaultError | None:
        """The sticky fault (a kernel's, an NCCL call's) after which the runtime refuses all work."""
        return self.rt.faults.failed

    # ---------------------------------------------------------------- steps
    def step_rows(self) -> int:
        """Decode steps of up to GRAPH_BUCKETS[-1] sequences run as one pass (the weights stream
        once a step, whatever B is)."""
        return GRAPH_BUCKETS[-1]

    def row_buckets(self) -> tuple[int, ...]:
        """One plan, one captured CUDA graph, per bucket (see GRAPH_BUCKETS)."""
        return GRAPH_BUCKETS

    def kv_page(self) -> int:
        """Under batch invariance a sequence starts on an attention chunk, as it does alone."""
        return BATCH_INVARIANT_KV_CHUNK if self.batch_invariant else 1

    # ---------------------------------------------------------------- leaf data
    def _store(self, d: int, host: np.ndarray):
        gpu = self.devices[d].gpu
        with self.rt.device(gpu):
            arr = self.rt.upload(host)
        self.rt.device_synchronize(gpu)
        return arr

    def upload(self, t: Tensor, full: np.ndarray, plan: Plan) -> None:
        """Store a leaf's float value (f32 on the device), split as the plan says."""
        parts = device_slices(np.ascontiguousarray(full, dtype=np.float32), t, plan.of(t), self.n)
        for d in self.owned:
            part = np.ascontiguousarray(parts[d], dtype=np.float32)
            self.leaf[d][t] = self._store(d, part.reshape(np_shape(plan.of(t).local[d].ne)))

    def keeps_raw(self, t: Tensor, plan: Plan) -> bool:
        """Is weight `t` stored in its GGUF encoding (only raw-reading kernels read it)?"""
        return (weight_type_name(t.type) is not None
                and plan.facts.only_src0_of(t, RAW_READERS, matrix_ops=(Op.MUL_MAT,)))

    def store_weight(self, t: Tensor, source: WeightSource, plan: Plan) -> None:
        """GPU kernels read the GGUF encoding: keep it when only they read the weight, else
        store the float32 value."""
        gtype = GGMLType(source.ggml_type)
        with allocating(f"weight {t.name!r}"):
            if weight_type_name(gtype) is None or not self.keeps_raw(t, plan):
                self.upload(t, source.dequantize(), plan)
                return
            parts = split_raw(source.raw, t, gtype, plan.of(t), self.n)
            for d in self.owned:
                loc = plan.of(t).local[d]
                self.leaf[d][t] = RawWeight(self._store(d, parts[d]), weight_type_name(gtype), tuple(loc.ne),
                                            raw_nb(gtype, loc.ne))

    def weight_bytes(self, t: Tensor, local_ne: tuple[int, ...], plan: Plan) -> int:
        """Bytes kept for a weight slice: its GGUF encoding when kernels read it raw, else f32."""
        if (t.flags & Flag.WEIGHT) and self.keeps_raw(t, plan):
            return int(np.prod(local_raw_shape(t.type, local_ne)))
        return int(np.prod(local_ne)) * 4

    def kv_itemsize(self, t: Tensor) -> int:
        """Bytes per element of a float KV cache as stored (an F32 cache is kept as kv_dtype, f16 by
        default); for a quantized cache the bytes of one block (the memory plan counts those
        caches by their blocks, as they are stored)."""
        if block_size(t.type) > 1:
            cache_storage(t.type, self.kv_dtype)          # ConfigError for a type the kernels cannot hold
            return type_size(t.type)
        return np.dtype(self._leaf_dtype(t)).itemsize

    def check_cache_types(self, plan: Plan) -> None:
        """Before anything is allocated: every KV cache has a storage type the kernels hold, and
        the K and V caches one attention reads are stored alike (the attention kernels are
        compiled for K and V of one type)."""
        for t in plan.graph.leaves:
            if t.flags & Flag.KV_CACHE:
                cache_storage(t.type, self.kv_dtype)
        for node in plan.graph.nodes:
            if node.op is not Op.FLASH_ATTN_EXT:
                continue
            k, v = (node.src[i].view_src or node.src[i] for i in (1, 2))
            if not (k.flags & Flag.KV_CACHE and v.flags & Flag.KV_CACHE):
                continue
            kt, vt = cache_storage(k.type, self.kv_dtype)[0], cache_storage(v.type, self.kv_dtype)[0]
            if kt != vt:
                raise ConfigError(f"cupy backend: K cache {k.name!r} ({k.type.name.lower()}, stored as {kt}) and V cache "
                                  f"{v.name!r} ({v.type.name.lower()}, stored as {vt}) differ; the attention kernels "
                                  "need K and V of one type (use the same cache type for both)")

    def workspace_bytes(self, plan: Plan) -> list[int]:
        """Per device: device memory beyond weights, KV and the plan's arena: the scratch buffers
        (f16 copies of the largest GEMM weight and input, attention split workspace, sized for this
        plan and for a one-token step, all-reduce wire and receive buffers) and the input block
        beyond the input tensors plan_memory already counts (kv_len words, 64-byte padding)."""
        layout, block = input_layout(plan.graph)
        inputs = sum(t.nelements * np.dtype(STORAGE[t.type]).itemsize for t in layout if isinstance(t, Tensor))
        local = self.local_devices
        leads = {dev.gpu: dev.index for dev in reversed(local)}
        out = []
        with self.rt.kernels():
            for d in range(self.n):
                # a device another process owns is sized as if on this process's first GPU
                dev = self.devices[d] or local[0]
                with self.rt.device(dev.gpu):
                    need = self._scratch_needs(plan, d, one_token_too=True)
                total = sum(max(n, 1) * np.dtype(dt).itemsize for n, dt in need.values())
                if self.devices[d] is None or leads[dev.gpu] == d:
                    total += max(0, block - inputs)
                out.append(int(total) + self._rank_wire_bytes(plan))
        return out

    def _rank_wire_bytes(self, plan: Plan) -> int:
        """The BF16 wire buffers a collective spanning processes keeps (one per reduced size)."""
        if self.collective is None:
            return 0
        sizes = {plan.graph.nodes[sub.reduction.node].nelements for sub in plan.subgraphs if sub.reduction is not None}
        return sum(2 * n for n in sizes if wire_dtype(self.n, n, self.wire, self.wire_thresholds) == "bf16")

    def _scratch_needs(self, plan: Plan, d: int, one_token_too: bool = False) -> dict[str, tuple[int, Any]]:
        """Scratch buffer -> (elements, dtype) device d needs to run `plan` (`one_token_too`: and a
        one-token step at the same KV length, whose attention splits the KV more): what the kernel
        families' handlers will ask for (`ops.scratch_needs`), and the all-reduce's buffers."""
        graph = plan.graph
        need = ops.scratch_needs(self, plan, d, one_token_too)

        def want(key: str, n: int, dtype) -> None:
            if n > need.get(key, (0, None))[0]:
                need[key] = (n, dtype)
        if self.n > 1 and self.collective is None:     # a collective spanning processes keeps its own
            for sub in plan.subgraphs:
                if sub.reduction is not None:
                    n_el = graph.nodes[sub.reduction.node].nelements
                    want("recv_f32", n_el, np.float32)
                    if wire_dtype(self.n, n_el, self.wire, self.wire_thresholds) == "bf16":
                        want("wire", n_el, np.uint16)
                        want("recv_bf16", n_el, np.uint16)
        return need

    def new_leaf(self, d: int, t: Tensor, ne: tuple[int, ...]):
        """A zero-filled device buffer (a quantized cache as uint8 rows of blocks)."""
        shape = local_raw_shape(t.type, ne) if block_size(t.type) > 1 else np_shape(ne)
        with allocating(f"the KV cache {t.name!r}"), self.rt.device(self.devices[d].gpu):
            arr = self.rt.zeros(shape, self._leaf_dtype(t))
        self.rt.device_synchronize(self.devices[d].gpu)
        return arr

    def zero_leaf(self, d: int, value) -> None:
        """A memset on the device's stream (`reset_kv` then synchronizes)."""
        dev = self.devices[d]
        if value.nbytes:
            with dev.ctx:
                self.rt.memset(device_ptr(value), int(value.nbytes), dev.stream)

    def _leaf_dtype(self, t: Tensor):
        if t.flags & Flag.KV_CACHE:
            return cache_storage(t.type, self.kv_dtype)[1]
        try:
            return STORAGE[t.type]
        except KeyError:
            raise UnsupportedOpError(f"cupy backend: leaf {t.name!r} of type {t.type.name} has no storage") from None

    def memory_budget(self) -> tuple[int | None, bool]:
        """(bytes available, shared by all devices?): free memory of the GPU(s), counting the
        blocks CuPy's pool keeps cached (free to us, but not to cudaMemGetInfo)."""
        try:
            gpus = sorted({dev.gpu for dev in self.local_devices})
            free = [self.rt.mem_info(g)[0] + self.rt.pool_free_bytes(g) for g in gpus]
        except Exception:  # noqa: BLE001
            return None, False
        if self.distinct_gpus:
            return min(free), False
        return sum(free), True

    def synchronize(self) -> None:
        for dev in self.local_devices:
            self.rt.synchronize(dev.stream)

    # ---------------------------------------------------------------- plans
    def kernel_families(self) -> list[str]:
        """The kernel modules this backend's plans may launch: every family, less the int8 one
        (mmvq) outside q8 numerics and the fused q/k/v module where `fuse_qkv_rope` is off."""
        q8 = self.numerics in ("q8", "llamacpp")
        return [f for f in FAMILIES if (f != "mmvq" or q8) and (f != "qkv_rope" or self.fuse_qkv_rope)]

    def _precompile_kernels(self) -> None:
        """Before the first executable: every kernel module compiled at once (`precompile`),
        instead of one after another at each module's first launch. `compile_seconds`: each
        module's compile time (empty when they were compiled already, or `precompile=False`)."""
        if not self.precompile or self._precompiled:
            return
        self._precompiled = True
        used = sorted({dev.gpu for dev in self.local_devices})
        self.compile_seconds = self.rt.precompile(used, self.kernel_families())

    def make_executable(self, plan: Plan) -> CupyExecutable:
        self.check_cache_types(plan)
        self._precompile_kernels()
        with allocating(f"the buffers of plan {plan.graph.name}"):    # the activations of a batch this size
            return CupyExecutable(self, plan)
