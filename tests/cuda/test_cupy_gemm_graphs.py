"""Steps with a cuBLAS GEMM replay a CUDA graph (issue 46 item 1: every batch bucket replays one).

A MUL_MAT of more than 16 rows in exact numerics runs dequantize + cuBLAS (`matvec._gemm_steps`);
the GEMM is a `StreamCall` on the device stream, captured with the kernels where the runtime's
cuBLAS can be (`gemm_capturable`: cuBLAS >= 12.2). So a decode step of 32 sequences (the bucket of
32 rows) is captured on its second run and replayed from then on. What must hold, on the emulator
(`EmuRuntime` records the GEMM in the capture and runs it at each replay) and on a GPU:

- the replayed step gives the eager run's bits (same kernels and GEMMs in the same order), the
  GEMMs running in the replay;
- a runtime whose cuBLAS cannot be captured keeps the plan eager;
- a capture that fails anyway (the GEMM invalidates it) ends the capture, warns, and the steps run
  eagerly with the right results.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from metatp.backends.cuda.backend import CupyBackend
from metatp.backends.cuda.device_ops import HostStep, StreamCall, capturable
from metatp.engine import Engine, StepItem
from metatp.passes import DeviceLayout
from metatp.testing import EmuRuntime
from metatp.testing.synth import SynthSpec
from support.require import require, requires

SPEC = SynthSpec(n_layer=1, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, tied=False, seed=11, default_type="Q8_0",
                 n_ctx_train=4096)     # the `synth_model` fixture (tests/conftest.py)
B = 32                                 # the bucket of 32 rows: above MMQ_MAX_TOKENS (16), the GEMM path
PROMPTS = [[5 + i, 30 + 3 * i] for i in range(B)]
STEPS = 3                              # eager, captured, replayed

requires_gpu = requires("gpu")
RUNTIMES = [pytest.param("emu", marks=requires("emulator"), id="emulator"),
            pytest.param("gpu", marks=[pytest.mark.gpu, requires_gpu], id="gpu")]


def engine(model, rt, cuda_graphs: bool = True) -> Engine:
    """An engine on the cupy backend (`rt` None: a real GPU through CuPy)."""
    lay = DeviceLayout()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Engine(model, 256, lay, CupyBackend(lay, runtime=rt, cuda_graphs=cuda_graphs), n_batch=64)


def decode_steps(eng: Engine, tokens: list[list[int]]) -> list[list[np.ndarray]]:
    """B prompts prefilled in one step, then one decode step of all B per entry of `tokens`."""
    seqs = [eng.new_sequence() for _ in PROMPTS]
    eng.run([StepItem(s, p, "none") for s, p in zip(seqs, PROMPTS)])
    out = [eng.run([StepItem(s, [t], "last") for s, t in zip(seqs, step)]) for step in tokens]
    for s in seqs:
        eng.free(s)
    return out


def executable_of(eng: Engine, rows: int):
    (ex,) = [ex for key, (_, ex) in eng._plans.items() if key[0] == key[2] == rows]
    return ex


def stream_calls(ex) -> list[StreamCall]:
    return [s for per_dev in ex.steps for steps in per_dev for s in steps if isinstance(s, StreamCall)]


@pytest.fixture(scope="module")
def eager_reference(synth_model):
    """(tokens fed per step, eager logits per step) of the step of B sequences on the emulator,
    each step's tokens the greedy ones of the step before."""
    require("emulator")
    eng = engine(synth_model, EmuRuntime(), cuda_graphs=False)
    seqs = [eng.new_sequence() for _ in PROMPTS]
    eng.run([StepItem(s, p, "none") for s, p in zip(seqs, PROMPTS)])
    tokens, logits = [[7] * B], []
    for k in range(STEPS):
        logits.append(eng.run([StepItem(s, [t], "last") for s, t in zip(seqs, tokens[k])]))
        tokens.append([int(np.argmax(row)) for row in logits[-1]])
    return tokens[:STEPS], logits


def same_bits(got: list[np.ndarray], want: list[np.ndarray]) -> bool:
    return all(np.array_equal(g, w) for g, w in zip(got, want, strict=True))


