"""`batch_invariant` on the numpy backend and the `--batch-invariant` flag.

The numpy backend is batch invariant already where its compiled kernels run (decode steps and
prompt chunks of up to 16 rows: per-row sums, attention chunks at absolute cells, sequences on
128-cell pages; tests/numpy/test_batch_invariance.py, tests/serving/test_batching.py), so
`batch_invariant=True` changes no kernel there: it insists on the compiled kernels (pure numpy's
BLAS sums depend on the pass's rows). Checked here end to end: a sequence's prompt logits and 8
decode steps alone == in a step of 8 sequences of other lengths, bitwise. Prompts of more than 16
tokens run through BLAS over the whole padded window, alone as batched: their logits are not
covered (docs/gpu-results.md says so).
"""

from __future__ import annotations

import argparse

import pytest

from metatp import LLM
from metatp.backends import create_backend
from metatp.cli_args import add_layout_args, layout_kwargs
from metatp.ir.errors import ConfigError
from metatp.passes.plan import DeviceLayout
from metatp.testing.synth import SynthSpec
from support.batch_invariance import sequence_logits
from support.require import requires

SPEC = SynthSpec(n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, tied=False, seed=5, default_type="Q8_0",
                 n_ctx_train=4096)


@requires("cpu_kernels")
def test_numpy_batch_invariant_gives_the_same_logits_alone_and_batched(path):
    llm = LLM(path, backend="numpy", n_ctx=1024, max_num_seqs=8, batch_invariant=True)
    assert llm.backend.use_kernels
    alone = sequence_logits(llm, batched=False)
    for at in (0, 3):
        batched = sequence_logits(llm, batched=True, at=at)
        assert all(a.tobytes() == b.tobytes() for a, b in zip(alone, batched))


def test_numpy_batch_invariant_refuses_pure_numpy():
    with pytest.raises(ConfigError, match="batch_invariant=True needs the compiled CPU kernels"):
        create_backend("numpy", DeviceLayout(), batch_invariant=True, cpu_kernels=False)
    with pytest.raises(ConfigError, match="batch_invariant=1 must be True or False"):
        create_backend("numpy", DeviceLayout(), batch_invariant=1)


def test_the_batch_invariant_flag_becomes_the_backend_option():
    p = argparse.ArgumentParser()
    add_layout_args(p)
    assert layout_kwargs(p.parse_args(["--batch-invariant"]))["backend_options"] == {"batch_invariant": True}
    assert "batch_invariant" not in layout_kwargs(p.parse_args([]))["backend_options"]
