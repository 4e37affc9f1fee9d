"""CUDA graphs per batch-size bucket (issue 46 item 1), on the CPU emulator.

A step of B sequences pads its rows to the first of `GRAPH_BUCKETS` that holds B (padding rows on
scratch cells of their own) and runs that bucket's plan, whose captured graph it replays from the
bucket's second step on. What must hold: every B lands in its bucket, a second step of that bucket
replays one graph (no eager launches), the replay gives the eager run's bits, and the padding rows
do not change the real rows' results (the same rows beside real sequences give the same bits).

The emulator runs without cuBLAS here (`EmuRuntime(gemm=False)`): every matmul is a kernel launch.
With cuBLAS, the buckets above 16 rows take dequantize + cuBLAS GEMMs, captured with the kernels
where the runtime's cuBLAS can be (>= 12.2): tests/cuda/test_cupy_gemm_graphs.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from metatp.backends.cuda.backend import GRAPH_BUCKETS, CupyBackend
from metatp.engine import Engine, StepItem
from metatp.passes import DeviceLayout
from metatp.step import bucket_rows
from metatp.testing import EmuRuntime
from metatp.testing.synth import SynthSpec
from support.require import require

SPEC = SynthSpec(n_layer=1, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, tied=False, seed=11, default_type="Q8_0",
                 n_ctx_train=4096)     # the `synth_model` fixture (tests/conftest.py)
PROMPTS = [[5 + i, 30 + 3 * i, 9, 2 + i] for i in range(8)]


def test_every_batch_size_pads_to_its_bucket():
    for b in range(1, GRAPH_BUCKETS[-1] + 1):
        want = next(k for k in GRAPH_BUCKETS if k >= b)
        assert bucket_rows(b, GRAPH_BUCKETS[-1], GRAPH_BUCKETS[-1], GRAPH_BUCKETS) == want
    assert bucket_rows(40, 48, 256, GRAPH_BUCKETS) == 48          # never past the cap (n_batch)
    assert bucket_rows(300, 512, 256, GRAPH_BUCKETS) == 320       # past the few-token path: the engine's
    be = CupyBackend(DeviceLayout(), runtime=EmuRuntime())
    assert be.row_buckets() == GRAPH_BUCKETS and be.step_rows() == GRAPH_BUCKETS[-1]


def prefilled(eng: Engine, prompts) -> list:
    seqs = [eng.new_sequence() for _ in prompts]
    for s, p in zip(seqs, prompts):
        eng.run([StepItem(s, p, "none")])
    return seqs


def step(eng: Engine, seqs, tokens) -> list[np.ndarray]:
    return eng.run([StepItem(s, [t], "last") for s, t in zip(seqs, tokens)])


def executable_of(eng: Engine, rows: int):
    (ex,) = [ex for key, (_, ex) in eng._plans.items() if key[0] == key[2] == rows]
    return ex


@pytest.fixture(scope="module")
def gpuengine_engines(synth_model):
    """(graphs, eager, graph runtime): two emulated engines alike but for CUDA graphs."""
    require("emulator")
    lay = DeviceLayout()
    rt = EmuRuntime(gemm=False)
    graphs = Engine(synth_model, 128, lay, CupyBackend(lay, runtime=rt), n_batch=64)
    eager = Engine(synth_model, 128, lay, CupyBackend(lay, runtime=EmuRuntime(gemm=False), cuda_graphs=False),
                   n_batch=64)
    return graphs, eager, rt


@pytest.mark.parametrize("b", [3, 5])
def test_a_step_of_b_sequences_replays_its_buckets_graph_with_the_eager_bits(gpuengine_engines, b):
    graphs, eager, rt = gpuengine_engines
    bucket = next(k for k in GRAPH_BUCKETS if k >= b)
    g_seqs, e_seqs = prefilled(graphs, PROMPTS[:b]), prefilled(eager, PROMPTS[:b])
    tokens = [7] * b
    for k in range(3):
        launches = rt.graph_launches
        got, want = step(graphs, g_seqs, tokens), step(eager, e_seqs, tokens)
        assert all(np.array_equal(g, w) for g, w in zip(got, want))      # same kernels, same order: same bits
        ex = executable_of(graphs, bucket)
        if k:                                       # captured on its second run, replayed from then on
            assert ex.graph_mode == "whole" and rt.graph_launches == launches + 1
        tokens = [int(np.argmax(g)) for g in got]
    assert ex.runs >= 3
    for s in g_seqs + e_seqs:
        (graphs if s in g_seqs else eager).free(s)


def test_padding_rows_do_not_change_the_real_rows(gpuengine_engines):
    """Eight sequences with their prompts in the cache: a step of the first five (the bucket of
    eight, three padding rows on scratch cells), then, on the same cells again, a step of all eight:
    the five rows' logits are the same bits (the same plan, each row's cells where they were)."""
    graphs, _, rt = gpuengine_engines
    got = []
    for k, n in enumerate((8, 5, 8)):           # the first: the bucket's plan run (and captured) before
        seqs = prefilled(graphs, PROMPTS[:8])
        launches = rt.graph_launches
        got.append(step(graphs, seqs[:n], [7] * n))
        if k:
            assert rt.graph_launches == launches + 1      # both steps replay the bucket's one graph
        for s in seqs:
            graphs.free(s)
    _, padded, full = got
    assert all(np.array_equal(p, f) for p, f in zip(padded, full[:5]))


def test_warm_up_compiles_every_bucket_and_keeps_them(synth_model):
    """A server's warm-up for 64 sequences: decode steps of every bucket up to 64 and prompt passes
    of every bucket up to 256 rows, more plans than the engine's default cache holds; none evicted."""
    require("emulator")
    lay = DeviceLayout()
    eng = Engine(synth_model, 512, lay, CupyBackend(lay, runtime=EmuRuntime(gemm=False)), n_batch=256)
    made = eng.warm_up(64)
    assert made == len(eng._plans) > 32
    assert {key[0] for key in eng._plans} == set(GRAPH_BUCKETS)
    assert {key[2] for key in eng._plans} == {b for b in GRAPH_BUCKETS if b <= 64}     # logits of 1..64 rows
