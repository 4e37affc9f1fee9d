"""The backend options the command line sets, checked against the chosen backend before the
model is read (`layout_kwargs` hands them to `LLM` as `backend_options`).

Three sources, the later ones over the earlier:

1. llama.cpp's environment switches, read only when the chosen backend is cupy (llama.cpp's CUDA
   backend alone reads them; a numpy run ignores them): ``GGML_CUDA_DISABLE_GRAPHS`` (set, to
   anything: cuda_graphs off), ``GGML_CUDA_DISABLE_FUSION`` (a nonzero integer: the optional
   fusions off, as ``--no-fusion``), ``GGML_CUDA_PDL`` (an integer: pdl on when nonzero, off
   when 0; llama.cpp's default is on, ours off until a GPU run measures it).
2. The named flags: ``--no-cuda-graphs``, ``--no-fusion``, ``--pdl``, ``--batch-invariant``,
   ``-t N`` (the numpy backend's kernel_threads).
3. ``--backend-option KEY=VALUE`` (repeatable): any option in the chosen backend's table
   (`backends.registry`), the value read as the option's type (true/false, a whole number, or
   one of its values).

A named flag and ``--backend-option`` giving one key different values is an error naming both
(neither silently wins); either overrides the environment. An option the chosen backend does
not take is refused naming the flag that asked for it (``--pdl`` on numpy).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from metatp.backends.registry import BACKENDS, BackendEntry, Option, backend_entry
from metatp.ir.errors import ConfigError

__all__ = ["FUSION_OPTIONS", "ENV_SWITCHES", "backend_options", "chosen_backend", "environment_note",
           "parse_backend_option"]

#: the cupy backend's fusions that can be turned off (`--no-fusion`): attention merging its own
#: KV splits, and a token's norm + q/k/v products + RoPE + KV write as one launch. Its other
#: fusions (norm x weight, GLU, matvec + add, q/k/v products of one x, RoPE and K/V-store pairs,
#: matmul groups) have no switch in the backend and stay.
FUSION_OPTIONS = ("attn_merge", "fuse_qkv_rope")

#: llama.cpp's environment switches read for a cupy run (`_env_options`)
ENV_SWITCHES = ("GGML_CUDA_DISABLE_GRAPHS", "GGML_CUDA_DISABLE_FUSION", "GGML_CUDA_PDL")

#: options with a flag of their own (they are `LLM` arguments too): `--backend-option` points at the flag,
#: so one setting has one spelling on the command line
_LLM_ARGUMENTS = {"numerics": "--numerics", "allreduce": "--allreduce"}

_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")


def chosen_backend(args: argparse.Namespace) -> str:
    """The backend `LLM` will make for `--backend`: "auto" is numpy under mpiexec (several
    processes), else cupy when a GPU runs a probe kernel (`resolve_backend_name`, probed once
    per process); a named backend is taken as named (LLM says why it cannot run)."""
    from metatp.backends import resolve_backend_name
    from metatp.backends.distributed import launched_world_size

    name = getattr(args, "backend", None) or "auto"
    if name != "auto":
        backend_entry(name)                  # an unknown name: ConfigError listing the backends
        return name
    world = launched_world_size()
    return "numpy" if world is not None and world > 1 else resolve_backend_name("auto")


def _env_options() -> dict[str, tuple[Any, str]]:
    """llama.cpp's CUDA switches in the environment, as cupy options (read as llama.cpp reads them):
    key -> (value, the variable as set)."""
    out: dict[str, tuple[Any, str]] = {}
    graphs = os.environ.get("GGML_CUDA_DISABLE_GRAPHS")
    if graphs is not None:
        out["cuda_graphs"] = (False, f"$GGML_CUDA_DISABLE_GRAPHS={graphs}")
    if _env_int("GGML_CUDA_DISABLE_FUSION"):
        text = f"$GGML_CUDA_DISABLE_FUSION={os.environ['GGML_CUDA_DISABLE_FUSION']}"
        out.update({key: (False, text) for key in FUSION_OPTIONS})
    pdl = _env_int("GGML_CUDA_PDL")
    if pdl is not None:
        out["pdl"] = (pdl != 0, f"$GGML_CUDA_PDL={os.environ['GGML_CUDA_PDL']}")
    return out


def environment_note(message: str) -> str:
    """A line naming the environment variable behind an option that an error names (``pdl=True``
    refused on a GPU below sm_90 came from $GGML_CUDA_PDL=1, not from a flag); "" when the error
    names none of them. The run stopped on the error: the note says where to change it."""
    try:
        env = _env_options()
    except ConfigError:
        return ""
    named = [f"{key}={value} is {var}" for key, (value, var) in env.items() if f"{key}={value}" in message]
    return f"metatp: note: {'; '.join(named)} in the environment (llama.cpp's switch)" if named else ""


def _env_int(var: str) -> int | None:
    """An integer environment variable (None: unset); another value is an error naming it."""
    text = os.environ.get(var)
    if text is None:
        return None
    try:
        return int(text.strip() or "0")
    except ValueError:
        raise ConfigError(f"${var}={text!r}: expected an integer (0 or 1)") from None


def _flag_options(args: argparse.Namespace) -> dict[str, tuple[Any, str]]:
    """key -> (value, the flag that set it) for the named flags given."""
    out: dict[str, tuple[Any, str]] = {}
    if getattr(args, "cuda_graphs", True) is False:
        out["cuda_graphs"] = (False, "--no-cuda-graphs")
    if getattr(args, "fusion", None) is False:
        out.update({key: (False, "--no-fusion") for key in FUSION_OPTIONS})
    if getattr(args, "pdl", None):
        out["pdl"] = (True, "--pdl")
    if getattr(args, "threads", None):
        out["kernel_threads"] = (args.threads, "-t")
    if getattr(args, "batch_invariant", False):
        out["batch_invariant"] = (True, "--batch-invariant")
    return out


def parse_backend_option(text: str, entry: BackendEntry) -> tuple[str, Any]:
    """One ``KEY=VALUE`` of ``--backend-option`` -> (key, value) checked against `entry`'s table:
    the key one of its options, the value read as that option's type and allowed."""
    key, sep, raw = text.partition("=")
    key, raw = key.strip(), raw.strip()
    if not sep or not key:
        raise ConfigError(f"--backend-option expects KEY=VALUE, got {text!r}")
    if key in _LLM_ARGUMENTS:
        raise ConfigError(f"--backend-option {text}: {key} is set by {_LLM_ARGUMENTS[key]}, not here")
    opt = entry.options.get(key)
    if opt is None:
        if key in entry.renamed:
            raise ConfigError(f"--backend-option {text}: option {key!r} of the {entry.name} backend is now "
                              f"{entry.renamed[key]!r}")
        takes = ", ".join(k for k in entry.options if k not in _LLM_ARGUMENTS)
        raise ConfigError(f"--backend-option {text}: the {entry.name} backend has no option {key!r}; it takes {takes}")
    value = _parse_value(raw, opt, text)
    try:
        entry.check({key: value})
    except ConfigError as e:
        raise ConfigError(f"--backend-option {text}: {e}") from None
    return key, value


