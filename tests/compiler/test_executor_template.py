"""The executor template: one construction sequence, one prepared all-reduce per Reduction (its
devices from the reduced node's compute flags), facts made once per Plan, fusions chosen once."""

from __future__ import annotations

import numpy as np
import pytest

from metatp.backends.collectives.host import HostCollective
from metatp.backends.fusion import Fusion, FusionKind, select
from metatp.backends.numpy.backend import NumpyBackend
from metatp.engine import Engine, padded_kv
from metatp.ir.loader import load_model
from metatp.ir.models import BatchSpec
from metatp.ir.ops import Op
from metatp.ir.tensor import Flag
from metatp.passes.plan import DeviceLayout
from metatp.testing.synth import SynthSpec


class _Recording(HostCollective):
    """The host butterfly, recording every prepare_allreduce call."""

    def __init__(self) -> None:
        super().__init__("butterfly")
        self.calls: list[tuple[int, list[bool], object]] = []

    def prepare_allreduce(self, bufs, active=None, stream=None):
        self.calls.append((int(bufs[0].size), list(active), stream))
        return super().prepare_allreduce(bufs, active, stream)


def _engine(synth_factory, layout, **kw):
    path, _ = synth_factory(SynthSpec(seed=11))
    backend = NumpyBackend(layout, **kw)
    return Engine(load_model(path), 64, layout, backend), backend


def _plan(eng, T=1):
    return eng.plan_for(BatchSpec(T, padded_kv(T, eng.n_ctx), 1))[0]


def test_one_prepare_per_reduction_with_the_compute_flags(synth_factory):
    """A zero share makes device 1 inactive in every reduction: the flags the collective gets
    are the reduced node's TensorPlan.compute (the one source of truth), one call per Reduction."""
    layout = DeviceLayout(4, "tensor", (1, 0, 2, 1))
    rec = _Recording()
    eng, backend = _engine(synth_factory, layout, collective=rec)
    plan = _plan(eng)
    ex = backend.prepare(plan)
    sinks = [plan.graph.nodes[r.node] for r in plan.reductions]
    assert len(rec.calls) == len(sinks) > 0
    for (size, active, stream), sink in zip(rec.calls, sinks):
        assert active == list(plan.of(sink).compute) and size == sink.nelements and stream is None
        assert active[1] is False and any(active)
    assert [r is not None for r in ex.reductions] == [s.reduction is not None for s in plan.subgraphs]


def test_facts_are_made_once_per_plan(synth_factory):
    eng, backend = _engine(synth_factory, DeviceLayout(2, "tensor"))
    plan = _plan(eng)
    assert plan.facts is plan.facts
    assert backend.prepare(plan).facts is plan.facts


def _old_numpy_norm_fusions(plan, facts):
    """The numpy executable's hand-written legality before the shared matcher (the reference)."""
    out = []
    for node in plan.graph.nodes:
        if node.op is not Op.MUL or node.src[0].op is not Op.RMS_NORM:
            continue
        rms, w = node.src[0], node.src[1]
        if facts.readers.get(rms) != [node] or not (w.flags & Flag.WEIGHT) or w.ne != (rms.ne[0], 1, 1, 1):
            continue
        if facts.sub_of[rms] != facts.sub_of[node] or plan.of(rms).state.is_partial or rms.flags & Flag.OUTPUT:
            continue
        if list(plan.of(rms).compute) != list(plan.of(node).compute):
            continue
        if not facts.read_after(rms.src[0], node):
            continue
        out.append((node, rms))
    return out


@pytest.mark.parametrize("layout", [DeviceLayout(), DeviceLayout(2, "tensor"), DeviceLayout(3, "tensor", (1, 0, 2))])
@pytest.mark.parametrize("T", [1, 7])
def test_numpy_norm_fusions_are_the_hand_written_ones(synth_factory, layout, T):
    eng, backend = _engine(synth_factory, layout)
    plan = _plan(eng, T)
    ex = backend.prepare(plan)
    norms = [f for f in ex.fusions.values() if f.kind is FusionKind.NORM]
    got = [(f.at, f.absorbed[0]) for f in norms]
    assert got == _old_numpy_norm_fusions(plan, plan.facts) and got
    assert all(f.kind == "norm" for f in norms)
    assert {f.kind for f in ex.fusions.values()} == {FusionKind.NORM, FusionKind.MATMUL_GROUP}


