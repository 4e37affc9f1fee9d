"""The kernel launchers, one module per ``cuda/<family>.cu`` (as ggml-cuda keeps a launcher next
to its kernel), and the table of entry points they launch.

Launchers take arrays plus Python ints/floats and launch on the current stream of the current
device of the kernel engine in use (`launch.using`), or record inside `launch.recording()`.
``from metatp.backends.cuda import kernels as ck`` gives every launcher by name.
"""

from __future__ import annotations

import time

from metatp.backends.cuda.kernels import attn as _attn, dequant as _dequant, elementwise as _elementwise
from metatp.backends.cuda.kernels import kv as _kv, matvec as _matvec, norm as _norm, rope as _rope
from metatp.backends.cuda.kernels.attn import (ATTN_DECODE_MAX_TOKENS, attn_workspace_floats, choose_splits,
                                               decode_splits, flash_attn, flash_attn_decode, flash_attn_prefill)
from metatp.backends.cuda.kernels.dequant import dequantize
from metatp.backends.cuda.kernels.elementwise import (add, add_id, add_inplace, argmax, bf16_to_f32, binary, copy,
                                                      div, f32_to_bf16, fill, geglu, gelu, get_rows, mul, scale,
                                                      sigmoid, silu, soft_max, softplus, sub, swiglu, top_k, unary)
from metatp.backends.cuda.kernels.kv import set_rows
from metatp.backends.cuda.kernels.matvec import MATVEC_MAX_TOKENS, matvec, matvec_glu, matvec_id, matvec_multi
from metatp.backends.cuda.kernels.norm import norm, rms_norm, sum_rows
from metatp.backends.cuda.kernels.rope import rope
from metatp.backends.cuda.launch import (CACHE_TYPES, COMPILE_OPTIONS, FAMILIES, KV_QUANT_TYPES, KV_TYPES, WEIGHT_TYPES,
                                         Launch, device_ptr, get_kernel, kernel_sources, launch, module_source,
                                         recording, rows2d, using)

__all__ = [
    "FAMILIES", "WEIGHT_TYPES", "KV_TYPES", "KV_QUANT_TYPES", "CACHE_TYPES", "COMPILE_OPTIONS", "MATVEC_MAX_TOKENS",
    "ATTN_DECODE_MAX_TOKENS", "Launch",
    "kernel_sources", "module_source", "expected_entry_points", "get_kernel", "launch", "recording", "using",
    "compile_all", "device_ptr", "rows2d",
    "dequantize", "matvec", "matvec_multi", "matvec_glu", "matvec_id", "rms_norm", "norm", "sum_rows", "rope",
    "set_rows", "flash_attn_decode", "flash_attn_prefill", "flash_attn", "attn_workspace_floats", "choose_splits",
    "decode_splits", "binary", "add", "sub", "mul", "div", "add_inplace", "add_id", "unary", "scale", "fill",
    "silu", "gelu", "sigmoid", "softplus", "swiglu", "geglu", "soft_max", "argmax", "top_k", "get_rows", "copy",
    "f32_to_bf16", "bf16_to_f32",
]

# `norm` and `rope` name both a family module and its launcher: as attributes of this package
# they are the launchers (imported last); the modules are these.
_MODULES = {"dequant": _dequant, "matvec": _matvec, "norm": _norm, "rope": _rope, "kv": _kv, "attn": _attn,
            "elementwise": _elementwise}
assert tuple(_MODULES) == FAMILIES


def expected_entry_points() -> dict[str, list[str]]:
    """Every extern "C" kernel name the launchers launch, per family (each family module's
    ENTRY_POINTS)."""
    return {fam: list(mod.ENTRY_POINTS) for fam, mod in _MODULES.items()}


def compile_all(families=None) -> dict[str, float]:
    """Compile (and load) every family on the current device of the current engine; seconds per family."""
    out = {}
    names = expected_entry_points()
    for fam in families or FAMILIES:
        t0 = time.perf_counter()
        for n in names[fam]:
            get_kernel(fam, n)
        out[fam] = time.perf_counter() - t0
    return out
