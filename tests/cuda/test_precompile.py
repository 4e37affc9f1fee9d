"""Kernel modules compiled ahead, all at once (`CupyRuntime.precompile`, the cupy backend's
`precompile` option): on a stand-in of CuPy (no GPU here) the modules compile in parallel threads,
once per compute capability, and the first launch finds them; on the emulated backend the
first executable asks for the families its plans may launch."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from metatp.backends.cuda.launch import FAMILIES
from metatp.backends.cuda.runtime import CupyRuntime


class _FakeModule:
    """cupy.RawModule's stand-in: `compile()` waits at a barrier, so it passes only when
    `parties` compiles run at the same time."""

    compiled: list[tuple[str, int]] = []
    barrier: threading.Barrier | None = None
    wait_s = 10.0
    lock = threading.Lock()

    def __init__(self, code: str, options) -> None:
        self.code, self.options = code, options

    def compile(self) -> None:
        if "mt_fail_here" in self.code:
            raise RuntimeError("nvrtc: error in the module")
        if _FakeModule.barrier is not None:
            _FakeModule.barrier.wait(timeout=_FakeModule.wait_s)
        with _FakeModule.lock:
            _FakeModule.compiled.append((self.code[:40], _FakeDevice.current()))

    def get_function(self, name: str):
        return SimpleNamespace(name=name)


class _FakeDevice:
    _tls = threading.local()

    def __init__(self, gpu: int) -> None:
        self.gpu = gpu

    @classmethod
    def current(cls) -> int:
        return getattr(cls._tls, "gpu", 0)

    def __enter__(self):
        self._prev = _FakeDevice.current()
        _FakeDevice._tls.gpu = self.gpu
        return self

    def __exit__(self, *exc) -> None:
        _FakeDevice._tls.gpu = self._prev


def _runtime(capabilities: dict[int, int]) -> CupyRuntime:
    rt = CupyRuntime.__new__(CupyRuntime)
    rt.cp = SimpleNamespace(RawModule=_FakeModule,
                            cuda=SimpleNamespace(Device=_FakeDevice,
                                                 runtime=SimpleNamespace(getDevice=_FakeDevice.current)))
    rt._modules, rt._kernels, rt._pdl = {}, {}, None
    rt.faults = SimpleNamespace()
    rt.capability = capabilities.__getitem__
    return rt


@pytest.fixture(autouse=True)
def _fresh_fake():
    _FakeModule.compiled, _FakeModule.barrier, _FakeModule.wait_s = [], None, 10.0
    yield
    _FakeModule.barrier = None


def test_modules_compile_in_parallel_once_per_capability():
    rt = _runtime({0: 90, 1: 90, 2: 80})
    families = ["norm", "rope", "kv"]
    _FakeModule.barrier = threading.Barrier(len(families) * 2)      # all six at once, or a timeout
    seconds = rt.precompile([0, 1, 2], families, workers=8)
    assert set(seconds) == set(families)
    assert sorted(gpu for _, gpu in _FakeModule.compiled) == [0, 0, 0, 2, 2, 2]   # GPU 1 shares GPU 0's sm_90
    assert set(rt._modules) == {(f, g) for f in families for g in (0, 2)}
    _FakeModule.barrier = None
    assert rt.precompile([0, 2], families) == {}                    # compiled already: nothing again
    assert len(_FakeModule.compiled) == 6


def test_one_worker_compiles_them_in_turn():
    rt = _runtime({0: 90})
    _FakeModule.barrier, _FakeModule.wait_s = threading.Barrier(2), 0.5
    with pytest.raises(threading.BrokenBarrierError):             # one thread: the two never meet
        rt.precompile([0], ["norm", "rope"], workers=1)


def test_a_compile_error_is_raised(monkeypatch):
    import metatp.backends.cuda.runtime as runtime_module

    rt = _runtime({0: 90})
    monkeypatch.setattr(runtime_module, "module_source",
                        lambda family: "mt_fail_here" if family == "kv" else f"// {family}")
    with pytest.raises(RuntimeError, match="nvrtc: error in the module"):
        rt.precompile([0], ["norm", "kv"])


def test_the_backend_precompiles_the_families_its_plans_may_launch():
    from metatp.backends.cuda.backend import CupyBackend
    from metatp.passes.plan import DeviceLayout
    from metatp.testing.emulated_runtime import EmuRuntime

    rt = EmuRuntime()
    be = CupyBackend(DeviceLayout(), runtime=rt)
    assert be.kernel_families() == [f for f in FAMILIES if f != "mmvq"]
    be._precompile_kernels()
    be._precompile_kernels()                                       # once a backend
    assert rt.precompiled == [((0,), tuple(be.kernel_families()))]
    q8 = CupyBackend(DeviceLayout(), runtime=EmuRuntime(), numerics="q8", fuse_qkv_rope=False)
    assert "mmvq" in q8.kernel_families() and "qkv_rope" not in q8.kernel_families()
    off = CupyBackend(DeviceLayout(), runtime=(rt2 := EmuRuntime()), precompile=False)
    off._precompile_kernels()
    assert rt2.precompiled == [] and off.compile_seconds == {}
