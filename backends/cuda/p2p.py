"""Copies between devices under -sm layer: the hidden state handed from one stage to the next.

In one process (`DeviceCopy`) a copy is one `cudaMemcpyAsync` (kind Default: a peer copy
between two GPUs with UVA, a plain device copy between virtual devices on one GPU) issued on
the destination's stream, ordered by two events: the destination waits for the source's
`sent` (the value is computed) before copying, and the source waits for the destination's
`received` before it runs on, so its next write of that buffer (the next step's) cannot
overtake the copy. Records, waits and the copy are all capturable, so a decode step with
copies is still one CUDA graph (the copy becomes a memcpy node, the events its edges).

Between processes (`NcclSendRecv`, one GPU per MPI rank) a copy is `ncclSend` on the source
rank's device stream and `ncclRecv` into the destination's own buffer of the value on its
device stream: the stream orders it after the value is computed and before anything reads
it, and NCCL's point-to-point calls are captured into the rank's step graph like its
all-reduces. Every rank posts its copies in plan order (`collectives.p2p`), so the earliest
unfinished copy always has both ends posted. The logits, on the last stage's rank, reach the
other ranks on the host (`broadcast`, over MPI), as `allgather` does for split logits.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from metatp.backends.collectives.base import Step
from metatp.backends.collectives.p2p import SendRecv
from metatp.backends.cuda.device_ops import Memcpy, Record, Wait
from metatp.backends.cuda.launch import device_ptr
from metatp.ir.errors import UnsupportedOpError
from metatp.ir.tensor import Tensor

if TYPE_CHECKING:
    from metatp.backends.cuda.executable import CupyExecutable

__all__ = ["DeviceCopy", "NcclSendRecv"]

#: NCCL's element type of the buffers a layer split hands on (nccl.h: ncclFloat32, ncclFloat16)
_NCCL_TYPES = {np.dtype(np.float32): 7, np.dtype(np.float16): 6}


def _flat(a: Any, what: str) -> Any:
    if not a.flags.c_contiguous:
        raise UnsupportedOpError(f"cupy backend: the copied value {what} is not contiguous")
    return a


class DeviceCopy:
    """One copy of a node's buffer from device `src` to device `dst` of this process: steps on
    both devices' streams, run in issue order (`ex.run_steps`)."""

    def __init__(self, ex: CupyExecutable, node: Tensor, src: int, dst: int) -> None:
        a, b = ex.devs[src], ex.devs[dst]
        name = node.name
        sbuf = _flat(ex.arrays[src][node], repr(name))
        dbuf = _flat(ex.arrays[dst][node], repr(name))
        if sbuf.nbytes != dbuf.nbytes or sbuf.dtype != dbuf.dtype:
            raise UnsupportedOpError(f"cupy backend: copy of {name!r} from device {src} ({sbuf.dtype}, {sbuf.nbytes} "
                                     f"bytes) to device {dst} ({dbuf.dtype}, {dbuf.nbytes} bytes) differ")
        rt = ex.rt
        self.ex = ex
        self.src, self.dst, self.nbytes = src, dst, int(dbuf.nbytes)
        self.steps: list[tuple[int, list]] = [
            (src, [Record(rt, a.stream, a.sent)]),
            (dst, [Wait(rt, b.stream, a.sent), Memcpy(rt, device_ptr(dbuf), device_ptr(sbuf), self.nbytes, b.stream),
                   Record(rt, b.stream, b.received)]),
            (src, [Wait(rt, a.stream, b.received)]),
        ]

    def __call__(self) -> None:
        for d, steps in self.steps:
            self.ex.run_steps(d, steps)


class NcclSendRecv(SendRecv):
    """`collectives.p2p.SendRecv` between GPU ranks: ncclSend / ncclRecv on the device stream
    (rank = device), over the world's NCCL communicator of `coll` (`nccl.NcclCollective`).
    `calls` / `bytes` count the copies this rank issued (eagerly or into a capture; a replayed
    graph runs its copies again without passing here)."""

    def __init__(self, coll: Any) -> None:
        self.coll = coll
        self.calls = 0
        self.bytes = 0

    def _check(self, buf: Any, peer: int, what: str) -> tuple[int, int]:
        size, rank = self.coll.size, self.coll.rank
        if not 0 <= int(peer) < size or int(peer) == rank:
            raise ValueError(f"{what}: device {peer} is not another rank of a world of {size}")
        code = _NCCL_TYPES.get(np.dtype(buf.dtype))
        if code is None:
            raise UnsupportedOpError(f"cupy backend: {what} of a {buf.dtype} buffer between ranks")
        _flat(buf, f"({what} to/from rank {peer})")
        return code, int(buf.size)

    def _step(self, kind: str, buf: Any, peer: int, stream: Any) -> Step:
        coll, rt = self.coll, self.coll.rt
        code, count = self._check(buf, peer, kind)
        st = stream if stream is not None else coll.default_stream()
        call = (coll.nccl, device_ptr(buf), count, code, int(peer), st)
        ctx = rt.context(coll.gpu, st)
        nbytes = int(buf.nbytes)
        issue = rt.nccl_send if kind == "send" else rt.nccl_recv

        def step() -> None:
            if count:
                with ctx:
                    issue(*call)
            self.calls += 1
            self.bytes += nbytes
        return step

    def prepare_send(self, buf: Any, dst: int, stream: Any = None) -> Step:
        """A step sending this rank's device `buf` to rank `dst` on `stream`."""
        return self._step("send", buf, dst, stream)

    def prepare_recv(self, buf: Any, src: int, stream: Any = None) -> Step:
        """A step receiving rank `src`'s value into this rank's device `buf` on `stream`."""
        return self._step("recv", buf, src, stream)

    def broadcast(self, buf: np.ndarray, root: int) -> None:
        """A host buffer of rank `root` on every rank (over MPI: what the host reads)."""
        self.coll.host().send_recv.broadcast(buf, root)
