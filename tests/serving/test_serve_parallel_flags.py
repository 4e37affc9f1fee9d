"""`metatp serve` takes vLLM's -pp / -tp (and --pipeline-parallel-size / --tensor-parallel-size)
beside --pp / --tp: a server started with them answers exactly as `LLM(pipeline_parallel_size=2,
tensor_parallel_size=2)` does in process (the same 4-device layout, bit for bit), and a
contradiction stops it with one line naming the flags."""

from __future__ import annotations

import subprocess
import sys

import pytest

from metatp import LLM
from metatp.testing.synth import SynthSpec
from support.require import requires
from support.serving import MetatpServe

SPEC = SynthSpec(n_layer=4, n_embd=64, head_dim=16, n_ff=128, n_vocab=300, seed=7)
ASK = dict(max_tokens=6, temperature=0, logprobs=1)


@pytest.fixture(scope="module")
def vllm_flag_server(path, tmp_path_factory):
    s = MetatpServe(path, "-c", "64", "-sm", "layer,tensor", "-pp", "2", "--tensor-parallel-size", "2", "-ts", "1,3",
                    log=tmp_path_factory.mktemp("tp-flags") / "serve.log")
    yield s
    s.stop()


@requires("serve")
def test_the_server_runs_the_layout_the_flags_name(vllm_flag_server, path):
    got = vllm_flag_server.client().completions.create(model="m", prompt="Hello world", **ASK).choices[0]
    same = LLM(path, backend="numpy", n_ctx=64, pipeline_parallel_size=2, tensor_parallel_size=2,
               tensor_split=[1, 3])("Hello world", **ASK)["choices"][0]
    one = LLM(path, backend="numpy", n_ctx=64)("Hello world", **ASK)["choices"][0]
    assert got.text == same["text"]
    assert got.logprobs.token_logprobs == same["logprobs"]["token_logprobs"]
    # the comparison can tell layouts apart: one device rounds differently in the last bits
    assert one["logprobs"]["token_logprobs"] != same["logprobs"]["token_logprobs"]


def test_a_contradiction_stops_serve_with_one_line(path):
    r = subprocess.run([sys.executable, "-m", "metatp", "serve", "-m", path, "--backend", "numpy", "-c", "64",
                        "-sm", "layer,tensor", "-pp", "2", "-tp", "2", "-ts", "1,1,1"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [
        "metatp: error: -ts has 3 shares but --tp is 2: under -sm layer,tensor -ts gives each device of a tensor group "
        "its share"]
