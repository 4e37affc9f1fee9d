"""GPU faults as typed errors: device out of memory (at load and at run), a failed kernel launch and
an NCCL error, from the runtime to the server.

On the CPU emulator, faults are injected into the emulated runtime (`EmuRuntime.inject`): the
call raises what the library would, inside the same guard as the real runtime's, so these tests
see the errors the backend meets on a GPU. The `gpu` tests provoke the real thing (an allocation
past free memory, a kernel that writes through a null pointer) and are skipped without a GPU.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from metatp import LLM
from metatp.backends.cuda.backend import CupyBackend
from metatp.backends.cuda.faults import DeviceFaults, LibraryErrors, cupy_errors
from metatp.engine import Engine
from metatp.ir.errors import CollectiveError, DeviceFaultError, DeviceMemoryError, MemoryPlanError
from metatp.passes import DeviceLayout
from metatp.sampling import SamplingParams
from metatp.testing import EmuRuntime
from metatp.testing.emulated_faults import EMULATED_ERRORS, EmulatedCudaError, EmulatedOutOfMemory
from metatp.testing.synth import SynthSpec
from support.require import requires

requires_emulator = requires("emulator")

SPEC = SynthSpec(n_layer=1, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, n_vocab=300, seed=5)
SMALL = [5, 17, 42]
BIG = list(range(1, 61))          # a 60-token prompt: a pass of 64 rows, buffers no decode step needs
GREEDY = SamplingParams(max_tokens=3, temperature=0.0)


def engine(synth_model, rt: EmuRuntime, n: int = 1, n_ctx: int = 128, **options) -> Engine:
    lay = DeviceLayout(n, "tensor" if n > 1 else "none")
    return Engine(synth_model, n_ctx, lay, CupyBackend(lay, runtime=rt, **options), n_batch=64)


def largest_buffers(backend: CupyBackend) -> int:
    """The most bytes any prepared plan's buffers take on one device."""
    return max(max(ex.buffer_bytes) for ex in backend._executables.values())


def emulated_llm(monkeypatch, path: str, rt: EmuRuntime, **options) -> LLM:
    """An LLM whose cupy backend runs on `rt` (the GPU probe answers yes; the runtime is `rt`)."""
    import metatp.backends as backends
    import metatp.backends.cuda.backend as cuda_backend

    monkeypatch.setattr(backends, "gpu_probe", lambda: (True, ""))
    monkeypatch.setattr(cuda_backend, "CupyRuntime", lambda: rt)
    return LLM(path, backend="cupy", n_ctx=128, n_batch=64, **options)


# ------------------------------------------------------------------ the translation, by type
def test_the_translation_maps_each_library_error_by_type_and_marks_only_sticky_faults():
    faults = DeviceFaults(EMULATED_ERRORS, lambda: 2, lambda gpu: 1234)
    oom = faults.translate(EmulatedOutOfMemory(4096), needed=4096)
    assert isinstance(oom, DeviceMemoryError) and isinstance(oom, MemoryPlanError)
    assert (oom.gpu, oom.needed, oom.free) == (2, 4096, 1234)
    assert "out of memory on GPU 2" in str(oom) and "4.00 KiB" in str(oom)
    assert faults.failed is None                                   # out of memory leaves the device usable
    status_oom = faults.translate(EmulatedCudaError(2))            # cudaErrorMemoryAllocation from any call
    assert isinstance(status_oom, DeviceMemoryError) and status_oom.needed is None
    soft = faults.translate(EmulatedCudaError(701), kernel="matvec_f32")
    assert isinstance(soft, DeviceFaultError) and not soft.sticky and faults.failed is None
    faults.capturing = 1                                           # inside a capture: abandoned, not sticky
    assert not faults.translate(EmulatedCudaError(700)).sticky and faults.failed is None
    faults.capturing = 0
    hard = faults.translate(EmulatedCudaError(700), kernel="rms_norm_f32")
    assert hard.sticky and faults.failed is hard and hard.kernel == "rms_norm_f32"
    assert "cudaErrorIllegalAddress" in str(hard) and "'rms_norm_f32'" in str(hard)
    with pytest.raises(DeviceFaultError, match="failed earlier") as later:
        faults.check()
    assert later.value.earlier and later.value.gpu == 2


