"""Greedy tokens under `mpiexec` read from vocabulary-split logits without gathering them
(backends/logits_read.py, issue 24 item 6): each rank sends (max, index, finite) per row to the
others instead of its slice of the vocabulary; the tokens equal one process's."""

from __future__ import annotations

import json
import sys

import pytest

from metatp import LLM, SamplingParams
from metatp.testing.synth import SynthSpec
from support.mpi import check_ok, mpiexec
from support.require import requires

SPEC = SynthSpec(n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, tied=False, seed=24, default_type="Q8_0")

GREEDY_SCRIPT = """
import json, sys
from metatp import LLM, SamplingParams
llm = LLM(sys.argv[1], n_ctx=256, backend="numpy")
prompts = [[5, 6, 7], [8, 9]]
greedy = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0,
                                                                             ignore_eos=True))]
after_greedy = llm.engine.logits_bytes
llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0.8, seed=0, ignore_eos=True))   # plain temperature: whole rows
if llm.world.rank == 0:
    print(json.dumps({"greedy": greedy, "greedy_bytes": after_greedy,
                      "gathered_bytes": llm.engine.logits_bytes - after_greedy, "n_vocab": llm.n_vocab}))
"""


@requires("mpi")
@pytest.mark.parametrize("n", [2, 3])
def test_greedy_under_mpiexec_moves_a_few_bytes_per_row_instead_of_the_vocabulary(path, n):
    r = mpiexec(n, [sys.executable, "-c", GREEDY_SCRIPT, path], timeout=300)
    check_ok(r)
    got = json.loads(r.stdout.strip().splitlines()[-1])
    one = [o.outputs[0].token_ids for o in LLM(path, n_ctx=256, backend="numpy").generate(
        [[5, 6, 7], [8, 9]], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))]
    assert got["greedy"] == one
    rows = 2 * 10                                   # two sequences, ten sampled rows each
    assert 0 < got["greedy_bytes"] <= 8 * 3 * (n - 1) * rows * 2          # (max, index, finite) per row and peer
    assert got["gathered_bytes"] >= 4 * got["n_vocab"] * rows // 2        # the gathered path: whole rows
    print(f"\n[argmax] n={n}: greedy {got['greedy_bytes']} B vs gathered {got['gathered_bytes']} B")
