"""The all-reduce between subgraphs on CUDA devices driven by one process: NCCL when every
device is its own GPU, else (and as NCCL's per-call fallback) a schedule of
`collectives.schedule` lowered to device copies, adds and events by `collectives.device`.
`DeviceCollective` is a `collectives.Collective`: `prepare_allreduce(bufs, active)` returns
the step the runner calls after each subgraph.

FP32 on the wire below llama.cpp's size thresholds, BF16 above (`collectives.wire`): a BF16
reduction converts each device's value into a wire buffer first and back after
(`cuda.wire_cast.wire_steps`, which the NCCL collective between MPI ranks,
`cuda.nccl.NcclCollective`, shares).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from metatp.backends.collectives.base import Collective
from metatp.backends.collectives.device import lower_schedule
from metatp.backends.collectives.schedule import Mode, butterfly_schedule
from metatp.backends.collectives.wire import wire_dtype
from metatp.backends.cuda import kernels as ck
from metatp.backends.cuda.device_ops import Memcpy, Record, Wait
from metatp.backends.cuda.launch import device_ptr, recording
from metatp.backends.cuda.nccl import NcclGroup
from metatp.backends.cuda.wire_cast import wire_steps
from metatp.ir.errors import ConfigError

if TYPE_CHECKING:
    from metatp.backends.cuda.executable import CupyExecutable

__all__ = ["wire_steps", "PreparedReduction", "DeviceCollective", "group_nccl"]


def group_nccl(backend: Any, gpus: Sequence[int]) -> NcclGroup | None:
    """The NCCL communicators of one device group's GPUs, made once per backend (a plan for
    another step size reuses them); None where NCCL cannot span them (the schedule then)."""
    cache = backend.group_nccl
    key = tuple(gpus)
    if key not in cache:
        made = NcclGroup(backend.rt, list(key), required=False)
        cache[key] = made if made.active else None
    return cache[key]


@dataclass
class PreparedReduction:
    """One prepared all-reduce (the step `DeviceCollective.prepare_allreduce` returns): per-device
    steps of the schedule, and the NCCL alternative."""

    collective: DeviceCollective
    n_elements: int
    wire: str                                       # "f32" / "bf16"
    ops: list = field(default_factory=list)         # schedule: [(device, [steps])] in issue order
    nccl: list = field(default_factory=list)        # NCCL: [(device, pre)], (None, calls), [(device, post)]

    def __call__(self) -> None:
        self.collective.run(self)


class _Steps:
    """collectives.device.DeviceSteps on the executable's devices (their streams and GPUs);
    schedule position i is device `devices[i]` (a stage's tensor group under layer,tensor)."""

    def __init__(self, ex: CupyExecutable, devices: Sequence[int] | None = None) -> None:
        self.ex, self.rt = ex, ex.rt
        self.devs = list(ex.devs) if devices is None else [ex.devs[d] for d in devices]

    def copy(self, d: int, dst, src) -> list:
        nbytes = int(dst.size) * dst.dtype.itemsize
        return [Memcpy(self.rt, device_ptr(dst), device_ptr(src), nbytes, self.devs[d].stream)]

    def add(self, d: int, dst, src) -> list:
        with self.rt.device(self.devs[d].gpu), recording() as launches:
            ck.add_inplace(dst, src)
        return [la.frozen() for la in launches]

    def record(self, d: int, event) -> Record:
        return Record(self.rt, self.devs[d].stream, event)

    def wait(self, d: int, event) -> Wait:
        return Wait(self.rt, self.devs[d].stream, event)


class DeviceCollective(Collective):
    """The executable's all-reduces with the backend's mode, on every device's own stream.

    `devices`: the devices summed over (default: all of the executable's); a subset is one
    stage's tensor group under -sm layer,tensor (`for_devices`), whose NCCL calls go to a
    communicator of that group's GPUs only (`nccl.NcclGroup`, made once per group)."""

    def __init__(self, ex: CupyExecutable, mode: Mode, devices: Sequence[int] | None = None,
                 nccl: NcclGroup | None = None) -> None:
        self.ex = ex
        self.backend = ex.backend
        self.mode = mode
        self.name = mode.name
        self.group = tuple(range(ex.n)) if devices is None else tuple(int(d) for d in devices)
        self.nccl = ex.backend.nccl if devices is None else nccl
        # a device-only mode (NCCL) falls back per call to the butterfly
        self.schedule_fn = mode.schedule or butterfly_schedule
        self._groups: dict[tuple[int, ...], DeviceCollective] = {}

    def for_devices(self, devices: Sequence[int]) -> DeviceCollective:
        """The same mode over a subset of the devices (-sm layer,tensor: one stage's tensor
        group), made once per group: NCCL over the group's GPUs when the backend uses NCCL."""
        group = tuple(int(d) for d in devices)
        if group == self.group:
            return self
        if not group or not set(group) <= set(self.group) or len(set(group)) != len(group):
            raise ConfigError(f"for_devices({list(group)}): not distinct devices of {list(self.group)}")
        made = self._groups.get(group)
        if made is None:
            nccl = None
            if self.nccl is not None and self.nccl.active:
                nccl = group_nccl(self.backend, [self.ex.devs[d].gpu for d in group])
            made = self._groups[group] = DeviceCollective(self.ex, self.mode, group, nccl)
        return made

    def prepare_allreduce(self, bufs: Sequence[Any], active: Sequence[bool] | None = None,
                          stream: Any = None) -> PreparedReduction:
        """The step for flat f32 `bufs` (one per device, in device order). `stream` is not used:
        each device's part runs on its own stream."""
        ex, backend = self.ex, self.backend
        n = len(bufs)
        if n != len(self.group):
            raise ValueError(f"{n} buffers for an all-reduce over devices {list(self.group)}")
        n_el = int(bufs[0].size)
        flags = [True] * n if active is None else list(active)
        wire = wire_dtype(n, n_el, backend.wire, backend.wire_thresholds)
        r = PreparedReduction(self, n_el, wire)
        send, recv = [], []
        for i, d in enumerate(self.group):
            if wire == "bf16":
                send.append(ex.scratch_buffer(d, "wire", n_el, np.uint16)[:n_el])
                recv.append(ex.scratch_buffer(d, "recv_bf16", n_el, np.uint16)[:n_el])
            else:
                send.append(bufs[i])
                recv.append(ex.scratch_buffer(d, "recv_f32", n_el, np.float32)[:n_el])
        devs = [ex.devs[d] for d in self.group]
        edges = [wire_steps(ex.rt, dev.gpu, dev.stream, bufs[i], send[i], flags[i], wire) for i, dev in enumerate(devs)]
        pro = [(d, edges[i][0]) for i, d in enumerate(self.group)]
        epi = [(d, edges[i][1]) for i, d in enumerate(self.group)]
        lowered = [(self.group[i], steps) for i, steps in
                   lower_schedule(self.schedule_fn(n, n_el), send, recv, _Steps(ex, self.group),
                                  [dev.ready for dev in devs], [dev.read_done for dev in devs])]
        r.ops = pro + lowered + epi
        nccl = self.nccl
        if nccl is not None and nccl.active:
            calls = nccl.calls([device_ptr(s) for s in send], n_el, wire, [dev.stream for dev in devs])
            r.nccl = pro + [(None, calls)] + epi
        return r

    def run(self, r: PreparedReduction) -> None:
        """NCCL when it is set up (per-call fallback to the schedule), else the schedule."""
        nccl = self.nccl
        if r.nccl and nccl is not None and nccl.active:
            ok = True
            for d, item in r.nccl:
                if d is None:
                    ok = nccl.allreduce(item, self.ex.capturing)
                    if not ok:
                        break       # the prologue may have run: the schedule redoes it (idempotent)
                elif item:
                    self.ex.run_steps(d, item)
            if ok:
                return
        for d, steps in r.ops:
            if steps:
                self.ex.run_steps(d, steps)
