"""Pipelined steps (metatp.pipeline) in one process: -sm layer on simulated numpy devices with
`Engine.micro_batches` forced (in one process the default is 1: the devices take turns anyway).

What must hold: the same logits, bit for bit, as one pass after another -- decode tokens and
short chunks split into micro-batches of whole sequences (the few-token path: a row's sums do
not depend on its pass-mates), long chunks in the same passes as before, their logits read
only after the window is issued (each pass of a window on buffers of its own); the same
greedy tokens; batch invariance (a sequence alone gets its bits among the others).
"""

from __future__ import annotations

import numpy as np
import pytest

from metatp import pipeline
from metatp.engine import Engine, StepItem
from metatp.ir.errors import ConfigError
from metatp.testing.synth import SynthSpec
from support.require import requires

pytestmark = requires("cpu_kernels")

SPEC = SynthSpec(n_layer=4, n_embd=64, n_head=4, n_head_kv=2, head_dim=16, n_ff=128, n_vocab=200, tied=False, seed=11,
                 n_ctx_train=1024, default_type="Q8_0", types={"gate": "Q4_0"})
N_SEQ = 8


def _engine(synth_model, n: int = 2, mode: str = "layer", micro: int | None = 1, n_batch: int = 512, **kw) -> Engine:
    from metatp.backends.numpy.backend import NumpyBackend
    from metatp.passes.plan import DeviceLayout

    layout = DeviceLayout(n, mode, **kw)
    eng = Engine(synth_model, 512, layout, NumpyBackend(layout), n_batch=n_batch)
    eng.micro_batches = micro
    return eng


def _prompts(rng, lengths) -> list[list[int]]:
    return [rng.integers(1, SPEC.n_vocab, size=n).tolist() for n in lengths]


def _drive(eng: Engine, prompts: list[list[int]], n_gen: int = 4) -> tuple[list[np.ndarray], list[list[int]]]:
    """Prefill every prompt in one step (scored at every position), then greedy decode steps of
    every sequence together: (every step's logits, per sequence its greedy tokens)."""
    seqs = [eng.new_sequence() for _ in prompts]
    got = eng.run([StepItem(s, p, "all") for s, p in zip(seqs, prompts)])
    logits = list(got)
    nxt = [int(np.argmax(x[-1])) for x in got]
    tokens = [[t] for t in nxt]
    for _ in range(n_gen):
        got = eng.run([StepItem(s, [t], "last") for s, t in zip(seqs, nxt)])
        logits.extend(got)
        nxt = [int(np.argmax(x)) for x in got]
        for row, t in zip(tokens, nxt):
            row.append(t)
    return logits, tokens


@pytest.mark.parametrize("micro", [2, 3, 4])
def test_micro_batches_give_the_bits_of_one_pass_after_another(synth_model, micro):
    """Short prompts (the few-token path) and decode tokens of 8 sequences, -sm layer -ts 1,1."""
    prompts = _prompts(np.random.default_rng(1), [5, 3, 9, 1, 7, 2, 4, 6])
    ref_eng = _engine(synth_model)
    ref, ref_tokens = _drive(ref_eng, prompts)
    eng = _engine(synth_model, micro=micro)
    got, tokens = _drive(eng, prompts)
    assert tokens == ref_tokens
    for a, b in zip(got, ref):
        np.testing.assert_array_equal(a, b)
    # really split: each decode step ran `micro` passes instead of one
    assert eng.passes - ref_eng.passes == 5 * (micro - 1)


def test_long_chunks_pipeline_in_the_same_passes(synth_model):
    """Prompts longer than the few-token path run in passes of n_batch rows as before (several
    passes of one shape in flight: each on its own executable); bits unchanged."""
    prompts = _prompts(np.random.default_rng(2), [150, 90, 120])
    ref_eng = _engine(synth_model, n=3, n_batch=96)
    ref, ref_tokens = _drive(ref_eng, prompts, n_gen=2)
    eng = _engine(synth_model, n=3, micro=3, n_batch=96)
    got, tokens = _drive(eng, prompts, n_gen=2)
    assert tokens == ref_tokens
    for a, b in zip(got, ref):
        np.testing.assert_array_equal(a, b)
    slots = [key for key in eng._plans if len(key) > 3]
    assert slots, "passes of one shape in a window use executables of their own"


