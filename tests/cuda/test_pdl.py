"""Programmatic dependent launch (the cupy backend's ``pdl`` option, issue 44).

Without a GPU: every kernel begins with ``mt_pdl_wait()`` (read from the sources, as the launcher
reads it), the emulator runs a decode with the attribute on every launch and gives the same bits
as without it (checking that every thread of each such launch waited), the option is refused
below sm_90, and the cuLaunchKernelEx path packs the arguments as CuPy does and builds its launch
configuration with the attribute (the real binding where it is installed). nvcc compiles the
griddepcontrol instructions for sm_90 only. On a GPU (marked ``gpu``): decode with pdl on and off
gives the same tokens and logits.
"""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
import sys
import warnings
from types import SimpleNamespace

import numpy as np
import pytest

from metatp.backends.cuda import kernels as ck
from metatp.backends.cuda import launch
from metatp.backends.cuda.backend import CupyBackend
from metatp.backends.cuda.pdl import PdlLauncher, ProgrammaticKernel, load_driver, pack_args
from metatp.backends.registry import backend_entry
from metatp.engine import Engine
from metatp.ir.errors import BackendUnavailableError, ConfigError
from metatp.passes import DeviceLayout
from metatp.testing import EmuRuntime
from metatp.testing.synth import SynthSpec
from support.require import require, requires

requires_cxx = requires("emulator")

SPEC = SynthSpec(n_layer=2, n_embd=128, n_head=4, n_head_kv=2, n_ff=192, n_vocab=256,
                 types={"q": "Q4_1", "k": "Q4_1", "v": "Q8_0", "o": "Q4_0", "gate": "Q4_0", "up": "Q4_1",
                        "down": "Q8_0", "embd": "Q8_0"}, seed=11)
PROMPT = [3, 14, 15, 92, 65, 35]


# ------------------------------------------------------------------ which kernels are PDL-ready
def test_every_kernel_waits_before_anything_else():
    """Every entry point of every family begins with mt_pdl_wait(): pdl=True launches them all
    programmatically (a kernel added without it would be launched the ordinary way)."""
    for family, names in ck.expected_entry_points().items():
        not_ready = [n for n in names if not launch.pdl_ready(family, n)]
        assert not not_ready, f"{family}: kernels without mt_pdl_wait() first: {not_ready}"


def test_pdl_ready_reads_the_first_statement(monkeypatch):
    src = r'''
#define ENTRY(name, W)                                                     \
    extern "C" __global__ void __launch_bounds__(256) k_##name##_x(int a, \
                                                                  int b) { \
        /* first */ mt_pdl_wait(); mt_pdl_launch_dependents();            \
    }
ENTRY(f32, WF32)
extern "C" __global__ void early(const float* x) {
    if (x == 0) return;
    mt_pdl_wait();
}
extern "C" __global__ void __launch_bounds__(1024)
    k_twice_x(int a) { a += 1; }
'''
    monkeypatch.setattr(launch, "module_source", lambda family: src)
    monkeypatch.setattr(launch, "_pdl_cache", {})
    monkeypatch.setattr(launch, "_pdl_answers", {})
    assert launch.pdl_ready("fam", "k_f32_x")
    assert not launch.pdl_ready("fam", "early")          # returns before waiting
    assert not launch.pdl_ready("fam", "k_twice_x")      # a second definition makes the name without the wait
    assert not launch.pdl_ready("fam", "absent")
    defs = launch.kernel_definitions(src)
    assert [ok for _, ok in defs] == [True, False, False]


# ------------------------------------------------------------------ the cuLaunchKernelEx path
class _DeviceArray:
    """Stands in for a cupy ndarray: what the packer reads is ``data.ptr``."""

    def __init__(self, ptr: int) -> None:
        self.data = SimpleNamespace(ptr=ptr)