def test_an_error_the_library_does_not_raise_passes_through_untouched():
    faults = DeviceFaults(EMULATED_ERRORS, lambda: 0, lambda gpu: 0)
    with pytest.raises(ValueError, match="not a device error"):
        with faults.guard():
            raise ValueError("not a device error")
    assert faults.failed is None


@requires("nvrtc")
def test_cupy_exceptions_are_translated_by_type():
    """CuPy's own exception objects (made without a GPU) through the real runtime's table."""
    from cupy.cuda.memory import OutOfMemoryError
    from cupy_backends.cuda.api.runtime import CUDARuntimeError

    faults = DeviceFaults(cupy_errors(), lambda: 0, lambda gpu: 2 << 30)
    with pytest.raises(DeviceMemoryError) as oom:
        with faults.guard(needed=3 << 30):
            raise OutOfMemoryError(3 << 30, 1 << 30, 0)
    assert (oom.value.needed, oom.value.free) == (3 << 30, 2 << 30)
    assert isinstance(oom.value.__cause__, OutOfMemoryError)       # the library's error, chained
    assert isinstance(faults.translate(CUDARuntimeError(2)), DeviceMemoryError)
    with pytest.raises(DeviceFaultError, match="cudaErrorIllegalAddress"):
        with faults.guard():
            raise CUDARuntimeError(700)
    assert faults.failed is not None and faults.failed.sticky


def test_library_types_loaded_later_are_learned():
    class NcclError(RuntimeError):
        pass

    faults = DeviceFaults(LibraryErrors(), lambda: 0, lambda gpu: 0)
    with pytest.raises(NcclError):
        with faults.guard():
            raise NcclError("before NCCL loads: not one of the library's types")
    faults.learn(nccl=(NcclError,))
    err = faults.translate(NcclError("ncclSystemError: unhandled system error"), op="all-reduce", gpus=(0, 1))
    assert isinstance(err, CollectiveError) and (err.op, err.gpus) == ("all-reduce", (0, 1)) and err.sticky


def test_device_errors_keep_their_numbers_through_pickling():
    import pickle

    for e in (DeviceMemoryError(1, 3 << 30, 1 << 30, "weight 'w'"), DeviceFaultError(0, "cudaErrorAssert", "k"),
              CollectiveError("all-reduce", (0, 1), "ncclRemoteError").again()):
        back = pickle.loads(pickle.dumps(e))
        assert type(back) is type(e) and str(back) == str(e) and back.args == e.args


# ------------------------------------------------------------------ the backend, on the emulator
@requires_emulator
def test_out_of_memory_at_load_is_typed_with_needed_and_free(synth_model):
    rt = EmuRuntime(mem_free=3 << 20, pool_free=1 << 20)
    eng = engine(synth_model, rt)
    rt.inject("oom")                    # the first allocation: a weight
    with pytest.raises(DeviceMemoryError) as e:
        eng.forward(SMALL)
    err = e.value
    assert err.gpu == 0 and err.needed > 0 and err.free == 4 << 20 and err.what.startswith("weight ")
    assert eng.backend.fault is None
    assert eng.forward(SMALL).shape == (SPEC.n_vocab,)        # nothing stuck: the next try loads and runs


@requires_emulator
def test_out_of_memory_for_the_kv_cache_names_it(synth_model):
    rt = EmuRuntime()
    eng = engine(synth_model, rt, n_ctx=4096)
    kv = 4096 * 32 * 2                              # one layer's K cache: n_ctx x (2 KV heads of 16), f16
    rt.inject("oom", min_bytes=kv, times=None)      # every weight is smaller: only the caches fail
    with pytest.raises(DeviceMemoryError, match="KV cache") as e:
        eng.forward(SMALL)
    assert e.value.needed >= kv


@requires_emulator
def test_out_of_memory_at_run_fails_that_batch_and_a_small_one_runs_after(synth_model):
    rt = EmuRuntime()
    eng = engine(synth_model, rt)
    eng.forward(SMALL)
    eng.reset()
    rt.inject("oom", min_bytes=largest_buffers(eng.backend) + 1, times=None)   # nothing bigger fits now
    seq = eng.new_sequence()
    with pytest.raises(DeviceMemoryError, match="the buffers of plan .*-T64-") as e:
        eng.forward(BIG, seq=seq)
    assert e.value.needed > largest_buffers(eng.backend) and seq.n_past == 0     # the failed step committed nothing
    eng.free(seq)
    assert eng.forward(SMALL).shape == (SPEC.n_vocab,) and eng.backend.fault is None


