"""The backend options the command line sets (`metatp.cli_options`): --no-fusion, --pdl,
--no-cuda-graphs, --backend-option KEY=VALUE and llama.cpp's GGML_CUDA_* switches, parsed and
checked against the chosen backend before any model is read. No model, no GPU: the errors come
from the flags alone (an emulated cupy run applying them: tests/cuda/test_cupy_cli_options.py)."""

from __future__ import annotations

import pytest

import metatp.backends as backends
from metatp import cli
from metatp.cli_args import layout_kwargs
from metatp.cli_options import ENV_SWITCHES
from metatp.ir.errors import ConfigError


@pytest.fixture(autouse=True)
def no_llama_cpp_switches(monkeypatch):
    for var in ENV_SWITCHES:
        monkeypatch.delenv(var, raising=False)


def options(*argv: str, cmd: str = "generate") -> dict:
    """layout_kwargs of `metatp CMD ARGV` (the keywords LLM gets from the layout flags)."""
    return layout_kwargs(cli._build_parser().parse_args([cmd, *argv]))


@pytest.mark.parametrize("cmd", ["generate", "serve", "batched-bench"])
def test_flags_and_backend_options_reach_the_cupy_options(cmd):
    kw = options("--backend", "cupy", "--no-fusion", "--pdl", "--backend-option", "kv_dtype=f32",
                 "--backend-option", "mmq_max_tokens=64", "--backend-option", "multi_gpu_graphs=segments",
                 "--backend-option", "cuda_graphs=off", cmd=cmd)
    assert kw["backend_options"] == {"attn_merge": False, "fuse_qkv_rope": False, "pdl": True, "kv_dtype": "f32",
                                     "mmq_max_tokens": 64, "multi_gpu_graphs": "segments", "cuda_graphs": False}


def test_no_flag_no_option_and_no_probe(monkeypatch):
    """Without a flag or switch nothing is checked, so "auto" is not probed for it."""
    monkeypatch.setattr(backends, "gpu_available", lambda: pytest.fail("probed"))
    assert options()["backend_options"] == {}


@pytest.mark.parametrize("value, parsed", [("true", True), ("False", False), ("1", True), ("off", False)])
def test_a_bool_value_is_read_as_a_bool(value, parsed):
    assert options("--backend", "cupy", "--backend-option", f"attn_merge={value}")["backend_options"] == \
        {"attn_merge": parsed}


@pytest.mark.parametrize("argv, match", [
    (["--backend-option", "frobnicate=1"],
     r"--backend-option frobnicate=1: the cupy backend has no option 'frobnicate'; it takes wire, cuda_graphs, "),
    (["--backend-option", "attn_merge=maybe"], r"attn_merge=maybe: attn_merge is true or false"),
    (["--backend-option", "mmq_min_tokens=many"], r"mmq_min_tokens=many: mmq_min_tokens is a whole number"),
    (["--backend-option", "mmq_min_tokens=0"], r"mmq_min_tokens=0: .*must be a whole number >= 1"),
    (["--backend-option", "kv_dtype=q8_0"], r"kv_dtype=q8_0: kv_dtype is one of f16, bf16, f32"),
    (["--backend-option", "kv_dtype"], r"--backend-option expects KEY=VALUE, got 'kv_dtype'"),
    (["--backend-option", "numerics=q8"], r"numerics is set by --numerics, not here"),
    (["--backend-option", "allreduce=ring"], r"allreduce is set by --allreduce, not here"),
    (["--no-fusion", "--backend-option", "fuse_qkv_rope=true"],
     r"--no-fusion sets fuse_qkv_rope=False but --backend-option sets fuse_qkv_rope=True; give one"),
    (["--backend-option", "pdl=true", "--backend-option", "pdl=false"], r"gives pdl twice, True and False"),
])
def test_refusals_name_the_flag_and_the_options(argv, match):
    with pytest.raises(ConfigError, match=match):
        options("--backend", "cupy", *argv)


def test_a_named_flag_and_the_same_value_agree():
    assert options("--backend", "cupy", "--pdl", "--backend-option", "pdl=yes")["backend_options"] == {"pdl": True}


@pytest.mark.parametrize("flag, key", [("--no-fusion", "attn_merge"), ("--pdl", "pdl"),
                                       ("--no-cuda-graphs", "cuda_graphs")])
def test_cupy_flags_are_refused_on_numpy_by_name(flag, key):
    with pytest.raises(ConfigError, match=rf"{flag}: the numpy backend has no option '{key}' \(an option of the "
                                          r"cupy backend\)"):
        options("--backend", "numpy", flag)


