"""One rank of an MPI run, started by tests/mpi/test_mpi.py as `mpiexec -n N python tests/support/mpi_worker.py ...`.

It is `LLM(..., backend="numpy", distributed="mpi")` on every rank (the API detects the world,
checks the layout and the model file, and builds this rank's backend: device `rank` only, MPI
all-reduce), run as `metatp.testing.mpi_rank.run_prompt` runs it: a prompt scored at every
position, then greedy tokens with rank 0's token on every rank. Rank 0 writes the logits and
tokens; every rank writes its memory facts. Test-only extras: a rank that fails mid-generation
(--fail-rank), mpi4py hidden (--no-mpi4py), the NCCL bootstrap (--nccl-uid, --nccl-allreduce)
and the API with rank-dependent prompts and seeds (--api).

Errors follow the CLI's rules under MPI (`finish_error`): one line, printed once (by rank 0
when every rank found it, by the rank that had it otherwise), then exit 1 or MPI_Abort of
every rank.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402


class _NoMpi4py:
    """An import hook under which mpi4py is not installed (the "mpi4py missing" case)."""

    def find_spec(self, name, path=None, target=None):
        if name == "mpi4py" or name.startswith("mpi4py."):
            raise ImportError(f"No module named {name!r}")
        return None


def _trim() -> None:
    """Give freed heap pages back to the OS before reading RSS (glibc keeps them otherwise)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, help="GGUF path; '{rank}' is replaced by the rank")
    ap.add_argument("--devices", type=int, default=None)
    ap.add_argument("-ts", "--tensor-split", default=None)
    ap.add_argument("--n-ctx", type=int, default=256)
    ap.add_argument("--prompt", default="1,2,3,4,5,6,7,8", help="token ids, comma separated")
    ap.add_argument("--n-gen", type=int, default=32)
    ap.add_argument("--out", default=None, help="folder for rank 0's logits and every rank's memory facts")
    ap.add_argument("--fail-rank", type=int, default=None, help="this rank raises after --fail-after steps")
    ap.add_argument("--fail-after", type=int, default=2)
    ap.add_argument("--no-mpi4py", action="store_true", help="run as if mpi4py were not installed")
    ap.add_argument("--nccl-uid", action="store_true", help="only broadcast an NCCL unique id and check it")
    ap.add_argument("--nccl-allreduce", action="store_true", help="NCCL all-reduce smoke test on GPUs")
    ap.add_argument("--api", action="store_true",
                    help="drive metatp.api.LLM(distributed='mpi') with rank-dependent prompts and seeds")
    args = ap.parse_args(argv)
    if args.no_mpi4py:
        sys.meta_path.insert(0, _NoMpi4py())

    from metatp.backends.distributed import finish_error, init_world
    from metatp.ir.errors import MetatpError

    try:
        if args.api:
            return _api(args)
        if args.nccl_uid or args.nccl_allreduce:
            return _nccl(init_world("mpi"), args)
        return _run(args)
    except MetatpError as e:
        return finish_error(e, f"metatp: error: {e}", 1)


def _run(args) -> int:
    from metatp.api import LLM
    from metatp.backends.distributed import launched_rank, process_memory
    from metatp.testing.mpi_rank import run_prompt, write_result

    path = args.model.replace("{rank}", str(launched_rank() or 0))
    llm = LLM(path, n_ctx=args.n_ctx, backend="numpy", n_devices=args.devices, tensor_split=args.tensor_split,
              distributed="mpi")
    rank = llm.world.rank
    if args.fail_rank == rank:
        _fail_in_generation(llm.engine, rank, args.fail_after)
    _trim()
    before = process_memory()
    logits, tokens = run_prompt(llm, [int(x) for x in args.prompt.split(",")], args.n_gen)
    _trim()
    after = process_memory()
    if args.out:
        out = Path(args.out)
        facts = _memory_facts(llm.engine, llm.backend, rank, before, after)
        (out / f"mem{rank}.json").write_text(json.dumps(facts))
        write_result(out, rank, logits, tokens)
    return 0


def _fail_in_generation(engine, rank: int, after: int) -> None:
    """This rank's engine raises where generation step `after` would run (after the prompt's
    scoring pass and the generation's prefill), while the other ranks wait in its collective."""
    run, calls = engine.run, [0]

    def failing(items):
        calls[0] += 1
        if calls[0] == 2 + after:
            raise RuntimeError(f"rank {rank} fails on purpose at step {after}")
        return run(items)
    engine.run = failing


