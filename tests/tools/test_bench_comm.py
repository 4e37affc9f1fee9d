"""`metatp bench` rows carry the communication `metatp dump` bills for their split (issue 27 item 4):
per token (a decode step) and per 512-token prompt; tensor: the all-reduce bytes of the busiest
rank, layer: the copies of the hidden state, none: nothing."""

from __future__ import annotations

import json

import pytest

from metatp.cli import main
from metatp.passes.plan import DeviceLayout
from metatp.testing.synth import SynthSpec
from metatp.tools.bench import COMM_COLUMNS, BenchConfig, format_rows, run_bench
from metatp.tools.bench_comm import format_bytes

SPEC = SynthSpec(n_layer=4, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, n_vocab=300, tied=False, seed=44)


def _dump(path: str, capsys, sm: str, ts: str, *extra: str) -> dict:
    assert main(["dump", "-m", path, "-sm", sm, "-ts", ts, "--format", "json", *extra]) == 0
    return json.loads(capsys.readouterr().out)["summary"]


def _bill(path: str, capsys, sm: str, ts: str) -> tuple[int, int]:
    """(per token, per 512-token prompt) as the dump reports them for this layout."""
    if sm == "layer":
        bill = _dump(path, capsys, sm, ts)["transfers"]
        assert bill["prompt_tokens"] == 512
        return bill["bytes_per_token"], bill["bytes_per_prompt"]
    token = _dump(path, capsys, sm, ts)["communication"]
    prompt = _dump(path, capsys, sm, ts, "--phase", "prefill")["communication"]
    assert prompt["n_tokens_per_step"] == 512
    return token["bytes_per_rank_per_token"], prompt["bytes_per_rank_per_step"]


@pytest.mark.parametrize("sm, ts", [("tensor", "1,1"), ("tensor", "3,1"), ("layer", "1,1"), ("layer", "1,2,1")])
def test_rows_carry_the_dumps_bill(path, capsys, sm, ts):
    shares = DeviceLayout.parse_split(ts)
    rows = run_bench(BenchConfig(model=path, n_prompt=[8], n_gen=[2], repetitions=1, backend="numpy",
                                 n_devices=[len(shares)], split_mode=[sm], tensor_split=[shares]))
    capsys.readouterr()
    token, prompt = _bill(path, capsys, sm, ts)
    assert 0 < token < prompt
    assert {r["split_mode"] for r in rows} == {"none", sm}
    for r in rows:
        want = (token, prompt) if r["split_mode"] == sm else (0, 0)
        assert (r["comm_bytes_per_token"], r["comm_bytes_per_prompt"]) == want, r
        assert r["comm_prompt_tokens"] == 512
    lines = format_rows(rows, "md").splitlines()
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    assert all(c in head for c in COMM_COLUMNS)
    for r, line in zip(rows, lines[2:]):
        cells = dict(zip(head, (c.strip() for c in line.strip("|").split("|"))))
        assert cells["comm/tok"] == format_bytes(r["comm_bytes_per_token"])
        assert cells["comm/pp512"] == format_bytes(r["comm_bytes_per_prompt"])


def test_layer_moves_less_per_prompt_than_tensor(path):
    """The trade-off the columns show: under -sm layer a prompt's hidden state crosses the one
    boundary once; under -sm tensor each rank sends it twice per layer (2L/(p-1) times as much;
    the last layer's two all-reduces carry only the row whose logits the prompt wants)."""
    rows = run_bench(BenchConfig(model=path, n_prompt=[4], n_gen=[0], repetitions=1, backend="numpy",
                                 n_devices=[2], split_mode=["tensor", "layer"]))
    by = {r["split_mode"]: r for r in rows}
    layer, tensor = by["layer"]["comm_bytes_per_prompt"], by["tensor"]["comm_bytes_per_prompt"]
    assert layer == 512 * SPEC.n_embd * 4
    assert (2 * SPEC.n_layer - 2) * layer < tensor < 2 * SPEC.n_layer * layer
    assert by["layer"]["comm_bytes_per_token"] == SPEC.n_embd * 4


def test_format_bytes():
    assert [format_bytes(n) for n in (None, 0, 1023, 1024, 3 << 20)] == ["", "0 B", "1023 B", "1.0 KiB", "3.0 MiB"]