@pytest.mark.parametrize("layout", [DeviceLayout(), DeviceLayout(2, "tensor"), DeviceLayout(3, "tensor", (1, 0, 2))])
@pytest.mark.parametrize("T", [1, 16, 100])
def test_numpy_groups_the_weight_products_of_one_x(synth_factory, layout, T):
    """q, k and v (and gate and up) of every layer run as one group at the first of them; the
    later ones are written early, into arena buffers that live from there (the activation memory
    stays within 25% of the ungrouped plan's); nothing else is grouped."""
    eng, backend = _engine(synth_factory, layout)
    plan = _plan(eng, T)
    ex = backend.prepare(plan)
    groups = [f for f in ex.fusions.values() if f.kind is FusionKind.MATMUL_GROUP]
    idx = plan.graph.index
    n_layer = eng.model.hparams.n_layer
    assert sorted(len(f.members) for f in groups) == [2] * n_layer + [3] * n_layer
    for f in groups:
        x = f.at.src[1]
        assert all(m.op is Op.MUL_MAT and m.src[1] is x and m.src[0].flags & Flag.WEIGHT for m in f.members)
        assert f.at is min(f.members, key=lambda m: idx[m]) and set(f.early) == set(f.absorbed) and not f.detach
        names = sorted(m.src[0].name.split(".")[-2] for m in f.members)
        assert names in (["attn_k", "attn_q", "attn_v"], ["ffn_gate", "ffn_up"])
    from metatp.backends.numpy.executable import NumpyExecutable, _norm_fusion
    ungrouped = _ungrouped_bytes(backend, plan, NumpyExecutable, _norm_fusion)
    assert sum(ex.buffer_bytes) <= 1.25 * ungrouped + 4096


def _ungrouped_bytes(backend, plan, executable, norm_fusion) -> int:
    """The activation bytes of `plan` prepared without the matmul groups."""
    orig = executable.find_fusions
    executable.find_fusions = lambda ex: select(ex, [norm_fusion])
    try:
        return sum(executable(backend, plan).buffer_bytes)
    finally:
        executable.find_fusions = orig


@pytest.mark.parametrize("numerics", ["exact", "q8"])
@pytest.mark.parametrize("layout", [DeviceLayout(), DeviceLayout(2, "tensor")])
def test_grouped_products_give_the_bits_of_separate_calls(synth_factory, monkeypatch, numerics, layout):
    """The logits of prompts of 1, 16 and 100 tokens (the few-token kernels, the GEMM, BLAS)
    and of the decode steps after them are the same bits with and without the groups."""
    from metatp.backends.numpy.executable import NumpyExecutable, _norm_fusion

    path, _ = synth_factory(SynthSpec(seed=11))

    def run() -> list[np.ndarray]:
        eng = Engine(load_model(path), 256, layout, NumpyBackend(layout, numerics=numerics))
        out = []
        for n in (1, 16, 100):
            eng.reset()
            out.append(eng.forward(list(range(1, n + 1)), all_logits=True))
            out.append(eng.forward([5]))
        return out
    grouped = run()
    monkeypatch.setattr(NumpyExecutable, "find_fusions", lambda ex: select(ex, [_norm_fusion]))
    separate = run()
    for a, b in zip(grouped, separate):
        assert np.array_equal(a, b)


def test_select_first_finder_wins_and_overlap_is_refused(synth_factory):
    eng, backend = _engine(synth_factory, DeviceLayout())
    plan = _plan(eng)
    ex = backend.prepare(plan)
    mul = next(iter(ex.fusions))
    norm = ex.fusions[mul].absorbed[0]

    def first(ex_, node, taken):
        return [Fusion(FusionKind.NORM, node, (norm,))] if node is mul else []

    def second(ex_, node, taken):
        return [Fusion(FusionKind.MATVEC_ADD, node, ())] if node is norm else []
    found = select(ex, [first, second])
    assert [(f.at, f.kind) for f in found] == [(mul, FusionKind.NORM)]
    with pytest.raises(ValueError, match="fusions overlap"):
        ex.set_fusions([Fusion(FusionKind.NORM, mul, (norm,)), Fusion(FusionKind.NORM, norm, ())])


def test_read_gathers_split_values(synth_factory):
    """read() is the template's (no override): a split result is gathered, equal to one device's."""
    one, _ = _engine(synth_factory, DeviceLayout())
    two, _ = _engine(synth_factory, DeviceLayout(2, "tensor"))
    a, b = one.forward([1, 2, 3]), two.forward([1, 2, 3])
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * np.abs(a).max())