def test_layer_tensor_micro_batches(synth_model):
    """-sm layer,tensor with 2 stages of 2 devices: the same bits with 2 micro-batches."""
    prompts = _prompts(np.random.default_rng(3), [4, 6, 2, 8])
    ref, ref_tokens = _drive(_engine(synth_model, n=4, mode="layer,tensor", tp=2), prompts, n_gen=3)
    got, tokens = _drive(_engine(synth_model, n=4, mode="layer,tensor", tp=2, micro=2), prompts, n_gen=3)
    assert tokens == ref_tokens
    for a, b in zip(got, ref):
        np.testing.assert_array_equal(a, b)


def test_batch_invariance_holds_with_micro_batches(synth_model):
    """A sequence decoded alone gets the bits it gets among 7 others split into micro-batches."""
    prompts = _prompts(np.random.default_rng(4), [6, 3, 5, 2, 7, 4, 1, 8])
    alone, alone_tokens = _drive(_engine(synth_model, micro=1), prompts[2:3])
    together, tokens = _drive(_engine(synth_model, micro=4), prompts)
    assert tokens[2] == alone_tokens[0]
    np.testing.assert_array_equal(together[2], alone[0])            # the prompt, every position
    for k in range(1, 5):                                            # each decode step
        np.testing.assert_array_equal(together[k * N_SEQ + 2], alone[k])


def test_unquantized_weights_agree_to_float_tolerance(synth_factory):
    """F32 weights take BLAS at every pass size, whose sums depend on the rows of the pass (as
    batching does, tests/serving/test_batching.py): smaller passes agree to float rounding only."""
    from metatp.ir.loader import load_model

    model = load_model(str(synth_factory(SynthSpec(n_layer=2, n_embd=64, n_head=4, n_head_kv=2, head_dim=16,
                                                   n_ff=128, n_vocab=200, tied=False, seed=12))[0]))
    prompts = _prompts(np.random.default_rng(5), [5, 3, 9, 1])
    ref, ref_tokens = _drive(_engine(model), prompts)
    got, tokens = _drive(_engine(model, micro=4), prompts)
    assert tokens == ref_tokens
    for a, b in zip(got, ref):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_split_small_keeps_sequences_whole_and_rows_balanced(synth_model):
    from metatp.step import Row

    eng = _engine(synth_model, micro=3)
    rows = [Row(k, 0, 1, True) for k, n in enumerate([1, 1, 1, 1, 1, 1, 1, 1]) for _ in range(n)]
    passes = pipeline.split_small(eng.pipelining(), rows, 64)
    assert [len(p) for p in passes] == [3, 2, 3]
    chunks = [Row(k, i, 1, i == n - 1) for k, n in enumerate([5, 1, 4, 2]) for i in range(n)]
    passes = pipeline.split_small(eng.pipelining(), chunks, 64)
    assert [[r.item for r in p] for p in passes] == [[0] * 5, [1], [2] * 4 + [3] * 2]   # whole sequences, in order
    assert [len(p) for p in pipeline.split_small(eng.pipelining(), chunks, 5)] == [5, 5, 2]   # each pass <= cap rows
    eng.micro_batches = 1
    assert [len(p) for p in pipeline.split_small(eng.pipelining(), chunks, 5)] == [5, 5, 2]   # as before: slices
    assert [len(p) for p in pipeline.split_small(eng.pipelining(), chunks, 64)] == [12]