def test_a_cupy_option_is_refused_on_numpy():
    with pytest.raises(ConfigError, match=r"pdl=true: the numpy backend has no option 'pdl'; it takes cpu_kernels"):
        options("--backend", "numpy", "--backend-option", "pdl=true")


def test_numpy_options_and_cpu_kernels():
    """cpu_kernels travels as a backend option (LLM joins it with its own keyword of that name)."""
    kw = options("--backend", "numpy", "--backend-option", "parallel_devices=true", "--backend-option",
                 "cpu_kernels=false", "--backend-option", "kernel_threads=3")
    assert kw["backend_options"] == {"parallel_devices": True, "cpu_kernels": False, "kernel_threads": 3}
    assert "cpu_kernels" not in options("--backend", "numpy")["backend_options"]


def test_threads_flag_and_kernel_threads_option_conflict():
    with pytest.raises(ConfigError, match=r"-t sets kernel_threads=2 but --backend-option sets kernel_threads=4"):
        options("--backend", "numpy", "-t", "2", "--backend-option", "kernel_threads=4", cmd="serve")


def test_the_renamed_numpy_option_names_its_new_name():
    with pytest.raises(ConfigError, match=r"option 'threads' of the numpy backend is now 'parallel_devices'"):
        options("--backend", "numpy", "--backend-option", "threads=true")


@pytest.mark.parametrize("gpu, backend", [(False, "numpy"), (True, "cupy")])
def test_auto_checks_against_the_backend_it_resolves_to(monkeypatch, gpu, backend):
    monkeypatch.setattr(backends, "gpu_available", lambda: gpu)
    if backend == "cupy":
        assert options("--no-fusion")["backend_options"] == {"attn_merge": False, "fuse_qkv_rope": False}
    else:
        with pytest.raises(ConfigError, match="--no-fusion: the numpy backend"):
            options("--no-fusion")


@pytest.mark.parametrize("env, expected", [
    ({"GGML_CUDA_DISABLE_FUSION": "1"}, {"attn_merge": False, "fuse_qkv_rope": False}),
    ({"GGML_CUDA_DISABLE_FUSION": "0"}, {}),
    ({"GGML_CUDA_DISABLE_GRAPHS": "0"}, {"cuda_graphs": False}),       # llama.cpp: set at all
    ({"GGML_CUDA_PDL": "1"}, {"pdl": True}),
    ({"GGML_CUDA_PDL": "0"}, {"pdl": False}),
])
def test_llama_cpp_switches_on_cupy(monkeypatch, env, expected):
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    assert options("--backend", "cupy")["backend_options"] == expected


def test_the_command_line_overrides_the_switches_and_numpy_ignores_them(monkeypatch):
    monkeypatch.setenv("GGML_CUDA_DISABLE_FUSION", "1")
    monkeypatch.setenv("GGML_CUDA_PDL", "1")
    assert options("--backend", "cupy", "--backend-option", "attn_merge=true", "--backend-option",
                   "pdl=false")["backend_options"] == {"attn_merge": True, "fuse_qkv_rope": False, "pdl": False}
    assert options("--backend", "numpy")["backend_options"] == {}


def test_a_switch_that_is_not_an_integer_is_an_error(monkeypatch):
    monkeypatch.setenv("GGML_CUDA_DISABLE_FUSION", "yes")
    with pytest.raises(ConfigError, match=r"\$GGML_CUDA_DISABLE_FUSION='yes': expected an integer"):
        options("--backend", "cupy")


def test_the_command_says_it_on_one_line_before_reading_the_model(capsys, tmp_path):
    rc = cli.main(["generate", "-m", str(tmp_path / "absent.gguf"), "--backend", "numpy", "--pdl", "-p", "x"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1
    assert err[0].startswith("metatp: error: --pdl: the numpy backend has no option 'pdl'")


def test_the_environment_note_names_only_the_switches_an_error_names(monkeypatch):
    from metatp.cli_options import environment_note

    refusal = "cupy backend: pdl=True needs compute capability 9.0 or newer"
    assert environment_note(refusal) == ""                      # nothing set in the environment
    monkeypatch.setenv("GGML_CUDA_PDL", "1")
    monkeypatch.setenv("GGML_CUDA_DISABLE_GRAPHS", "1")
    assert environment_note(refusal) == "metatp: note: pdl=True is $GGML_CUDA_PDL=1 in the environment (llama.cpp's switch)"
    assert environment_note("model file not found") == ""
    monkeypatch.setenv("GGML_CUDA_PDL", "0")                    # off: the error cannot be about it
    assert environment_note(refusal) == ""
