"""Collectives: schedules as data, the host runner, the mode table, byte counts, the numpy backend.

Every host-runnable mode is checked the same way for N = 1..9 devices and sizes that N does not
divide: NaN garbage in disabled devices, every device ending with the same bits, FP32 within
float32 rounding of a float64 sum (exact on integers). The butterfly must keep the bits of the
implementation it replaced (kept below as `_butterfly_before`), of the C kernel and of a naive
schedule simulation.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from support.require import have
from metatp.backends.collectives import (ALLREDUCE_MODES, HostCollective, Mode, Schedule, Transfer, TransferOp,
                                         butterfly_schedule, bytes_moved, bytes_per_rank, check_schedule,
                                         resolve_mode, ring_schedule, schedule_for, wire_dtype)
from metatp.backends.collectives.host import host_mode
from metatp.backends.collectives.schedule import chunk_bounds
from metatp.backends.numpy.backend import NumpyBackend
from metatp.ir.errors import ConfigError
from metatp.passes.plan import DeviceLayout

F32 = np.float32
HOST_MODES = [m for m, row in ALLREDUCE_MODES.items() if not row.device_only]
U = 2.0 ** -24          # float32 unit roundoff


# ---------------------------------------------------------------- references


def _butterfly_before(bufs, active):
    """backends/allreduce.py as it was before the collectives package (the bits to keep)."""
    n = len(bufs)
    for b, on in zip(bufs, active):
        if not on:
            b.fill(0)
    if n <= 1:
        return
    p2 = 1 << (n.bit_length() - 1)
    for j in range(p2, n):
        np.add(bufs[j - p2], bufs[j], out=bufs[j - p2])
    off = p2 // 2
    while off >= 1:
        for j in range(off):
            np.add(bufs[j], bufs[j + off], out=bufs[j])
        off //= 2
    for j in range(1, n):
        np.copyto(bufs[j], bufs[0])


def _simulate(bufs, s: Schedule, active):
    """The schedule's meaning, literally: zero the inactive, then per round read all, then write."""
    for b, on in zip(bufs, active):
        if not on:
            b.fill(0)
    flat = [b.reshape(-1) for b in bufs]
    for rnd in s.rounds:
        got = [flat[t.src][t.start:t.start + t.length].copy() for t in rnd]
        for t, v in zip(rnd, got):
            dst = flat[t.dst][t.start:t.start + t.length]
            if t.op is TransferOp.ADD:
                dst += v
            else:
                dst[...] = v


def _case(n, size, seed, active=None, integers=False):
    """(values, active, buffers with NaN in the inactive devices)."""
    rng = np.random.default_rng(seed)
    if active is None:
        active = [bool(rng.integers(0, 4)) or j == 0 for j in range(n)]
    if integers:
        vals = [rng.integers(-1000, 1000, size).astype(F32) for _ in range(n)]
    else:   # magnitudes spread over 6 decades: a different summation order shows in the bits
        vals = [(rng.standard_normal(size) * 10 ** rng.uniform(-3, 3, size)).astype(F32) for _ in range(n)]
    bufs = [v.copy() if a else np.full(size, np.nan, F32) for v, a in zip(vals, active)]
    return vals, active, bufs


def _check_sum(bufs, vals, active, exact=False):
    want = np.zeros(bufs[0].shape, np.float64)
    mag = np.zeros(bufs[0].shape, np.float64)
    for v, a in zip(vals, active):
        if a:
            want += v
            mag += np.abs(v.astype(np.float64))
    for b in bufs:
        assert not np.isnan(b).any()
        assert np.array_equal(b.view(np.uint32), bufs[0].view(np.uint32))      # the same bits everywhere
    got = bufs[0].astype(np.float64)
    if exact:
        assert np.array_equal(got, want)
    else:   # n-1 float32 additions, each off by at most half an ulp of its partial sum
        k = max(sum(active) - 1, 0)
        assert np.all(np.abs(got - want) <= k * U * mag * (1 + 1e-6) + 1e-45)


# ---------------------------------------------------------------- schedules