def test_default_is_off_in_one_process_and_the_setting_is_checked(synth_model, monkeypatch):
    eng = _engine(synth_model, micro=None)
    assert pipeline.micro_batches(eng.pipelining(), 8) == 1     # simulated devices run one after another anyway
    monkeypatch.setenv(pipeline.ENV, "4")
    assert pipeline.env_micro_batches() == 4
    for bad in ("0", "x", "65", "-2", "1.5"):
        monkeypatch.setenv(pipeline.ENV, bad)
        with pytest.raises(ConfigError, match="METATP_MICRO_BATCHES"):
            pipeline.env_micro_batches()
    eng.micro_batches = 0
    with pytest.raises(ConfigError, match="Engine.micro_batches"):
        pipeline.micro_batches(eng.pipelining(), 8)


def test_the_cli_flag_reaches_every_engine(synth_model, monkeypatch):
    """`--micro-batches M` (generate, serve, bench, batched-bench) sets $METATP_MICRO_BATCHES,
    which every Engine of the process reads; a bad count is a ConfigError naming the flag."""
    import os

    from metatp import cli
    from metatp.backends.numpy.backend import NumpyBackend
    from metatp.passes.plan import DeviceLayout

    monkeypatch.setenv(pipeline.ENV, "auto")          # restored after the test
    for cmd in (["generate", "-p", "x"], ["serve"], ["bench"], ["batched-bench"]):
        args = cli._build_parser().parse_args([*cmd, "--micro-batches", "3"])
        cli._check_args(args)
        assert os.environ[pipeline.ENV] == "3"
        monkeypatch.setenv(pipeline.ENV, "auto")
    cli._check_args(cli._build_parser().parse_args(["serve", "--micro-batches", "2"]))
    layout = DeviceLayout(2, "layer")
    assert Engine(synth_model, 128, layout, NumpyBackend(layout)).micro_batches == 2
    with pytest.raises(ConfigError, match="--micro-batches must be"):
        cli._check_args(cli._build_parser().parse_args(["serve", "--micro-batches", "many"]))


class _Request:
    waited: list = []

    def __init__(self, data) -> None:
        self.data = data

    @classmethod
    def Waitall(cls, reqs) -> None:
        cls.waited.extend(reqs)


class _Comm:
    """The calls MpiSendRecv makes, recorded (rank 0 of 2)."""

    def __init__(self) -> None:
        self.log: list = []

    def Dup(self):
        return self

    def Get_rank(self) -> int:
        return 0

    def Get_size(self) -> int:
        return 2

    def Send(self, data, dest, tag) -> None:
        self.log.append(("Send", data.copy()))

    def Isend(self, data, dest, tag):
        self.log.append(("Isend", data))
        return _Request(data)


def test_deferred_sends_are_isends_completed_at_the_end_of_the_block():
    """Inside `deferred_sends` a send does not wait for its receiver; every request is waited
    for when the block ends, also when it raises, and a strided buffer's copy lives until then."""
    from metatp.backends.collectives.p2p import MpiSendRecv

    comm = _Comm()
    link = MpiSendRecv(comm)
    buf = np.arange(12, dtype=np.float32).reshape(3, 4)
    send, strided = link.prepare_send(buf, 1), link.prepare_send(buf[:, ::2], 1)
    send()
    assert [k for k, _ in comm.log] == ["Send"] and not link._pending
    _Request.waited = []
    with link.deferred_sends():
        send()
        strided()
        assert [k for k, _ in comm.log[1:]] == ["Isend", "Isend"] and len(link._pending) == 2
        assert comm.log[2][1].flags.c_contiguous and not np.shares_memory(comm.log[2][1], buf)
    assert len(_Request.waited) == 2 and not link._pending and not link.deferred
    with pytest.raises(RuntimeError):
        with link.deferred_sends():
            send()
            raise RuntimeError("a pass failed")
    assert len(_Request.waited) == 3 and not link._pending
    send()
    assert comm.log[-1][0] == "Send" and link.calls == 5
