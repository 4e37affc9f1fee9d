"""One Plan executor for every backend: binding, the plan walk, and reading results.

A backend's executable subclasses `PlanExecutor` and supplies only what really differs:
how memory is allocated and viewed (`new_arena`, `place`, `view`), what a node runs
(`node_steps`, `fused_steps`, `zero_fill_step`), and how the collected steps are run (its
runner: node-major closures and threads on the host; streams, events and CUDA graphs on a
GPU). The walk below is the one place that decides which device runs which node:

- a pure view runs nothing (its memory is its source's);
- a device whose slice is empty runs nothing, or zero-fills the buffer when a later node
  reads it as an exact zero (`TensorPlan.zero_fill`);
- a node another device computed for it (`shared`, a mirrored value on devices that share
  memory) runs nothing there;
- a node absorbed into a fusion runs inside the fusion's launch at the fusion's position.

An executor owns the devices of `self.devices`: all N when one process simulates or drives
them all, one when a process drives one device of a larger group.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

import numpy as np

from metatp.backends.analysis import PlanFacts, is_pure_view
from metatp.backends.base import Executable
from metatp.backends.slicing import gather_array
from metatp.ir.dtypes import np_shape
from metatp.ir.errors import UnsupportedOpError
from metatp.ir.tensor import Flag, Tensor
from metatp.passes.memory import assign_offsets
from metatp.passes.plan import Local, Plan

__all__ = ["Fusion", "NodeSteps", "PlanExecutor", "np_shape"]


@dataclass
class Fusion:
    """Nodes run as one launch at `at`'s position; `absorbed` nodes get no launch of their own.

    Memory rules that keep the arena allocator's view (computed from the unfused graph) true:
    an input read later than its last unfused reader is kept alive (`keep`), and an output
    written before its own node gets memory of its own (`detach`)."""

    kind: str
    at: Tensor
    absorbed: tuple[Tensor, ...]
    keep: tuple[Tensor, ...] = ()
    detach: tuple[Tensor, ...] = ()
    parts: dict = field(default_factory=dict)


@dataclass
class NodeSteps:
    """What each device runs for one node of a subgraph (devices that run nothing are absent)."""

    node: Tensor
    per_device: dict[int, list]


class PlanExecutor(Executable):
    """The shared part of an executable. Subclasses call `bind()` then `walk()` in __init__."""

    def __init__(self, plan: Plan, devices: Iterable[int]) -> None:
        self.plan = plan
        self.devices = list(devices)
        self.facts = PlanFacts(plan)
        n = plan.n_devices
        self.arrays: list[dict[Tensor, Any]] = [{} for _ in range(n)]
        self.buffer_bytes = [0] * n
        self.fusions: dict[Tensor, Fusion] = {}
        self.shared: set[Tensor] = set()

    # ---------------------------------------------------------------- hooks (memory)
    def itemsize(self, t: Tensor) -> int:
        """Bytes per element of an activation of `t`'s type in this backend's buffers."""
        raise NotImplementedError

    def new_arena(self, d: int, nbytes: int) -> Any:
        """Device d's activation memory of `nbytes` bytes."""
        raise NotImplementedError

    def place(self, d: int, arena: Any, offset: int, node: Tensor, loc: Local) -> Any:
        """The buffer of an owner node at `offset` in the arena."""
        raise NotImplementedError

    def own_buffer(self, d: int, node: Tensor, loc: Local) -> Any:
        """Memory of its own for a detached node (written before its own position)."""
        raise NotImplementedError

    def view(self, d: int, node: Tensor, loc: Local) -> Any:
        """A view node's buffer: its local shape, strides and offset into its source's memory."""
        raise NotImplementedError

    def device_scope(self, d: int):
        """Context entered while building device d's steps (a GPU's device context)."""
        return nullcontext()

    # ---------------------------------------------------------------- hooks (work)
    def find_fusions(self) -> list[Fusion]:
        """The fusions this backend's kernels implement, found on this plan (default: none)."""
        return []

    def node_steps(self, d: int, node: Tensor) -> list:
        """Device d's steps for one node (raise UnsupportedOpError for an op it cannot run)."""
        raise NotImplementedError

    def fused_steps(self, d: int, fusion: Fusion) -> list:
        raise UnsupportedOpError(f"{type(self).__name__}: fusion {fusion.kind!r} is not implemented")

    def zero_fill_step(self, d: int, node: Tensor):
        """A step that writes zeros over device d's buffer of `node`."""
        raise NotImplementedError

    def host_value(self, d: int, t: Tensor) -> np.ndarray:
        """Device d's slice of `t` as a host array in the graph's type."""
        raise NotImplementedError

    # ---------------------------------------------------------------- binding
    def bind_leaves(self, leaf_of) -> None:
        """Map every non-input leaf to its stored per-device value (`leaf_of(d, t)`)."""
        for t in self.plan.graph.leaves:
            if t.flags & Flag.INPUT:
                continue
            for d in self.devices:
                self.arrays[d][t] = leaf_of(d, t)

    def set_fusions(self, fusions: list[Fusion]) -> None:
        """Adopt fusions; a node may belong to one fusion only (earlier ones win)."""
        taken: set[Tensor] = set()
        self.fusions = {}
        for f in fusions:
            members = (f.at, *f.absorbed)
            if any(m in taken for m in members):
                continue
            taken.update(members)
            self.fusions[f.at] = f

    def bind_nodes(self, d: int, live_until: dict[Tensor, int] | None = None) -> None:
        """Device d's node buffers: owners in one arena (dead buffers reused), fusion outputs
        written early in memory of their own, views onto their source, shared values onto
        the computing device's buffer."""
        keep = {t.view_src or t for f in self.fusions.values() for t in f.keep}
        detach = {t for f in self.fusions.values() for t in f.detach}
        offsets, size = assign_offsets(self.plan, d, self.itemsize, keep=keep, live_until=live_until)
        arena = self.new_arena(d, size)
        arrays = self.arrays[d]
        lead = self.devices[0]
        for node in self.plan.graph.nodes:
            loc = self.plan.of(node).local[d]
            if d != lead and node in self.shared:
                arrays[node] = self.arrays[lead][node]
            elif node.view_src is not None:
                arrays[node] = self.view(d, node, loc)
            elif node in detach:
                arrays[node] = self.own_buffer(d, node, loc)
            else:
                arrays[node] = self.place(d, arena, offsets[node], node, loc)

    # ---------------------------------------------------------------- the walk
    def walk(self) -> list[list[NodeSteps]]:
        """[subgraph] -> the nodes that run, in graph order, with each device's steps."""
        plan, nodes = self.plan, self.plan.graph.nodes
        absorbed = {t for f in self.fusions.values() for t in f.absorbed}
        lead = self.devices[0]
        out: list[list[NodeSteps]] = []
        for sub in plan.subgraphs:
            items: list[NodeSteps] = []
            for i in range(sub.start, sub.end + 1):
                node = nodes[i]
                if is_pure_view(node):
                    continue
                tp = plan.of(node)
                per: dict[int, list] = {}
                for d in self.devices:
                    if d != lead and node in self.shared:
                        continue
                    if not tp.compute[d]:
                        if tp.zero_fill is not None and tp.zero_fill[d]:
                            with self.device_scope(d):
                                per[d] = [self.zero_fill_step(d, node)]
                        continue
                    if node in absorbed:
                        continue
                    with self.device_scope(d):
                        fusion = self.fusions.get(node)
                        steps = self.fused_steps(d, fusion) if fusion is not None else self.node_steps(d, node)
                    if steps:
                        per[d] = steps
                if per:
                    items.append(NodeSteps(node, per))
            out.append(items)
        return out

    @staticmethod
    def per_device(walked: list[list[NodeSteps]], devices: Sequence[int], n: int) -> list[list[list]]:
        """[subgraph][device] -> that device's steps in graph order (devices not owned: empty)."""
        out = []
        for items in walked:
            lists: list[list] = [[] for _ in range(n)]
            for item in items:
                for d, steps in item.per_device.items():
                    lists[d].extend(steps)
            out.append(lists)
        return out

    # ---------------------------------------------------------------- results
    def read(self, t: Tensor) -> np.ndarray:
        """The full value of `t` (gathered from slices; a PARTIAL value is summed)."""
        if self.plan.n_devices == 1:
            return np.array(self.host_value(self.devices[0], t), copy=True).reshape(np_shape(t.ne))
        if len(self.devices) != self.plan.n_devices:
            raise UnsupportedOpError(f"read({t.name!r}): this process holds devices {self.devices} of "
                                     f"{self.plan.n_devices}; use read_across with the collective")
        return gather_array([self.host_value(d, t) for d in self.devices], t, self.plan.of(t))

    def read_across(self, collective, t: Tensor) -> np.ndarray:
        """The full value of `t` when this process owns only some devices: a value every device
        holds whole (mirrored and computed everywhere) is read here; a split one (the
        vocabulary-split logits) is gathered from every process (`collective.allgather`) and put
        together, so every process gets the same bits."""
        tp = self.plan.of(t)
        own = self.devices
        if tp.sync_state.is_mirrored and all(tp.compute[d] for d in own):
            return np.array(self.host_value(own[0], t), copy=True).reshape(np_shape(t.ne))
        counts = [loc.nelements for loc in tp.local]
        flat = collective.allgather([self.host_value(d, t) for d in own], counts)
        parts = [p.reshape(np_shape(loc.ne)) for p, loc in zip(flat, tp.local)]
        return gather_array(parts, t, tp)
