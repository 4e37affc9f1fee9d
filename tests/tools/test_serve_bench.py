"""`python -m scripts.serve_bench`: the serving figure of docs/performance.md, against a real
`metatp serve` on a synthetic model: every request generates exactly the tokens asked for, both
figures and their ratio come per repetition, a server that cannot start is one clear error. No
speed is asserted."""

from __future__ import annotations

import pytest

from metatp.testing.synth import SynthSpec
from scripts import serve_bench
from support.require import requires

pytestmark = requires("serve")

SPEC = SynthSpec(n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, seed=47, default_type="Q8_0")


def test_serial_and_concurrent_rows(path, capsys):
    assert serve_bench.main(["-m", path, "--requests", "3", "--tokens", "5", "-r", "2", "--",
                             "--backend", "numpy", "-c", "512"]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("| 3 |")]
    assert len(lines) == 2
    for ln in lines:
        cells = [c.strip() for c in ln.strip("|").split("|")]
        serial, concurrent, ratio = float(cells[2]), float(cells[3]), float(cells[4].rstrip("x"))
        assert serial > 0 and concurrent > 0 and ratio == pytest.approx(concurrent / serial, rel=0.02)


def test_a_server_that_cannot_start_is_one_error(tmp_path):
    with pytest.raises(RuntimeError, match="exited with code"):
        serve_bench.serve_bench(str(tmp_path / "missing.gguf"), 1, 1, 1, ("--backend", "numpy"), ready_timeout=60)
