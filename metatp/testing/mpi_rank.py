"""One GPU rank under mpiexec: `LLM(backend="cupy", distributed="mpi")` owning device `rank`,
NCCL between the ranks; and the prompt run every rank test driver shares (`run_prompt`).

    mpiexec -n 2 python -m metatp.testing.mpi_rank --model m.gguf -ts 1,1 --emulate --out DIR
    mpiexec -n 1 python scripts/gpu_check --mpi-rank --smoke --model m.gguf --out DIR   (on a GPU)

Started by `tests/mpi/test_mpi_gpu.py` (emulated: `EmuRuntime` on every rank, its NCCL stand-in
`mpi_nccl` summing over MPI) and by `scripts/gpu_check`'s MPI+NCCL step (a real GPU and NCCL).
The API does the wiring (the world, the layout and the model check, the local GPU, the NCCL
unique id over MPI); this module adds what the checks read: `run_prompt` scores the prompt at
every position, then generates greedy tokens (rank 0 leads both calls, every rank returns its
results: `metatp.mpi_calls`). Rank 0 writes
`result.npz` (logits, tokens); every rank writes `rank{r}.json` (its GPU, what the communicator
was handed, the graph mode). `--smoke` (one rank) also runs the single-process cupy backend on
the same prompt and the collective's step eagerly and inside a CUDA graph, and writes
`smoke.json`. `tests/support/mpi_worker.py` drives the numpy backend through `run_prompt` too.

Errors follow the CLI's rules under MPI (`finish_error`): one line `metatp: error: ...`,
printed once, then exit 1 or MPI_Abort of every rank.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402

__all__ = ["main", "parse_args", "run_prompt", "write_result"]


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("-ts", "--tensor-split", default=None)
    ap.add_argument("--n-ctx", type=int, default=128)
    ap.add_argument("--prompt", default="1,17,42,99,7,250,3,64", help="token ids, comma separated")
    ap.add_argument("--n-gen", type=int, default=8)
    ap.add_argument("--out", default=None, help="folder for rank 0's logits and every rank's facts")
    ap.add_argument("--emulate", action="store_true", help="EmuRuntime (CPU kernel emulator, NCCL over MPI)")
    ap.add_argument("--emu-gpus", type=int, default=None, help="emulated GPUs per machine (default: one per rank)")
    ap.add_argument("--kv-dtype", default=None)
    ap.add_argument("--matmul-dtype", default=None)
    ap.add_argument("--wire", default=None)
    ap.add_argument("--no-graphs", action="store_true", help="cuda_graphs=False (eager)")
    ap.add_argument("--smoke", action="store_true", help="also the single-process run and the collective's step")
    ap.add_argument("--check-collective", action="store_true",
                    help="the collective's step eagerly and in a graph (f32, bf16, an inactive rank 0)")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    from metatp.backends.distributed import finish_error
    from metatp.ir.errors import MetatpError

    try:
        return _run(args)
    except MetatpError as e:
        return finish_error(e, f"metatp: error: {e}", 1)


def run_prompt(llm, prompt: list[int], n_gen: int) -> tuple[np.ndarray, list[int]]:
    """What every rank runs: the prompt scored (logits at every position), then `n_gen` greedy
    tokens generated from it (rank 0 runs both calls, the other ranks follow its steps and get
    its logits and tokens back, `metatp.mpi_calls`)."""
    from metatp.sampling import SamplingParams

    logits = llm.score(prompt)
    out = llm.generate([prompt], SamplingParams(max_tokens=n_gen, temperature=0.0, ignore_eos=True))
    return logits, list(out[0].outputs[0].token_ids)


def write_result(out: Path, rank: int, logits: np.ndarray, tokens: list[int]) -> None:
    """Rank 0's `result.npz`: the prompt's logits and the greedy tokens."""
    if rank == 0:
        np.savez(out / "result.npz", logits=logits, tokens=np.array(tokens))


def _runtime(args):
    """EmuRuntime with one emulated GPU per rank (or --emu-gpus) under --emulate, else None (CuPy)."""
    if not args.emulate:
        return None
    from metatp.backends.distributed import init_world
    from metatp.testing import EmuRuntime

    return EmuRuntime(n_gpus=args.emu_gpus if args.emu_gpus is not None else init_world("mpi").size)


def _options(args) -> dict:
    opts = {"kv_dtype": args.kv_dtype, "matmul_dtype": args.matmul_dtype, "wire": args.wire}
    opts = {k: v for k, v in opts.items() if v is not None}
    if args.no_graphs:
        opts["cuda_graphs"] = False
    return opts


def _run(args) -> int:
    from metatp.api import LLM

    # `runtime` is the device-API seam `backends.create_backend(..., world=...)` takes for cupy (EmuRuntime here)
    runtime = _runtime(args)
    options = _options(args) | ({"runtime": runtime} if runtime is not None else {})
    llm = LLM(args.model, n_ctx=args.n_ctx, backend="cupy", tensor_split=args.tensor_split, distributed="mpi",
              backend_options=options)
    world, backend = llm.world, llm.backend
    prompt = [int(x) for x in args.prompt.split(",")]
    t0 = time.perf_counter()
    logits, tokens = run_prompt(llm, prompt, args.n_gen)
    seconds = time.perf_counter() - t0
    facts = _facts(world, backend, seconds)
    if args.check_collective or args.smoke:
        facts["collective"] = _collective_steps(world)
    smoke = _smoke(args, llm.model, llm.layout, prompt, logits, tokens) if args.smoke else None
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"rank{world.rank}.json").write_text(json.dumps(facts))
        write_result(out, world.rank, logits, tokens)
        if world.rank == 0 and smoke is not None:
            (out / "smoke.json").write_text(json.dumps(smoke))
    backend.collective.close()
    return 0


def _facts(world, backend, seconds: float) -> dict:
    """What this rank's backend and communicator were given (the test checks the wiring)."""
    coll = backend.collective
    info = backend.describe()
    dev = backend.devices[world.rank]
    execs = list(backend._executables.values())
    facts = {"rank": world.rank, "size": world.size, "local_rank": world.local_rank, "gpu": dev.gpu,
             "owned": list(info.owned), "strategy": info.allreduce, "stream": getattr(dev.stream, "ptr", None),
             "graph_modes": sorted({str(ex.graph_mode) for ex in execs}), "seconds": seconds,
             "held": {d: len(backend.leaf[d]) for d in range(backend.n)}, "allocated": backend.allocated_bytes()}
    comm = coll.nccl
    if hasattr(comm, "calls"):          # the MPI stand-in records what NCCL was handed
        facts["nccl_calls"] = len(comm.calls)
        facts["nccl_streams"] = sorted(comm.streams)
        facts["nccl_in_place"] = all(c[0] == c[1] for c in comm.calls)
    return facts