@requires("emulator")
def test_a_step_of_32_rows_replays_its_graph_gemm_included(synth_model, eager_reference):
    tokens, want = eager_reference
    rt = EmuRuntime()
    eng = engine(synth_model, rt)
    seqs = [eng.new_sequence() for _ in PROMPTS]
    eng.run([StepItem(s, p, "none") for s, p in zip(seqs, PROMPTS)])
    for k, step in enumerate(tokens):
        launches, gemms = rt.graph_launches, rt.gemm_runs
        got = eng.run([StepItem(s, [t], "last") for s, t in zip(seqs, step)])
        assert same_bits(got, want[k]), f"step {k}"
        ex = executable_of(eng, B)
        calls = stream_calls(ex)
        assert calls and all(c.capturable for c in calls)       # the GEMM path, every GEMM capturable
        assert not any(isinstance(s, HostStep) for per_dev in ex.steps for steps in per_dev for s in steps)
        if k:                                  # captured on its second run, replayed from then on
            assert ex.graph_mode == "whole" and rt.graph_launches == launches + 1
            assert rt.gemm_runs - gemms == len(calls)          # the GEMMs ran inside the replay
        else:
            assert ex.graph_mode is None
    assert rt.emu.capture is None


@requires("emulator")
def test_a_gemm_the_runtime_cannot_capture_keeps_the_plan_eager(synth_model, eager_reference):
    tokens, want = eager_reference
    rt = EmuRuntime(gemm_capture=False)        # as a cuBLAS older than 12.2
    eng = engine(synth_model, rt)
    got = decode_steps(eng, tokens)
    assert all(same_bits(g, w) for g, w in zip(got, want))
    ex = executable_of(eng, B)
    assert stream_calls(ex) and not any(c.capturable for c in stream_calls(ex))
    assert not ex.capturable and ex.graph_mode is None and ex.runs == STEPS
    assert eng.backend.cuda_graphs and rt.graph_launches == 0    # graphs stay on for the plans without a GEMM


@requires("emulator")
def test_a_capture_the_gemm_breaks_warns_and_runs_eagerly(synth_model, eager_reference):
    tokens, want = eager_reference
    rt = EmuRuntime(gemm_breaks_capture=True)      # says yes, yet the GEMM invalidates the capture
    eng = engine(synth_model, rt)
    with pytest.warns(UserWarning, match=r"CUDA graph capture failed \(DeviceFaultError: .*"
                                         r"cudaErrorStreamCaptureUnsupported"):
        got = decode_steps(eng, tokens)
    assert all(same_bits(g, w) for g, w in zip(got, want))       # the failed step ran eagerly, right
    assert rt.emu.capture is None and rt.faults.capturing == 0 and rt.faults.failed is None   # stream usable
    assert not eng.backend.cuda_graphs and executable_of(eng, B).graph_mode is None
    assert rt.graph_launches == 0


def test_capturable_steps():
    """What keeps a plan eager: a HostStep always, a StreamCall its library refuses."""
    assert not capturable(HostStep(lambda: None, "cupy op"))
    assert capturable(StreamCall(lambda: None, "cuBLAS GEMM", True))
    assert not capturable(StreamCall(lambda: None, "cuBLAS GEMM", False))
    assert capturable(object())            # a launch, copy, memset, record or wait
    assert not EmuRuntime(gemm=False).gemm_capturable()


@pytest.mark.parametrize("kind", [p for p in RUNTIMES if p.id == "gpu"])
def test_gpu_step_of_32_rows_with_cublas_replays_its_graph(synth_model, kind):
    """On real CuPy: where cuBLAS >= 12.2 the step of 32 rows replays one graph, GEMMs included,
    else it stays eager; either way its logits are the eager run's (cuBLAS picks its algorithm by
    shape and workspace, so within 1e-5 of the largest logit, not bitwise)."""
    graphs, eager = engine(synth_model, None), engine(synth_model, None, cuda_graphs=False)
    tokens = [[7] * B]
    for _ in range(STEPS - 1):
        tokens.append([(t * 31 + 3) % 200 for t in tokens[-1]])
    got, want = decode_steps(graphs, tokens), decode_steps(eager, tokens)
    for g_step, w_step in zip(got, want):
        for g, w in zip(g_step, w_step):
            assert np.abs(g - w).max() <= 1e-5 * np.abs(w).max()
    ex = executable_of(graphs, B)
    assert stream_calls(ex)
    assert ex.graph_mode == ("whole" if graphs.backend.rt.gemm_capturable() else None)


