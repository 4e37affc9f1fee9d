"""The backend contract: the only calls the engine makes on a backend.

A backend stores weights (it alone decides how: float32, 16-bit, int8 codes or raw GGUF
blocks), allocates the KV cache, prepares a Plan into an Executable, and reports memory.
The engine never asks a backend what it can do: every backend implements all of this, and
anything backend-specific travels as an option chosen once (see `backends.registry`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

import numpy as np

from metatp.backends.collectives.wire import WireThresholds
from metatp.backends.store import LeafStore, owned_devices
from metatp.ir.errors import DeviceFaultError
from metatp.ir.tensor import GGMLType, Tensor
from metatp.passes.plan import DeviceLayout, Plan

if TYPE_CHECKING:
    from metatp.backends.candidates import RowCandidates
    from metatp.backends.collectives.base import Collective
    from metatp.backends.logit_adjustment import Adjustment

__all__ = ["WeightSource", "BackendInfo", "Executable", "Backend"]


@dataclass(frozen=True)
class WeightSource:
    """Where a weight's value comes from: its GGUF tensor, as bytes and as a float32 array.

    `raw` is the tensor's GGUF encoding (uint8 rows, usually memory-mapped); `dequantize`
    returns its float32 value in the graph's shape (the engine caches it when several leaves
    share one GGUF tensor, as a tied lm head and its embedding do)."""

    name: str
    ggml_type: GGMLType
    raw: np.ndarray
    dequantize: Callable[[], np.ndarray]


@dataclass(frozen=True)
class BackendInfo:
    """What a backend runs, for reports (bench rows, batched-bench, GPU checks): read this
    rather than a backend's attributes."""

    name: str                       # "numpy", "cupy"
    n_devices: int                  # devices of the layout
    owned: tuple[int, ...]          # the devices this process drives
    allreduce: str                  # the all-reduce that runs: "none" on one device, a schedule, "nccl", "mpi"
    wire: str                       # its wire type: "f32", "bf16", or "auto" (f32 below the thresholds)
    wire_thresholds: WireThresholds
    kernels: str                    # the kernels in use, in words (numpy: the C build, or "off")
    kernel_threads: int | None      # threads of the compiled CPU kernels (None: the backend has none)
    options: tuple[tuple[str, Any], ...] = ()   # further settings in effect (cupy: graphs, dtypes)


class Executable(ABC):
    """A Plan bound to buffers on the devices this process owns.

    Everything the engine calls on one is declared here: `run` (with `set_input`), and the
    three ways to read a result: `read` (the whole value), `read_argmax` (greedy tokens) and
    `read_candidates` (sampling candidates; `candidates_pay` says where they are worth it)."""

    plan: Plan
    buffer_bytes: list[int]          # per device: bytes of this plan's own buffers
    devices: list[int]               # the devices this process drives (all of the plan's in one process)

    @abstractmethod
    def set_input(self, t: Tensor, value: np.ndarray) -> None:
        """Write one INPUT leaf (token ids, positions, KV rows, masks) for the next run."""

    @abstractmethod
    def run(self, inputs: dict[Tensor, np.ndarray] | None = None) -> None:
        """One forward step: inputs in, every subgraph and the collective between them."""

    @abstractmethod
    def read(self, t: Tensor) -> np.ndarray:
        """The full value of `t` on the host (gathered from slices; a partial sum is reduced)."""

    @abstractmethod
    def read_argmax(self, t: Tensor) -> tuple[list[int | None], int]:
        """Each row's greedy token of the logits `t` without gathering a vocabulary split; None
        for a row with a non-finite logit. Also the bytes this process received for it."""

    @abstractmethod
    def candidates_pay(self, t: Tensor, k: int) -> bool:
        """Are `k` sampling candidates per device fewer bytes than a row of the logits `t`? Only
        where `t` is split along the vocabulary (else `read_candidates` has nothing to save)."""

    @abstractmethod
    def read_candidates(self, t: Tensor, k: int, temps: list[float] | None = None,
                        adjs: list[Adjustment | None] | None = None) -> tuple[list[RowCandidates] | None, int]:
        """Each row's sampling candidates (`k` per device, after the adjustment `adjs[row]`, its
        mass at `temps[row]`) of the logits `t`; None where `t` is not split along the
        vocabulary. Also the bytes this process received for it."""


