"""The command line's fusion switches applied on the cupy backend, on the CPU emulator: `metatp
batched-bench --backend cupy` with --no-fusion launches the unfused kernels, and --backend-option attn_merge=false the merge kernel after the
split decode attention. The launches are counted by kernel name (the emulator's before_launch)."""

from __future__ import annotations

import warnings
from collections import Counter

import pytest

from metatp.cli_options import ENV_SWITCHES
from metatp.testing.synth import SynthSpec
from metatp.tools import batched_bench
from support.emulated_gpu import record_launches
from support.require import requires

pytestmark = requires("emulator")

SPEC = SynthSpec(n_layer=1, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, tied=False, seed=13, default_type="Q8_0",
                 n_ctx_train=4096)     # the `path` fixture (tests/conftest.py)


@pytest.fixture
def launches(monkeypatch):
    """run(path, argv) -> the kernels (name -> count) a batched-bench on the emulated cupy backend launched."""
    import metatp.backends as backends
    import metatp.backends.cuda.backend as cuda_backend
    from metatp.testing import EmuRuntime

    monkeypatch.setattr(backends, "gpu_probe", lambda: (True, ""))

    def run(path: str, argv: list[str]) -> Counter:
        seen: Counter = Counter()

        def counting_runtime(*a, **k):
            rt = EmuRuntime(*a, **k)
            record_launches(rt, lambda name: seen.update((name,)))
            return rt
        monkeypatch.setattr(cuda_backend, "CupyRuntime", counting_runtime)
        for var in ENV_SWITCHES:
            monkeypatch.delenv(var, raising=False)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            # 40 prompt tokens: the decode steps' attention splits the KV (a merge to make)
            assert batched_bench.main(["-m", path, "--backend", "cupy", "-npp", "40", "-ntg", "2", "-npl", "1",
                                       "--no-warmup", "-o", "jsonl", *argv]) == 0
        return seen
    return run


def fused_qkv(seen: Counter) -> int:
    return sum(n for name, n in seen.items() if name.startswith("qkv_rope_kv_"))


def test_no_fusion_launches_the_unfused_kernels_and_attn_merge_false_the_merge_kernel(path, launches):
    fused = launches(path, [])
    assert fused_qkv(fused) > 0 and fused["attn_merge_f32"] == 0
    unfused = launches(path, ["--no-fusion"])
    assert fused_qkv(unfused) == 0 and unfused["attn_merge_f32"] > 0
    assert unfused["rope_norm_f32"] > fused["rope_norm_f32"] and unfused["set_rows_f32_f16"] > fused["set_rows_f32_f16"]
    assert sum(unfused.values()) > sum(fused.values())
    apart = launches(path, ["--backend-option", "attn_merge=false"])
    assert apart["attn_merge_f32"] > 0 and fused_qkv(apart) == fused_qkv(fused)
    assert sum(apart.values()) == sum(fused.values()) + apart["attn_merge_f32"]


def test_a_switch_the_gpu_refuses_is_named_under_the_error(path, capsys, monkeypatch):
    """$GGML_CUDA_PDL=1 on a GPU below sm_90: the backend refuses pdl=True (llama.cpp's option name,
    not the variable), and the line under the error says the environment set it."""
    import metatp.backends as backends
    import metatp.backends.cuda.backend as cuda_backend
    from metatp import cli
    from metatp.testing import EmuRuntime

    monkeypatch.setattr(backends, "gpu_probe", lambda: (True, ""))
    monkeypatch.setattr(cuda_backend, "CupyRuntime", lambda *a, **k: EmuRuntime(*a, compute_capability=80, **k))
    for var in ENV_SWITCHES:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("GGML_CUDA_PDL", "1")
    rc = cli.main(["generate", "-m", path, "--backend", "cupy", "-p", "x", "-n", "1"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 2, err
    assert err[0].startswith("metatp: error: ") and "pdl=True needs compute capability 9.0" in err[0]
    assert err[1] == "metatp: note: pdl=True is $GGML_CUDA_PDL=1 in the environment (llama.cpp's switch)"
