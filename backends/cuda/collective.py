"""The all-reduce between subgraphs on CUDA devices driven by one process: NCCL when every
device is its own GPU, else (and as NCCL's per-call fallback) a schedule of
`collectives.schedule` lowered to device copies, adds and events by `collectives.device`.
`DeviceCollective` is a `collectives.Collective`: `prepare_allreduce(bufs, active)` returns
the step the runner calls after each subgraph.

FP32 on the wire below llama.cpp's size thresholds, BF16 above (`collectives.wire`): a BF16
reduction converts each device's value into a wire buffer first and back after
(`wire_steps`, which the NCCL collective between MPI ranks, `cuda.nccl.NcclCollective`,
shares).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from metatp.backends.collectives.device import lower_schedule
from metatp.backends.collectives.schedule import Mode, butterfly_schedule
from metatp.backends.collectives.wire import wire_dtype
from metatp.backends.cuda import kernels as ck
from metatp.backends.cuda.device_ops import Memcpy, Memset, Record, Wait
from metatp.backends.cuda.launch import device_ptr, recording

if TYPE_CHECKING:
    from metatp.backends.cuda.executable import CupyExecutable

__all__ = ["wire_steps", "PreparedReduction", "DeviceCollective"]


def wire_steps(rt: Any, gpu: int, stream: Any, buf: Any, send: Any, active: bool, wire: str) -> tuple[list, list]:
    """(prologue, epilogue) of one device's part of an all-reduce: zero an inactive device's
    value (a fill: its buffer may hold garbage, NaN) and, on a BF16 wire, convert the flat f32
    `buf` into the wire buffer `send` before the sum and back after it."""
    pre: list = [] if active else [Memset(rt, device_ptr(buf), int(buf.nbytes), stream)]
    post: list = []
    if wire == "bf16":
        with rt.kernels(), rt.device(gpu):
            with recording() as launches:
                ck.f32_to_bf16(buf, send)
            pre += [la.frozen() for la in launches]
            with recording() as launches:
                ck.bf16_to_f32(send, buf)
            post += [la.frozen() for la in launches]
    return pre, post


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
    """collectives.device.DeviceSteps on the executable's devices (their streams and GPUs)."""

    def __init__(self, ex: CupyExecutable) -> None:
        self.ex, self.rt, self.devs = ex, ex.rt, ex.devs

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


class DeviceCollective:
    """The executable's all-reduces with the backend's mode, on every device's own stream."""

    def __init__(self, ex: CupyExecutable, mode: Mode) -> None:
        self.ex = ex
        self.backend = ex.backend
        self.mode = mode
        self.name = mode.name
        # a device-only mode (NCCL) falls back per call to the butterfly
        self.schedule_fn = mode.schedule or butterfly_schedule

    def prepare_allreduce(self, bufs: Sequence[Any], active: Sequence[bool] | None = None,
                          stream: Any = None) -> PreparedReduction:
        """The step for flat f32 `bufs` (one per device, in device order). `stream` is not used:
        each device's part runs on its own stream."""
        ex, backend = self.ex, self.backend
        n = len(bufs)
        n_el = int(bufs[0].size)
        flags = [True] * n if active is None else list(active)
        wire = wire_dtype(n, n_el, backend.wire, backend.wire_thresholds)
        r = PreparedReduction(self, n_el, wire)
        send, recv = [], []
        for d in range(n):
            if wire == "bf16":
                send.append(ex.scratch_buffer(d, "wire", n_el, np.uint16)[:n_el])
                recv.append(ex.scratch_buffer(d, "recv_bf16", n_el, np.uint16)[:n_el])
            else:
                send.append(bufs[d])
                recv.append(ex.scratch_buffer(d, "recv_f32", n_el, np.float32)[:n_el])
        devs = ex.devs
        edges = [wire_steps(ex.rt, devs[d].gpu, devs[d].stream, bufs[d], send[d], flags[d], wire) for d in range(n)]
        pro = [(d, edges[d][0]) for d in range(n)]
        epi = [(d, edges[d][1]) for d in range(n)]
        lowered = lower_schedule(self.schedule_fn(n, n_el), send, recv, _Steps(ex),
                                 [dev.ready for dev in devs], [dev.read_done for dev in devs])
        r.ops = pro + lowered + epi
        nccl = backend.nccl
        if nccl is not None and nccl.active:
            calls = nccl.calls([device_ptr(s) for s in send], n_el, wire, [dev.stream for dev in devs])
            r.nccl = pro + [(None, calls)] + epi
        return r

    def run(self, r: PreparedReduction) -> None:
        """NCCL when it is set up (per-call fallback to the schedule), else the schedule."""
        nccl = self.backend.nccl
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