def test_pack_args_as_cupy_packs_them():
    """matvec_q4_0_t1's signature (pointers, ints, an optional pointer as NULL) plus the other
    kinds of value a launch may carry: each pointer of the packed array points at the
    argument's bytes, of the parameter's size."""
    args = (_DeviceArray(0x7F00_0000_1000), _DeviceArray(0x7F00_0000_2000), np.uint64(0x7F00_0000_3000),
            np.int32(576), np.int32(-3), np.int64(1 << 40), np.float32(1.5), np.uint64(0), 7, 0.25, True)
    p = pack_args(args)
    want = [np.uint64(0x7F00_0000_1000).tobytes(), np.uint64(0x7F00_0000_2000).tobytes(),
            np.uint64(0x7F00_0000_3000).tobytes(), np.int32(576).tobytes(), np.int32(-3).tobytes(),
            np.int64(1 << 40).tobytes(), np.float32(1.5).tobytes(), bytes(8), np.int64(7).tobytes(),
            np.float64(0.25).tobytes(), np.int64(1).tobytes()]
    assert [p.value_bytes(i) for i in range(len(args))] == want
    assert p.sizes == (8, 8, 8, 4, 4, 8, 4, 8, 8, 8, 8)
    # kernelParams is a void**: the array of slot addresses, read back through ctypes
    ptrs = (ctypes.c_void_p * len(args)).from_address(p.address)
    assert [ptrs[i] for i in range(len(args))] == [p.pointers[i] for i in range(len(args))]
    assert pack_args(()).address == 0
    for bad in (np.zeros(3, np.float32), None, np.complex128(1), "x"):
        with pytest.raises(TypeError):
            pack_args((bad,))


class _FakeDriver:
    """The parts of cuda.bindings.driver the launcher uses, recording the calls."""

    class CUlaunchAttributeID:
        CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6

    class CUlaunchAttribute:
        def __init__(self) -> None:
            self.id = None
            self.value = SimpleNamespace(programmaticStreamSerializationAllowed=0)

    class CUlaunchConfig:
        pass

    CUstream = staticmethod(lambda h: ("stream", h))
    CUfunction = staticmethod(lambda h: ("function", h))

    def __init__(self, status: int = 0) -> None:
        self.status = status
        self.calls: list = []

    def cuInit(self, flags):
        self.calls.append(("cuInit", flags))
        return (0,)

    def cuLaunchKernelEx(self, cfg, f, params, extra):
        vals = ctypes.c_void_p.from_address(params).value if params else None
        self.calls.append(("launch", cfg, f, ctypes.c_int32.from_address(vals).value if vals else None, extra))
        return (self.status,)


def test_launcher_hands_the_driver_config_function_and_arguments():
    drv = _FakeDriver()
    pl = PdlLauncher(driver=drv)
    pl.launch(0xABC, (5, 2), (128,), (np.int32(42),), 2048, 0x77)
    pl.launch(0xABC, (1,), (32, 4), (np.int32(-1),), 0, 0x77)
    assert [c[0] for c in drv.calls] == ["cuInit", "launch", "launch"]      # the driver bound once
    _, cfg, f, first_arg, extra = drv.calls[1]
    assert f == ("function", 0xABC) and first_arg == 42 and extra == 0
    assert (cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ, cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ) == (5, 2, 1, 128, 1, 1)
    assert cfg.sharedMemBytes == 2048 and cfg.hStream == ("stream", 0x77) and cfg.numAttrs == 1
    (attr,) = cfg.attrs
    assert attr.id == 6 and attr.value.programmaticStreamSerializationAllowed == 1
    failing = PdlLauncher(driver=_FakeDriver(status=719), error=lambda s: OSError(f"status {s}"))
    with pytest.raises(OSError, match="status 719"):
        failing.launch(1, (1,), (32,), (), 0, 0)


@requires("cuda_bindings")
def test_launch_config_of_the_real_binding():
    """The CUlaunchConfig cuda-bindings builds carries the attribute (no GPU needed to build it)."""
    drv = load_driver()
    cfg = PdlLauncher(driver=drv).config((7, 3), (256,), 4096, 0x1234)
    assert (cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ) == (7, 3, 1)
    assert (cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ) == (256, 1, 1)
    assert cfg.sharedMemBytes == 4096 and int(cfg.hStream) == 0x1234 and cfg.numAttrs == 1
    (attr,) = cfg.attrs
    assert attr.id == drv.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    assert attr.value.programmaticStreamSerializationAllowed == 1


def test_missing_binding_is_refused_by_name(monkeypatch):
    monkeypatch.setitem(sys.modules, "cuda.bindings", None)
    with pytest.raises(BackendUnavailableError, match=r"cuLaunchKernelEx.*metatp\[pdl\]"):
        load_driver()


