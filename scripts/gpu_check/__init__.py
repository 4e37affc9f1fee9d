"""A session that has a GPU: metatp's cupy backend checked end to end, one module per step.

    python3 scripts/gpu_check --out gpu-results.md             # from a source tree, no install
    python3 -m scripts.gpu_check --out gpu-results.md          # the same, from the tree's root
    python3 scripts/gpu_check --pytest -q -m gpu tests/cuda/   # pytest, same import mapping

Steps (each in its own try/except, so one failure does not hide the others; each prints as it
goes and the whole run stays inside --budget seconds, about 7 minutes):

0. `preflight`: yaml, gguf, numpy, CuPy, NVRTC and its headers, the GPU, a trivial RawKernel,
   NCCL, free memory, in about 10 seconds; a missing requirement stops the run there;
1. `env`: GPU name, driver and runtime versions, CuPy, NVRTC, NCCL, cuBLAS;
2. `kernels`: every CUDA kernel against numpy on fresh random inputs;
3. `model`: a synthetic GGUF with SmolLM2-135M's shapes (the real model does not travel to the
   GPU machine), logits vs the numpy backend for N=1 and N=3 virtual devices, greedy tokens;
4. `speed`: decode tokens/s eager vs CUDA graph at two KV lengths, graph replay == eager, prefill,
   N=2 / N=3 virtual devices (-sm tensor) and N=2 -sm layer against N=1; `shapes` (decode at three
   model sizes: 135M Q4_1, 1B Q8_0, 8B Q4_K with --big) under each kernel variant of `variants`
   (defaults, this round's old kernels, q8, pdl: the ones the tree's backend takes), and on the same
   engines `profile` (the 135M and 1B decode steps' kernels timed one by one); `llama_cpp`: llama.cpp on the 135M
   and 1B files beside those rows, with the ratio (built by build_llama_cpp.sh: a wheel carried in
   .whl/, or its source built there; skipped with a row saying why without it); `throughput`
   (batched-bench rows B = 1..256, pp512 / pp4096, and `metatp serve --backend cupy` with 64
   concurrent openai clients vs one after another);
5. `nccl`: a 1-rank communicator, f32 and bf16 all-reduce, eagerly and inside a CUDA graph;
6. `mpi`: one GPU rank under mpiexec with NCCL, in a subprocess bounded in time.

On a GPU each part after the environment rows (kernels; model with speed; each model size; llama_cpp;
throughput; nccl; mpi) runs in a process of its own (`isolate`, `--isolate`): a kernel fault that
poisons a process's CUDA context costs that part's rows, not the run's.

`report` holds the table (printed, and written to --out with a JSON copy); `config` the run's
settings and the engines; `plan` the estimated seconds of each section (`--plan`: sizes a call); `carry` what travels to the GPU machine (docs/gpu-results.md);
`build_llama_cpp.sh` and `slim_wheel.py` make llama.cpp's wheel.
``--emulate`` is a dry run without a GPU: the same steps on the CPU kernel emulator with a tiny
model, to catch mistakes before a GPU session spends its time on them.
"""
