"""llama-cpp-python's spellings, translated to metatp's: the `Llama(...)` constructor keywords
that differ (split_mode as an int, n_gpu_layers, main_gpu, n_threads), `response_format` of
`create_chat_completion`, and the count that is both an int and a method (`llm.n_ctx` is
metatp's and vLLM's attribute, `llm.n_ctx()` llama-cpp-python's method). Each keyword is
honoured or refused by name: none is accepted and ignored."""

from __future__ import annotations

import numbers
from typing import Any

from metatp.ir.errors import ConfigError
from metatp.request_fields import FieldError, short

__all__ = ["Count", "split_mode_name", "check_gpu_layers", "check_layer_count", "check_main_gpu", "check_threads",
           "response_format_constraint", "LLAMA_SPLIT_MODES"]

# llama.cpp's enum llama_split_mode: NONE, LAYER, ROW (rows of each matrix across GPUs: metatp's tensor split)
LLAMA_SPLIT_MODES = {0: "none", 1: "layer", 2: "tensor"}


class Count(int):
    """An int that returns itself when called: `llm.n_ctx == 2048` and `llm.n_ctx() == 2048` both
    hold, so scripts in either library's idiom read the same number."""

    def __call__(self) -> int:
        return int(self)


def _is_int(v: Any) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def split_mode_name(split_mode: Any) -> Any:
    """llama-cpp-python's split_mode (0 none, 1 layer, 2 row) as metatp's name; metatp's own
    names pass through for `DeviceLayout` to check."""
    if _is_int(split_mode):
        if int(split_mode) not in LLAMA_SPLIT_MODES:
            raise ConfigError(f"split_mode {split_mode} is not one of llama.cpp's 0 (none), 1 (layer), 2 (row)")
        return LLAMA_SPLIT_MODES[int(split_mode)]
    return split_mode


def check_gpu_layers(n_gpu_layers: Any, backend: str) -> str:
    """The backend to use for llama-cpp-python's n_gpu_layers (None: not given). -1 or a count
    covering every layer (checked once the model is read: `check_layer_count`) keeps `backend`;
    0 (every layer on the CPU) is the numpy backend, refused with a GPU backend named."""
    if n_gpu_layers is None:
        return backend
    if not _is_int(n_gpu_layers) or n_gpu_layers < -1:
        raise ConfigError(f"n_gpu_layers must be -1 (every layer) or a count of layers >= 0, got {short(n_gpu_layers)}")
    if n_gpu_layers == 0:
        if backend not in ("auto", "numpy"):
            raise ConfigError(f"n_gpu_layers=0 keeps every layer on the CPU, but backend={backend!r} runs them on "
                              "GPUs; pass backend='numpy' (or n_gpu_layers=-1)")
        return "numpy"
    return backend


def check_layer_count(n_gpu_layers: Any, n_layer: int, backend_name: str) -> None:
    """A positive n_gpu_layers must cover the model's layers: metatp offloads nothing to the CPU
    (a split between CPU and GPU, llama.cpp's partial offload, is refused by name)."""
    if n_gpu_layers is None or n_gpu_layers in (-1, 0) or n_gpu_layers >= n_layer:
        return
    raise ConfigError(f"n_gpu_layers={n_gpu_layers} would leave {n_layer - n_gpu_layers} of the model's {n_layer} "
                      f"layers on the CPU; metatp runs every layer on the {backend_name} backend's devices (no "
                      "partial offload): pass n_gpu_layers=-1, or split the model over more devices with split_mode")


def check_main_gpu(main_gpu: Any) -> None:
    """llama.cpp's main_gpu: metatp's devices are the first N visible ones, so only 0 is honoured."""
    if main_gpu is None:
        return
    if not _is_int(main_gpu) or main_gpu < 0:
        raise ConfigError(f"main_gpu must be a GPU index >= 0, got {short(main_gpu)}")
    if main_gpu != 0:
        raise ConfigError(f"main_gpu={main_gpu} is not supported: metatp uses the first visible GPUs from device 0; "
                          f"pick GPU {main_gpu} with CUDA_VISIBLE_DEVICES={main_gpu} instead")


def check_threads(n_threads: Any, backend_options: dict[str, Any]) -> dict[str, Any]:
    """llama-cpp-python's n_threads as the numpy backend's kernel_threads (the compiled CPU
    kernels' thread count); None keeps the default. Given twice (n_threads and
    backend_options['kernel_threads']) differently: a ConfigError naming both."""
    if n_threads is None:
        return backend_options
    if not _is_int(n_threads) or n_threads <= 0:
        raise ConfigError(f"n_threads must be a positive integer (CPU threads), got {short(n_threads)}")
    given = backend_options.get("kernel_threads")
    if given is not None and given != n_threads:
        raise ConfigError(f"n_threads={n_threads} contradicts backend_options kernel_threads={given}; set one")
    return {**backend_options, "kernel_threads": int(n_threads)}


def response_format_constraint(response_format: Any) -> dict[str, Any]:
    """OpenAI's / llama-cpp-python's response_format as SamplingParams keywords: {"type": "text"}
    (none), {"type": "json_object"} (any JSON object; with llama-cpp-python's "schema": that
    schema), {"type": "json_schema", "json_schema": {"schema": ...}}. Anything else is a
    FieldError naming response_format."""
    if response_format is None:
        return {}
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind not in ("text", "json_object", "json_schema"):
        raise FieldError("response_format", "response_format must be a dict with 'type' one of text, json_object, "
                                            f"json_schema, got {short(response_format)}")
    if kind == "text":
        return {}
    if kind == "json_object":
        schema = response_format.get("schema")
        return {"json_object": True} if schema is None else {"json_schema": schema}
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict):
        raise FieldError("response_format", "response_format['json_schema'] must be a dict {name, schema, strict}, "
                                            f"got {short(spec)}")
    schema = spec.get("schema")
    return {"json_object": True} if schema is None else {"json_schema": schema}
