"""The numpy backend's options through the registry: kernel_threads (the env var only as its
default), parallel_devices (the old `threads` refused by name), describe() instead of attributes."""

from __future__ import annotations

import argparse
import os

import pytest

from metatp.backends import create_backend
from metatp.backends.base import BackendInfo
from metatp.backends.numpy import native
from metatp.ir.errors import ConfigError
from metatp.passes.plan import DeviceLayout


def test_kernel_threads_option_and_its_env_default(monkeypatch):
    monkeypatch.setenv("METATP_NUM_THREADS", "5")
    assert create_backend("numpy", DeviceLayout(), kernel_threads=3).kernel_threads == 3
    assert create_backend("numpy", DeviceLayout(), kernel_threads=None).kernel_threads == 5   # None: the default
    assert create_backend("numpy", DeviceLayout()).describe().kernel_threads == 5
    monkeypatch.delenv("METATP_NUM_THREADS")
    assert create_backend("numpy", DeviceLayout()).kernel_threads == native.default_threads()


@pytest.mark.parametrize("bad", [0, -2, True, "4", 2.5])
def test_kernel_threads_refuses_what_is_not_a_count(bad):
    with pytest.raises(ConfigError, match=f"option kernel_threads={bad!r} must be a whole number >= 1"):
        create_backend("numpy", DeviceLayout(), kernel_threads=bad)


def test_threads_is_now_parallel_devices():
    with pytest.raises(ConfigError, match="numpy backend: option 'threads' is now 'parallel_devices'.*kernel_threads"):
        create_backend("numpy", DeviceLayout(2, "tensor"), threads=True)
    be = create_backend("numpy", DeviceLayout(2, "tensor"), parallel_devices=True)
    assert be.parallel_devices and be.pool() is not None
    assert create_backend("numpy", DeviceLayout(2, "tensor")).pool() is None
    with pytest.raises(ConfigError, match="parallel_devices=1 must be True or False"):
        create_backend("numpy", DeviceLayout(2, "tensor"), parallel_devices=1)


def test_numerics_is_checked_by_the_registry_only():
    with pytest.raises(ConfigError, match="numerics='fast' is not one of exact, llamacpp, q8"):
        create_backend("numpy", DeviceLayout(), numerics="fast")


def test_llm_refuses_the_old_option_before_reading_the_model(tmp_path):
    from metatp.api import LLM

    with pytest.raises(ConfigError, match="'threads' is now 'parallel_devices'"):
        LLM(tmp_path / "absent.gguf", backend="numpy", backend_options={"threads": True})


def test_cli_threads_flag_is_the_kernel_threads_option(monkeypatch):
    """-t N travels as a backend option; the environment is not written."""
    from metatp.cli import layout_kwargs

    monkeypatch.delenv("METATP_NUM_THREADS", raising=False)
    args = argparse.Namespace(tensor_split=None, devices=None, split_mode=None, threads=4)
    kw = layout_kwargs(args)
    assert kw["backend_options"] == {"kernel_threads": 4}
    assert "kernel_threads" not in layout_kwargs(argparse.Namespace(tensor_split=None, devices=None,
                                                                    split_mode=None))["backend_options"]
    assert "METATP_NUM_THREADS" not in os.environ


def test_batched_bench_threads_reach_the_backend(synth_factory, monkeypatch, capsys):
    from metatp.testing.synth import SynthSpec
    from metatp.tools.batched_bench import main

    monkeypatch.delenv("METATP_NUM_THREADS", raising=False)
    path, _ = synth_factory(SynthSpec(seed=3))
    assert main(["-m", str(path), "--backend", "numpy", "-npp", "4", "-ntg", "2", "-npl", "1", "-t", "2",
                 "--no-warmup"]) == 0
    assert "kernel threads 2," in capsys.readouterr().out
    assert "METATP_NUM_THREADS" not in os.environ


def test_describe_numpy():
    one = create_backend("numpy", DeviceLayout(), cpu_kernels=False).describe()
    assert isinstance(one, BackendInfo)
    assert (one.name, one.n_devices, one.owned, one.allreduce, one.wire, one.kernels) == \
        ("numpy", 1, (0,), "none", "f32", "off")
    two = create_backend("numpy", DeviceLayout(2, "tensor"), allreduce="ring").describe()
    assert two.allreduce == "ring" and two.owned == (0, 1)
    assert two.kernels == (native.kernel_info() if native.available() else "off")
    assert dict(two.options)["numerics"] == "exact"
