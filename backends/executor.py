"""One Plan executor for every backend: binding, the plan walk, and reading results.

A backend's executable subclasses `PlanExecutor` and supplies only what really differs:
how inputs and memory are allocated and viewed (`bind_inputs`, `new_arena`, `place`, `view`),
what a node runs (`node_steps`, `fused_steps`, `zero_fill_step`), and how the collected steps
are run (its runner: node-major closures and threads on the host; streams, events and CUDA
graphs on a GPU). `PlanExecutor.__init__` runs the one construction sequence (inputs, leaves,
shared values, fusions, node buffers, the walk, one prepared all-reduce per reduction) and
`read` gathers results. Under -sm layer a subgraph may end with copies of values another
device reads (`transfer_step`, prepared once per `Transfer`; a send or receive when the
other device belongs to another process, `transfer_across`). The walk below is the one place
that decides which device runs which node:

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

from abc import abstractmethod
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from metatp.passes.facts import is_pure_view
from metatp.backends.base import Backend, Executable
from metatp.backends.collectives.base import Collective, Step
from metatp.backends.collectives.p2p import SendRecv
from metatp.backends.fusion import Fusion
from metatp.backends.slicing import gather_array
from metatp.ir.dtypes import np_shape
from metatp.ir.errors import UnsupportedOpError
from metatp.ir.tensor import Flag, GGMLType, Tensor
from metatp.passes.memory import assign_offsets
from metatp.passes.plan import Local, Plan

__all__ = ["NodeSteps", "PlanExecutor"]

# what a process that holds none of a value allocates to receive it whole (`read_across`)
_HOST_TYPES = {GGMLType.F32: np.dtype(np.float32), GGMLType.I32: np.dtype(np.int32), GGMLType.F16: np.dtype(np.float16)}


@dataclass
class NodeSteps:
    """What each device runs for one node of a subgraph (devices that run nothing are absent)."""

    node: Tensor
    per_device: dict[int, list]


class PlanExecutor(Executable):
    """The shared part of an executable. A subclass sets up what its hooks need, then calls
    `super().__init__(backend, plan)`, which binds and walks the plan; after it, `steps`
    holds [subgraph][device] -> steps, `reductions` [subgraph] -> the prepared all-reduce
    (None where the subgraph ends without one) and `transfers` [subgraph] -> its prepared
    copies between devices (run after the all-reduce; empty but under -sm layer)."""

    def __init__(self, backend: Backend, plan: Plan) -> None:
        if plan.n_devices != backend.n:
            raise ValueError(f"plan is for {plan.n_devices} devices, backend has {backend.n}")
        self.backend = backend
        self.plan = plan
        self.devices = list(backend.owned)
        self.facts = plan.facts
        n = plan.n_devices
        self.arrays: list[dict[Tensor, Any]] = [{} for _ in range(n)]
        self.buffer_bytes = [0] * n
        self.fusions: dict[Tensor, Fusion] = {}
        self.shared: set[Tensor] = set()
        self.bind_inputs()
        self.bind_leaves()
        several = len(self.devices) > 1
        self.shared = self.facts.shared_mirrored() if several and self.shares_mirrored() else set()
        self.set_fusions(self.find_fusions())
        late = self.facts.late_reads(self.shared) if self.shared else None
        for d in self.devices:
            self.bind_nodes(d, live_until=late if d == self.devices[0] else None)
        self.walked = self.walk()
        self.steps = self.per_device(self.walked, self.devices, n)
        self.reductions = self.prepare_reductions()
        self.transfers = self.prepare_transfers()

    # ---------------------------------------------------------------- hooks (memory)
    @abstractmethod
    def bind_inputs(self) -> None:
        """Buffers for every INPUT leaf of the plan on every owned device (`self.arrays`)."""

    @abstractmethod
    def itemsize(self, t: Tensor) -> int:
        """Bytes per element of an activation of `t`'s type in this backend's buffers."""

    @abstractmethod
    def new_arena(self, d: int, nbytes: int) -> Any:
        """Device d's activation memory of `nbytes` bytes."""

    @abstractmethod
    def place(self, d: int, arena: Any, offset: int, node: Tensor, loc: Local) -> Any:
        """The buffer of an owner node at `offset` in the arena."""

    @abstractmethod
    def own_buffer(self, d: int, node: Tensor, loc: Local) -> Any:
        """Memory of its own for a detached node (written before its own position)."""

    @abstractmethod
    def view(self, d: int, node: Tensor, loc: Local) -> Any:
        """A view node's buffer: its local shape, strides and offset into its source's memory."""

    @abstractmethod
    def host_value(self, d: int, t: Tensor) -> np.ndarray:
        """Device d's slice of `t` as a host array in the graph's type."""

    def device_scope(self, d: int):
        """Context entered while building device d's steps (a GPU's device context)."""
        return nullcontext()

    def shares_mirrored(self) -> bool:
        """May the first device compute the values mirrored on every device for all of them
        (`PlanFacts.shared_mirrored`)? Only where the devices share memory (default: no)."""
        return False

    # ---------------------------------------------------------------- hooks (work)
    def find_fusions(self) -> list[Fusion]:
        """The fusions this backend's kernels implement, found on this plan (`fusion.select`;
        default: none)."""
        return []

    @abstractmethod
    def node_steps(self, d: int, node: Tensor) -> list:
        """Device d's steps for one node (raise UnsupportedOpError for an op it cannot run)."""

    def fused_steps(self, d: int, fusion: Fusion) -> list:
        raise UnsupportedOpError(f"{type(self).__name__}: fusion {fusion.kind!r} is not implemented")

    @abstractmethod
    def zero_fill_step(self, d: int, node: Tensor):
        """A step that writes zeros over device d's buffer of `node`."""

    def reduction_collective(self) -> Collective:
        """The collective that sums the reduced nodes (default: the backend's)."""
        return self.backend.collective

    def reduction_buffer(self, d: int, node: Tensor) -> Any:
        """Device d's buffer of a reduced node, as the collective takes it."""
        return self.arrays[d][node]

    def transfer_step(self, node: Tensor, src: int, dst: int) -> Any:
        """A step copying device src's buffer of `node` into device dst's (-sm layer)."""
        raise UnsupportedOpError(f"{self.backend.name} backend: split_mode={self.plan.layout.split_mode!r} (copies "
                                 "between devices) is not implemented on this backend yet")

    def reduction_stream(self) -> Any:
        """The stream the prepared all-reduces run on (None: the collective's own choice)."""
        return None

    # ---------------------------------------------------------------- binding
    def bind_leaves(self) -> None:
        """Map every non-input leaf to the backend's stored per-device value (a KV cache not
        stored yet is allocated, zero-filled, now)."""
        backend = self.backend
        for t in self.plan.graph.leaves:
            if t.flags & Flag.INPUT:
                continue
            if t.flags & Flag.KV_CACHE and not backend.has(t):
                backend.allocate_leaf(t, self.plan)
            if not backend.has(t):
                raise UnsupportedOpError(f"{backend.name} backend: leaf {t.name!r} has no data (upload it first)")
            for d in self.devices:
                self.arrays[d][t] = backend.leaf[d][t]

    def set_fusions(self, fusions: list[Fusion]) -> None:
        """Adopt fusions (`fusion.select` made them disjoint: a node belongs to one at most)."""
        self.fusions = {f.at: f for f in fusions}
        if sum(len(f.members) for f in fusions) != len({m for f in fusions for m in f.members}):
            raise ValueError("fusions overlap: a node may belong to one fusion only (use fusion.select)")

    def bind_nodes(self, d: int, live_until: dict[Tensor, int] | None = None) -> None:
        """Device d's node buffers: owners in one arena (dead buffers reused; fusion outputs
        written early from the fusion's position on, or in memory of their own), views onto
        their source, shared values onto the computing device's buffer."""
        keep = {t.view_src or t for f in self.fusions.values() for t in f.keep}
        detach = {t for f in self.fusions.values() for t in f.detach}
        idx = self.plan.graph.index
        early = {t: idx[f.at] for f in self.fusions.values() for t in f.early}
        offsets, size = assign_offsets(self.plan, d, self.itemsize, keep=keep, live_until=live_until, born_at=early)
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

    # ---------------------------------------------------------------- all-reduces
    def prepare_reductions(self) -> list[Step | None]:
        """[subgraph] -> its all-reduce, prepared once (`Collective.prepare_allreduce`), or None.
        Which devices contribute is the reduced node's compute flags: every device's, local or
        not (a device with an empty slice counts as zeros)."""
        out: list[Step | None] = [None] * len(self.plan.subgraphs)
        if self.plan.n_devices == 1:
            return out
        collective = self.reduction_collective()
        stream = self.reduction_stream()
        for k, sub in enumerate(self.plan.subgraphs):
            if sub.reduction is None:
                continue
            node = self.plan.graph.nodes[sub.reduction.node]
            group, coll = sub.reduction.devices, collective
            if group is not None:          # layer,tensor: one stage's tensor group
                coll = self.group_collective(collective, tuple(group))
                if not set(group) & set(self.devices):
                    continue
            span = self.devices if group is None else [d for d in self.devices if d in group]
            bufs = [self.reduction_buffer(d, node) for d in span]
            flags = list(self.plan.of(node).compute)
            active = flags if group is None else [flags[d] for d in group]
            out[k] = coll.prepare_allreduce(bufs, active, stream=stream)
        return out

    def group_collective(self, collective: Collective, group: tuple[int, ...]) -> Collective:
        """The collective summing over `group` only (`for_devices`; layer,tensor's stage groups)."""
        sub = collective.for_devices(group)
        if sub is None:
            raise UnsupportedOpError(f"{self.backend.name} backend: split_mode='layer,tensor' (all-reduces within "
                                     f"a stage's tensor group) is not implemented on collective "
                                     f"{collective.name!r}")
        return sub

    def prepare_transfers(self) -> list[list]:
        """[subgraph] -> its copies between devices, in plan order: a copy between two owned
        devices is `transfer_step`; one whose other end another process owns is this side's
        send or receive (`transfer_across`); one between two devices owned elsewhere is
        nothing here."""
        out: list[list] = [[] for _ in self.plan.subgraphs]
        nodes = self.plan.graph.nodes
        own = set(self.devices)
        for k, sub in enumerate(self.plan.subgraphs):
            for x in sub.transfers:
                node = nodes[x.node]
                if x.src in own and x.dst in own:
                    out[k].append(self.transfer_step(node, x.src, x.dst))
                elif x.src in own or x.dst in own:
                    out[k].append(self.transfer_across(node, x.src, x.dst))
        return out

    def send_recv(self) -> SendRecv | None:
        """The point-to-point link between this process's devices and the others'
        (`collectives.p2p.SendRecv`: the backend collective's `send_recv`), or None."""
        return self.reduction_collective().send_recv

    def transfer_across(self, node: Tensor, src: int, dst: int) -> Any:
        """This process's half of a copy between processes: the send where src is owned here,
        else the receive into dst's buffer (its shape and dtype are the plan's)."""
        link = self.send_recv()
        if link is None:
            raise UnsupportedOpError(f"{self.backend.name} backend: split_mode='layer' across processes needs "
                                     f"a collective with point-to-point copies; {self.reduction_collective().name!r} "
                                     "has none")
        if src in self.devices:
            return link.prepare_send(self.reduction_buffer(src, node), dst)
        return link.prepare_recv(self.reduction_buffer(dst, node), src)

    # ---------------------------------------------------------------- results
    def read(self, t: Tensor) -> np.ndarray:
        """The full value of `t` (gathered from slices; a PARTIAL value is summed); a process
        owning some devices only gathers through the backend's collective (`read_across`)."""
        self.backend.synchronize()
        if len(self.devices) < self.plan.n_devices:
            return self.read_across(t)
        if self.plan.n_devices == 1:
            return np.array(self.host_value(self.devices[0], t), copy=True).reshape(np_shape(t.ne))
        return gather_array([self.host_value(d, t) for d in self.devices], t, self.plan.of(t))

    def read_argmax(self, t: Tensor) -> tuple[list[int | None], int]:
        """Each row's greedy token of the logits `t`, without gathering a vocabulary split
        (`backends.logits_read`); None for a row with a non-finite logit. Also the bytes received."""
        from metatp.backends.logits_read import read_argmax

        return read_argmax(self, t)

    def candidates_pay(self, t: Tensor, k: int) -> bool:
        """Are `k` candidates per device fewer bytes than the row (`backends.candidates`)?"""
        from metatp.backends.candidates import candidates_pay

        return candidates_pay(self, t, k)

    def read_candidates(self, t: Tensor, k: int, temps: list[float] | None = None,
                        adjs: list[Any] | None = None) -> tuple[list[Any] | None, int]:
        """Each row's sampling candidates (`k` per device, after the penalties `adjs[row]`; its
        mass at `temps[row]`) of the logits `t` without gathering a vocabulary split
        (`backends.candidates`); None where `t` is not split. Also the bytes received."""
        from metatp.backends.candidates import read_candidates

        return read_candidates(self, t, k, temps, adjs)

    def read_across(self, t: Tensor) -> np.ndarray:
        """The full value of `t` when this process owns only some devices: a value every device
        holds whole (mirrored and computed everywhere) is read here; one that a single device
        computed whole (-sm layer: the logits, on the last layer's device) is broadcast from
        there (`send_recv().broadcast`); a split one (the vocabulary-split logits) is gathered
        from every process (`collective.allgather`) and put together. Every process gets the
        same bits."""
        tp = self.plan.of(t)
        own = self.devices
        if tp.sync_state.is_mirrored and all(tp.compute[d] for d in own):
            return np.array(self.host_value(own[0], t), copy=True).reshape(np_shape(t.ne))
        by = [d for d, on in enumerate(tp.compute) if on]
        link = self.send_recv()
        if len(by) == 1 and tuple(tp.local[by[0]].ne) == tuple(t.ne) and link is not None:
            return self._broadcast(t, by[0], link)
        counts = [loc.nelements for loc in tp.local]
        flat = self.backend.collective.allgather([self.host_value(d, t) for d in own], counts)
        parts = [p.reshape(np_shape(loc.ne)) for p, loc in zip(flat, tp.local)]
        return gather_array(parts, t, tp)

    def _broadcast(self, t: Tensor, root: int, link: Any) -> np.ndarray:
        """Device root's whole value of `t` on every process (each allocates it from the plan)."""
        if root in self.devices:
            out = np.array(self.host_value(root, t), copy=True).reshape(np_shape(t.ne))
        else:
            dtype = _HOST_TYPES.get(t.type)
            if dtype is None:
                raise UnsupportedOpError(f"reading {t.name!r} ({t.type.name}) across processes is not supported")
            out = np.empty(np_shape(t.ne), dtype)
        link.broadcast(out, root)
        return out
