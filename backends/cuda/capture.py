"""The CUDA runner: one step on the devices' streams, eagerly or as a captured CUDA graph.

A step is: the per-step inputs copied to each GPU (one copy per GPU, on its lead device's
stream), the other devices of a GPU forked from that copy, every subgraph's steps on every
device followed by the all-reduce and (-sm layer) its copies between devices, and the devices
joined back into their GPU's lead stream.

The copies of a layer plan are captured with the rest: in one process a copy is a record, a
wait and a cudaMemcpyAsync on the two devices' streams (`p2p.DeviceCopy`), all capturable, so
the whole step stays one graph; between GPU ranks it is ncclSend / ncclRecv on the device
stream, captured like the rank's all-reduces (where NCCL cannot be captured the capture fails
and the step runs eagerly, as below). In "segments" mode the copies run eagerly between the
segments, like the collectives.

From its second run on, a plan whose steps CUDA can capture (kernel launches, copies, events,
and `StreamCall`s such as a cuBLAS GEMM where the runtime's cuBLAS can be captured: no `HostStep`;
`device_ops.capturable`) is captured as one graph on the first GPU's lead stream, every device
of every GPU joining it through events (virtual devices, schedules and NCCL calls included), and
replayed. On several GPUs, when that capture fails (an NCCL that cannot be captured) or
`multi_gpu_graphs="segments"`, each (subgraph, device) is captured on its own and the collectives
run eagerly between them; when capture fails on one GPU, the step runs eagerly.

A process owning one device of several (an MPI rank on its GPU) is the one-GPU case: its
collective's NCCL call is issued on the device stream inside the capture, so the whole step,
all-reduces included, is one graph; where NCCL cannot be captured the capture fails and the
step runs eagerly from then on (every rank decides alike: they run the same plan).

A capture that fails is always ended (`_captured`): the step's work then runs eagerly on the same
streams, so nothing may be left capturing; the warning names the first error, not the
invalidated capture's at its end.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any, Callable

from metatp.backends.cuda.launch import device_ptr

if TYPE_CHECKING:
    from metatp.backends.cuda.executable import CupyExecutable

__all__ = ["Runner"]


class Runner:
    """Runs an executable's steps; owns its captured graph."""

    def __init__(self, ex: CupyExecutable) -> None:
        self.ex = ex
        self.rt = ex.rt
        self.devs = ex.devs
        self.graph: Any = None
        self.graph_mode: str | None = None      # "whole" / "segments" once captured
        self.capturing = False
        self.runs = 0

    # ---------------------------------------------------------------- one step, eagerly
    def copy_inputs(self) -> None:
        ex, rt = self.ex, self.rt
        for gpu, d in ex.leads.items():
            dev = self.devs[d]
            with dev.ctx:
                rt.memcpy_h2d(device_ptr(ex.dev_in[gpu]), ex.host_in, ex.in_bytes, dev.stream)
                rt.record(dev.stream, dev.inputs_copied)
        ex.inputs_pending = True

    def _others_of_leads(self):
        """(lead device, device) for every device that shares a GPU with its lead."""
        for d in self.ex.devices:
            dev = self.devs[d]
            lead = self.devs[self.ex.leads[dev.gpu]]
            if lead is not dev:
                yield lead, dev

    def fork(self) -> None:
        """Devices sharing a GPU with its lead wait for the lead's input copy."""
        for lead, dev in self._others_of_leads():
            self.rt.record(lead.stream, lead.fork)
            self.rt.wait(dev.stream, lead.fork)

    def join(self) -> None:
        """The lead of each GPU waits for the other devices on it (end of the step)."""
        for lead, dev in self._others_of_leads():
            self.rt.record(dev.stream, dev.done)
            self.rt.wait(lead.stream, dev.done)

    def run_subgraph(self, k: int) -> None:
        for d, steps in enumerate(self.ex.steps[k]):
            if steps:
                self.ex.run_steps(d, steps)

    def body(self) -> None:
        self.fork()
        for k in range(len(self.ex.plan.subgraphs)):
            self.run_subgraph(k)
            self.ex.allreduce(k)
            self.ex.run_transfers(k)
        self.join()

    def run(self) -> None:
        """One step: inputs to the devices, then the graph (captured on the second run)."""
        self.copy_inputs()
        if self.graph is None and self._should_capture():
            self._capture()
        if self.graph is not None:
            self._replay()
        else:
            self.body()
        self.runs += 1

    # ---------------------------------------------------------------- CUDA graphs
    def _should_capture(self) -> bool:
        return self.ex.backend.cuda_graphs and self.ex.capturable and self.runs >= 1

    def _single_gpu(self) -> bool:
        return len(self.ex.leads) == 1

    def _primary_and_others(self):
        """The lead device of the first GPU (whose stream captures and launches a whole-step
        graph) and the lead devices of the other GPUs."""
        leads = [self.devs[d] for d in self.ex.leads.values()]
        return leads[0], leads[1:]

    def _capture(self) -> None:
        backend = self.ex.backend
        if self._single_gpu() or backend.multi_gpu_graphs == "whole":
            try:
                self.graph, self.graph_mode = self._capture_whole(), "whole"
                return
            except Exception as e:  # noqa: BLE001 - a failed capture leaves the graph mode below
                self.graph = None
                if self._single_gpu():
                    warnings.warn(f"CUDA graph capture failed ({type(e).__name__}: {e}); running eagerly",
                                  stacklevel=4)
                    backend.cuda_graphs = False
                    return
                warnings.warn(f"capturing one CUDA graph across {len(self.ex.leads)} GPUs failed "
                              f"({type(e).__name__}: {e}); using per-subgraph graph segments", stacklevel=4)
                backend.multi_gpu_graphs = "segments"
        try:
            self.graph, self.graph_mode = self._capture_segments(), "segments"
        except Exception as e:  # noqa: BLE001 - a failed capture leaves eager mode
            warnings.warn(f"CUDA graph capture failed ({type(e).__name__}: {e}); running eagerly", stacklevel=4)
            backend.cuda_graphs = False
            self.graph = None

    def _captured(self, stream, issue: Callable[[], None]) -> Any:
        """The graph of what `issue()` puts on `stream` (and the streams that join it). When
        `issue` fails the capture is ended all the same (CUDA ends an invalidated one at
        cudaStreamEndCapture; the runtime ends one left open) and that first error is raised:
        the step then runs eagerly on these streams."""
        rt = self.rt
        rt.begin_capture(stream)
        self.capturing = True
        try:
            issue()
        except BaseException:
            self.capturing = False
            try:
                rt.end_capture(stream)
            except Exception:  # noqa: BLE001 - the invalidated capture's error: the cause is raised below
                pass
            raise
        self.capturing = False
        return rt.end_capture(stream)

    def _capture_whole(self):
        rt = self.rt
        primary, others = self._primary_and_others()

        def issue() -> None:
            rt.record(primary.stream, primary.step_fork)
            for o in others:                      # the other GPUs join the capture
                with o.ctx:
                    rt.wait(o.stream, primary.step_fork)
            self.body()
            for o in others:                      # ... and are joined back before it ends
                with o.ctx:
                    rt.record(o.stream, o.step_done)
                rt.wait(primary.stream, o.step_done)
        with primary.ctx:
            return self._captured(primary.stream, issue)

    def _capture_segments(self) -> dict:
        segs = {}
        for k, per_dev in enumerate(self.ex.steps):
            for d, steps in enumerate(per_dev):
                if not steps:
                    continue
                dev = self.devs[d]
                with dev.ctx:
                    segs[(k, d)] = self._captured(dev.stream, lambda steps=steps: self._issue(steps))
        return segs

    @staticmethod
    def _issue(steps: list) -> None:
        for s in steps:
            s()

    def _replay(self) -> None:
        rt = self.rt
        if self.graph_mode == "whole":
            primary, others = self._primary_and_others()
            with primary.ctx:
                for o in others:                      # the other GPUs' input copies come first
                    rt.wait(primary.stream, o.inputs_copied)
                rt.launch_graph(self.graph, primary.stream)
                if others:                            # their next input copy waits for this step
                    rt.record(primary.stream, primary.step_done)
            for o in others:
                with o.ctx:
                    rt.wait(o.stream, primary.step_done)
            return
        self.fork()
        for k in range(len(self.ex.plan.subgraphs)):
            for d in self.ex.devices:
                dev = self.devs[d]
                g = self.graph.get((k, d))
                if g is not None:
                    with dev.ctx:
                        rt.launch_graph(g, dev.stream)
            self.ex.allreduce(k)
            self.ex.run_transfers(k)
        self.join()
