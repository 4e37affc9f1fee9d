"""The numpy backend: N devices simulated in one process, on the CPU.

- `backend`: `NumpyBackend`, the storage policy (which weights stay as codes, f16/bf16 or f32);
- `executable`: `NumpyExecutable`, the node-major runner and the batching of compiled calls;
- `codes`: the int8-code weight format the compiled kernels read (`AffineWeight`);
- `kernels/`: the op builders (one closure per node), by op family, with the `KERNELS` table;
- `native/`: the ctypes face of the C kernels in `backends/csrc/`, by kernel family.
"""