def _smoke(args, model, layout, prompt, logits, tokens) -> dict:
    """One rank: the same prompt on the single-process cupy backend driven directly (greedy
    tokens and logits compared with the rank's)."""
    from metatp.backends.registry import backend_entry
    from metatp.engine import Engine

    ref = Engine(model, args.n_ctx, layout, backend_entry("cupy").create(layout, _options(args), runtime=_runtime(args)))
    want = ref.forward(prompt, all_logits=True)
    ref_tokens, last = [], want[-1]
    for _ in range(args.n_gen):
        ref_tokens.append(int(np.argmax(last)))
        last = ref.forward([ref_tokens[-1]])
    diff = float(np.abs(np.asarray(logits, np.float64) - want).max() / max(np.abs(want).max(), 1e-30))
    return {"tokens": tokens, "ref_tokens": ref_tokens, "same_tokens": tokens == ref_tokens,
            "logits_rel_err": diff}


def _collective_steps(world) -> dict:
    """The world's NCCL collective on a fresh stream: f32 and bf16 wire, eager and captured
    (every rank holds x: the sum is size * x, exact in both wire types); and rank 0 inactive
    with NaN in its buffer (it counts as zero). Every rank must call this (collective)."""
    from metatp.testing.oracles import f32_to_bf16_bits

    coll = world.collective("nccl")
    rt, wire_was = coll.rt, coll.wire
    res = {}
    x = (np.arange(40000, dtype=np.float32) - 20000.0) / 7.0
    bf = (f32_to_bf16_bits(x).astype(np.uint32) << 16).view(np.float32)
    for wire, want in (("f32", x), ("bf16", bf)):
        coll.wire = wire
        stream = rt.new_stream(coll.gpu)
        for how in ("eager", "graph"):
            with rt.device(coll.gpu):
                buf = rt.upload(x)
            rt.device_synchronize(coll.gpu)
            step = coll.prepare_allreduce([buf], [True] * world.size, stream=stream)
            with rt.context(coll.gpu, stream):
                if how == "eager":
                    step()
                else:
                    rt.begin_capture(stream)
                    try:
                        step()
                    finally:
                        graph = rt.end_capture(stream)
                    rt.launch_graph(graph, stream)
            rt.synchronize(stream)
            got = rt.download(buf)
            res[f"{wire} {how}"] = bool(np.array_equal(got, want * np.float32(world.size)))
    coll.wire = "f32"
    stream = rt.new_stream(coll.gpu)
    with rt.device(coll.gpu):
        buf = rt.upload(np.full(1024, np.nan, np.float32) if world.rank == 0 else x[:1024])
    rt.device_synchronize(coll.gpu)
    coll.prepare_allreduce([buf], [r != 0 for r in range(world.size)], stream=stream)()
    rt.synchronize(stream)
    res["inactive rank 0"] = bool(np.array_equal(rt.download(buf), x[:1024] * np.float32(world.size - 1)))
    coll.wire = wire_was
    return res


if __name__ == "__main__":
    raise SystemExit(main())
