"""`metatp generate --numerics` / `metatp serve --numerics`: the flag reaches the LLM (the q8
path's greedy text is the CLI's), and a bad value is refused by argparse naming the choices."""

from __future__ import annotations

import pytest

from metatp import LLM, SamplingParams
from metatp.cli import main
from metatp.testing.synth import SynthSpec

SPEC = SynthSpec(n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, seed=11, default_type="Q8_0")


@pytest.mark.parametrize("numerics", ["exact", "q8"])
def test_generate_applies_numerics(path, capsys, numerics):
    rc = main(["generate", "-m", path, "--backend", "numpy", "-p", "hello there", "-n", "12", "--temp", "0",
               "--numerics", numerics])
    assert rc == 0
    out = capsys.readouterr().out
    llm = LLM(path, backend="numpy", numerics=numerics)
    want = llm.generate("hello there", SamplingParams(max_tokens=12, temperature=0))[0].outputs[0].text
    assert want and want in out


def test_a_bad_numerics_is_refused(path, capsys):
    try:
        rc = main(["generate", "-m", path, "-p", "hi", "--numerics", "fast"])
    except SystemExit as e:
        rc = e.code
    assert rc == 2 and "--numerics" in capsys.readouterr().err
