"""One rank of `mpiexec -n N python tests/mpi/layer_rank.py ...` (tests/mpi/test_mpi_layer.py): -sm layer
(or -sm layer,tensor, tests/mpi/test_mpi_layer_tensor.py).

`LLM(..., backend="numpy", split_mode="layer", distributed="mpi")` on every rank: rank r owns
device r, holds its layers' weights and KV cache only and sends the hidden state to the next
rank. It runs `metatp.testing.mpi_rank.run_prompt` (the prompt scored at every position, then
greedy tokens). Rank 0 writes `result.npz`; every rank writes `rank{r}.json`: the layers whose
weights and KV cache it holds, the bytes it holds per device, and its sends / receives.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")


def _held(backend, rank: int) -> dict:
    """The layers (blk.N) whose weights / KV cache this rank stores data for, and the non-layer weights."""
    from metatp.ir.tensor import Flag

    weights, kv, other = set(), set(), []
    for t, a in backend.leaf[rank].items():
        if not a.size:
            continue
        if t.flags & Flag.KV_CACHE:
            kv.add(t.layer)
        elif t.flags & Flag.WEIGHT:
            if t.layer is not None:
                weights.add(t.layer)
            else:
                other.append(t.name)
    return {"weight_layers": sorted(weights), "kv_layers": sorted(kv), "other_weights": sorted(other)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("-ts", "--tensor-split", default=None)
    ap.add_argument("--n-ctx", type=int, default=128)
    ap.add_argument("--prompt", default="1,17,42,99,7,250,3,64")
    ap.add_argument("--n-gen", type=int, default=16)
    ap.add_argument("--cache-type", default="f32")
    ap.add_argument("--out", required=True)
    ap.add_argument("-sm", "--split-mode", default="layer", help="layer | layer,tensor (-ts: a tensor group's shares)")
    args = ap.parse_args(argv)

    from metatp.api import LLM
    from metatp.backends.distributed import finish_error
    from metatp.ir.errors import MetatpError
    from metatp.testing.mpi_rank import run_prompt, write_result

    try:
        llm = LLM(args.model, n_ctx=args.n_ctx, backend="numpy", split_mode=args.split_mode, tensor_split=args.tensor_split,
                  distributed="mpi", cache_type_k=args.cache_type, cache_type_v=args.cache_type)
        logits, tokens = run_prompt(llm, [int(x) for x in args.prompt.split(",")], args.n_gen)
    except MetatpError as e:
        return finish_error(e, f"metatp: error: {e}", 1)
    rank, backend = llm.world.rank, llm.backend
    link = backend.collective.send_recv
    facts = {"rank": rank, "size": llm.world.size, "split_mode": llm.layout.split_mode, **_held(backend, rank),
             "leaf_bytes": backend.leaf_bytes(), "copies": link.calls, "copied_bytes": link.bytes,
             "allreduces": backend.collective.calls}
    out = Path(args.out)
    (out / f"rank{rank}.json").write_text(json.dumps(facts))
    write_result(out, rank, logits, tokens)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
