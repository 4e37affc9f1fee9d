"""-sm layer,tensor under `mpiexec -n 4` (2 stages x 2-device tensor groups, oversubscribed on
loopback): ranks 0,1 are stage 0's group, ranks 2,3 stage 1's. Each rank holds its stage's layers
(its tensor slices of them); the all-reduces run on the group's own communicator and the hidden
state goes from rank s*T+t to rank (s+1)*T+t. Checked against one process: the prompt's logits
and greedy tokens (tests/mpi/layer_rank.py), a quantized KV cache, `metatp generate`, `metatp
serve` answering the official openai client, and a rank killed mid-step ending every rank.
"""

from __future__ import annotations

import pytest

from support.helpers import assert_close
from support.mpi import check_ok, cli, error_lines
from support.require import requires
from test_mpi_layer import SPEC, _one_process, _ranks, check_rank_lost, check_serve  # noqa: F401 (SPEC: `path`)

needs_mpi = requires("mpi")
LAYOUT = {"n_devices": 4, "split_mode": "layer,tensor", "tensor_split": [1.0, 1.0]}


def _check_holdings(facts: list[dict], layers: list[int]) -> None:
    """Ranks 2s and 2s+1 hold exactly stage s's layers (weights and KV), nothing for other
    devices; every rank all-reduced (within its group) and copied the hidden state."""
    for f in facts:
        r = f["rank"]
        mine = [il for il, s in enumerate(layers) if s == r // 2]
        assert f["split_mode"] == "layer,tensor" and f["size"] == 4
        assert f["weight_layers"] == mine and f["kv_layers"] == mine, (r, f)
        assert all(b == 0 for d, b in enumerate(f["leaf_bytes"]) if d != r), f["leaf_bytes"]
        assert f["allreduces"] > 0 and f["copies"] > 0, (r, f)


@needs_mpi
@pytest.mark.parametrize("cache", ["f32", "q8_0"])
def test_two_stages_of_two_ranks_match_one_process(path, tmp_path, cache):
    from metatp.passes.layer_split import layer_devices

    res, facts = _ranks(tmp_path, path, (1.0, 1.0), cache, stages=2)
    logits, tokens = _one_process(path, cache)
    assert_close(res["logits"], logits, f"logits, -sm layer,tensor --pp 2 --tp 2, {cache} KV cache", rtol=1e-5)
    assert res["tokens"].tolist() == tokens and len(set(tokens)) > 1
    sim, sim_tokens = _one_process(path, cache, **LAYOUT)          # the same plan simulated in one process
    assert_close(res["logits"], sim, "logits, 4 ranks vs 4 simulated devices", rtol=1e-6)
    assert sim_tokens == tokens
    _check_holdings(facts, layer_devices(SPEC.n_layer, [1, 1])[:-1])


@needs_mpi
def test_cli_generate_and_bad_layouts_under_mpiexec(path):
    flags = ["-m", path, "-p", "hello world", "-n", "12", "--temp", "0", "-c", "128", "--backend", "numpy"]
    one = cli("generate", *flags)
    check_ok(one)
    got = cli("generate", *flags, "-sm", "layer,tensor", "--pp", "2", "--tp", "2", n=4, timeout=180)
    check_ok(got)
    assert got.stdout == one.stdout
    for extra, want in ((["--pp", "2", "--tp", "1"], "--pp 2 x --tp 1 is 2 devices"),
                        (["--tp", "3"], "--tp 3 does not divide the 4 devices"),
                        (["--tp", "2", "-ts", "1,1,1"], "-ts has 3 shares but --tp is 2")):
        r = cli("generate", *flags, "-sm", "layer,tensor", *extra, n=4, timeout=120)
        lines = error_lines(r)
        assert r.returncode == 1 and len(lines) == 1 and want in lines[0], (extra, r.stderr)


@needs_mpi
def test_serve_under_mpiexec_answers_the_openai_client(path, tmp_path):
    """`mpiexec -n 4 metatp serve -sm layer,tensor --pp 2 --tp 2`: the one-process text."""
    check_serve(path, tmp_path, 4, "-sm", "layer,tensor", "--pp", "2", "--tp", "2")


@needs_mpi
def test_a_rank_killed_ends_every_rank(path, tmp_path):
    """Rank 3 (stage 1's second device) killed at its 40th all-reduce or copy."""
    check_rank_lost(path, tmp_path, "SIGKILL", 3, "EXIT STRING: Killed (signal 9)", 4,
                    "-sm", "layer,tensor", "--pp", "2", "--tp", "2")


def test_layout_for_takes_layer_tensor():
    from metatp.backends.distributed import World
    from metatp.ir.errors import ConfigError

    world = World(comm=None, rank=1, size=4)
    assert world.layout_for(None, "layer,tensor", (1.0, 1.0)) == (4, "layer,tensor")
    with pytest.raises(ConfigError, match="--pp x --tp must be the number of processes"):
        world.layout_for(None, "layer,tensor", (1.0, 1.0, 1.0))


@needs_mpi
def test_bench_under_mpiexec_has_layer_tensor_rows_with_the_bill(path):
    """`mpiexec -n 4 metatp bench -sm layer,tensor --pp 2 --tp 2`: the -sm none baseline and the
    layer,tensor rows, each with the bill one process computes, and the group all-reduce times."""
    import json

    from metatp.tools.bench import BenchConfig, run_bench

    r = cli("bench", "-m", path, "-p", "8", "-n", "4", "-r", "1", "--backend", "numpy", "-sm", "layer,tensor",
            "--pp", "2", "--tp", "2", "-o", "json", n=4, timeout=240)
    check_ok(r)
    rows = json.loads(r.stdout)
    want = run_bench(BenchConfig(model=path, n_prompt=[8], n_gen=[4], repetitions=1, backend="numpy",
                                 split_mode=["layer,tensor"], pp=2, tp=2))
    key = ("n_devices", "split_mode", "tensor_split", "test", "comm_bytes_per_token", "comm_bytes_per_prompt")
    assert [tuple(x[k] for k in key) for x in rows] == [tuple(w[k] for k in key) for w in want]
    staged = [x for x in rows if x["split_mode"] == "layer,tensor"]
    assert len(staged) == 2 and all(x["comm_bytes_per_token"] > 0 and x["allreduce_us_per_call"] > 0 for x in staged)


@needs_mpi
def test_dump_under_mpiexec_prints_once_what_one_process_prints(path):
    one = cli("dump", "-m", path, "-sm", "layer,tensor", "--pp", "2", "--tp", "2")
    check_ok(one)
    four = cli("dump", "-m", path, "-sm", "layer,tensor", "--tp", "2", n=4)
    check_ok(four)
    assert four.stdout == one.stdout and "stage 1 [dev2,dev3]" in one.stdout and four.stderr == ""
