"""CupyBackend.describe(): what reports read instead of the backend's attributes (emulated GPUs)."""

from __future__ import annotations

import warnings

from metatp.backends.base import BackendInfo
from metatp.backends.collectives.wire import WireThresholds
from metatp.backends.cuda.backend import CupyBackend
from metatp.passes.plan import DeviceLayout
from metatp.testing import EmuRuntime


def test_describe_names_the_allreduce_wire_and_settings():
    one = CupyBackend(DeviceLayout(), runtime=EmuRuntime()).describe()
    assert isinstance(one, BackendInfo)
    assert (one.name, one.n_devices, one.owned, one.allreduce, one.kernel_threads) == ("cupy", 1, (0,), "none", None)
    lay = DeviceLayout(3, "tensor")
    nccl = CupyBackend(lay, runtime=EmuRuntime(n_gpus=3), wire="bf16", kv_dtype="f32").describe()
    assert nccl.allreduce == "nccl" and nccl.wire == "bf16" and nccl.wire_thresholds == WireThresholds()
    assert dict(nccl.options)["kv_dtype"] == "f32" and dict(nccl.options)["virtual"] is False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        virtual = CupyBackend(lay, runtime=EmuRuntime(n_gpus=1), allreduce="ring").describe()
    assert virtual.allreduce == "ring" and dict(virtual.options)["virtual"] is True
    assert virtual.owned == (0, 1, 2) and virtual.n_devices == 3


def test_describe_of_a_rank_names_its_collective():
    class _Spanning:
        name = "nccl"

    be = CupyBackend(DeviceLayout(2, "tensor"), runtime=EmuRuntime(n_gpus=2), devices=[1], collective=_Spanning(),
                     gpus=[1])
    info = be.describe()
    assert info.owned == (1,) and info.allreduce == "nccl"
