"""Seeded samples and logprobs under `mpiexec` read from each rank's top candidates of the
vocabulary-split logits (backends/candidates.py, issue 24 item 6): the tokens equal those the
gathered path draws from the same seed in the same job, the logprobs agree within 1e-9, and
far fewer bytes cross between ranks per sampled row than the gathered vocabulary."""

from __future__ import annotations

import json
import sys

import pytest

from support.mpi import check_ok, mpiexec
from support.require import requires
from metatp.testing.synth import SynthSpec

SPEC = SynthSpec(n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, n_vocab=2048, tied=False, seed=24,
                 default_type="Q8_0")

SCRIPT = """
import json, sys
from metatp import LLM, SamplingParams
from metatp.sampling import Sampler
prompts = [[5, 6, 7], [8, 9]]
params = [SamplingParams(max_tokens=8, temperature=0.9, top_k=20, seed=3, ignore_eos=True, logprobs=3),
          SamplingParams(max_tokens=8, temperature=0.7, min_p=0.2, top_p=0.9, seed=4, ignore_eos=True),
          SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2),
          SamplingParams(max_tokens=8, temperature=0.05, top_p=0.6, seed=6, ignore_eos=True),
          SamplingParams(max_tokens=8, temperature=0.9, top_k=20, seed=7, presence_penalty=1.0,
                         logit_bias={5: 5.0, 9: -100}, min_tokens=3, stop_token_ids=[12], ignore_eos=True),
          SamplingParams(max_tokens=8, temperature=0, frequency_penalty=0.5, ignore_eos=True)]
llm = LLM(sys.argv[1], n_ctx=256, backend="numpy")
runs = {}
for mode in ("candidates", "gathered"):
    if mode == "gathered":
        Sampler.candidate_spec = lambda self, n_vocab: None     # every row read whole (rank 0 decides)
    before, rows = llm.engine.logits_bytes, llm.engine.candidate_rows
    outs = [[(c.token_ids, [{str(k): v.logprob for k, v in d.items()} for d in c.logprobs or []])
             for o in llm.generate(prompts, p) for c in o.outputs] for p in params]
    runs[mode] = {"outs": outs, "bytes": llm.engine.logits_bytes - before,
                  "candidate_rows": llm.engine.candidate_rows - rows}
if llm.world.rank == 0:
    print(json.dumps({"runs": runs, "n_vocab": llm.n_vocab}))
"""


@requires("mpi")
@pytest.mark.parametrize("n", [2, 3])
def test_seeded_samples_under_mpiexec_equal_the_gathered_path_with_fewer_bytes(path, n):
    r = mpiexec(n, [sys.executable, "-c", SCRIPT, path], timeout=300)
    check_ok(r)
    got = json.loads(r.stdout.strip().splitlines()[-1])
    cand, full = got["runs"]["candidates"], got["runs"]["gathered"]
    for a, b in zip(cand["outs"], full["outs"]):
        for (ta, la), (tb, lb) in zip(a, b):
            assert ta == tb
            for da, db in zip(la, lb):
                assert da.keys() == db.keys()
                assert all(abs(da[k] - db[k]) <= 1e-9 for k in da)
    rows = 6 * 2 * 8                                  # six params, two prompts, eight sampled rows
    assert full["candidate_rows"] == 0 and full["bytes"] >= 4 * got["n_vocab"] * rows // 2
    assert cand["candidate_rows"] > rows // 3         # most rows never gathered
    assert cand["bytes"] < full["bytes"]
    print(f"\n[candidates] n={n}: {cand['candidate_rows']}/{rows} rows from candidates, "
          f"{cand['bytes'] / rows:.0f} B/row vs gathered {full['bytes'] / rows:.0f} B/row")