@requires_emulator
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph"])
def test_a_failed_launch_is_a_device_fault_and_the_backend_refuses_after(synth_model, graphs):
    rt = EmuRuntime()
    eng = engine(synth_model, rt, cuda_graphs=graphs)
    for t in SMALL:                     # the decode plan runs twice: captured (graphs) and replayed
        eng.forward([t])
    rt.inject("launch", after_n_calls=3)
    with pytest.raises(DeviceFaultError) as e:
        eng.forward([7])
    err = e.value
    assert err.sticky and not err.earlier and err.gpu == 0 and "cudaErrorLaunchFailure" in str(err)
    # eagerly the launch names its kernel; in a replayed graph the fault surfaces at the graph launch
    assert (err.kernel is not None) == (not graphs)
    assert eng.backend.fault is err
    launches = rt.emu.launches
    for call in (lambda: eng.forward([8]), lambda: eng.forward(BIG, seq=eng.new_sequence())):
        with pytest.raises(DeviceFaultError, match="failed earlier") as later:
            call()
        assert later.value.earlier
    assert rt.emu.launches == launches             # refused before any work was queued


@requires_emulator
def test_a_launch_error_that_is_not_sticky_fails_the_step_only(synth_model):
    rt = EmuRuntime()
    eng = engine(synth_model, rt, cuda_graphs=False)
    eng.forward(SMALL)
    rt.inject("launch", status=701)          # too many resources requested: this launch only
    with pytest.raises(DeviceFaultError, match="cudaErrorLaunchOutOfResources") as e:
        eng.forward([7])
    assert not e.value.sticky and eng.backend.fault is None
    assert eng.forward([7]).shape == (SPEC.n_vocab,)


@requires_emulator
def test_an_nccl_error_on_a_two_gpu_split_is_a_collective_error(synth_model):
    rt = EmuRuntime(n_gpus=2)
    eng = engine(synth_model, rt, n=2, cuda_graphs=False, allreduce="nccl")
    eng.forward(SMALL)
    calls = rt.nccl_calls
    rt.inject("nccl", after_n_calls=1)
    with pytest.raises(CollectiveError) as e:
        eng.forward([7])
    err = e.value
    assert not err.earlier and err.op == "all-reduce" and err.gpus == (0, 1) and "ncclSystemError" in str(err) and "GPUs 0, 1" in str(err)
    assert eng.backend.fault is err
    with pytest.raises(CollectiveError, match="failed earlier"):       # no fallback to another all-reduce
        eng.forward([8])
    assert rt.nccl_calls == calls + 1                                 # the one that worked


# ------------------------------------------------------------------ through the server
@pytest.fixture
def faulty_server(monkeypatch, path):
    """(client, runtime, llm): the real app over an LLM on the emulated cupy backend."""
    from metatp.server import create_app
    from support.require import require
    from support.serving import optional_import

    require("emulator")
    testclient = optional_import("fastapi.testclient")
    rt = EmuRuntime(mem_free=6 << 20)
    llm = emulated_llm(monkeypatch, path, rt, enable_prefix_caching=False)
    with testclient.TestClient(create_app(llm, max_model_len=128)) as client:
        yield client, rt, llm


def complete(client, prompt, **body):
    return client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2, "temperature": 0, **body})


def test_the_server_answers_503_for_a_batch_that_does_not_fit_and_serves_what_fits(faulty_server):
    client, rt, llm = faulty_server
    assert complete(client, SMALL).status_code == 200
    rt.inject("oom", min_bytes=largest_buffers(llm.backend) + 1, times=None)
    r = complete(client, BIG)
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    err = r.json()["error"]
    assert err["code"] == "device_out_of_memory" and err["type"] == "server_error"
    assert "out of memory on GPU 0" in err["message"] and "6.00 MiB free" in err["message"]
    assert "Traceback" not in r.text
    assert client.get("/health").json() == {"status": "ok"}
    ok = complete(client, SMALL)
    assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"


