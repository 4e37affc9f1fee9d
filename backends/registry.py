"""Backends by name, and the options each takes, validated in one place.

An option is chosen once (by `LLM(...)` or the CLI), checked here against the table, and
handed to the backend's constructor, which does not check it again; nothing downstream
re-derives it. Every backend is made here (`BackendEntry.create`, which `backends.create_backend`
calls): in one process as the options say, and on an MPI rank (`world` given) also wired as the
entry's `rank_wiring` says (the rank's device, the collective spanning the ranks). Names follow llama.cpp
where it has one (GGML_CUDA_ALLREDUCE-style all-reduce choice, `-ctk`-style cache types later).
"""

from __future__ import annotations

import importlib
import numbers
from dataclasses import dataclass, field
from typing import Any

from metatp.backends.collectives.schedule import mode_names
from metatp.backends.rank_errors import every_rank
from metatp.ir.errors import ConfigError, MetatpError

__all__ = ["Option", "BackendEntry", "BACKENDS", "backend_entry", "rank_backend_entry", "check_options",
           "ALLREDUCE_CHOICES"]

# The all-reduce algorithms a user may name: the collectives' mode table, with llama.cpp's
# GGML_CUDA_ALLREDUCE spellings as aliases ("none"/"internal": the copy-and-add butterfly).
ALLREDUCE_CHOICES = mode_names()


@dataclass(frozen=True)
class Option:
    """One backend option: its allowed values (a tuple) or type (bool; int: a whole number >= 1),
    default and meaning."""

    name: str
    allowed: tuple | type
    default: Any
    doc: str

    def takes_none(self) -> bool:
        """Is None one of the values (else None means "the backend's default")?"""
        return isinstance(self.allowed, tuple) and None in self.allowed

    def check(self, value: Any, backend: str) -> Any:
        if self.allowed is bool:
            if not isinstance(value, bool):
                raise ConfigError(f"{backend} backend: option {self.name}={value!r} must be True or False")
            return value
        if self.allowed is int:
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ConfigError(f"{backend} backend: option {self.name}={value!r} must be a whole number >= 1 "
                                  f"({self.doc})")
            return int(value)
        if value not in self.allowed:
            raise ConfigError(f"{backend} backend: option {self.name}={value!r} is not one of "
                              f"{', '.join(map(str, self.allowed))} ({self.doc})")
        return value


@dataclass(frozen=True)
class BackendEntry:
    """Where a backend class lives (imported on first use: cupy must not load on a CPU
    machine), the options its constructor accepts, and how an MPI rank wires it."""

    name: str
    target: str                       # "module:Class"
    options: dict[str, Option] = field(default_factory=dict)
    renamed: dict[str, str] = field(default_factory=dict)     # an old option name -> its new one
    # "module:function" (entry, world, layout, options) -> (checked options, wiring): how one
    # process per device drives this backend (`distributed`); "": not under mpiexec
    rank_wiring: str = ""

    def load(self):
        return _load(self.target)

    def check(self, options: dict[str, Any]) -> dict[str, Any]:
        """`options` validated; None values mean "the default" and are dropped. An option the
        backend does not take is an error naming the ones it does (an old name: its new one)."""
        out: dict[str, Any] = {}
        for key, value in options.items():
            opt = self.options.get(key)
            if opt is None:
                if key in self.renamed:
                    new = self.options[self.renamed[key]]
                    raise ConfigError(f"{self.name} backend: option {key!r} is now {new.name!r} ({new.doc}); "
                                      f"it takes {', '.join(self.options)}")
                raise ConfigError(f"{self.name} backend has no option {key!r}; it takes {', '.join(self.options)}")
            if value is None and not opt.takes_none():
                continue            # the backend's default
            out[key] = opt.check(value, self.name)
        return out

    def create(self, layout: Any, options: dict[str, Any], world: Any = None, **wiring: Any) -> Any:
        """The backend for `layout` with `options` checked. With `world` (one process per
        device, `distributed.World`): this rank's backend, owning device `world.rank`, wired by
        `rank_wiring` (its device, the collective spanning the ranks); errors every rank finds
        alike are reported once, by rank 0. `wiring` is how this process drives its devices,
        not a user's choice (cupy's `runtime` in tests), and is passed as it is."""
        if world is None:
            return self.load()(layout, **self.check(options), **wiring)
        if not self.rank_wiring:
            raise every_rank(ConfigError(f"the {self.name} backend does not run one process per device"))
        checked, rank = _load(self.rank_wiring)(self, world, layout, dict(options))
        return self.load()(layout, **checked, **rank, **wiring)