@pytest.mark.parametrize("n", range(1, 10))
@pytest.mark.parametrize("mode", HOST_MODES)
def test_schedules_are_valid_for_any_n(n, mode):
    for size in (0, 1, n - 1, n, n + 1, 7 * n + 3, 1000):
        s = schedule_for(mode, n, max(size, 0))
        check_schedule(s)
        assert s.n_devices == n and all(t.length > 0 for rnd in s.rounds for t in rnd)


def test_butterfly_shape_and_ring_rounds():
    assert butterfly_schedule(1, 10).rounds == ()
    assert len(butterfly_schedule(4, 10).rounds) == 2               # log2(4) doubling rounds
    r = butterfly_schedule(6, 10).rounds                            # fold, 2 doubling rounds, copy back
    assert [t.op for t in r[0]] == [TransferOp.ADD] * 2 and [t.op for t in r[-1]] == [TransferOp.COPY] * 2
    assert {(t.dst, t.src) for t in r[0]} == {(0, 4), (1, 5)}
    assert all((t.start, t.length) == (0, 10) for rnd in r for t in rnd)
    ring = ring_schedule(4, 10)
    assert len(ring.rounds) == 2 * (4 - 1)
    assert [t.op for t in ring.rounds[2]] == [TransferOp.ADD] * 4 and ring.rounds[3][0].op is TransferOp.COPY
    assert chunk_bounds(10, 4) == [(0, 3), (3, 3), (6, 2), (8, 2)]
    assert len(ring_schedule(5, 2).rounds) == 2 * 4                 # empty chunks drop out, rounds stay
    assert ring_schedule(5, 0).rounds == ()


def test_check_schedule_rejects_broken_schedules():
    add = TransferOp.ADD
    for rnd in ([Transfer(0, 0, add, 0, 4)], [Transfer(0, 2, add, 0, 4)], [Transfer(0, 1, add, 2, 4)],
                [Transfer(0, 1, add, 0, 3), Transfer(0, 1, add, 2, 2)]):
        with pytest.raises(ValueError):
            check_schedule(Schedule("bad", 2, 4, (tuple(rnd),)))


# ---------------------------------------------------------------- running them


@settings(max_examples=150, deadline=None)
@given(n=st.integers(1, 9), size=st.integers(0, 70), seed=st.integers(0, 2**16), mode=st.sampled_from(HOST_MODES),
       data=st.data())
def test_allreduce_sums_with_nan_garbage_in_inactive(n, size, seed, mode, data):
    active = data.draw(st.lists(st.booleans(), min_size=n, max_size=n))
    vals, active, bufs = _case(n, size, seed, active)
    HostCollective(mode).allreduce(bufs, active)
    _check_sum(bufs, vals, active)
    naive = [v.copy() if a else np.full(size, np.nan, F32) for v, a in zip(vals, active)]
    _simulate(naive, schedule_for(mode, n, size), active)
    for b, c in zip(bufs, naive):       # the runner's shortcuts (no temporaries, paired adds) keep the bits
        assert np.array_equal(b, c)


@pytest.mark.parametrize("n", range(1, 10))
@pytest.mark.parametrize("mode", HOST_MODES)
def test_fp32_is_exact_on_integers(n, mode):
    vals, active, bufs = _case(n, 1000 + n, seed=n, integers=True)
    HostCollective(mode).allreduce(bufs, active)
    _check_sum(bufs, vals, active, exact=True)


@pytest.mark.parametrize("n", range(1, 10))
def test_butterfly_keeps_the_bits_of_the_implementation_it_replaced(n):
    for size in (1, 5, 999):
        _, active, base = _case(n, size, seed=100 * n + size)
        before = [b.copy() for b in base]
        _butterfly_before(before, active)
        host = [b.copy() for b in base]
        HostCollective("butterfly").allreduce(host, active)
        naive = [b.copy() for b in base]
        _simulate(naive, butterfly_schedule(n, size), active)
        for j in range(n):
            assert np.array_equal(host[j], before[j]) and np.array_equal(naive[j], before[j])
        if have("cpu_kernels"):
            compiled = [b.copy() for b in base]
            HostCollective("butterfly", use_kernels=True).prepare_allreduce(compiled, active)()
            assert all(np.array_equal(compiled[j], before[j]) for j in range(n))