# ---------------------------------------------------------------- CupyRuntime, with a stand-in CuPy
def fake_cupy_runtime(cublas_version: int | None, runtime_version: int, capturing_after_end: bool = False):
    """A CupyRuntime over a stand-in of CuPy's runtime and cuBLAS modules (no GPU): cuBLAS reports
    `cublas_version` (None: getVersion fails), the CUDA runtime `runtime_version`; a stream's
    `end_capture` raises the invalidated capture's error and, with `capturing_after_end`, leaves
    the stream capturing (the runtime must end that capture). Returns (runtime, ended captures)."""
    from types import SimpleNamespace

    from metatp.backends.cuda.faults import DeviceFaults, LibraryErrors
    from metatp.backends.cuda.runtime import CupyRuntime

    ended: list[int] = []
    state = {"capturing": False}

    class Cublas:
        def getVersion(self, handle):
            if cublas_version is None:
                raise RuntimeError("cublasGetVersion failed")
            return cublas_version

    class Stream:
        ptr = 0x1234

        def begin_capture(self):
            state["capturing"] = True

        def end_capture(self):
            state["capturing"] = capturing_after_end
            raise RuntimeError("cudaErrorStreamCaptureInvalidated")

    def stream_end_capture(ptr):
        ended.append(ptr)
        state["capturing"] = False

    runtime = SimpleNamespace(runtimeGetVersion=lambda: runtime_version, streamCaptureStatusNone=0,
                              streamIsCapturing=lambda ptr: 1 if state["capturing"] else 0,
                              streamEndCapture=stream_end_capture)
    rt = CupyRuntime.__new__(CupyRuntime)
    rt.cp = SimpleNamespace(cuda=SimpleNamespace(runtime=runtime,
                                                 device=SimpleNamespace(get_cublas_handle=lambda: 1)))
    rt._cublas, rt._gemm_capture = Cublas(), None
    rt.faults = DeviceFaults(LibraryErrors(), lambda: 0, lambda gpu: 0)
    return rt, Stream(), ended, state


@pytest.mark.parametrize("cublas_version,runtime_version,want", [
    (120205, 12020, True),          # CUDA 12.2: cuBLAS 12.2.5
    (130002, 13000, True),          # CUDA 13.0
    (120103, 12010, False),         # CUDA 12.1: cuBLAS keeps a workspace per capture
    (120205, 12010, False),         # a newer cuBLAS under an older runtime
    (11402, 11040, False),          # CUDA 11.4 (cuBLAS 11 counted major * 1000)
    (None, 12040, False),           # the version cannot be read
])
def test_cupy_runtime_says_whether_its_gemm_can_be_captured(cublas_version, runtime_version, want):
    rt, *_ = fake_cupy_runtime(cublas_version, runtime_version)
    assert rt.gemm_capturable() is want


@pytest.mark.parametrize("capturing_after_end", [False, True])
def test_cupy_runtime_ends_a_failed_capture(capturing_after_end):
    """cudaStreamEndCapture of an invalidated capture raises; the stream is left not capturing
    (ended again when the failed end left it open), so the step's eager run can use it."""
    rt, stream, ended, state = fake_cupy_runtime(120205, 12020, capturing_after_end)
    rt.begin_capture(stream)
    with pytest.raises(RuntimeError, match="Invalidated"):
        rt.end_capture(stream)
    assert not state["capturing"] and rt.faults.capturing == 0
    assert ended == ([stream.ptr] if capturing_after_end else [])


# ---------------------------------------------------------------- the GPU check's throughput row
def test_throughput_row_names_the_plans_with_cublas_and_how_they_ran():
    """`plans by rows`: each row count's plans, ' + cuBLAS' where one has GEMMs; then whether the
    runtime lets a capture take them (what the next GPU run shows for the buckets 32..256)."""
    from types import SimpleNamespace

    from scripts.gpu_check.report import Report
    from scripts.gpu_check.throughput import _graph_note

    gemm = StreamCall(lambda: None, "cuBLAS GEMM", True)

    def ex(mode, runs, *steps):
        return SimpleNamespace(graph_mode=mode, runs=runs, steps=[[list(steps)]])
    plans = {(1, 256, 1): (None, ex("whole", 5, object())), (32, 256, 32): (None, ex("whole", 5, object(), gemm)),
             (64, 256, 64): (None, ex(None, 3, gemm)), (512, 512, 1): (None, ex(None, 1, gemm)),
             (512, 1024, 1): (None, ex("whole", 2, gemm))}
    for capture in (True, False):
        rep = Report()
        llm = SimpleNamespace(engine=SimpleNamespace(_plans=plans, backend=SimpleNamespace(
            rt=EmuRuntime(gemm_capture=capture))))
        _graph_note(rep, llm, "1B Q8_0")
        rows = {r["check"]: r["result"] for r in rep.rows}
        assert rows["plans by rows, 1B Q8_0"] == ("1: whole, 32: whole + cuBLAS, 64: eager + cuBLAS, "
                                                  "512: once + cuBLAS/whole + cuBLAS")
        assert rows["cuBLAS GEMM in CUDA graphs, 1B Q8_0"] == ("yes" if capture else "no (cuBLAS or the CUDA "
                                                               "runtime below 12.2, or no cuBLAS: plans with a "
                                                               "GEMM run eagerly)")