def _load(target: str) -> Any:
    """The object a "module:name" target names (its module imported now)."""
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def _opts(*options: Option) -> dict[str, Option]:
    return {o.name: o for o in options}


_NUMERICS = Option("numerics", ("exact", "llamacpp", "q8"), "exact",
                   "exact float32, or llama.cpp's CPU rounding of matmul activations (q8: the same; on cupy, int8 "
                   "dot products for decode)")
_ALLREDUCE = Option("allreduce", ALLREDUCE_CHOICES, "auto", "the all-reduce between devices")
_WIRE = Option("wire", ("auto", "f32", "bf16"), "auto", "all-reduce wire type (auto: f32 below a size, bf16 above)")

BACKENDS: dict[str, BackendEntry] = {
    "numpy": BackendEntry("numpy", "metatp.backends.numpy.backend:NumpyBackend", _opts(
        _NUMERICS, _ALLREDUCE,
        Option("cpu_kernels", (None, False, True), None,
               "compiled C kernels for few-token steps: None when they build, False never, True insist"),
        Option("parallel_devices", bool, False, "run the simulated devices side by side in threads"),
        Option("kernel_threads", int, None,
               "threads of the compiled kernels; None: $METATP_NUM_THREADS, else the CPUs shared among local ranks"),
        Option("batch_invariant", bool, False,
               "a sequence's bits do not depend on its batch-mates (the compiled kernels already give that: "
               "True insists on them)"),
    ), renamed={"threads": "parallel_devices"}, rank_wiring="metatp.backends.distributed:mpi_wiring"),
    "cupy": BackendEntry("cupy", "metatp.backends.cuda.backend:CupyBackend", _opts(
        _NUMERICS, _ALLREDUCE, _WIRE,
        Option("cuda_graphs", bool, True, "capture the decode step as a CUDA graph"),
        Option("kv_dtype", ("f16", "bf16", "f32"), "f16", "KV cache storage type"),
        Option("matmul_dtype", ("f16", "f32"), "f16", "operand type of the cuBLAS prefill path"),
        Option("mmq_min_tokens", int, None, "fewest tokens a MUL_MAT runs the tiled many-token kernel for"),
        Option("mmq_max_tokens", int, None, "most tokens a MUL_MAT runs the tiled many-token kernel for"),
        Option("mmq_tensor_cores", bool, False,
               "the tiled many-token kernel multiplies f16 tiles on the tensor cores (sm_80+; the cuBLAS path's "
               "operand rounding) instead of f32 on the CUDA cores"),
        Option("multi_gpu_graphs", ("whole", "segments"), "whole",
               "one CUDA graph across GPUs, or per-subgraph segments"),
        Option("batch_invariant", bool, False,
               "a sequence's bits do not depend on its batch-mates (one matmul kernel, fixed KV chunks)"),
        Option("attn_merge", bool, True,
               "merge the split-KV partials of decode attention inside its own launch (False: a merge kernel after it)"),
        Option("fuse_qkv_rope", bool, True,
               "one launch for a layer's norm, q/k/v products, RoPE and KV-cache write (False: the kernels apart)"),
        Option("pdl", bool, False,
               "programmatic dependent launch: each kernel may start while the one before it ends (sm_90+, "
               "the pdl extra's cuda-bindings)"),
        Option("precompile", bool, True,
               "compile the kernel modules all at once, in threads, before the first step (False: each at its "
               "first launch)"),
    ), rank_wiring="metatp.backends.distributed:nccl_wiring"),
}


def backend_entry(name: str) -> BackendEntry:
    try:
        return BACKENDS[name]
    except KeyError:
        raise ConfigError(f"unknown backend {name!r}; choose one of auto, {', '.join(BACKENDS)}") from None


def rank_backend_entry(name: str, layout: Any, world: Any) -> BackendEntry:
    """The entry of backend `name` on an MPI rank ("auto": numpy; a GPU rank names cupy) for a
    `layout` of one device per rank; errors every rank finds alike, marked as such."""
    if layout.n_devices != world.size:
        raise every_rank(ConfigError(f"layout has {layout.n_devices} devices for {world.size} ranks"))
    try:
        return backend_entry("numpy" if name == "auto" else name)
    except MetatpError as e:
        raise every_rank(e) from None


def check_options(name: str, options: dict[str, Any]) -> dict[str, Any]:
    """`options` validated for backend `name` (`BackendEntry.check`)."""
    return backend_entry(name).check(options)
