"""Declared contracts between the engine, pipelining and the backends.

The engine reads only what `backends.base.Executable` and `collectives.Collective` declare
(no getattr probes); pipelining drives public `step.Pass` objects and a `Pipelining`, never the
Engine; one factory makes every backend, in one process or on an MPI rank; the memory plan of
another context length needs no second Engine.
"""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import numpy as np
import pytest

from metatp import pipeline
from metatp.backends.base import Executable
from metatp.backends.collectives import Collective, HostCollective
from metatp.backends.collectives.p2p import MpiSendRecv, SendRecv
from metatp.engine import Engine
from metatp.ir.errors import ConfigError
from metatp.passes.plan import DeviceLayout
from metatp.testing.synth import SynthSpec

SPEC = SynthSpec(n_layer=2, n_embd=64, n_head=4, n_head_kv=2, head_dim=16, n_ff=128, n_vocab=200, seed=13)
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("module", ["metatp/engine.py", "metatp/step.py", "metatp/pipeline.py"])
def test_no_getattr_probe_in_the_engine_side(module):
    tree = ast.parse((ROOT / module).read_text())
    probes = [f"{module}:{n.lineno} {n.func.id}" for n in ast.walk(tree)
              if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ("getattr", "hasattr")]
    assert probes == []


def test_the_executable_declares_what_the_engine_reads():
    declared = Executable.__abstractmethods__
    assert {"read", "read_argmax", "read_candidates", "candidates_pay", "run"} <= declared
    assert "devices" in inspect.get_annotations(Executable)


def test_collective_capabilities_default_to_not_supported():
    class Sums(Collective):
        name = "sums"

        def prepare_allreduce(self, bufs, active=None, stream=None):
            return lambda: None

    bare = Sums()
    assert bare.send_recv is None and bare.for_devices((0, 1)) is None
    host = HostCollective("butterfly")
    assert host.send_recv is None and host.for_devices((0, 1)).group.devices == (0, 1)

    class Blocking(SendRecv):
        def prepare_send(self, buf, dst):
            return lambda: None

        def prepare_recv(self, buf, src):
            return lambda: None

        def broadcast(self, buf, root):
            pass

    assert Blocking.defers_sends is False and MpiSendRecv.defers_sends is True
    with Blocking().deferred_sends():           # the default changes nothing
        pass


class _FakePass:
    """Anything with issue() and read(): pipelining needs nothing else."""

    def __init__(self, k: int, log: list) -> None:
        self.k, self.log = k, log

    def run(self):
        self.issue()
        return self.read()

    def issue(self, in_flight=None):
        self.log.append(("issue", self.k, in_flight is not None))

    def read(self):
        self.log.append(("read", self.k))
        return [self.k]


class _Link(SendRecv):
    defers_sends = True

    def __init__(self, log: list) -> None:
        self.log = log

    def prepare_send(self, buf, dst):
        return lambda: None

    def prepare_recv(self, buf, src):
        return lambda: None

    def broadcast(self, buf, root):
        pass

    def deferred_sends(self):
        log = self.log

        class _Window:
            def __enter__(self):
                log.append("defer")

            def __exit__(self, *exc):
                log.append("complete")
        return _Window()


def test_pipelining_drives_passes_without_an_engine():
    log: list = []
    how = pipeline.Pipelining(setting=None, stages=2, across_processes=True, links=(_Link(log),))
    out = pipeline.run_passes(how, [_FakePass(k, log) for k in range(3)], n_seqs=3)
    assert out == [[0], [1], [2]]
    assert log == ["defer", ("issue", 0, True), ("issue", 1, True), "complete", ("read", 0), ("read", 1),
                   "defer", ("issue", 2, True), "complete", ("read", 2)]
    log.clear()        # one process, or no deferrable link: one pass after another, by default
    for how in (pipeline.Pipelining(None, 2, False, (_Link(log),)), pipeline.Pipelining(None, 2, True, ())):
        assert pipeline.run_passes(how, [_FakePass(k, log) for k in range(2)], n_seqs=3) == [[0], [1]]
    assert "defer" not in log and all(e[2] is False for e in log if e[0] == "issue")
    with pytest.raises(ConfigError, match="Engine.micro_batches"):
        pipeline.micro_batches(pipeline.Pipelining(0, 1, False), 4)


def test_an_engine_in_one_process_declares_no_deferrable_link(synth_model):
    from metatp.backends.numpy.backend import NumpyBackend

    layout = DeviceLayout(2, "layer")
    how = Engine(synth_model, 64, layout, NumpyBackend(layout)).pipelining()
    assert how.links == () and how.stages == 2 and not how.across_processes


def test_a_pass_is_read_after_it_is_issued(synth_model):
    from metatp.backends.numpy.backend import NumpyBackend
    from metatp.step import Pass, Row, StepItem

    eng = Engine(synth_model, 64, DeviceLayout(), NumpyBackend(DeviceLayout()))
    item = StepItem(eng.new_sequence(), [1, 2, 3], "last")
    eng.cells.grow(item.seq, 3)
    p = Pass(eng, [item], [Row(0, i, t, i == 2) for i, t in enumerate(item.tokens)], {item.seq.id: 3})
    with pytest.raises(RuntimeError, match="before Pass.issue"):
        p.read()
    got = p.run()
    want = Engine(synth_model, 64, DeviceLayout(), NumpyBackend(DeviceLayout())).forward([1, 2, 3])
    assert eng.passes == 1 and len(got) == 1
    np.testing.assert_array_equal(got[0], want)


@pytest.mark.parametrize("n_ctx", [32, 256, 512])
def test_memory_plan_of_another_context_equals_that_engines(synth_model, n_ctx):
    from metatp.backends.numpy.backend import NumpyBackend

    layout = DeviceLayout(2, "tensor")
    backend = NumpyBackend(layout)
    eng = Engine(synth_model, 128, layout, backend, n_batch=64)
    assert eng.memory_plan(n_ctx) == Engine(synth_model, n_ctx, layout, backend, n_batch=64).memory_plan()
    assert eng.memory_plan() == eng.memory_plan(128)


class _World:
    """A stand-in for `distributed.World` of two ranks, this one rank 1."""

    size, rank, devices = 2, 1, [1]

    def __init__(self) -> None:
        self.made: list[str] = []

    def collective(self, kind: str = "mpi", **options):
        self.made.append(kind)
        return HostCollective("butterfly")


def test_one_factory_makes_a_ranks_backend():
    from metatp.backends import create_backend
    from metatp.backends.numpy.backend import NumpyBackend

    world = _World()
    be = create_backend("auto", DeviceLayout(2, "tensor"), world=world, parallel_devices=False)
    assert isinstance(be, NumpyBackend) and be.owned == [1] and world.made == ["mpi"]
    with pytest.raises(ConfigError, match="allreduce='ring'.*MPI_Allreduce") as e:
        create_backend("numpy", DeviceLayout(2, "tensor"), world=world, allreduce="ring")
    assert e.value.every_rank
    with pytest.raises(ConfigError, match="layout has 1 devices for 2 ranks"):
        create_backend("numpy", DeviceLayout(), world=world)
