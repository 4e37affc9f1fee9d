"""-sm layer under `mpiexec -n 2` / `-n 3` (oversubscribed, loopback): one process per device.

Each rank holds its layers' weights and KV cache only; the hidden state goes from rank to rank
by MPI send / receive and the last rank's logits are broadcast. Checked against one process:
the prompt's logits at every position and the greedy tokens (tests/mpi/layer_rank.py on every
rank; uneven -ts; a quantized KV cache), `metatp generate`'s text, `metatp serve` answering the
official openai client, and a rank killed mid-copy ending every rank.
"""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from support.helpers import assert_close
from support.mpi import FaultJob, check_ok, cli, error_lines, mpiexec
from support.require import require, requires
from metatp.testing.synth import SynthSpec

needs_mpi = requires("mpi")

SPEC = SynthSpec(n_layer=5, n_embd=64, n_head=4, n_head_kv=2, head_dim=32, n_ff=128, n_vocab=300, tied=False, seed=3,
                 n_ctx_train=4096, types={"gate": "Q4_0", "up": "Q4_0", "down": "Q8_0"})   # the `path` fixture
WORKER = Path(__file__).with_name("layer_rank.py")
PROMPT = [1, 17, 42, 99, 7, 250, 3, 64]
N_GEN = 16


def _ranks(tmp_path: Path, path: str, ts: tuple[float, ...], cache: str = "f32",
           prompt: list[int] = PROMPT, stages: int | None = None) -> tuple[dict, list[dict]]:
    """Rank 0's result and every rank's facts; `stages`: -sm layer,tensor with that many stages
    of len(ts) ranks (tests/mpi/test_mpi_layer_tensor.py)."""
    n = len(ts) * (stages or 1)
    out = tmp_path / f"out-{cache}-{'-'.join(f'{x:g}' for x in ts)}-{stages}"
    out.mkdir()
    mode = ["-sm", "layer,tensor"] if stages else []
    r = mpiexec(n, [sys.executable, str(WORKER), "--model", path, "-ts", ",".join(f"{x:g}" for x in ts),
                    "--out", str(out), "--n-gen", str(N_GEN), "--cache-type", cache, *mode,
                    "--prompt", ",".join(map(str, prompt))], timeout=180 if n < 4 else 300)
    check_ok(r)
    res = np.load(out / "result.npz")
    return {k: res[k] for k in res.files}, [json.loads((out / f"rank{k}.json").read_text()) for k in range(n)]


def _one_process(path: str, cache: str = "f32", prompt: list[int] = PROMPT, **layout):
    from metatp.api import LLM
    from metatp.testing.mpi_rank import run_prompt

    llm = LLM(path, n_ctx=128, backend="numpy", distributed="none", cache_type_k=cache, cache_type_v=cache, **layout)
    return run_prompt(llm, prompt, N_GEN)


def _check_holdings(facts: list[dict], ts: tuple[float, ...]) -> None:
    """Rank r holds exactly the layers llama.cpp's rule gives device r (weights and KV), the token
    embedding on rank 0 and the output layer on the output device; nothing for the other devices;
    it copied (sent or received) and never all-reduced."""
    from metatp.passes.layer_split import layer_devices

    slots = layer_devices(SPEC.n_layer, ts)
    for f in facts:
        r = f["rank"]
        mine = [il for il, d in enumerate(slots[:-1]) if d == r]
        assert f["split_mode"] == "layer" and f["size"] == len(ts)
        assert f["weight_layers"] == mine and f["kv_layers"] == mine, (r, f)
        want = (["token_embd.weight"] if r == 0 else []) + (["output.weight", "output_norm.weight"]
                                                             if slots[-1] == r else [])
        assert f["other_weights"] == sorted(want), (r, f)
        assert all(b == 0 for d, b in enumerate(f["leaf_bytes"]) if d != r), f["leaf_bytes"]
        assert f["allreduces"] == 0
        busy = bool(mine) or r in (0, slots[-1])
        assert (f["copies"] > 0) == busy and (f["copied_bytes"] > 0) == busy, (r, f)


@needs_mpi
@pytest.mark.parametrize("ts", [(1.0, 1.0), (3.0, 1.0), (1.0, 3.0, 1.0), (2.0, 1.0, 2.0), (1.0, 0.0, 1.0)],
                         ids=["2:1,1", "2:3,1", "3:1,3,1", "3:2,1,2", "3:1,0,1-idle-rank"])
def test_layer_ranks_match_one_process(path, tmp_path, ts):
    res, facts = _ranks(tmp_path, path, ts)
    logits, tokens = _one_process(path)
    assert_close(res["logits"], logits, f"logits at every prompt position, -sm layer -ts {ts}", rtol=1e-5)
    assert res["tokens"].tolist() == tokens and len(set(tokens)) > 1
    # the same kernels on the same values, only copied between processes: the simulated run's bits
    sim, sim_tokens = _one_process(path, n_devices=len(ts), split_mode="layer", tensor_split=list(ts))
    np.testing.assert_array_equal(res["logits"], sim)
    assert sim_tokens == tokens
    _check_holdings(facts, ts)


