"""-sm layer and -sm layer,tensor on the cupy backend, emulated (`EmuRuntime`, needs g++).

A layer plan's copies between devices are a peer copy between two (emulated) GPUs or a device
copy between virtual devices on one GPU, ordered by events and captured into the decode step's
CUDA graph; layer,tensor's stage groups all-reduce on their own (NCCL per group's GPUs, or the
butterfly over the group's virtual devices). Each must give one device's logits (within 1e-5
relative, at every prompt position and on decode steps) and its greedy tokens, with uneven
-ts, on gemma3's sliding-window layers too. The emulator is slow: small models, short runs,
one reference per model.
"""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import pytest

from metatp.backends.cuda.backend import CupyBackend
from metatp.engine import Engine
from metatp.ir.errors import ConfigError
from metatp.ir.loader import load_model
from metatp.passes.plan import DeviceLayout
from metatp.testing import EmuRuntime
from metatp.testing.synth import SynthSpec
from support.require import requires

pytestmark = requires("emulator")

SPEC = SynthSpec(n_layer=4, n_embd=64, n_head=4, n_head_kv=2, head_dim=16, n_ff=128, n_vocab=300, tied=False, seed=3,
                 types={"gate": "Q4_0", "up": "Q4_0", "down": "Q8_0"})     # the `path` fixture
GEMMA3 = SynthSpec(arch="gemma3", n_layer=6, qk_norm=True, post_norms=True, sliding_window=4, rope_base=1e6,
                   head_dim=16, n_ff=128, norm_eps=1e-6, seed=27, types={"q": "Q5_0", "down": "Q8_0"})
PROMPT = [1, 17, 42, 99, 7, 250, 3, 64]       # longer than gemma3's window
N_GEN = 2                     # decode steps: the first runs eagerly, the second is captured and replayed
_refs: dict[str, tuple] = {}


def _run(model, layout: DeviceLayout, n_gpus: int, **kw):
    """(prompt logits, greedy tokens, backend) on emulated GPUs, exact storage (f32 KV, f32 GEMM)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        be = CupyBackend(layout, runtime=EmuRuntime(n_gpus=n_gpus), kv_dtype="f32", matmul_dtype="f32", **kw)
    eng = Engine(model, 64, layout, be)
    logits = eng.forward(PROMPT, all_logits=True)
    tokens, steps, last = [], [], logits[-1]
    for _ in range(N_GEN):
        tokens.append(int(np.argmax(last)))
        last = eng.forward([tokens[-1]])
        steps.append(last)
    return np.vstack([logits, *steps]), tokens, be


def _reference(key: str, model):
    if key not in _refs:
        _refs[key] = _run(model, DeviceLayout(), 1)[:2]
    return _refs[key]


def _rel(a, b) -> float:
    return float(np.abs(np.asarray(a, np.float64) - b).max() / np.abs(b).max())


def _check(key, model, layout, n_gpus, varied: bool = True, **kw):
    """`varied`: the reference's greedy tokens differ (a model whose greedy run is not stuck)."""
    want, want_tokens = _reference(key, model)
    got, tokens, be = _run(model, layout, n_gpus, **kw)
    assert _rel(got, want) < 1e-5, (layout, _rel(got, want))
    assert tokens == want_tokens and (len(set(tokens)) > 1 or not varied)
    return be


@pytest.mark.parametrize("n, ts, n_gpus", [(2, (1, 3), 2), (3, (2, 1, 1), 1), (3, (1, 2, 2), 2)],
                         ids=["2gpus-ts1,3", "3virtual-1gpu-ts2,1,1", "3-on-2gpus-ts1,2,2"])
def test_layer_split_matches_one_device(synth_model, n, ts, n_gpus):
    """Peer copies (distinct GPUs), device copies (virtual devices), and both mixed; the decode
    step with its copies is captured and replayed as one graph."""
    be = _check("llama", synth_model, DeviceLayout(n, "layer", ts), n_gpus)
    assert "whole" in {ex.graph_mode for ex in be._executables.values()}
    plans = [ex for ex in be._executables.values() if any(ex.transfers)]
    assert plans and all(len(ex.transfers[k]) == len(sub.transfers) for ex in plans
                         for k, sub in enumerate(ex.plan.subgraphs))


@pytest.mark.parametrize("kw, modes", [({"cuda_graphs": False}, {None}),
                                      ({"multi_gpu_graphs": "segments"}, {None, "segments"})], ids=["eager", "segments"])
def test_layer_split_eager_and_segments_match_one_device(synth_model, kw, modes):
    """The same copies without CUDA graphs, and run eagerly between per-subgraph graph segments."""
    be = _check("llama", synth_model, DeviceLayout(2, "layer", (3, 1)), 2, **kw)
    assert {ex.graph_mode for ex in be._executables.values()} == modes


def test_gemma3_sliding_window_layer_split(synth_factory):
    model = load_model(synth_factory(GEMMA3)[0])
    """Six layers (gemma3 makes every sixth global): sliding-window and global masks both fed."""
    _check("gemma3", model, DeviceLayout(2, "layer", (1, 2)), 2, varied=False)   # its greedy run repeats a token


@pytest.mark.parametrize("n_gpus, ts", [(4, (1, 1)), (2, (1, 3))], ids=["4gpus-nccl-groups", "2gpus-virtual-ts1,3"])
def test_layer_tensor_2x2_matches_one_device(synth_model, n_gpus, ts):
    """P=2 stages of T=2: on 4 GPUs each stage all-reduces with NCCL over its own two GPUs; on
    2 GPUs (one per stage, two virtual devices each) with the butterfly inside the GPU."""
    be = _check("llama", synth_model, DeviceLayout(4, "layer,tensor", ts), n_gpus)
    if n_gpus == 4:
        assert sorted(be.group_nccl) == [(0, 1), (2, 3)] and be.rt.nccl_calls > 0
        _check_for_devices(be)


