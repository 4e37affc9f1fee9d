"""The all-reduce between subgraphs on CUDA devices: NCCL when every device is its own GPU,
else (and as NCCL's per-call fallback) a schedule of `collectives.schedule` lowered to device
copies, adds and events by `collectives.device`.

FP32 on the wire below llama.cpp's size thresholds, BF16 above (`collectives.wire`): a BF16
reduction converts each device's value into a wire buffer first and back after.

A process that owns one device of several (one GPU per MPI rank) sums through the backend's
collective spanning the processes instead (`RankCollective`: NCCL, `collectives.nccl`), on
its device's stream, so the call is issued (and captured into the step's CUDA graph) where
the subgraph's kernels ran.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from metatp.backends.collectives.device import lower_schedule
from metatp.backends.collectives.schedule import Mode, butterfly_schedule
from metatp.backends.collectives.wire import wire_dtype
from metatp.backends.cuda import kernels as ck
from metatp.backends.cuda.device_ops import Memcpy, Memset, Record, Wait
from metatp.backends.cuda.launch import device_ptr, recording

if TYPE_CHECKING:
    from metatp.backends.cuda.executable import CupyExecutable

__all__ = ["Reduction", "DeviceCollective", "RankCollective"]


@dataclass
class Reduction:
    """One prepared all-reduce: per-device steps of the schedule, and the NCCL alternative."""

    node: Any
    n_elements: int
    wire: str                                       # "f32" / "bf16"
    ops: list = field(default_factory=list)         # schedule: [(device, [steps])] in issue order
    nccl: list = field(default_factory=list)        # NCCL: [(device, pre)], (None, calls), [(device, post)]


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
    """Prepares and runs the executable's reductions with the backend's mode."""

    def __init__(self, ex: CupyExecutable, mode: Mode) -> None:
        self.ex = ex
        self.backend = ex.backend
        self.mode = mode
        # a device-only mode (NCCL) falls back per call to the butterfly
        self.schedule_fn = mode.schedule or butterfly_schedule

    def prepare(self, node, bufs: list, active: list[bool]) -> Reduction:
        ex, backend = self.ex, self.backend
        n = len(bufs)
        n_el = int(bufs[0].size)
        wire = wire_dtype(n, n_el, backend.wire, backend.wire_thresholds)
        r = Reduction(node, n_el, wire)
        send, recv = [], []
        for d in range(n):
            if wire == "bf16":
                send.append(ex.scratch_buffer(d, "wire", n_el, np.uint16)[:n_el])
                recv.append(ex.scratch_buffer(d, "recv_bf16", n_el, np.uint16)[:n_el])
            else:
                send.append(bufs[d])
                recv.append(ex.scratch_buffer(d, "recv_f32", n_el, np.float32)[:n_el])
        pro = [(d, self._prologue(d, bufs[d], send[d], active[d], wire)) for d in range(n)]
        epi = [(d, self._epilogue(d, bufs[d], send[d], wire)) for d in range(n)]
        devs = ex.devs
        lowered = lower_schedule(self.schedule_fn(n, n_el), send, recv, _Steps(ex),
                                 [dev.ready for dev in devs], [dev.read_done for dev in devs])
        r.ops = pro + lowered + epi
        nccl = backend.nccl
        if nccl is not None and nccl.active:
            calls = nccl.calls([device_ptr(s) for s in send], n_el, wire, [dev.stream for dev in devs])
            r.nccl = pro + [(None, calls)] + epi
        return r

    def _prologue(self, d: int, buf, send, active: bool, wire: str) -> list:
        """Zero an inactive device's value (a fill: its buffer may hold garbage, NaN) and put the
        value into the wire format."""
        ex = self.ex
        dev = ex.devs[d]
        steps: list = []
        if not active:
            steps.append(Memset(ex.rt, device_ptr(buf), int(buf.nbytes), dev.stream))
        if wire == "bf16":
            with ex.rt.device(dev.gpu), recording() as launches:
                ck.f32_to_bf16(buf, send)
            steps += [la.frozen() for la in launches]
        return steps

    def _epilogue(self, d: int, buf, send, wire: str) -> list:
        if wire != "bf16":
            return []
        with self.ex.rt.device(self.ex.devs[d].gpu), recording() as launches:
            ck.bf16_to_f32(send, buf)
        return [la.frozen() for la in launches]

    def run(self, r: Reduction, capturing: bool) -> None:
        """NCCL when it is set up (per-call fallback to the schedule), else the schedule."""
        nccl = self.backend.nccl
        if r.nccl and nccl is not None and nccl.active:
            ok = True
            for d, item in r.nccl:
                if d is None:
                    ok = nccl.allreduce(item, capturing)
                    if not ok:
                        break       # the prologue may have run: the schedule redoes it (idempotent)
                elif item:
                    self.ex.run_steps(d, item)
            if ok:
                return
        for d, steps in r.ops:
            if steps:
                self.ex.run_steps(d, steps)


class RankCollective:
    """The reductions of an executable whose process owns some devices of the group: each one
    is the spanning collective's step on the owned device's stream (`prepare_allreduce(bufs,
    active, stream=)`; every device's `active` flag, local or not)."""

    def __init__(self, ex: CupyExecutable, collective: Any) -> None:
        if len(ex.devices) != 1:
            raise ValueError(f"a collective spanning processes drives one device per process, "
                             f"this one owns {ex.devices}")
        self.ex = ex
        self.collective = collective
        self.device = ex.devs[ex.devices[0]]

    def prepare(self, node, bufs: list, active: list[bool]):
        """The prepared step (pointers and wire type resolved once)."""
        return self.collective.prepare_allreduce(bufs, active, stream=self.device.stream)

    def run(self, step, capturing: bool) -> None:
        """Issue the step (inside a graph capture, the NCCL call is captured with the kernels)."""
        step()