@needs_mpi
@pytest.mark.slow
def test_layer_ranks_match_one_process_default_model(default_model, tmp_path):
    """The default model on 3 ranks, -ts 1,2,1: the logits and greedy tokens of one device."""
    ts, prompt = (1.0, 2.0, 1.0), [1, 504, 3575, 282, 4649, 314, 253, 1345]
    res, _ = _ranks(tmp_path, str(default_model), ts, prompt=prompt)
    logits, tokens = _one_process(str(default_model), prompt=prompt)
    assert_close(res["logits"], logits, "default model logits, 3 ranks -sm layer -ts 1,2,1", rtol=1e-5)
    assert res["tokens"].tolist() == tokens


@needs_mpi
@pytest.mark.parametrize("cache", ["q8_0", "q4_0"])
def test_layer_ranks_with_a_quantized_kv_cache(path, tmp_path, cache):
    ts = (1.0, 2.0)
    res, facts = _ranks(tmp_path, path, ts, cache)
    logits, tokens = _one_process(path, cache)
    assert_close(res["logits"], logits, f"logits, {cache} KV cache, -sm layer -ts {ts}", rtol=1e-5)
    assert res["tokens"].tolist() == tokens
    _check_holdings(facts, ts)


@needs_mpi
def test_cli_generate_under_mpiexec(path):
    """`mpiexec -n 2|3 metatp generate -sm layer` prints once, the single-device run's text."""
    flags = ["-m", path, "-p", "hello world", "-n", "16", "--temp", "0", "-c", "128", "--backend", "numpy"]
    one = cli("generate", *flags)
    check_ok(one)
    assert len(set(one.stdout)) > 3, one.stdout
    for ts in ("3,1", "1,2,2"):
        got = cli("generate", *flags, "-sm", "layer", "-ts", ts, n=len(ts.split(",")))
        check_ok(got)
        assert got.stdout == one.stdout, (ts, got.stdout, one.stdout)


@needs_mpi
def test_other_split_modes_and_counts_stay_refused(path):
    flags = ["-m", path, "-p", "hi", "-n", "2", "-c", "64", "--backend", "numpy"]
    for extra, want in ((["-sm", "none"], "split_mode is 'none'"),
                        (["-sm", "layer", "--devices", "3"], "--devices 3 but mpiexec started 2 processes"),
                        (["-sm", "layer", "-ts", "1,1,1"], "-ts has 3 shares but mpiexec started 2 processes")):
        r = cli("generate", *flags, *extra, n=2, timeout=60)
        lines = error_lines(r)
        assert r.returncode == 1 and len(lines) == 1 and want in lines[0], (extra, r.stderr)


@needs_mpi
def test_dump_under_mpiexec_prints_once_what_one_process_prints(path):
    one = cli("dump", "-m", path, "--devices", "2", "-sm", "layer", "-ts", "1,2")
    check_ok(one)
    two = cli("dump", "-m", path, "-sm", "layer", "-ts", "1,2", n=2)
    check_ok(two)
    assert two.stdout == one.stdout and "copy bill" in one.stdout and two.stderr == ""


def test_layout_for_takes_layer():
    from metatp.backends.distributed import World
    from metatp.ir.errors import ConfigError

    world = World(comm=None, rank=1, size=3)
    assert world.layout_for(None, "layer", (1, 2, 1)) == (3, "layer")
    assert world.layout_for(3, None, None) == (3, "tensor")
    with pytest.raises(ConfigError, match="-sm tensor or -sm layer"):
        world.layout_for(None, "none", None)
    assert World(comm=None, rank=0, size=1).layout_for(None, "layer", None) == (1, "layer")


# ---------------------------------------------------------------- serve
@needs_mpi
def test_serve_under_mpiexec_answers_the_openai_client(path, tmp_path):
    """`mpiexec -n 2 metatp serve -sm layer -ts 2,3`: concurrent and streamed completions from
    the official client, each text the one-process text."""
    check_serve(path, tmp_path, 2, "-sm", "layer", "-ts", "2,3")


