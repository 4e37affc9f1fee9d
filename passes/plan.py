"""The Plan: everything a backend needs to run a graph on N devices, as plain data.

Backends read it and never re-derive split decisions; the dump tool prints it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property

from metatp.ir.errors import ConfigError
from metatp.ir.graph import Graph
from metatp.ir.tensor import Tensor
from metatp.passes.facts import PlanFacts
from metatp.passes.state import SplitState

__all__ = ["DeviceLayout", "Local", "TensorPlan", "Reduction", "Transfer", "Subgraph", "Plan", "single_device_plan"]

SPLIT_MODES = ("none", "tensor", "layer", "layer,tensor")


@dataclass(frozen=True)
class DeviceLayout:
    """How many devices, and how work is shared between them (llama.cpp's -sm / -ts).

    split_mode "layer,tensor" (vLLM's --pp P --tp T): P pipeline stages, each a tensor-parallel
    group of T devices, device d = stage * T + t. `tp` is T; without it T is the number of
    -ts shares (which then apply inside each group); P is n_devices / T."""

    n_devices: int = 1
    split_mode: str = "none"
    tensor_split: tuple[float, ...] | None = None
    tp: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.n_devices, int) or isinstance(self.n_devices, bool) or self.n_devices < 1:
            raise ConfigError(f"n_devices must be an integer >= 1, got {self.n_devices!r}")
        if self.n_devices > 16:
            raise ConfigError(f"n_devices={self.n_devices}: at most 16 devices are supported")
        if self.split_mode not in SPLIT_MODES:
            raise ConfigError(f"split_mode must be one of {', '.join(SPLIT_MODES)}, got {self.split_mode!r}")
        if self.split_mode == "none" and self.n_devices != 1:
            raise ConfigError(f"n_devices={self.n_devices} needs split_mode='tensor' or 'layer' "
                              "(split_mode='none' runs on one device)")
        if self.split_mode == "layer,tensor":
            self._check_stages()
        elif self.tp is not None:
            raise ConfigError(f"tp={self.tp!r} (--tp) needs split_mode='layer,tensor', got {self.split_mode!r}")
        if self.tensor_split is not None:
            ts = self.tensor_split
            if len(ts) != self.group_size:
                raise ConfigError(f"tensor_split has {len(ts)} entries for {self.group_size} devices"
                                  + (" of a tensor group (--tp)" if self.split_mode == "layer,tensor" else ""))
            for x in ts:
                if not isinstance(x, (int, float)) or isinstance(x, bool) or not math.isfinite(x) or x < 0:
                    raise ConfigError(f"tensor_split entries must be finite numbers >= 0, got {list(ts)}")
            if sum(ts) <= 0:
                raise ConfigError(f"tensor_split must have a positive entry, got {list(ts)}")

    def _check_stages(self) -> None:
        tp = self.tp if self.tp is not None else (len(self.tensor_split) if self.tensor_split is not None else None)
        if tp is None:
            raise ConfigError("split_mode='layer,tensor' needs the tensor-parallel size T: --tp T, or "
                              "tensor_split (-ts) with T shares, one per device of a tensor group")
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise ConfigError(f"--tp (tp) must be an integer >= 1, got {tp!r}")
        if self.n_devices % tp:
            raise ConfigError(f"--pp x --tp must be the device count: {self.n_devices} devices are not "
                              f"stages of --tp {tp} devices")
        object.__setattr__(self, "tp", tp)

    @property
    def group_size(self) -> int:
        """Devices that share work by -ts: all of them, or one tensor group under layer,tensor."""
        return self.tp if self.split_mode == "layer,tensor" else self.n_devices

    @property
    def pp(self) -> int:
        """Pipeline stages: n_devices / tp under layer,tensor, else 1 (tensor) or n_devices (layer)."""
        if self.split_mode == "layer,tensor":
            return self.n_devices // self.tp
        return self.n_devices if self.split_mode == "layer" else 1

    def stage_devices(self, stage: int) -> tuple[int, ...]:
        """The tensor group of one pipeline stage (layer,tensor): devices stage*T .. stage*T+T-1."""
        t = self.group_size
        return tuple(range(stage * t, stage * t + t))

    @staticmethod
    def parse_split(text: str) -> tuple[float, ...]:
        """Parse llama.cpp's `-ts 3,1` (also '3/1')."""
        try:
            return tuple(float(x) for x in text.replace("/", ",").split(",") if x.strip())
        except ValueError:
            raise ConfigError(f"tensor_split {text!r}: expected numbers separated by commas, e.g. 3,1") from None

    def ratios(self) -> tuple[float, ...]:
        return self.tensor_split if self.tensor_split is not None else (1.0,) * self.group_size


@dataclass(frozen=True)
class Local:
    """One device's view of a tensor: local shape, byte strides and view offset."""

    ne: tuple[int, int, int, int]
    nb: tuple[int, int, int, int]
    offs: int = 0

    @property
    def nelements(self) -> int:
        return self.ne[0] * self.ne[1] * self.ne[2] * self.ne[3]


@dataclass
class TensorPlan:
    """How one tensor sits on the devices. Under -sm layer (`passes.layer_plan`) a device holds
    the tensor when its Local is the whole tensor (empty, ne0 = 0, elsewhere)."""

    tensor: Tensor
    state: SplitState            # assume_sync=False: PARTIAL where a reduction is pending
    sync_state: SplitState       # assume_sync=True: what consumers see
    local: list[Local]           # per device
    compute: list[bool]          # per device: does it run this node (False = zero slice / skipped)
    # per device: the node is not computed there but a later node on that device reads it as an
    # exact zero (an un-reduced partial sum whose slice is empty): the backend fills its buffer
    # with zeros (a fill, not x*0). None: no device needs it.
    zero_fill: list[bool] | None = None
    # PARTIAL leaves (e.g. ffn_down_exps.bias): the device that holds the full value; every other
    # device holds zeros, so the sum is exact even when some device has an empty slice.
    owner: int | None = None


@dataclass
class Reduction:
    node: int                    # index of the node whose value is all-reduced in place
    covers: list[int]            # the PARTIAL nodes this one reduction stands for
    nbytes: int                  # bytes of the reduced tensor (full size, per device)
    # the devices the all-reduce spans (layer,tensor: one stage's tensor group); None: all
    devices: tuple[int, ...] | None = None
    # Which devices contribute is the reduced node's TensorPlan.compute (False: its slice was
    # empty, the all-reduce counts it as zeros): executors and the dump read it there.


@dataclass
class Transfer:
    """split_mode="layer": a point-to-point copy of one node's whole buffer from the device that
    computed it to a device that reads it (the hidden state at a layer boundary); under
    "layer,tensor" device t of a stage's group copies its buffer to device t of the next group."""

    node: int                    # index of the node whose buffer is copied
    src: int                     # the device that computed it
    dst: int                     # the device that reads it (its own buffer of the node)
    nbytes: int                  # bytes copied


@dataclass
class Subgraph:
    start: int                   # first node index
    end: int                     # last node index (inclusive)
    reduction: Reduction | None  # all-reduce after the subgraph (None: nothing pending)
    # copies after the subgraph (and after its all-reduce), in order; empty but under -sm layer(,tensor)
    transfers: list[Transfer] = field(default_factory=list)


@dataclass
class Plan:
    graph: Graph
    layout: DeviceLayout
    tensors: dict[Tensor, TensorPlan]
    subgraphs: list[Subgraph]
    stats: dict = field(default_factory=dict)

    @property
    def n_devices(self) -> int:
        return self.layout.n_devices

    def of(self, t: Tensor) -> TensorPlan:
        return self.tensors[t]

    @cached_property
    def facts(self) -> PlanFacts:
        """The graph facts every backend reads (`passes.facts.PlanFacts`), made once per
        Plan: the weight uploads, the executor and the fusion finders share them."""
        return PlanFacts(self)

    @property
    def reductions(self) -> list[Reduction]:
        return [s.reduction for s in self.subgraphs if s.reduction is not None]

    @property
    def transfers(self) -> list[Transfer]:
        return [t for s in self.subgraphs for t in s.transfers]


def _full_local(t: Tensor) -> Local:
    return Local(t.ne, t.nb, t.view_offs)


def single_device_plan(graph: Graph) -> Plan:
    """The trivial plan: one device, everything mirrored, one subgraph."""
    m = SplitState.mirrored()
    tensors = {t: TensorPlan(t, m, m, [_full_local(t)], [True]) for t in graph.tensors()}
    subs = [Subgraph(0, len(graph.nodes) - 1, None)] if graph.nodes else []
    return Plan(graph, DeviceLayout(), tensors, subs,
                {"stage": "lowered", "reductions_before_coalescing": 0, "reductions_per_step": 0,
                 "reductions_saved": 0, "bytes_reduced_per_step": 0, "n_subgraphs": len(subs)})
