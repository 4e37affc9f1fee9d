"""One rank of `mpiexec -n N python tests/mpi/embed_rank.py MODEL SPLIT_MODE OUT` (tests/mpi/test_mpi_embed.py).

Every rank calls `LLM.embed` and `create_embedding` alike (ranks > 0 with other inputs: rank 0's
decide the results), then a greedy generation (the lm head is uploaded after the embedding plans).
Every rank writes what it got to OUT/rank{r}.json.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

INPUTS = [[5, 17, 200, 3, 99, 42, 7], [9, 8, 7], "hello world"]


def main(path: str, split_mode: str, out: str) -> int:
    from metatp.api import LLM
    from metatp.backends.distributed import launched_rank
    from metatp.sampling import SamplingParams

    rank = launched_rank() or 0
    llm = LLM(path, n_ctx=128, backend="numpy", split_mode=split_mode, distributed="mpi", max_num_seqs=4)
    mine = INPUTS if rank == 0 else [[3] * (4 + rank), "other"]
    vectors = llm.embed(mine)
    answer = llm.create_embedding(mine[-1])
    tokens = llm.generate([[1, 17, 42]], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    facts = {"vectors": vectors, "answer": answer, "tokens": tokens[0].outputs[0].token_ids,
             "used": llm.engine.cells.n_used}
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(facts, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