def test_programmatic_kernel_routes_by_the_flag():
    """A plain launch stays CuPy's; a programmatic one goes to cuLaunchKernelEx with the kernel's
    CUfunction (RawKernel.kernel.ptr) and the current stream."""
    plain, ex = [], []

    class Raw:                                  # a cupy RawKernel: called, and its CUfunction
        kernel = SimpleNamespace(ptr=0xF00)
        max_dynamic_shared_size_bytes = 0

        def __call__(self, *a, **k):
            plain.append((a, k))
    raw = Raw()
    launcher = SimpleNamespace(launch=lambda *a: ex.append(a))
    k = ProgrammaticKernel(raw, launcher, lambda: 0x55)
    k((2,), (64,), (np.int32(1),), shared_mem=16)
    k((2,), (64,), (np.int32(1),), shared_mem=16, programmatic=True)
    assert plain == [(((2,), (64,), (np.int32(1),)), {"shared_mem": 16})]
    assert ex == [(0xF00, (2,), (64,), (np.int32(1),), 16, 0x55)]
    k.max_dynamic_shared_size_bytes = 65536
    assert raw.max_dynamic_shared_size_bytes == 65536


@requires("nvrtc")
@requires("cuda_bindings")
def test_cupy_runtime_hands_out_programmatic_kernels(monkeypatch):
    """CupyRuntime.enable_pdl on a stand-in for CuPy's device calls: refused on sm_80; on sm_90 the
    kernels it hands out launch programmatically through cuLaunchKernelEx with the kernel's
    CUfunction and CuPy's current stream, and plainly through the RawKernel otherwise."""
    from metatp.backends.cuda.runtime import CupyRuntime

    plain = []

    class Raw:
        kernel = SimpleNamespace(ptr=0xBEEF)
        max_dynamic_shared_size_bytes = 0

        def __call__(self, *a, **k):
            plain.append(a)
    cc = {"value": "80"}

    class Device:
        def __init__(self, gpu: int) -> None:
            self.compute_capability = cc["value"]
    rt = CupyRuntime()
    rt.cp = SimpleNamespace(
        cuda=SimpleNamespace(Device=Device, runtime=SimpleNamespace(getDevice=lambda: 0),
                             get_current_stream=lambda: SimpleNamespace(ptr=0x99)),
        RawModule=lambda code, options: SimpleNamespace(get_function=lambda name: Raw()))
    monkeypatch.setattr(rt, "gpu_name", lambda gpu: "stand-in")
    with pytest.raises(BackendUnavailableError, match=r"GPU 0 \(stand-in\) is 8\.0"):
        rt.enable_pdl([0])
    assert not rt.programmatic
    cc["value"] = "90"
    rt.enable_pdl([0])
    assert rt.programmatic
    k = rt.kernel("norm", "rms_norm_f32")
    drv = _FakeDriver()
    k.raw.launcher.driver = drv
    k((3,), (64,), (np.int32(8),), programmatic=True)
    k((3,), (64,), (np.int32(8),))
    (_, cfg, f, first_arg, _) = drv.calls[-1]
    assert f == ("function", 0xBEEF) and cfg.hStream == ("stream", 0x99) and first_arg == 8
    assert plain == [((3,), (64,), (np.int32(8),))]


# ------------------------------------------------------------------ the option
def test_option_is_checked_and_refused_below_sm90():
    entry = backend_entry("cupy")
    with pytest.raises(ConfigError, match="pdl"):
        entry.create(DeviceLayout(), {"pdl": "yes"}, runtime=EmuRuntime())
    with pytest.raises(BackendUnavailableError, match=r"pdl=True needs compute capability 9\.0.*is 8\.0"):
        entry.create(DeviceLayout(), {"pdl": True}, runtime=EmuRuntime(compute_capability=80))
    be = entry.create(DeviceLayout(), {"pdl": True}, runtime=EmuRuntime())
    assert be.pdl and be.rt.programmatic and ("pdl", True) in be.describe().options
    off = entry.create(DeviceLayout(), {}, runtime=EmuRuntime())
    assert not off.pdl and not off.rt.programmatic


def _engine(model, pdl: bool, **kw) -> Engine:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lay = DeviceLayout(1, "none")
        return Engine(model, 256, lay, CupyBackend(lay, runtime=EmuRuntime(), pdl=pdl, **kw))


def _launches(be) -> list:
    return [s for ex in be._executables.values() for per_dev in ex.steps for steps in per_dev for s in steps
            if isinstance(s, launch.Launch)]


