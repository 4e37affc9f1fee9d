"""Test support, shipped apart from the backends so `python -m metatp.tools.gpu_check --emulate` works installed.

- `cuda_emulator`: metatp's CUDA kernels compiled as host C++ (a kernel engine for
  `launch.using`), so launch contracts and kernel logic are checked on a CPU;
- `emulated_runtime`: `EmuRuntime`, the CUDA backend's device API on the CPU: the one seam,
  ``CupyBackend(layout, runtime=EmuRuntime())``;
- `oracles`: the float64 references; `kernel_checks`: one check module per kernel family;
- `synth`: small synthetic GGUF models written with `gguf.GGUFWriter` (the tests' model factory).

Production modules never import this package.
"""

from metatp.testing.cuda_emulator import Emulator, emulator_available
from metatp.testing.emulated_runtime import EmuRuntime

__all__ = ["Emulator", "emulator_available", "EmuRuntime"]