def check_serve(path: str, tmp_path: Path, n: int, *flags: str) -> None:
    """`mpiexec -n n metatp serve FLAGS` answers concurrent and streamed completions of the
    official client with the one-process text (also tests/mpi/test_mpi_layer_tensor.py)."""
    require("serve")
    from test_mpi_serving import N_CTX, PROMPTS, MpiServer

    from metatp.api import LLM
    from metatp.sampling import SamplingParams

    one = LLM(path, n_ctx=int(N_CTX), backend="numpy", distributed="none")
    want = [o.outputs[0].text for o in one.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0,
                                                                            ignore_eos=True))]
    assert len(set(want)) > 1
    server = MpiServer(path, *flags, "--parallel", "4", log=tmp_path / "server.log", n=n)
    try:
        assert len(server.ranks()) == n, server.text()
        c = server.client()
        got: dict[int, str] = {}

        def complete(i: int) -> None:
            r = c.completions.create(model="m", prompt=PROMPTS[i], max_tokens=12, temperature=0,
                                     extra_body={"ignore_eos": True})
            got[i] = r.choices[0].text
        threads = [threading.Thread(target=complete, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=180)
        assert [got.get(i) for i in range(len(PROMPTS))] == want
        stream = c.completions.create(model="m", prompt=PROMPTS[1], max_tokens=12, temperature=0, stream=True,
                                      extra_body={"ignore_eos": True})
        assert "".join(ch.choices[0].text for ch in stream if ch.choices) == want[1]
    finally:
        server.kill()


# ---------------------------------------------------------------- a rank killed mid-copy
@needs_mpi
@pytest.mark.parametrize("sig,rank,line", [("SIGKILL", 1, "EXIT STRING: Killed (signal 9)"),
                                           ("SIGSTOP", 0, "rank 0 (pid")], ids=["SIGKILL-rank1", "SIGSTOP-rank0"])
def test_a_rank_lost_mid_copy_ends_every_rank(path, tmp_path, sig, rank, line):
    """The fault lands at the rank's 40th send / receive (inside a decode step): every rank ends
    within the bound, with one line saying why."""
    check_rank_lost(path, tmp_path, sig, rank, line, 2, "-sm", "layer", "-ts", "2,3")


def check_rank_lost(path: str, tmp_path: Path, sig: str, rank: int, line: str, n: int, *flags: str) -> None:
    """`mpiexec -n n metatp generate FLAGS` with rank `rank` sent `sig` at its 40th all-reduce or
    copy: every rank ends within the bound, one line saying why (also test_mpi_layer_tensor.py)."""
    from test_rank_faults import FAST, GENERATE, _ended, _one_line

    job = FaultJob([*GENERATE, *flags, "-m", path], tmp_path, n=n, env={**FAST, "FAULT": f"{sig}:{rank}:40"})
    try:
        t = job.wait_fault(120)
        _one_line(_ended(job, t, f"generate {' '.join(flags)}, {sig} on rank {rank}"), line, sig)
    finally:
        job.kill()


def test_a_backend_without_copies_across_processes_says_so(path):
    """A process owning some devices whose collective cannot send / receive (a GPU rank's NCCL
    collective today) refuses a layer plan with copies to or from the others, by name."""
    from metatp.backends.numpy.backend import NumpyBackend
    from metatp.engine import Engine
    from metatp.ir.errors import UnsupportedOpError
    from metatp.ir.loader import load_model
    from metatp.passes.plan import DeviceLayout

    from metatp.backends.collectives import Collective

    class Sums(Collective):          # an all-reduce; send_recv left at its default (none)
        name = "sums"

        def prepare_allreduce(self, bufs, active=None, stream=None):
            return lambda: None

    layout = DeviceLayout(2, "layer")
    eng = Engine(load_model(path), 64, layout, NumpyBackend(layout, devices=[1], collective=Sums()))
    with pytest.raises(UnsupportedOpError, match="point-to-point copies; 'sums' has none"):
        eng.forward([1, 2, 3])


# ---------------------------------------------------------------- bench
@needs_mpi
def test_bench_under_mpiexec_has_layer_rows_with_bill_and_copy_times(path):
    """`mpiexec -n 2 metatp bench -sm layer`: rank 0 prints the in-process rows (the -sm none
    baseline and the layer rows), each with the dump's bill and, for layer, its send / receive time."""
    from metatp.tools.bench import COPY_COLUMNS, MPI_COLUMNS, BenchConfig, run_bench

    r = cli("bench", "-m", path, "-p", "8", "-n", "4", "-r", "2", "--backend", "numpy", "-sm", "layer",
            "-ts", "1/2", "-o", "json", n=2)
    check_ok(r)
    rows = json.loads(r.stdout)
    want = run_bench(BenchConfig(model=path, n_prompt=[8], n_gen=[4], repetitions=1, backend="numpy",
                                 n_devices=[2], split_mode=["layer"], tensor_split=[(1.0, 2.0)]))
    key = ("n_devices", "split_mode", "tensor_split", "test", "comm_bytes_per_token", "comm_bytes_per_prompt")
    assert [tuple(x[k] for k in key) for x in rows] == [tuple(w[k] for k in key) for w in want]
    for x in rows:
        layer = x["split_mode"] == "layer"
        assert (x["copy_us_per_call"] is not None) == layer and x["allreduce_us_per_call"] is None, x
        assert not layer or (x["copy_us_per_call"] > 0 and x["copy_ms_per_token"] > 0)
    md = cli("bench", "-m", path, "-p", "8", "-n", "0", "-r", "1", "--backend", "numpy", "-sm", "layer", n=2)
    check_ok(md)
    head = next(line for line in md.stdout.splitlines() if line.startswith("| model |"))
    assert all(c in head for c in COPY_COLUMNS) and not any(c in head for c in MPI_COLUMNS), head