@requires_cxx
def test_decode_with_pdl_gives_the_same_bits(synth_model):
    """The same kernels with the attribute: prefill and decode steps (the CUDA graph captured and
    replayed) give bit-identical logits; every recorded launch carries the attribute and the
    emulator ran them as such, eagerly and in replays, each thread waiting first."""
    plain, pdl = _engine(synth_model, False), _engine(synth_model, True)
    a, b = plain.forward(PROMPT), pdl.forward(PROMPT)
    assert np.array_equal(a, b)
    emu = pdl.backend.rt.emu
    after_prefill = sum(emu.programmatic.values())
    assert after_prefill > 0
    for _ in range(3):
        tok = int(np.argmax(a))
        a, b = plain.forward([tok]), pdl.forward([tok])
        assert np.array_equal(a, b)
    launches = _launches(pdl.backend)
    assert launches and all(la.programmatic for la in launches)
    # the cuLaunchKernelEx packing of every launch fits its kernel's C parameter list (the emulator
    # reads it from the compiled kernel: p pointer, i int, l long long, f float)
    size = {"p": 8, "i": 4, "l": 8, "f": 4}
    for la in launches:
        assert pack_args(la.args).sizes == tuple(size[c] for c in la.kernel.raw.signature), la.name
    assert not any(la.programmatic for la in _launches(plain.backend))
    assert sum(plain.backend.rt.emu.programmatic.values()) == 0
    assert pdl.backend.rt.graph_launches >= 1                   # decode replayed the captured graph
    assert sum(emu.programmatic.values()) > after_prefill
    names = set(emu.programmatic)
    assert any(n.startswith("matvec") for n in names) and any(n.startswith("attn_decode") for n in names)


@requires_cxx
def test_emulator_refuses_a_programmatic_launch_whose_threads_did_not_wait(monkeypatch):
    """The emulator's check itself: a launch where fewer threads waited than ran is an error."""
    from metatp.testing.cuda_emulator import Emulator

    emu = Emulator()
    k = emu.kernel("elementwise", "fill_f32")
    y = np.zeros(300, np.float32)
    k((2,), (256,), (y, np.int32(300), np.float32(2.0)), programmatic=True)
    assert np.all(y == 2.0) and emu.programmatic["fill_f32"] == 1
    monkeypatch.setattr(k, "_pdl_waits", lambda: 511)
    with pytest.raises(RuntimeError, match="511 mt_pdl_wait"):
        k((2,), (256,), (y, np.int32(300), np.float32(3.0)), programmatic=True)


# ------------------------------------------------------------------ compiled code
@requires("nvcc", why=None if shutil.which("nvcc") else "nvcc not on PATH")
def test_griddepcontrol_only_for_sm90(tmp_path):
    """nvcc emits griddepcontrol.wait / launch_dependents for sm_90 and nothing for sm_80."""
    cu = tmp_path / "norm.cu"
    cu.write_text(ck.module_source("norm"), encoding="utf-8")
    ptx = {}
    for arch in ("80", "90"):
        out = tmp_path / f"norm_{arch}.ptx"
        r = subprocess.run([shutil.which("nvcc"), "-ptx", f"-arch=sm_{arch}", "-o", str(out), str(cu)],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        ptx[arch] = out.read_text()
    n_kernels = len(re.findall(r"\.entry\s+\w+", ptx["90"]))
    assert len(re.findall(r"griddepcontrol\.wait", ptx["90"])) == n_kernels
    assert len(re.findall(r"griddepcontrol\.launch_dependents", ptx["90"])) == n_kernels
    assert "griddepcontrol" not in ptx["80"]


# ------------------------------------------------------------------ on a GPU
@pytest.mark.gpu
@requires("gpu")
def test_gpu_decode_with_pdl_matches_without(synth_model):
    """On an sm_90 GPU with cuda-bindings: greedy tokens and logits with pdl on equal pdl off
    (graphs on, so the programmatic edges are captured)."""
    require("cuda_bindings")
    import cupy

    if int(cupy.cuda.Device(0).compute_capability) < 90:
        pytest.skip("programmatic dependent launch needs sm_90 (this GPU is older)")
    lay = DeviceLayout(1, "none")
    plain = Engine(synth_model, 256, lay, CupyBackend(lay, pdl=False))
    pdl = Engine(synth_model, 256, lay, CupyBackend(lay, pdl=True))
    a, b = plain.forward(PROMPT), pdl.forward(PROMPT)
    np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)
    for _ in range(8):
        tok = int(np.argmax(a))
        assert int(np.argmax(b)) == tok
        a, b = plain.forward([tok]), pdl.forward([tok])
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-5)
    assert all(ex.graph_mode == "whole" for ex in pdl.backend._executables.values() if ex.runner.runs > 1)