def test_ring_in_place_on_strided_views():
    """Partial ranges on views that are not contiguous: the runner stages and writes back."""
    base = [np.arange(24, dtype=F32).reshape(4, 6) * (j + 1) for j in range(3)]
    views = [b[:, ::2] for b in base]
    HostCollective("ring").allreduce(views, [True] * 3)
    full = np.arange(24, dtype=F32).reshape(4, 6)
    for b in base:
        assert np.array_equal(b[:, ::2], full[:, ::2] * 6)
    assert np.array_equal(base[2][:, 1::2], full[:, 1::2] * 3)      # untouched between the views' elements


def test_compiled_path_is_an_explicit_choice():
    bufs = [np.ones(8, F32) for _ in range(3)]
    ring = HostCollective("ring", use_kernels=True).prepare_allreduce(bufs)
    assert type(ring).__name__ == "function"                        # no C ring: the host runner
    if have("cpu_kernels"):
        fly = HostCollective("butterfly", use_kernels=True).prepare_allreduce(bufs)
        assert type(fly).__name__ == "_Call"


# ---------------------------------------------------------------- byte counts and wire


@pytest.mark.parametrize("n", range(2, 10))
def test_bytes_of_ring_and_butterfly(n):
    size = 64 * n                                                    # divisible: the textbook numbers
    ring = ring_schedule(n, size)
    assert bytes_per_rank(ring) == 2 * (n - 1) * size // n * 4
    assert bytes_moved(ring) == 2 * (n - 1) * size * 4
    p2 = 1 << (n.bit_length() - 1)
    folded = n > p2
    fly = butterfly_schedule(n, size)
    assert bytes_per_rank(fly) == (p2.bit_length() - 1 + 2 * folded) * size * 4
    assert bytes_moved(fly) == ((p2.bit_length() - 1) * p2 + 2 * (n - p2)) * size * 4
    assert bytes_per_rank(fly, "bf16") * 2 == bytes_per_rank(fly)
    assert bytes_per_rank(ring_schedule(n, size + 1)) >= bytes_per_rank(ring)   # the larger chunk sets the pace


def test_wire_thresholds_and_auto_bytes():
    assert wire_dtype(2, 32767) == "f32" and wire_dtype(2, 32768) == "bf16"
    assert wire_dtype(3, 131071) == "f32" and wire_dtype(4, 262144) == "bf16"
    assert wire_dtype(8, 10, "bf16") == "bf16"
    small, big = butterfly_schedule(2, 100), butterfly_schedule(2, 1 << 16)
    assert bytes_moved(small, "auto") == bytes_moved(small, "f32")
    assert bytes_moved(big, "auto") == bytes_moved(big, "bf16")
    with pytest.raises(ConfigError, match="wire mode must be one of auto, f32, bf16"):
        wire_dtype(2, 10, "fp8")


# ---------------------------------------------------------------- the mode table


def test_mode_table_names_and_errors():
    assert resolve_mode("auto").name == "butterfly"
    assert resolve_mode("none").name == "butterfly"                 # llama.cpp: no comm backend -> fallback
    assert resolve_mode("internal").name == "butterfly"             # llama.cpp's own copy-and-add
    assert resolve_mode("nccl").device_only and schedule_for("nccl", 4, 8).name == "ring"   # billed as a ring
    with pytest.raises(ConfigError, match=r"allreduce must be one of auto, butterfly, ring, nccl.*got 'tree'"):
        resolve_mode("tree")
    with pytest.raises(ConfigError, match=r"allreduce='nccl' is a device-side.*auto, butterfly, ring"):
        host_mode("nccl")
    with pytest.raises(ConfigError, match="nccl"):
        NumpyBackend(DeviceLayout(2, "tensor"), allreduce="nccl")
    with pytest.raises(ConfigError, match="allreduce must be one of"):
        NumpyBackend(allreduce="tree")


