"""`LLM` calls under a real `mpiexec -n 2` / `-n 3`: rank 0 leads each call, the others return its results.

`tests/mpi/calls_rank.py` runs on every rank (ranks > 0 with other prompts and seeds): generate
greedy and seeded, score, a completion, a stream, two streams read in turn, a stream left early
and a call rank 0 refuses. Every rank must get exactly rank 0's results (texts, token ids,
request ids, logits, the error), ranks > 0 must never step a scheduler, and the results must be
what one process gives with the same split.

Skips with a reason where mpi4py or mpiexec is missing (`pip install "metatp[mpi]"`).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from support.helpers import assert_close
from support.mpi import check_ok, mpiexec
from support.require import requires
from support.serving import LoopbackPosts
from metatp.testing.synth import SynthSpec

DRIVER = Path(__file__).with_name("calls_rank.py")
SPEC = SynthSpec(n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, tied=False, seed=5,
                 default_type="Q8_0")      # the `path` fixture (varied tokens, greedy and sampled)


@requires("mpi")
@pytest.mark.parametrize("n", [2, 3])
def test_every_rank_returns_rank_0s_results(path, tmp_path, n):
    sys.path.insert(0, str(DRIVER.parent))
    try:
        from calls_rank import PROMPTS, TEXT, texts
    finally:
        sys.path.pop(0)
    from metatp.api import LLM
    from metatp.sampling import SamplingParams

    r = mpiexec(n, [sys.executable, str(DRIVER), path, str(tmp_path)], timeout=300)
    check_ok(r)
    facts = [json.loads((tmp_path / f"rank{k}.json").read_text()) for k in range(n)]
    scores = [np.load(tmp_path / f"score{k}.npy") for k in range(n)]
    lead = facts[0]
    assert lead["scheduler_steps"] > 0 and lead["used"] == 0
    for k, f in enumerate(facts[1:], 1):
        assert f.pop("rank") == k and f.pop("scheduler_steps") == 0       # a follower never steps a scheduler
        assert f == {key: v for key, v in lead.items() if key not in ("rank", "scheduler_steps")}
        assert np.array_equal(scores[k], scores[0])
    # a script printing on every rank prints the same line on every rank
    line = f"rank text: {ascii(lead['greedy_text'][0])}"
    assert r.stdout.splitlines().count(line) == n, r.stdout
    name, message, every = lead["refused"]
    # a ConfigError (request_fields' FieldError is one: it names the field) on every rank alike
    assert name in ("ConfigError", "FieldError") and "out of range" in message and every
    # ... and what one process gives with the same split
    one = LLM(path, n_ctx=128, backend="numpy", n_devices=n, split_mode="tensor", tensor_split=[3] + [1] * (n - 1),
              distributed="none", max_num_seqs=4)
    assert lead["greedy"] == [o.outputs[0].token_ids
                              for o in one.generate(PROMPTS, SamplingParams(max_tokens=10, temperature=0,
                                                                            ignore_eos=True))]
    assert lead["sampled"] == [[c.token_ids for c in o.outputs]
                               for o in one.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=1.0,
                                                                             seed=100, n=2))]
    assert_close(scores[0], one.score(PROMPTS[0]), "score under mpiexec vs one process", rtol=1e-5)
    want = one.create_completion(TEXT, max_tokens=6, temperature=0)
    assert lead["completion"]["choices"] == want["choices"]
    assert lead["stream"] == texts(one.create_completion(TEXT, max_tokens=6, temperature=0, stream=True))
    a = texts(one.create_completion(TEXT, max_tokens=5, temperature=0, stream=True))
    b = texts(one.create_completion("the end", max_tokens=7, temperature=0, stream=True))
    assert [list(p) for p in zip(a, b)] == lead["pairs"] and b[len(a):] == lead["rest"]
    assert lead["early"] == texts(one.create_completion(TEXT, max_tokens=40, temperature=0, stream=True))[:2]


def _script(llm, rank: int) -> dict:
    """What both 'ranks' run alike: streams read in turn and left early, a refused call, a stream
    that fails, a generate."""
    from metatp.ir.errors import ConfigError, MetatpError
    from metatp.sampling import SamplingParams

    from calls_rank import texts

    a = llm.create_completion("hello", max_tokens=4, temperature=0, stream=True)
    b = llm.create_completion("world" if rank == 0 else "zz", max_tokens=6, temperature=0, stream=True)
    pairs = [(x["choices"][0]["text"], y["choices"][0]["text"]) for x, y in zip(a, b)]
    left = llm.create_completion("left", max_tokens=30, temperature=0, stream=True)
    early = texts([next(left), next(left)])
    rest = texts(b)
    del left
    try:
        llm.score([1, 10 ** 6] if rank == 0 else [1])
        refused = None
    except ConfigError as e:
        refused = str(e)
    too_long = llm.create_completion([5] * 300 if rank == 0 else [5], max_tokens=4, stream=True)
    try:
        next(too_long)                                    # the stream fails as it starts, on every rank
        broken = None
    except MetatpError as e:
        broken = (type(e).__name__, str(e))
    out = llm.generate([[1, 2, 3]] if rank == 0 else [[9]], SamplingParams(max_tokens=5, temperature=0.7, seed=4))
    return {"pairs": pairs, "early": early, "rest": rest, "refused": refused, "broken": broken,
            "out": out[0].outputs[0].token_ids, "id": out[0].request_id}


def test_followers_get_rank_0s_calls_without_mpi(path):
    """No MPI needed: rank 0's posts replayed by a follower LLM give it rank 0's results (two
    streams in turn, one left early, a refused call, a stream that fails, a sampled generate),
    it steps no scheduler, and both caches end empty."""
    sys.path.insert(0, str(DRIVER.parent))
    from metatp.api import LLM
    from metatp.ir.errors import ConfigError
    from metatp.mpi_calls import MpiCalls

    def make(rank: int, posts: list) -> LLM:
        llm = LLM(path, n_ctx=256, backend="numpy", n_devices=2, split_mode="tensor", distributed="none",
                  max_num_seqs=3)
        llm._mpi_calls = MpiCalls(llm, LoopbackPosts(rank, posts))
        return llm
    try:
        posts: list = []
        lead = make(0, posts)
        got0 = _script(lead, 0)
        rest = make(1, posts)
        got1 = _script(rest, 1)
    finally:
        sys.path.pop(0)
    assert got1 == got0 and "out of range" in got0["refused"] and not posts
    assert got0["broken"][0] == "ContextOverflowError"
    assert rest.scheduler.metrics.steps == 0 and lead.scheduler.metrics.steps > 0
    assert lead.engine.passes == rest.engine.passes
    assert lead.engine.cells.n_used == 0 and rest.engine.cells.n_used == 0
    with pytest.raises(ConfigError, match="rank 1 cannot submit"):
        rest.submit([1, 2], None)
