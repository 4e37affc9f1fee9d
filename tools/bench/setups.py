"""A row's setup: the engine a layout runs on (metatp's, or llama.cpp's with --compare) and the
row fields that describe it (backend, kernels, KV types, all-reduces, modelled communication)."""

from __future__ import annotations

import os

from metatp.tools import llamacpp
from metatp.tools.bench.config import BenchConfig, context_size
from metatp.tools.bench_comm import modelled_communication

__all__ = ["COMPARE", "decode_allreduces", "setup_layout", "setup_llama_cpp"]


def decode_allreduces(eng, backend) -> dict:
    """Row fields for one decode step's all-reduces: how many, the algorithm the backend runs and
    the bytes its schedule moves on the busiest rank (collectives.allreduce_bytes)."""
    from metatp.backends.collectives import allreduce_bytes
    from metatp.ir.models import BatchSpec

    plan, _ = eng.plan_for(BatchSpec(1, eng.kv_span(1, 1), 1))     # the plan decode runs
    info = backend.describe()
    strategy, wire, thresholds = info.allreduce, info.wire, info.wire_thresholds
    # MPI ranks: MPICH / Open MPI run recursive doubling for short vectors, billed as the butterfly
    billed = "butterfly" if strategy == "mpi" else strategy
    per_rank = 0
    if strategy != "none":
        per_rank = sum(allreduce_bytes(billed, len(r.devices or range(plan.n_devices)), r.nbytes // 4, wire, thresholds)[0]
                       for r in plan.reductions)
    return {"reductions_per_token": int(plan.stats.get("reductions_per_step", 0)),
            "allreduce": strategy, "allreduce_bytes_per_token": per_rank}


def setup_layout(cfg: BenchConfig, n_dev: int, sm: str, ts, numerics: str = "exact", ctk: str | None = None,
           ctv: str | None = None, distributed: str = "none") -> tuple:
    """(engine, the row fields that describe the setup) for one layout; distributed="mpi": this
    rank's part of it (one device per rank)."""
    from metatp.api import LLM

    kv = {k: v for k, v in (("cache_type_k", ctk), ("cache_type_v", ctv)) if v is not None}
    llm = LLM(cfg.model, n_ctx=context_size(cfg), backend=cfg.backend, n_devices=n_dev, split_mode=sm,
              tensor_split=list(ts) if ts else None, seed=cfg.seed, numerics=numerics, distributed=distributed, **kv)
    tensors = llm.engine.tensors
    info = llm.backend.describe()
    kernels = info.kernels if info.kernel_threads is not None else ""     # the CPU kernels' build, or "off"
    base = {
        "model_filename": str(llm.model_path), "model_type": f"{llm.model.arch} {llm.model.name}",
        "backend": info.name, "n_devices": n_dev, "split_mode": sm,
        "tensor_split": "/".join(f"{x:g}" for x in ts) if ts else "",
        "n_threads": os.environ.get("OPENBLAS_NUM_THREADS", ""), "cpu_kernels": kernels, "numerics": numerics,
        "type_k": tensors.kv_type.name.lower(), "type_v": tensors.kv_type_v.name.lower(),
        **decode_allreduces(llm.engine, llm.backend),
        **modelled_communication(llm),
    }
    return llm.engine, base


COMPARE = ("llama-cpp",)


def setup_llama_cpp(cfg: BenchConfig, model_path: str) -> tuple:
    """(llama.cpp engine, its row fields): default llama.cpp settings (f16 KV cache, no flash
    attention), the kernel thread count metatp uses."""
    from metatp.backends.numpy.native import default_threads
    from metatp.ir.errors import ConfigError

    try:
        kernels = llamacpp.version()
    except llamacpp.ComparisonFailed as e:
        raise ConfigError(str(e)) from None
    threads = default_threads()
    eng = llamacpp.LlamaCppEngine(model_path, context_size(cfg), threads)
    base = {"model_filename": model_path, "model_type": "llama.cpp", "backend": "llama.cpp",
            "n_devices": 1, "split_mode": "none", "tensor_split": "", "n_threads": str(threads),
            "cpu_kernels": kernels, "numerics": "llama.cpp",
            "type_k": "f16", "type_v": "f16", "reductions_per_token": 0, "allreduce": "none", "allreduce_bytes_per_token": 0,
            "comm_bytes_per_token": 0, "comm_bytes_per_prompt": 0, "comm_prompt_tokens": 512}
    return eng, base
