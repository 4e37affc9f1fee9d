"""Test support, not installed with the wheel: the tests and the workshop scripts (scripts/) import it from the tree.

- `cuda_emulator`: metatp's CUDA kernels compiled as host C++ (a kernel engine for
  `launch.using`), so launch contracts and kernel logic are checked on a CPU;
- `emulated_runtime`: `EmuRuntime`, the CUDA backend's device API on the CPU: the one seam,
  ``CupyBackend(layout, runtime=EmuRuntime())``; `emulated_faults`: the device faults its
  `inject` raises (out of memory, a failed launch, an NCCL error), as the libraries would;
- `oracles`: the float64 references; `kernel_checks`: one check module per kernel family;
- `synth`: small synthetic GGUF models written with `gguf.GGUFWriter` (the tests' model factory);
  `gguf_edit`: a GGUF read into parts, changed and written back (`read_parts` / `write_parts`);
- `compare`: two engines along one teacher-forced token path (`teacher_forced`);
- `mpi_rank`: one GPU rank under mpiexec through `LLM(distributed="mpi")`, and the prompt run
  every rank driver shares (`run_prompt`); `mpi_nccl`: the NCCL stand-in that sums over MPI.

Production modules never import this package.
"""

from metatp.testing.cuda_emulator import Emulator, emulator_available
from metatp.testing.emulated_runtime import EmuRuntime

__all__ = ["Emulator", "emulator_available", "EmuRuntime"]
