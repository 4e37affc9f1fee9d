"""The compiled kernels' thread governor (csrc/threads.c, `native.adaptive_threads`): while other
processes keep CPUs busy, a parallel region takes at most the CPUs they leave, and the results
keep the bits of any fixed thread count.

The conftest turns the governor off for the other kernel tests; the `adaptive` fixture turns it
on here."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time

import numpy as np
import pytest

from metatp.backends.numpy import native
from metatp.backends.numpy.codes import AffineWeight
from support.require import requires

pytestmark = requires("cpu_kernels")

F32 = np.float32


def _cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


needs_two_cpus = pytest.mark.skipif(_cpus() < 2 or not os.path.exists("/proc/stat"),
                                    reason="the governor needs two CPUs and /proc/stat")


@pytest.fixture
def adaptive():
    native.set_adaptive_threads(True)
    yield
    native.set_adaptive_threads(False)


@contextlib.contextmanager
def busy_process():
    """A process spinning on one of our CPUs (it inherits our affinity) until the block ends."""
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.2)
        yield proc
    finally:
        proc.kill()
        proc.wait()


def _weight(rng, rows: int, k: int) -> AffineWeight:
    return AffineWeight(q=rng.integers(-128, 128, (rows, k)).astype(np.int8),
                        scale=(rng.standard_normal((rows, k // 32)) * 0.02).astype(F32), offset=None, block=32)


def _lib():
    return native.lib._library()[0]


@pytest.mark.parametrize("ncpu,others,cap", [
    (2, 0.0, 2), (2, 0.3, 2), (2, 0.5, 2), (2, 0.51, 1),
    (2, 0.67, 1),                   # two threads beside one spinner: three threads share two CPUs
    (2, 1.0, 1), (2, 3.0, 1),       # never below one
    (2, -0.2, 2),                   # tick noise below zero: never above the CPUs
    (16, 1.0, 15), (16, 2.4, 14), (1, 0.0, 1)])
def test_the_cap_is_the_cpus_other_processes_leave(ncpu, others, cap):
    assert _lib().metatp_team_cap_for(ncpu, others) == cap


def test_off_means_every_region_takes_what_it_asks(monkeypatch):
    lib = _lib()
    native.set_adaptive_threads(False)
    assert lib.metatp_thread_governor(-1) == 0 and native.team_cap() is None and native.others_load() is None
    assert [lib.metatp_team_size(n) for n in (0, 1, 2, 64)] == [1, 1, 2, 64]
    monkeypatch.setenv("METATP_ADAPTIVE_THREADS", "1")
    native.set_adaptive_threads(None)           # back to the variable
    assert native.adaptive_threads() and lib.metatp_thread_governor(-1) == 1
    monkeypatch.setenv("METATP_ADAPTIVE_THREADS", "0")
    native.set_adaptive_threads(None)
    assert not native.adaptive_threads() and lib.metatp_thread_governor(-1) == 0
    monkeypatch.delenv("METATP_ADAPTIVE_THREADS")
    assert native.adaptive_threads()            # on by default
    native.set_adaptive_threads(False)


@needs_two_cpus
def test_a_busy_process_caps_the_threads_and_the_bits_stay(adaptive):
    """Beside a spinning process the governor takes at most the CPUs it leaves (within a few
    100 ms checks), and every product meanwhile has the bits of one thread and of all of them."""
    rng = np.random.default_rng(3)
    ncpu = _cpus()
    aw = _weight(rng, 1024, 1024)
    x = rng.standard_normal((4, 1024)).astype(F32)
    native.set_adaptive_threads(False)
    want = [native.qmatmul(x, aw, nthreads=t).view(np.uint32) for t in (1, ncpu)]
    assert np.array_equal(want[0], want[1])
    native.set_adaptive_threads(True)
    with busy_process():
        end = time.monotonic() + 0.6                # six checks of 100 ms
        while time.monotonic() < end:
            got = native.qmatmul(x, aw, nthreads=ncpu)
            assert np.array_equal(got.view(np.uint32), want[0])
        while True:             # a check may fall between the reads: read again until the cap held
            cap, others = native.team_cap(), native.others_load()
            sizes = [_lib().metatp_team_size(n) for n in (1, 2, ncpu, 4 * ncpu)]
            if native.team_cap() == cap:
                break
    assert others is not None and others >= 0.5, others         # the spinner had at least half a CPU
    assert cap is not None and cap <= ncpu - 1, cap
    assert sizes == [1, min(2, cap), min(ncpu, cap), cap]


@needs_two_cpus
def test_decode_beside_a_busy_process_gives_the_logits_of_fixed_threads(synth_factory, adaptive):
    """Through the engine: a prompt and a few decode steps on the kernels' default threads beside
    a spinning process (the governor capping them) give the logits of two fixed threads, bit for
    bit."""
    from metatp.backends.numpy.backend import NumpyBackend
    from metatp.engine import Engine
    from metatp.ir.loader import load_model
    from metatp.passes.plan import DeviceLayout
    from metatp.testing.synth import SynthSpec

    spec = SynthSpec(n_layer=2, n_embd=512, n_head=8, n_head_kv=4, n_ff=1536, n_vocab=600, seed=5,
                     types={"q": "Q4_0", "k": "Q8_0", "v": "Q4_1", "o": "Q8_0", "gate": "Q4_1", "up": "Q4_0",
                            "down": "Q8_0", "embd": "Q8_0"})
    model = load_model(synth_factory(spec)[0])

    def run() -> np.ndarray:
        eng = Engine(model, 128, DeviceLayout(), NumpyBackend(DeviceLayout(), kernel_threads=2), n_batch=64)
        first = eng.forward(list(range(1, 40)))
        steps = [eng.forward([t]) for t in (3, 7, 11, 13, 17, 19)]
        return np.concatenate([np.ravel(first), *map(np.ravel, steps)]).view(np.uint32)

    native.set_adaptive_threads(False)
    fixed = run()
    native.set_adaptive_threads(True)
    with busy_process():
        time.sleep(0.15)                            # a check's window that saw the spinner
        capped = run()
        cap = native.team_cap()
    assert cap is not None and cap <= _cpus() - 1, cap       # the regions ran capped
    assert np.array_equal(fixed, capped)
