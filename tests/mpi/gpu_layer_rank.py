"""One GPU rank of `mpiexec -n N python tests/mpi/gpu_layer_rank.py ...` (tests/mpi/test_mpi_gpu_layer.py):
the cupy backend under -sm layer or -sm layer,tensor on an emulated GPU (`EmuRuntime`, one per
rank), NCCL between the ranks being the MPI stand-in (`metatp.testing.mpi_nccl`: its send / recv
and sub-communicators really move the bytes over MPI).

Rank r owns device r: its layers' weights and KV cache, ncclSend of the hidden state to the next
stage's rank, ncclRecv from the previous one, and (layer,tensor) its group's all-reduces on the
group's own communicator. Rank 0 writes `result.npz`; every rank writes `rank{r}.json`: the
point-to-point calls its communicator was handed, the all-reduce calls, the graph modes.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("-ts", "--tensor-split", default=None)
    ap.add_argument("-sm", "--split-mode", default="layer")
    ap.add_argument("--prompt", default="1,17,42,99,7,250,3,64")
    ap.add_argument("--n-gen", type=int, default=4)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)

    from metatp.api import LLM
    from metatp.backends.distributed import finish_error, init_world
    from metatp.ir.errors import MetatpError
    from metatp.testing import EmuRuntime
    from metatp.testing.mpi_rank import run_prompt, write_result

    try:
        options = {"runtime": EmuRuntime(n_gpus=init_world("mpi").size), "kv_dtype": "f32", "matmul_dtype": "f32"}
        llm = LLM(args.model, n_ctx=64, backend="cupy", split_mode=args.split_mode, tensor_split=args.tensor_split,
                  distributed="mpi", backend_options=options)
        logits, tokens = run_prompt(llm, [int(x) for x in args.prompt.split(",")], args.n_gen)
    except MetatpError as e:
        return finish_error(e, f"metatp: error: {e}", 1)
    rank, backend = llm.world.rank, llm.backend
    coll = backend.collective
    groups = [g for g in coll.groups.values() if hasattr(g, "nccl")]
    facts = {"rank": rank, "split_mode": llm.layout.split_mode, "held": {d: len(backend.leaf[d]) for d in range(backend.n)},
             "p2p": [list(c[:2]) for c in coll.nccl.p2p], "p2p_streams": sorted({c[4] for c in coll.nccl.p2p}),
             "stream": backend.devices[rank].stream.ptr, "world_allreduces": len(coll.nccl.calls),
             "group_allreduces": sum(len(g.nccl.calls) for g in groups),
             "group_sizes": [g.size for g in groups],
             "graph_modes": sorted({str(ex.graph_mode) for ex in backend._executables.values()})}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps(facts))
    write_result(out, rank, logits, tokens)
    coll.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
