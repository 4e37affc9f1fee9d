"""A Plan bound to CUDA device buffers: the shared `PlanExecutor` on CUDA memory.

The executor walks the plan (views, zero-fill, fusion members, mirrored values shared between
devices); this module supplies what is CUDA's:

- memory: one arena per device (`passes.memory.assign_offsets`), views rescaled from the
  graph's element size to the storage's (an F32 KV cache is f16), fusion outputs written early
  in memory of their own, zero-fill as a memset, scratch buffers sized once per plan;
- per-step inputs (token ids, positions, KV rows, the mask and the attended KV length) in one
  device block per GPU, filled by one host-to-device copy, so a captured graph replays them;
- each node becomes frozen kernel launches (`ops.CUDA_OPS`, `ops.FUSION_ROWS`: the kernel
  families' tables; a fused kernel that refuses a layout runs its row's `unfused` steps);
- the all-reduce between subgraphs (`collective.DeviceCollective`; a process owning one device
  of several: the backend's collective spanning the processes, `nccl.NcclCollective`, on the
  device's stream), and the runner (streams, events and CUDA graphs, `capture.Runner`);
- -sm layer's copies between devices (`p2p.DeviceCopy`: a peer or device copy ordered by
  events; between GPU ranks `p2p.NcclSendRecv` on the device stream) and layer,tensor's
  per-group all-reduces (`DeviceCollective.for_devices`; the ranks' `NcclCollective.for_devices`).

Mirrored values identical on every device (`PlanFacts.shared_mirrored`) are computed once,
by the first device, when all devices share one GPU: the others read its buffer. They wait
for it with one event per subgraph (`shared_ready`, recorded by the lead after its last
shared value, waited for before a device's first read of one), and the lead keeps those
buffers until the end of the last reader's subgraph (`PlanFacts.late_reads`); the all-reduce
after a subgraph orders every device after every other, so nothing is overwritten early.
Across GPUs (peer reads, per-segment graph capture) values are not shared.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from metatp.backends.cuda import ops
from metatp.backends.cuda.capture import Runner
from metatp.backends.cuda.collective import DeviceCollective
from metatp.backends.cuda.device_ops import Memset, Record, Wait, capturable
from metatp.backends.cuda.fusion import find_fusions
from metatp.backends.cuda.launch import device_ptr
from metatp.backends.cuda.p2p import DeviceCopy
from metatp.backends.cuda.storage import (STORAGE, RawWeight, attended_length, contig_strides, graph_itemsize,
                                          input_layout, is_quant_cache, to_float)
from metatp.backends.executor import NodeSteps, PlanExecutor
from metatp.backends.fusion import Fusion
from metatp.ir.dtypes import np_shape
from metatp.ir.errors import UnsupportedOpError
from metatp.ir.tensor import Flag, GGMLType, Tensor, row_bytes, type_size
from metatp.passes.plan import Local, Plan

if TYPE_CHECKING:
    from metatp.backends.cuda.backend import CupyBackend

__all__ = ["CupyExecutable"]


class CupyExecutable(PlanExecutor):
    """A plan bound to device buffers: per subgraph, per device, a list of launches."""

    backend: CupyBackend

    def __init__(self, backend: CupyBackend, plan: Plan) -> None:
        self.rt = backend.rt
        self.devs = backend.devices                 # Device objects, None where not owned (self.devices: the owned indices)
        self.n = backend.n
        self._scratch: list[dict[str, Any]] = [{} for _ in range(self.n)]
        self._retired: list = []          # outgrown scratch buffers: frozen launches may point at them
        self.leads = self._lead_devices(backend.owned)
        with self.rt.kernels():
            super().__init__(backend, plan)
        # kernel launches and stream calls the library lets CUDA capture (cuBLAS >= 12.2): one graph
        self.capturable = all(capturable(s) for per_dev in self.steps for steps in per_dev for s in steps)
        for gpu in self.leads:
            self.rt.device_synchronize(gpu)       # allocations and zero-fills are done
        self.runner = Runner(self)

    # ---------------------------------------------------------------- devices and inputs
    def _lead_devices(self, owned: list[int]) -> dict[int, int]:
        """GPU -> the first logical device on it (its stream copies inputs and joins the rest)."""
        leads: dict[int, int] = {}
        for d in owned:
            leads.setdefault(self.devs[d].gpu, d)
        return leads

    def bind_inputs(self) -> None:
        """One input block per GPU (every INPUT leaf, plus an int32 'attended length' per
        attention mask), filled from a pinned host mirror by one copy per step."""
        graph = self.plan.graph
        layout, self.in_bytes = input_layout(graph)
        self.host_in = self.rt.pinned(self.in_bytes)
        self._host_views = {key: np.ndarray(shape, dtype, buffer=self.host_in, offset=o)
                            for key, (o, shape, dtype) in layout.items()}
        for key, v in self._host_views.items():
            v[...] = 0 if not isinstance(key, tuple) else 1 << 30
        self.dev_in: dict[int, Any] = {}
        self._dev_views: dict[int, dict[Any, Any]] = {}
        for gpu in self.leads:
            with self.rt.device(gpu):
                block = self.rt.zeros((self.in_bytes,), np.uint8)
                self.dev_in[gpu] = block
                self._dev_views[gpu] = {key: self.rt.view(block, o, shape, contig_strides(shape, dtype), dtype)
                                        for key, (o, shape, dtype) in layout.items()}
        for d in self.devices:
            dev = self.devs[d]
            for t in graph.leaves:
                if t.flags & Flag.INPUT:
                    self.arrays[d][t] = self._dev_views[dev.gpu][t]
        self.inputs_pending = False

    def kv_len_view(self, d: int, mask: Tensor):
        return self._dev_views[self.devs[d].gpu].get(("kv_len", mask))

    def set_input(self, t: Tensor, value: np.ndarray) -> None:
        """Write a per-step input into the pinned host block (copied to the GPUs by run)."""
        if self.inputs_pending:
            for gpu, d in self.leads.items():
                self.rt.host_wait(self.devs[d].inputs_copied)
            self.inputs_pending = False
        view = self._host_views.get(t)
        if view is None:
            raise KeyError(f"{t.name!r} is not an input of this plan")
        np.copyto(view, np.asarray(value).reshape(view.shape), casting="unsafe")
        kv = self._host_views.get(("kv_len", t))
        if kv is not None:
            kv[0] = attended_length(view)

    # ---------------------------------------------------------------- memory (PlanExecutor hooks)
    def shares_mirrored(self) -> bool:
        """Devices on one GPU share its memory: the first computes mirrored values for all."""
        return len(self.leads) == 1

    def bind_nodes(self, d: int, live_until: dict[Tensor, int] | None = None) -> None:
        """The shared binding, then device d's scratch buffers at their largest size."""
        super().bind_nodes(d, live_until)
        with self.rt.device(self.devs[d].gpu):
            self._presize(d)

    def itemsize(self, t: Tensor) -> int:
        return graph_itemsize(t)

    def device_scope(self, d: int):
        return self.rt.device(self.devs[d].gpu)

    def new_arena(self, d: int, nbytes: int):
        with self.rt.device(self.devs[d].gpu):
            arena = self.rt.empty((max(nbytes, 64),), np.uint8)
        self.buffer_bytes[d] = int(arena.nbytes)
        return arena

    @staticmethod
    def _dtype(node: Tensor):
        dtype = STORAGE.get(node.type)
        if dtype is None:
            raise UnsupportedOpError(f"cupy backend: node {node.name!r} of type {node.type.name}")
        return dtype

    def place(self, d: int, arena, offset: int, node: Tensor, loc: Local):
        dtype, shape = self._dtype(node), np_shape(loc.ne)
        return self.rt.view(arena, offset, shape, contig_strides(shape, dtype), dtype)

    def own_buffer(self, d: int, node: Tensor, loc: Local):
        with self.rt.device(self.devs[d].gpu):
            arr = self.rt.empty(np_shape(loc.ne), self._dtype(node))
        self.buffer_bytes[d] += int(arr.nbytes)
        return arr

    def view(self, d: int, node: Tensor, loc: Local):
        """The device view of `node`: the plan's local shape/strides/offset, rescaled from the
        graph's element size to the storage's (an F32 KV cache is stored as f16)."""
        root = self.arrays[d][node.view_src]
        if isinstance(root, RawWeight):
            raise UnsupportedOpError(f"cupy backend: view {node.name!r} of the quantized weight "
                                     f"{node.view_src.name!r} is not supported")
        if is_quant_cache(node):
            return self._block_view(root, node, loc)
        gsz, ssz = graph_itemsize(node), root.dtype.itemsize
        for x in (loc.offs, *loc.nb):
            if x % gsz:
                raise UnsupportedOpError(f"cupy backend: view {node.name!r} is not element-aligned")
        strides = tuple(loc.nb[i] // gsz * ssz for i in (3, 2, 1, 0))
        return self.rt.view(root, loc.offs // gsz * ssz, np_shape(loc.ne), strides, root.dtype)

    def _block_view(self, root, node: Tensor, loc: Local):
        """A view of a quantized cache: uint8, its rows whole blocks (numpy shape (ne3, ne2, ne1,
        row bytes), byte strides as the plan says). The graph only takes such views (head rows
        of whole blocks); anything else is refused by name."""
        ts = type_size(node.type)
        ne0 = loc.ne[0]
        try:
            rb = row_bytes(node.type, ne0)
        except ValueError:                    # not whole blocks
            rb = None
        if rb is None or (ne0 > 1 and loc.nb[0] != ts) or root.dtype != np.uint8:
            raise UnsupportedOpError(f"cupy backend: view {node.name!r} of the {node.type.name} cache "
                                     f"{node.view_src.name!r} does not take whole blocks per row")
        shape = (loc.ne[3], loc.ne[2], loc.ne[1], rb)
        return self.rt.view(root, loc.offs, shape, (loc.nb[3], loc.nb[2], loc.nb[1], 1), np.uint8)

    def scratch_buffer(self, d: int, key: str, n: int, dtype):
        """A per-device scratch array of at least n elements (shared by every node that needs
        it: work on one stream runs in order). Sized up front by `_presize`; an outgrown
        buffer is kept alive, as recorded steps may hold its address."""
        cur = self._scratch[d].get(key)
        if cur is None or cur.size < n or cur.dtype != np.dtype(dtype):
            if cur is not None:
                self._retired.append(cur)
            with self.rt.device(self.devs[d].gpu):
                cur = self.rt.empty((max(n, 1),), dtype)
            self._scratch[d][key] = cur
            self.buffer_bytes[d] += int(cur.nbytes)
        return cur

    def _presize(self, d: int) -> None:
        """Allocate every scratch buffer of device d at its largest size before recording."""
        for key, (n, dtype) in self.backend._scratch_needs(self.plan, d).items():
            self.scratch_buffer(d, key, n, dtype)

    def host_value(self, d: int, t: Tensor) -> np.ndarray:
        a = self.arrays[d][t]
        if isinstance(a, RawWeight):
            raise UnsupportedOpError(f"cupy backend: reading the quantized weight {t.name!r}")
        with self.rt.device(self.devs[d].gpu):
            h = self.rt.download(a)
        return to_float(h, a.dtype, t)

    # ---------------------------------------------------------------- work (PlanExecutor hooks)
    def find_fusions(self) -> list[Fusion]:
        return find_fusions(self)

    def set_fusions(self, fusions: list[Fusion]) -> None:
        super().set_fusions(fusions)
        self._unshare_fused()

    def node_steps(self, d: int, node: Tensor) -> list:
        handler = ops.CUDA_OPS.get(node.op)
        if handler is None:
            raise UnsupportedOpError(f"cupy backend: no kernel for op {node.op.name} (node {node.name!r})")
        try:
            return handler(self, d, node)
        except (ValueError, TypeError) as e:
            raise UnsupportedOpError(f"cupy backend: {node.op.name} node {node.name!r} on device {d}: {e}") from e

    def fused_steps(self, d: int, fusion: Fusion) -> list:
        """The fusion's row runs it; a layout its kernel cannot take runs the row's `unfused`
        steps instead (its nodes one by one)."""
        row = ops.FUSION_ROWS[fusion.kind]
        try:
            return row.run(self, d, fusion)
        except (ValueError, TypeError, UnsupportedOpError):
            return row.unfused(self, d, fusion)

    def zero_fill_step(self, d: int, node: Tensor):
        a = self.arrays[d][node]
        return Memset(self.rt, device_ptr(a), int(a.nbytes), self.devs[d].stream)

    # ---------------------------------------------------------------- mirrored values shared on one GPU
    def walk(self) -> list[list[NodeSteps]]:
        """The shared walk, with the waits that order reads of values the lead shares."""
        walked = super().walk()
        self._order_shared_reads(walked)
        return walked

    def _unshare_fused(self) -> None:
        """A value absorbed into a fusion another device runs for itself is not shared: a
        fallback there would write the lead's buffer."""
        for f in self.fusions.values():
            if f.at not in self.shared:
                self.shared.difference_update(f.absorbed)

    def _order_shared_reads(self, walked: list[list[NodeSteps]]) -> None:
        """The lead records `shared_ready` after its last shared value of a subgraph; any other
        device waits for it before its first step that reads one (values of earlier subgraphs
        are ordered by the all-reduce between them)."""
        if not self.shared:
            return
        lead = self.devices[0]
        rt, ldev = self.rt, self.devs[lead]
        for items in walked:
            made = [i for i, item in enumerate(items) if item.node in self.shared and lead in item.per_device]
            if not made:
                continue
            last = made[-1]
            items[last].per_device[lead].append(Record(rt, ldev.stream, ldev.shared_ready))
            for d in self.devices[1:]:        # issued after the lead's steps: the wait sees this record
                for item in items:
                    if d in item.per_device and self._reads_shared(item.node):
                        item.per_device[d].insert(0, Wait(rt, self.devs[d].stream, ldev.shared_ready))
                        break

    def _reads_shared(self, node: Tensor) -> bool:
        f = self.fusions.get(node)
        members = (node, *f.absorbed) if f is not None else (node,)
        return any(s is not None and (s.view_src or s) in self.shared for m in members for s in m.src)

    # ---------------------------------------------------------------- all-reduce and running
    def reduction_collective(self):
        """The backend's collective spanning the processes when it has one (one owned device),
        else this executable's own over the devices of this process."""
        if self.backend.collective is not None:
            return self.backend.collective
        return DeviceCollective(self, self.backend.mode)

    def reduction_buffer(self, d: int, node: Tensor):
        """Device d's buffer of a reduced node, flat: f32 and contiguous (as the kernels sum)."""
        if node.type != GGMLType.F32:
            raise UnsupportedOpError(f"cupy backend: all-reduce of a {node.type.name} tensor ({node.name!r})")
        a = self.arrays[d][node]
        if not a.flags.c_contiguous:
            raise UnsupportedOpError(f"cupy backend: reduced tensor {node.name!r} is not contiguous")
        return a.reshape(-1)

    def reduction_stream(self):
        """A process owning one device sums on that device's stream (inside its captured graph)."""
        return self.devs[self.devices[0]].stream if self.backend.collective is not None else None

    # ---------------------------------------------------------------- -sm layer: copies between devices
    def transfer_step(self, node: Tensor, src: int, dst: int) -> DeviceCopy:
        """A peer copy between two GPUs, a device copy between virtual devices on one GPU,
        ordered by events on both streams (`p2p.DeviceCopy`)."""
        return DeviceCopy(self, node, src, dst)

    def transfer_across(self, node: Tensor, src: int, dst: int):
        """This rank's half of a copy between GPU ranks: an NCCL send or receive on the device
        stream (`p2p.NcclSendRecv`), so it is ordered with the kernels and captured with them."""
        link = self.send_recv()
        if link is None:
            return super().transfer_across(node, src, dst)       # the typed refusal
        stream = self.devs[self.devices[0]].stream
        if src in self.devices:
            return link.prepare_send(self.arrays[src][node], dst, stream=stream)
        return link.prepare_recv(self.arrays[dst][node], src, stream=stream)

    def run_transfers(self, k: int) -> None:
        """Subgraph k's copies between devices (after its all-reduce), in plan order."""
        for step in self.transfers[k]:
            step()

    def run_steps(self, d: int, steps: list) -> None:
        """Issue `steps` on device d's stream."""
        with self.devs[d].ctx:
            for s in steps:
                s()

    def allreduce(self, k: int) -> None:
        """Subgraph k's all-reduce, if it ends with one."""
        r = self.reductions[k]
        if r is not None:
            r()

    @property
    def capturing(self) -> bool:
        """Is the runner capturing the step into a CUDA graph now (an NCCL failure then propagates)?"""
        return self.runner.capturing

    def run(self, inputs: dict[Tensor, np.ndarray] | None = None) -> None:
        """One step: inputs to the devices, then the graph (replayed when captured)."""
        for t, v in (inputs or {}).items():
            self.set_input(t, v)
        self.runner.run()

    @property
    def graph_mode(self) -> str | None:
        """"whole" / "segments" once captured, None while eager."""
        return self.runner.graph_mode

    @property
    def runs(self) -> int:
        return self.runner.runs

    def synchronize(self) -> None:
        self.backend.synchronize()