# ---------------------------------------------------------------- the numpy backend


def _logits(path, n, ts, **backend_kw):
    from metatp.engine import Engine
    from metatp.ir.loader import load_model

    model = load_model(path)
    layout = DeviceLayout(n, "tensor" if n > 1 else "none", ts)
    backend = NumpyBackend(layout, **backend_kw)
    eng = Engine(model, 64, layout, backend)
    out = [np.asarray(eng.forward([1, 5, 9, 2, 7], all_logits=True)).ravel()]
    out += [np.asarray(eng.forward([t])).ravel() for t in (3, 11)]
    return np.concatenate(out), backend


@pytest.mark.parametrize("n,ts", [(2, None), (3, (1, 2, 1)), (4, (1, 0, 2, 1))])
def test_numpy_backend_modes(synth_factory, n, ts):
    from metatp.testing.synth import SynthSpec

    path, _ = synth_factory(SynthSpec(seed=7))
    one, _ = _logits(path, 1, None)
    fly, be = _logits(path, n, ts)
    assert be.allreduce == "butterfly" and be.allreduce_strategy == "butterfly"
    fly_py, _ = _logits(path, n, ts, cpu_kernels=False)
    ring, be = _logits(path, n, ts, allreduce="ring")
    assert be.allreduce_strategy == "ring"
    ring_py, _ = _logits(path, n, ts, allreduce="ring", cpu_kernels=False)
    none, _ = _logits(path, n, ts, allreduce="none")
    assert np.array_equal(none, fly)                                 # an alias: the same schedule
    scale = np.abs(one).max()
    for got in (fly, fly_py, ring, ring_py):
        np.testing.assert_allclose(got, one, atol=1e-4 * scale, rtol=1e-4)
    if have("cpu_kernels"):     # the C butterfly vs the host runner: only the matmuls differ
        np.testing.assert_allclose(fly, fly_py, atol=1e-4 * scale)


def test_a_new_algorithm_is_one_function_and_one_row(synth_factory, monkeypatch):
    """Register a toy schedule (reduce into device 0, then broadcast) and run the backend on it."""
    from metatp.testing.synth import SynthSpec

    def star_schedule(n: int, n_elements: int) -> Schedule:
        rounds = [(Transfer(0, j, TransferOp.ADD, 0, n_elements),) for j in range(1, n)]
        rounds.append(tuple(Transfer(j, 0, TransferOp.COPY, 0, n_elements) for j in range(1, n)))
        return Schedule("star", n, n_elements, tuple(r for r in rounds if r and n_elements))

    monkeypatch.setitem(ALLREDUCE_MODES, "star", Mode("star", star_schedule, "reduce to 0, broadcast"))
    vals, active, bufs = _case(5, 33, seed=3)
    HostCollective("star").allreduce(bufs, active)
    _check_sum(bufs, vals, active)
    path, _ = synth_factory(SynthSpec(seed=7))
    one, _ = _logits(path, 1, None)
    star, be = _logits(path, 3, (1, 2, 1), allreduce="star")
    assert be.allreduce_strategy == "star"
    np.testing.assert_allclose(star, one, atol=1e-4 * np.abs(one).max(), rtol=1e-4)


def test_every_collective_is_the_one_protocol():
    """Host, MPI, the CUDA devices of one process and NCCL between GPU ranks all prepare an
    all-reduce as `Collective.prepare_allreduce(bufs, active, stream=None)`."""
    import inspect

    from metatp.backends.collectives import Collective, MpiCollective
    from metatp.backends.cuda.collective import DeviceCollective
    from metatp.backends.cuda.nccl import NcclCollective

    want = ["self", "bufs", "active", "stream"]
    for cls in (HostCollective, MpiCollective, DeviceCollective, NcclCollective):
        params = inspect.signature(cls.prepare_allreduce).parameters
        assert list(params) == want and params["stream"].default is None, cls.__name__
    assert isinstance(HostCollective("auto"), Collective)
    import metatp.backends.collectives as collectives
    assert not hasattr(collectives, "PointToPoint") and not hasattr(collectives, "NcclCollective")
