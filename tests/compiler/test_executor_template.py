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
    got = [(f.at, f.absorbed[0]) for f in ex.fusions.values()]
    assert got == _old_numpy_norm_fusions(plan, plan.facts) and got
    assert all(f.kind is FusionKind.NORM and f.kind == "norm" for f in ex.fusions.values())


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
