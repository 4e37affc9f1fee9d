"""One rank of `mpiexec -n N python tests/mpi/calls_rank.py MODEL OUT` (tests/mpi/test_mpi_calls.py).

A program every rank runs alike, through `LLM` only: generate (greedy, seeded n=2), score, a
completion, a streamed completion, two streams read in turn, a stream left after two chunks,
and a call rank 0 refuses. Ranks > 0 pass other prompts and seeds: rank 0's must decide every
result. Every rank prints its generated text (the same line on every rank) and writes what it
got to OUT/rank{r}.json (the score's logits to OUT/score{r}.npy).
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402

PROMPTS = [[1, 17, 42, 99, 7], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22], [250, 3]]
TEXT = "hello world"


def texts(chunks) -> list[str]:
    return [c["choices"][0]["text"] for c in chunks]


def main(path: str, out: str) -> int:
    from metatp.api import LLM
    from metatp.backends.distributed import launched_rank
    from metatp.ir.errors import ConfigError
    from metatp.sampling import SamplingParams

    rank = launched_rank() or 0
    llm = LLM(path, n_ctx=128, backend="numpy", tensor_split=[3] + [1] * (int(os.environ["PMI_SIZE"]) - 1),
              seed=rank, distributed="mpi", max_num_seqs=4)
    mine = PROMPTS if rank == 0 else [[3] * (4 + rank + i) for i in range(len(PROMPTS))]
    greedy = llm.generate(mine, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    sampled = llm.generate(mine, SamplingParams(max_tokens=8, temperature=1.0, seed=100 + rank, n=2))
    os.write(1, f"rank text: {ascii(greedy[0].outputs[0].text)}\n".encode())     # one write: lines stay whole
    logits = llm.score(mine[0])
    np.save(f"{out}/score{rank}.npy", logits)
    done = llm.create_completion(TEXT if rank == 0 else "other", max_tokens=6, temperature=0)
    stream = texts(llm.create_completion(TEXT if rank == 0 else "x", max_tokens=6, temperature=0, stream=True))
    a = llm.create_completion(TEXT, max_tokens=5, temperature=0, stream=True)
    b = llm.create_completion("the end" if rank == 0 else "y", max_tokens=7, temperature=0, stream=True)
    pairs = [[x["choices"][0]["text"], y["choices"][0]["text"]] for x, y in zip(a, b)]
    rest = [c["choices"][0]["text"] for c in b]            # b runs on alone after a ended
    left = llm.create_completion(TEXT, max_tokens=40, temperature=0, stream=True)
    early = [next(left)["choices"][0]["text"] for _ in range(2)]
    del left                                              # closed: rank 0 cancels it, every rank frees its cells
    try:
        llm.generate([[1, 10 ** 6]] if rank == 0 else [[1, 2]], SamplingParams(temperature=0.0, max_tokens=3))
        refused = None
    except ConfigError as e:
        refused = [type(e).__name__, str(e), bool(getattr(e, "every_rank", False))]
    after = llm.generate(mine[:1], SamplingParams(max_tokens=4, temperature=0))
    facts = {"rank": rank, "size": llm.world.size,
             "greedy": [o.outputs[0].token_ids for o in greedy],
             "greedy_text": [o.outputs[0].text for o in greedy],
             "ids": [o.request_id for o in greedy + sampled],
             "sampled": [[c.token_ids for c in o.outputs] for o in sampled],
             "completion": done, "stream": stream, "pairs": pairs, "rest": rest, "early": early,
             "refused": refused, "after": after[0].outputs[0].token_ids,
             "passes": llm.engine.passes, "used": llm.engine.cells.n_used,
             "scheduler_steps": llm.scheduler.metrics.steps}
    with open(f"{out}/rank{rank}.json", "w") as f:
        json.dump(facts, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1], sys.argv[2]))