def test_a_failed_device_is_503_and_health_reports_it_while_the_server_answers(faulty_server):
    client, rt, llm = faulty_server
    assert complete(client, SMALL).status_code == 200
    rt.inject("launch", status=700)
    r = complete(client, SMALL)
    assert r.status_code == 503 and "retry-after" not in r.headers
    assert r.json()["error"]["code"] == "device_failed" and "cudaErrorIllegalAddress" in r.json()["error"]["message"]
    health = client.get("/health")
    assert health.status_code == 503
    assert health.json()["status"] == "error" and health.json()["device"] == "GPU 0"
    assert "cudaErrorIllegalAddress" in health.json()["error"]
    t0 = time.perf_counter()
    later = complete(client, SMALL)                   # refused at once, never queued
    assert later.status_code == 503 and "failed earlier" in later.json()["error"]["message"]
    assert time.perf_counter() - t0 < 5
    assert complete(client, SMALL, stream=True).status_code == 503       # before any event is sent
    assert client.get("/v1/models").status_code == 200      # the server itself still answers


def test_a_streamed_request_that_fails_on_the_device_ends_with_an_error_event(faulty_server):
    client, rt, llm = faulty_server
    assert complete(client, SMALL).status_code == 200
    rt.inject("launch", after_n_calls=2, status=700)
    with client.stream("POST", "/v1/completions", json={"prompt": SMALL, "max_tokens": 4, "stream": True}) as r:
        text = "".join(r.iter_text())
    assert '"code":"device_failed"' in text and text.rstrip().endswith("data: [DONE]")


def test_out_of_memory_at_load_reaches_the_api_caller_typed(monkeypatch, path):
    from support.require import require

    require("emulator")
    rt = EmuRuntime(mem_free=5 << 20)
    llm = emulated_llm(monkeypatch, path, rt)
    rt.inject("oom")
    with pytest.raises(DeviceMemoryError) as e:
        llm.generate([SMALL], GREEDY)
    assert e.value.free == 5 << 20 and e.value.needed > 0
    out = llm.generate([SMALL], GREEDY)[0].outputs[0]
    assert len(out.token_ids) == GREEDY.max_tokens


# ------------------------------------------------------------------ a real GPU
@pytest.mark.gpu
@requires("gpu")
def test_a_real_allocation_past_free_memory_is_a_device_memory_error():
    from metatp.backends.cuda.runtime import CupyRuntime

    rt = CupyRuntime()
    free = rt.mem_info(0)[0] + rt.pool_free_bytes(0)
    with rt.device(0), pytest.raises(DeviceMemoryError) as e:
        rt.empty((free + (1 << 30),), np.uint8)
    assert e.value.gpu == 0 and e.value.needed == free + (1 << 30)
    assert e.value.free is not None and e.value.free < e.value.needed
    assert rt.faults.failed is None
    with rt.device(0):
        assert rt.empty((1 << 20,), np.uint8).nbytes == 1 << 20        # what fits still runs


FAULTING_KERNEL = textwrap.dedent('''
    from metatp.backends.cuda.faults import CheckedKernel
    from metatp.backends.cuda.runtime import CupyRuntime
    from metatp.ir.errors import DeviceFaultError

    rt = CupyRuntime()
    src = 'extern "C" __global__ void write_null(float* p) { p[threadIdx.x] = 1.0f; }'
    k = CheckedKernel(rt.cp.RawKernel(src, "write_null"), "write_null", 0, rt.faults)
    stream = rt.new_stream(0)
    with rt.context(0, stream):
        k((1,), (32,), (rt.cp.uint64(0),))
    try:
        rt.synchronize(stream)
    except DeviceFaultError as e:
        assert e.sticky and rt.faults.failed is e, e
        try:
            rt.empty((16,), "float32")
        except DeviceFaultError as later:
            assert later.earlier
            print("typed:", e)
        else:
            raise SystemExit("a failed device gave memory")
    else:
        raise SystemExit("the null write did not fault")
''')


@pytest.mark.gpu
@requires("gpu")
def test_a_real_kernel_fault_is_a_sticky_device_fault():
    """In a process of its own: the fault leaves that process's CUDA context unusable."""
    r = subprocess.run([sys.executable, "-c", FAULTING_KERNEL], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "typed: GPU 0 failed" in r.stdout and "cudaErrorIllegalAddress" in r.stdout