class Backend(LeafStore, ABC):
    """N devices (simulated in one process, or GPUs) that run Plans for one model.

    The base owns the leaf store (`backends.store`: which devices this process owns, every
    stored leaf, `has`, `allocate_leaf`, `reset_kv`) and the prepared plans."""

    name: str = "?"
    layout: DeviceLayout
    #: the collective a process owning only some devices must be given (named in the error)
    spanning: str = "a collective spanning the processes"

    def __init__(self, layout: DeviceLayout | None = None, devices: Sequence[int] | None = None,
                 collective: Collective | None = None) -> None:
        self.layout = layout or DeviceLayout()
        n = self.layout.n_devices
        self.init_store(n, owned_devices(n, devices, collective, self.spanning))
        #: the collective spanning the processes (None: this backend chooses its own); a
        #: collective subclasses `collectives.Collective`, whose capabilities the engine reads
        self.collective = collective
        self._executables: dict[int, Executable] = {}

    @abstractmethod
    def describe(self) -> BackendInfo:
        """What this backend runs (name, all-reduce, wire, kernels, kernel threads)."""

    @property
    def fault(self) -> DeviceFaultError | None:
        """The error that left a device unusable (a faulted kernel, a failed collective), after
        which this backend refuses all work; None while every device works (host memory never
        fails so)."""
        return None

    # ---- weights and the KV cache
    @abstractmethod
    def store_weight(self, t: Tensor, source: WeightSource, plan: Plan) -> None:
        """Keep weight leaf `t`, split as `plan` says, in whatever form this backend reads."""

    @abstractmethod
    def weight_bytes(self, t: Tensor, local_ne: tuple[int, ...], plan: Plan) -> int:
        """Bytes `store_weight` keeps for one device's slice of local shape `local_ne`."""

    def storage_key(self, t: Tensor, plan: Plan, source: str) -> object | None:
        """Weights with equal non-None keys share one stored copy (the memory plan counts it
        once): a tied lm head and its embedding, or a weight mirrored on simulated devices."""
        return None

    def kv_itemsize(self, t: Tensor) -> int:
        """Bytes per element this backend stores for KV-cache leaf `t` (f16 on GPUs)."""
        return np.dtype(np.float32).itemsize if t.type == GGMLType.F32 else 2

    def step_rows(self) -> int:
        """Most rows a forward pass may carry on this backend's few-token path, where a row's
        result does not depend on the other rows of the pass (the engine packs decode tokens
        of many sequences into passes of at most this many rows)."""
        return 16

    def row_buckets(self) -> tuple[int, ...]:
        """Row counts a few-token pass is padded up to (one plan, and on a GPU one captured
        graph, per bucket), ascending; empty: the engine's own buckets (`metatp.step.bucket_rows`)."""
        return ()

    def kv_page(self) -> int:
        """A sequence's KV cells should start on a multiple of this many cells: attention that
        tiles the cache at absolute positions then meets the sequence as it does alone."""
        return 1

    def kv_span_floor(self, n_rows: int) -> int:
        """The fewest cache cells a pass of `n_rows` rows attends over (the engine pads the span
        in use up to it, capped at n_ctx). A plan is compiled per span, so a backend whose
        attention reads only the cells a row sees gains by a floor that covers the cache: then a
        growing cache does not compile new plans. Default 0: the span in use, rounded up to KV_PAD."""
        return 0

    # ---- plans
    def prepare(self, plan: Plan) -> Executable:
        """The plan bound to buffers, made once per plan (preparing twice returns the same one)."""
        ex = self._executables.get(id(plan))
        if ex is None or ex.plan is not plan:
            ex = self._executables[id(plan)] = self.make_executable(plan)
        return ex

    @abstractmethod
    def make_executable(self, plan: Plan) -> Executable:
        """Bind `plan` to new buffers (called by `prepare`, once per plan)."""

    def release(self, plan: Plan) -> None:
        """Forget a prepared plan and free its buffers (after queued work that uses them)."""
        ex = self._executables.get(id(plan))
        if ex is not None and ex.plan is plan:
            self.synchronize()
            del self._executables[id(plan)]

    def synchronize(self) -> None:
        """Wait for queued device work (a no-op where work runs synchronously)."""

    # ---- memory
    @abstractmethod
    def workspace_bytes(self, plan: Plan) -> list[int]:
        """Per device: bytes beyond weights, KV cache and the plan's activations (scratch,
        dequantization slabs, wire buffers) that running `plan` needs."""

    @abstractmethod
    def memory_budget(self) -> tuple[int | None, bool]:
        """(bytes available or None if unknown, shared by all devices?)."""

    def allocated_bytes(self) -> list[int]:
        """Bytes held per device now: the stored leaves (`leaf_bytes`) and the buffers of the
        largest prepared plan."""
        leaves = self.leaf_bytes()
        return [leaves[d] + max((ex.buffer_bytes[d] for ex in self._executables.values()), default=0)
                for d in range(self.n)]