API_PROMPTS = [[1, 17, 42, 99, 7], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22], [250, 3]]


def _api(args) -> int:
    """The API under MPI: several prompts in one continuous batch, greedy and sampled. Ranks other
    than 0 are given other prompts and seeds: rank 0's must win on every rank (prompt ids where a
    request enters, sampled tokens per step), or the ranks drift apart or hang. Every rank writes
    what it got."""
    from metatp.api import LLM
    from metatp.backends.distributed import launched_rank
    from metatp.sampling import SamplingParams

    rank = launched_rank() or 0
    llm = LLM(args.model, n_ctx=args.n_ctx, tensor_split=args.tensor_split, seed=rank, distributed="mpi")
    prompts = API_PROMPTS if rank == 0 else [[3] * (4 + rank + i) for i in range(len(API_PROMPTS))]
    greedy = llm.generate(prompts, SamplingParams(max_tokens=args.n_gen, temperature=0))
    sampled = llm.generate(prompts, SamplingParams(max_tokens=args.n_gen, temperature=1.0, seed=100 + rank, n=2))
    facts = {"rank": llm.world.rank, "size": llm.world.size,
             "greedy": [o.outputs[0].token_ids for o in greedy],
             "sampled": [[c.token_ids for c in o.outputs] for o in sampled],
             "passes": llm.engine.passes}
    if args.out:
        (Path(args.out) / f"api{llm.world.rank}.json").write_text(json.dumps(facts))
    return 0


def _memory_facts(engine, backend, rank: int, before: dict, after: dict) -> dict:
    """What this rank holds, what the memory plans predict for its device, and its RSS."""
    from metatp.ir.models import BatchSpec, build_graph
    from metatp.ir.tensor import Flag
    from metatp.passes.memory import plan_memory
    from metatp.tools.dump import raw_weight_bytes

    n_ctx = engine.n_ctx
    decode = engine.compile(build_graph(engine.tensors, BatchSpec(1, n_ctx, 1)))
    dump = plan_memory(decode, raw_weight_bytes, n_ctx)                     # what `metatp dump` prints
    ours = plan_memory(decode, backend.weight_bytes, n_ctx, backend.workspace_bytes(decode))
    leaves = [t for t in decode.graph.leaves if t.flags & (Flag.WEIGHT | Flag.KV_CACHE)]
    held = {d: sum(1 for t in leaves if t in backend.leaf[d]) for d in range(backend.n)}
    return {"rank": rank, "allocated": backend.allocated_bytes(), "held_leaves": held, "n_leaves": len(leaves),
            "dump_weights": dump.weights[rank], "dump_kv": dump.kv[rank], "dump_compute": dump.compute[rank],
            "plan_weights": ours.weights[rank], "plan_kv": ours.kv[rank], "plan_compute": ours.compute[rank],
            "rss_before": before, "rss_after": after,
            "allreduce_calls": backend.collective.calls, "allreduce_seconds": backend.collective.seconds}


def _nccl(world, args) -> int:
    """The NCCL bootstrap: the unique id over MPI (no GPU needed), or a real all-reduce on GPUs."""
    from metatp.backends.cuda.nccl import NcclCollective, nccl_unique_id

    if args.nccl_uid:
        uid = nccl_unique_id(world.comm)
        ids = world.comm.allgather(bytes(uid))
        assert len(ids[0]) == 128 and all(i == ids[0] for i in ids), "ranks got different NCCL ids"
        if world.rank == 0:
            print(f"nccl uid agreed on {world.size} ranks", flush=True)
        return 0
    import cupy

    coll = NcclCollective(world.comm)
    n = 1 << 16
    want = sum(range(1, world.size + 1))
    for wire, tol in (("f32", 0.0), ("bf16", 1e-2)):
        coll.wire = wire
        buf = cupy.full(n, world.rank + 1, cupy.float32)
        coll.allreduce([buf], [True] * world.size)
        got = cupy.asnumpy(buf)
        assert np.allclose(got, want, rtol=tol), (wire, got[:4])
    buf = cupy.full(1024, world.rank + 1, cupy.float32)
    if world.rank == 0:
        buf.fill(np.nan)                                   # an inactive rank's garbage counts as zero
    coll.allreduce([buf], [r != 0 for r in range(world.size)])
    assert np.all(cupy.asnumpy(buf) == want - 1), cupy.asnumpy(buf)[:4]
    coll.close()
    if world.rank == 0:
        print(f"nccl all-reduce ok on {world.size} rank(s), GPU {coll.gpu}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
