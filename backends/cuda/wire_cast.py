"""One device's part of an all-reduce around the sum itself: the zero fill of a device that
computed nothing, and the f32 <-> bf16 conversions of a BF16 wire (`collectives.wire`).

Both all-reduces on CUDA devices use it: `collective.DeviceCollective` (the GPUs of one
process) and `nccl.NcclCollective` (one GPU per MPI rank). It sits apart from both so that
neither imports the other for it.
"""

from __future__ import annotations

from typing import Any

from metatp.backends.cuda import kernels as ck
from metatp.backends.cuda.device_ops import Memset
from metatp.backends.cuda.launch import device_ptr, recording

__all__ = ["wire_steps"]


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