def _parse_value(raw: str, opt: Option, text: str) -> Any:
    """`raw` as option `opt`'s type: true/false for a bool, a whole number for an int, else the
    allowed value it spells (None as "none")."""
    low = raw.lower()
    if opt.allowed is bool:
        if low in _TRUE or low in _FALSE:
            return low in _TRUE
        raise ConfigError(f"--backend-option {text}: {opt.name} is true or false ({opt.doc})")
    if opt.allowed is int:
        try:
            return int(raw)
        except ValueError:
            raise ConfigError(f"--backend-option {text}: {opt.name} is a whole number ({opt.doc})") from None
    for value in opt.allowed:
        if str(value).lower() == low:
            return value
    raise ConfigError(f"--backend-option {text}: {opt.name} is one of "
                      f"{', '.join(str(v).lower() for v in opt.allowed)} ({opt.doc})")


def _given_options(args: argparse.Namespace, entry: BackendEntry) -> dict[str, Any]:
    """The --backend-option values, one value a key (a key given twice with different values is
    an error)."""
    out: dict[str, Any] = {}
    for text in getattr(args, "backend_option", None) or ():
        key, value = parse_backend_option(text, entry)
        if key in out and out[key] != value:
            raise ConfigError(f"--backend-option gives {key} twice, {out[key]!r} and {value!r}")
        out[key] = value
    return out


def backend_options(args: argparse.Namespace) -> dict[str, Any]:
    """The backend options the flags, --backend-option and (on cupy) llama.cpp's environment
    switches set, checked against the chosen backend; {} when none is set."""
    flags = _flag_options(args)
    env_set = any(os.environ.get(var) is not None for var in ENV_SWITCHES)
    if not flags and not getattr(args, "backend_option", None) and not env_set:
        return {}                # nothing to check: "auto" is not probed for it
    name = chosen_backend(args)
    entry = backend_entry(name)
    for key, (_, flag) in flags.items():
        if key not in entry.options:
            owners = [b for b, e in BACKENDS.items() if key in e.options]
            raise ConfigError(f"{flag}: the {name} backend has no option {key!r} (an option of the "
                              f"{' and '.join(owners)} backend); leave {flag} out or choose that --backend")
    given = _given_options(args, entry)
    for key, value in given.items():
        if key in flags and flags[key][0] != value:
            raise ConfigError(f"{flags[key][1]} sets {key}={flags[key][0]!r} but --backend-option sets "
                              f"{key}={value!r}; give one")
    options = {key: value for key, (value, _) in _env_options().items()} if name == "cupy" else {}
    options.update({key: value for key, (value, _) in flags.items()})
    options.update(given)
    return options