def _check_for_devices(be) -> None:
    """for_devices takes distinct devices of the collective's own group, made once per group."""
    from metatp.backends.cuda.collective import DeviceCollective

    coll = DeviceCollective(next(iter(be._executables.values())), be.mode)
    assert coll.for_devices((2, 3)) is coll.for_devices([2, 3]) and coll.for_devices(range(4)) is coll
    assert coll.for_devices((2, 3)).group == (2, 3)
    for bad in ((1, 1), (3, 4), ()):
        with pytest.raises(ConfigError, match="not distinct devices"):
            coll.for_devices(bad)


def test_gpu_check_layer_section_on_the_emulator(tmp_path):
    """scripts/gpu_check's -sm layer row (what a GPU session checks) passes on the emulator's dry run."""
    from scripts.gpu_check.config import Budget, Config
    from scripts.gpu_check.model import section_layer, write_model
    from scripts.gpu_check.report import Report

    cfg, rep = Config.dry_run(2), Report()
    section_layer(rep, cfg, write_model(rep, cfg, tmp_path), Budget(600))
    row = rep.rows[-1]
    assert row["check"].startswith("-sm layer N=2") and row["status"] == "pass", row
    assert "virtual devices on one GPU" in row["result"] and "whole" in row["result"]


class _FakeComm:
    """Two ranks' worth of MPI for the NCCL stand-in, in one process: what rank 0 sends is queued."""

    def __init__(self, rank: int, queue: list) -> None:
        self.rank, self.queue = rank, queue

    def allgather(self, item):
        uid, n, rank = item
        return [(uid, n, r) for r in range(n)]

    def send(self, obj, dest, tag):
        self.queue.append(obj)

    def Send(self, buf, dest, tag):  # noqa: N802 - mpi4py's name
        self.queue.append(np.array(buf, copy=True))

    def recv(self, source, tag):
        return self.queue.pop(0)

    def Recv(self, buf, source, tag):  # noqa: N802
        buf[...] = self.queue.pop(0)


def test_nccl_stand_in_send_recv_is_strict():
    """The stand-in's ncclSend / ncclRecv move the bytes, and refuse what NCCL would hang or
    corrupt on: a mismatched count or type, a peer outside the group or itself, a stream object."""
    from metatp.testing.mpi_nccl import NCCL_FLOAT32, MpiNcclComm, fake_unique_id

    queue: list = []
    uid = fake_unique_id()
    a, b = MpiNcclComm(2, uid, 0, _FakeComm(0, queue)), MpiNcclComm(2, uid, 1, _FakeComm(1, queue))
    x, y = np.arange(6, dtype=np.float32), np.zeros(6, np.float32)
    a.send(x.ctypes.data, 6, NCCL_FLOAT32, 1, 0x1000)
    b.recv(y.ctypes.data, 6, NCCL_FLOAT32, 0, 0x1000)
    assert np.array_equal(x, y) and a.p2p == [("send", 1, 6, NCCL_FLOAT32, 0x1000)]
    a.send(x.ctypes.data, 6, NCCL_FLOAT32, 1, 0x1000)
    with pytest.raises(RuntimeError, match="mismatched send/recv"):
        b.recv(y.ctypes.data, 5, NCCL_FLOAT32, 0, 0x1000)
    for peer in (0, 2):
        with pytest.raises(ValueError, match="not another rank"):
            a.send(x.ctypes.data, 6, NCCL_FLOAT32, peer, 0x1000)
    with pytest.raises(TypeError, match="raw stream handle"):
        a.send(x.ctypes.data, 6, NCCL_FLOAT32, 1, object())
    with pytest.raises(ValueError, match="datatype"):
        a.send(x.ctypes.data, 6, 3, 1, 0x1000)


def test_emulated_events_are_checked_as_cuda_does():
    """An event recorded on another GPU's stream, and a wait inside a capture on an event
    recorded outside it, are errors (the copies of a layer plan must not rely on either)."""
    rt = EmuRuntime(n_gpus=2)
    s0, s1, e0 = rt.new_stream(0), rt.new_stream(1), rt.new_event(0)
    rt.record(s0, e0)
    rt.wait(s1, e0)                       # another GPU's event: a stream may wait for it
    with pytest.raises(RuntimeError, match="InvalidResourceHandle"):
        rt.record(s1, e0)
    rt.begin_capture(s0)
    try:
        with pytest.raises(RuntimeError, match="CaptureIsolation"):
            rt.wait(s1, e0)
        rt.record(s0, e0)
        rt.wait(s1, e0)
    finally:
        rt.end_capture(s0)


def test_an_all_sliding_window_model_runs_without_its_full_mask(synth_factory):
    """Under six gemma3 layers every layer is a sliding-window one: the graph declares the full
    mask but no node reads it, and the CuPy executable takes (and drops) its value."""
    model = load_model(str(synth_factory(dataclasses.replace(GEMMA3, n_layer=2))[0]))
    got, tokens, _ = _run(model, DeviceLayout(), 1)
    from metatp.backends import create_backend

    ref = Engine(model, 64, DeviceLayout(), create_backend("numpy", DeviceLayout())).forward(PROMPT, all_logits=True)
    assert _rel(got[: len(PROMPT)], ref) < 1e-4
