"""Step 5: a 1-rank NCCL communicator, f32 and bf16 all-reduce, eagerly and inside a CUDA graph
(GPU runs only: the emulator has no NCCL)."""

from __future__ import annotations

import numpy as np

from scripts.gpu_check.report import Report


def section_nccl(rep: Report) -> None:
    import cupy as cp

    from metatp.backends.cuda.runtime import CupyRuntime

    rt = CupyRuntime()
    if rt.nccl_module() is None:
        rep.add("nccl", "available", "no (cupy cannot load NCCL)", None)
        return
    comms = rt.nccl_comms([0])
    stream = rt.new_stream(0)
    x = cp.arange(4096, dtype=cp.float32)
    ref = np.arange(4096, dtype=np.float32)
    bits = (ref.view(np.uint32) >> 16).astype(np.uint16)
    b = cp.asarray(bits)
    cp.cuda.runtime.deviceSynchronize()
    with stream:
        rt.nccl_allreduce([(comms[0], x.data.ptr, x.size, "f32", stream)])
        rt.nccl_allreduce([(comms[0], b.data.ptr, b.size, "bf16", stream)])
    stream.synchronize()
    ok = np.array_equal(cp.asnumpy(x), ref) and np.array_equal(cp.asnumpy(b), bits)
    rep.add("nccl", "1-rank all-reduce f32 + bf16", "values unchanged" if ok else "WRONG values", ok)
    try:
        with stream:
            stream.begin_capture()
            try:
                rt.nccl_allreduce([(comms[0], x.data.ptr, x.size, "f32", stream)])
            finally:
                g = stream.end_capture()
            g.launch(stream=stream)
        stream.synchronize()
        ok = np.array_equal(cp.asnumpy(x), ref)
        rep.add("nccl", "1-rank all-reduce inside a CUDA graph", "ok" if ok else "WRONG values", ok)
    except Exception as e:  # noqa: BLE001
        rep.fail("nccl", "all-reduce inside a CUDA graph", e)
