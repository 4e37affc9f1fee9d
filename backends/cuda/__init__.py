"""The CUDA backend (CuPy), split by responsibility along the ``cuda/*.cu`` kernel families.

- `runtime`: the one device API over CuPy (devices, streams, events, memory, NVRTC modules,
  cuBLAS, NCCL calls) and the GPU probe;
- `launch`: kernel sources, `Launch` recording and the argument helpers every launcher uses;
- `kernels/<family>`: one launcher module per ``cuda/<family>.cu``;
- `backend`: `CupyBackend` (devices, peer access, how weights are stored);
- `executable`: a Plan bound to device buffers (the shared `PlanExecutor` plus CUDA memory);
- `ops` / `fusion`: what a node runs (`CUDA_OPS`) and which nodes run as one launch;
- `collective` / `nccl`: the all-reduce between subgraphs (`collective.DeviceCollective` over
  the GPUs of this process, with NCCL's `nccl.NcclGroup`; `nccl.NcclCollective` between GPU
  ranks under MPI); `capture`: streams, events and CUDA graphs; `device_ops`: the small
  callables a step list is made of.

Nothing here imports CuPy at import time. Test support (the CPU emulator of the kernels and
an emulated runtime) lives apart, in `metatp.testing`.
"""
