"""The public Python API: `LLM` with vLLM-style `generate` and llama-cpp-python-style completions.

Construction, tokens, scoring, the request entry point (`submit`) and vLLM's generate / chat are
here; llama-cpp-python's completions come from `metatp.llama_completions` and the embedding
methods from `metatp.embedding_methods` (mixins `LLM` inherits).
"""

from __future__ import annotations

import dataclasses
import numbers
import os
import threading
import time
import uuid
import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from metatp import request_fields
from metatp.openai_messages import chat_messages
from metatp.ir.errors import ConfigError
from metatp.ir.models.common import cache_type
from metatp.embedding_methods import EmbeddingMethods
from metatp.embeddings import check_pooling
from metatp.sampling import SamplingParams, check_seed
from metatp.logprobs import prompt_logprob_dicts
from metatp.chat_formats import with_chat_format
from metatp.llama_completions import CompletionMethods
from metatp.llama_compat import Count, check_gpu_layers, check_layer_count, check_main_gpu, check_threads, split_mode_name
from metatp.mpi_calls import MpiCalls, mirrored
from metatp.requests import CompletionOutput, RequestHandle, RequestOutput
from metatp.output_processor import OutputProcessor
from metatp.runner import ModelRunner
from metatp.vllm_compat import check_tokenizer, engine_keywords
from metatp.scheduler import Request, Scheduler, context_budget

if TYPE_CHECKING:
    from metatp.vllm_compat import TokenizerView

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "chat_messages"]

DEFAULT_N_CTX = 2048
DEFAULT_N_BATCH = 512        # the most tokens one pass feeds (vLLM's max_num_batched_tokens)
MAX_N_CTX = 2**31 - 1        # cells and positions are int32 (the kv_idxs and pos inputs)


# ---------------------------------------------------------------- argument checks at the public boundary
_type_name, _short = request_fields.type_name, request_fields.short


def _check_bool(name: str, v: Any) -> bool:
    return request_fields.Flag(name).check(v)


def _check_opt_bool(name: str, v: Any) -> bool | None:
    return None if v is None else _check_bool(name, v)


BATCH_INVARIANT_ENV = ("METATP_BATCH_INVARIANT", "VLLM_BATCH_INVARIANT")


def batch_invariant_requested(value: Any) -> bool:
    """`LLM(batch_invariant=...)`: True/False as given; None: is $METATP_BATCH_INVARIANT or vLLM's
    $VLLM_BATCH_INVARIANT "1"?"""
    if value is not None:
        return _check_bool("batch_invariant", value)
    return any(os.environ.get(name, "").strip() == "1" for name in BATCH_INVARIANT_ENV)



def with_keyword_options(options: dict[str, Any], **keywords: tuple[Any, Any]) -> dict[str, Any]:
    """`LLM`'s own keywords that are backend options too (numerics, cpu_kernels, allreduce), each
    given as (value, default), joined with `backend_options`: a keyword left at its default takes
    the option's value, a set keyword fills the option, and the two set differently is a
    ConfigError naming both (never one silently dropped). A value that is still None (cpu_kernels'
    default) is left out: it is not an option of every backend."""
    out = dict(options)
    for key, (value, default) in keywords.items():
        given = out.get(key, default)
        if value != default and key in out and given != value:
            raise ConfigError(f"{key}={value!r} contradicts backend_options {key}={given!r}; set one")
        chosen = value if value != default else given
        if chosen is None:
            out.pop(key, None)
        else:
            out[key] = chosen
    return out

class LLM(CompletionMethods, EmbeddingMethods):
    """A GGUF model on one or more (simulated or real) devices.

    `model`: a GGUF path or a known model name; None is the default small model.
    `n_ctx`: context size; default 2048, capped at the model's trained context.
    `n_devices`/`split_mode`/`tensor_split` follow llama.cpp (-sm tensor or -sm layer, -ts 3,1).
    `tensor_parallel_size` T / `pipeline_parallel_size` P are vLLM's spellings of the same (T alone:
    -sm tensor over T devices; P alone: -sm layer over P; both: -sm layer,tensor over P*T, each
    stage a tensor group of T, `tensor_split` one share per device of a group); a contradiction
    with n_devices, split_mode or tensor_split is a ConfigError naming both (`metatp.parallel`).
    `numerics`: "exact" (float32) or "llamacpp" / "q8" (round matmul activations as llama.cpp's CPU
    backend does, to compare logits with it; the cupy backend takes int8 dot products for decode).
    `memory_budget`: bytes per device ("8GiB"); default: what the backend reports free. The memory
    plan is checked before any weight is loaded; `fit_context=True` shrinks n_ctx to fit instead
    of refusing.
    `cpu_kernels` (numpy backend): few-token steps use compiled C kernels over int8-coded weights
    (built on first use with the machine's C compiler; ~3x faster decode). None: when they build;
    False: pure numpy; True: fail if they cannot be built. METATP_CPU_KERNELS=0 turns them off.
    `allreduce`: the all-reduce between devices: "auto" (the backend's choice: NCCL on distinct
    GPUs, else the butterfly), "butterfly", "ring", "nccl", or llama.cpp's GGML_CUDA_ALLREDUCE
    spellings "none" / "internal" (the copy-and-add butterfly).
    `max_num_seqs`: sequences decoded together in one step (continuous batching; vLLM's name).
    `max_waiting`: requests that may wait for a slot (None: unbounded); one more is QueueFullError.
    `enable_prefix_caching`: keep finished requests' KV blocks and reuse them for prompts that
    start the same way (vLLM's name; `metatp.prefix_cache`); a reused prefix may differ from a
    recomputed one in the last bits where its passes differed (README, "Prefix cache").
    `max_model_len`: the most tokens one request may hold, prompt + completion (vLLM's name): a
    longer prompt is a ContextOverflowError, a generation reaching it ends with "length", and
    admission reserves no more cells than it. None: the cache alone bounds a request (n_ctx
    cells); `metatp serve` defaults it to n_ctx // parallel (llama-server's slot).
    `cache_type_k` / `cache_type_v`: KV cache types (llama.cpp's -ctk / -ctv): f32 (default; the
    cupy backend keeps an f32 cache as its kv_dtype, f16), f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1;
    V defaults to K's. A quantized cache is split by whole heads like any other (beyond llama.cpp,
    whose -sm tensor needs an unquantized cache); its head size must be whole quant blocks.
    `backend_options`: further options of the chosen backend, checked against its table in
    `metatp.backends.registry` (cupy: cuda_graphs, wire, kv_dtype, matmul_dtype,
    multi_gpu_graphs, mmq_min_tokens, mmq_max_tokens; numpy: parallel_devices, kernel_threads, the compiled kernels' thread
    count, default $METATP_NUM_THREADS).
    `speculative_config` (vLLM's dict: {"method": "ngram" | "draft", "num_speculative_tokens": k,
    "prompt_lookup_max": n, "prompt_lookup_min": m, "model": draft}) or `speculative_model` with
    `num_speculative_tokens`: speculative decoding (`metatp.speculative`): k tokens drafted by
    prompt lookup or a draft model, verified in one pass; the same tokens greedy, the same
    distribution sampled. Structured-output requests do not speculate.
    `batch_invariant`: a sequence's greedy tokens and logits do not depend on what shares its steps,
    bitwise (vLLM's VLLM_BATCH_INVARIANT=1; None: $METATP_BATCH_INVARIANT or $VLLM_BATCH_INVARIANT
    set to 1). The cupy backend then runs one matmul kernel and fixed KV chunks for every row count
    (slower: docs/gpu-results.md); the numpy backend's compiled kernels are so already (it insists
    on them).
    `distributed`: "auto" (one process per device when started by `mpiexec -n N`, N > 1), "mpi"
    (even for one process) or "none". Under MPI the world size is the device count (`n_devices`
    None means it) and every rank holds only its device's slices; every rank makes the same
    calls, in the same order: rank 0 runs them (schedules, samples, posts each step) and the
    other ranks follow its steps and return its results (`metatp.mpi_calls`), so rank 0's
    prompts and seeds drive every rank. Only rank 0 may `submit` (a server).
    `pooling`: how `embed` / `create_embedding` pool a prompt's final hidden states: "mean",
    "cls" or "last" (llama.cpp's --pooling names; "none" and "rank" are refused); None: the GGUF's
    `{arch}.pooling_type`, "last" where it has none (`metatp.embeddings`).

    llama-cpp-python's constructor keywords (`metatp.llama_compat`), so `Llama(model_path=...,
    n_ctx=..., n_gpu_layers=-1, ...)` runs unchanged: `model_path` is `model`; `n_threads` the
    compiled CPU kernels' threads (numpy backend's kernel_threads; the cupy backend computes
    nothing on CPU threads); `n_gpu_layers` -1 or a count covering every layer (0: the numpy
    backend; a partial offload is refused); `split_mode` 0/1/2 (none/layer/row = tensor);
    `main_gpu` 0 (others: use CUDA_VISIBLE_DEVICES); `chat_format` None (the GGUF's template) or
    one of `metatp.chat_formats.CHAT_FORMATS`; `seed` -1 a random seed; `embedding` and
    `logits_all` True or False (metatp computes embeddings and every logit on demand either way).

    vLLM's engine keywords (`metatp.vllm_compat.engine_keywords`), each honoured or refused by
    name: `dtype` ("auto"; "float32"; "float16" on cupy; "bfloat16" refused), `gpu_memory_utilization`
    (the fraction of the backend's free memory the memory plan may use), `enforce_eager` (cupy:
    no CUDA graphs), `trust_remote_code` (a GGUF runs no code), `tokenizer` (None or the model
    itself), `quantization` (None or "gguf"), `swap_space` (accepted: preemption recomputes),
    `max_num_batched_tokens` (n_batch, default 512), `disable_log_stats` (True only), `seed`.
    """

    def __init__(self, model: str | os.PathLike | None = None, n_ctx: int | None = None, backend: str = "auto",
                 n_devices: int | None = None, split_mode: str | None = None, tensor_split: Sequence[float] | None = None,
                 seed: int = 0, n_batch: int | None = None, numerics: str = "exact", memory_budget: int | str | None = None,
                 fit_context: bool = False, verbose: bool = False, cpu_kernels: bool | None = None,
                 allreduce: str = "auto", backend_options: Mapping[str, Any] | None = None,
                 max_num_seqs: int = 16, distributed: str = "auto", cache_type_k: str = "f32",
                 cache_type_v: str | None = None, max_model_len: int | None = None,
                 max_waiting: int | None = None, enable_prefix_caching: bool = True,
                 tensor_parallel_size: int | None = None, pipeline_parallel_size: int | None = None,
                 pooling: str | None = None,
                 model_path: str | os.PathLike | None = None, n_threads: int | None = None,
                 n_gpu_layers: int | None = None, main_gpu: int | None = None, chat_format: str | None = None,
                 embedding: bool = False, logits_all: bool = False,
                 speculative_config: Mapping[str, Any] | None = None, speculative_model: str | os.PathLike | None = None,
                 num_speculative_tokens: int | None = None, dtype: str = "auto",
                 gpu_memory_utilization: float | None = None, enforce_eager: bool = False,
                 trust_remote_code: bool = False, tokenizer: str | os.PathLike | None = None,
                 quantization: str | None = None, swap_space: float | None = None,
                 max_num_batched_tokens: int | None = None, disable_log_stats: bool = True,
                 batch_invariant: bool | None = None) -> None:
        from metatp.backends import create_backend, resolve_backend_name
        from metatp.backends.distributed import init_world
        from metatp.engine import Engine
        from metatp.ir.loader import load_model
        from metatp.models import resolve_model
        from metatp.passes.plan import DeviceLayout
        from metatp.speculative import spec_config

        if model_path is not None:
            if model is not None:
                raise ConfigError(f"model={_short(model)} and model_path={_short(model_path)}: give the model once")
            model = model_path
        speculation = spec_config(speculative_config, speculative_model, num_speculative_tokens)
        if model is not None and not isinstance(model, (str, os.PathLike)):
            raise ConfigError(f"model must be a GGUF path or a known model name (str or path), got "
                              f"{_type_name(model)} {_short(model)}")
        if n_ctx is not None and (isinstance(n_ctx, bool) or not isinstance(n_ctx, numbers.Integral) or n_ctx <= 0):
            raise ConfigError(f"n_ctx must be a positive integer, got {n_ctx!r}")
        if n_ctx is not None and n_ctx > MAX_N_CTX:
            raise ConfigError(f"n_ctx must be at most {MAX_N_CTX} (KV cells and positions are 32-bit), got {n_ctx}")
        n_ctx = None if n_ctx is None else int(n_ctx)
        if n_batch is not None and (isinstance(n_batch, bool) or not isinstance(n_batch, numbers.Integral)
                                    or n_batch <= 0):
            raise ConfigError(f"n_batch must be a positive integer, got {n_batch!r}")
        if isinstance(max_num_seqs, bool) or not isinstance(max_num_seqs, numbers.Integral) or max_num_seqs <= 0:
            raise ConfigError(f"max_num_seqs must be a positive integer, got {max_num_seqs!r}")
        max_num_seqs = int(max_num_seqs)
        if max_waiting is not None and (isinstance(max_waiting, bool) or not isinstance(max_waiting, numbers.Integral)
                                        or max_waiting < 0):
            raise ConfigError(f"max_waiting must be an integer >= 0 or None (unbounded), got {max_waiting!r}")
        if max_model_len is not None and (isinstance(max_model_len, bool) or not isinstance(max_model_len, numbers.Integral)
                                          or max_model_len <= 0):
            raise ConfigError(f"max_model_len must be a positive integer or None, got {max_model_len!r}")
        max_model_len = None if max_model_len is None else int(max_model_len)
        if not isinstance(enable_prefix_caching, (bool, np.bool_)):
            raise ConfigError(f"enable_prefix_caching must be True or False, got {enable_prefix_caching!r}")
        self._pooling = check_pooling(pooling)   # embeddings' pooling; None: the model's (a bad name fails now)
        cache_type(cache_type_k, "k")             # a bad name fails before the model is read
        if cache_type_v is not None:
            cache_type(cache_type_v, "v")
        if isinstance(n_devices, numbers.Integral) and not isinstance(n_devices, (bool, np.bool_)):
            n_devices = int(n_devices)
        for name, v in (("backend", backend), ("numerics", numerics), ("allreduce", allreduce)):
            if not isinstance(v, str):
                raise ConfigError(f"{name} must be a string, got {_type_name(v)} {_short(v)}")
        split_mode = split_mode_name(split_mode)         # llama-cpp-python's 0 / 1 / 2
        if split_mode is not None and not isinstance(split_mode, str):
            raise ConfigError(f"split_mode must be 'none', 'tensor', 'layer' or None, got {_short(split_mode)}")
        seed = check_seed("seed", None if request_fields.is_integer(seed) and seed == -1 else seed)  # -1: random
        backend = check_gpu_layers(n_gpu_layers, backend)
        check_main_gpu(main_gpu)
        self.embedding, self.logits_all = _check_bool("embedding", embedding), _check_bool("logits_all", logits_all)
        fit_context = _check_bool("fit_context", fit_context)
        verbose = _check_bool("verbose", verbose)
        cpu_kernels = _check_opt_bool("cpu_kernels", cpu_kernels)
        if memory_budget is not None and (isinstance(memory_budget, bool)
                                          or not isinstance(memory_budget, (str, numbers.Integral))):
            raise ConfigError(f"memory_budget must be bytes (an int) or a size like '8GiB', got {_short(memory_budget)}")
        ts = self._tensor_split(tensor_split)
        if distributed is not None and not isinstance(distributed, str):
            raise ConfigError(f"distributed must be 'auto', 'mpi' or 'none', got {_short(distributed)}")
        self.world = init_world(distributed)     # None: this process holds every device
        if tensor_parallel_size is not None or pipeline_parallel_size is not None:
            from metatp.parallel import KEYWORDS, parallel_layout

            n_devices, split_mode, ts = parallel_layout(
                n_devices if n_devices is not None or self.world is None else self.world.size, split_mode, ts,
                pipeline_parallel_size, tensor_parallel_size, KEYWORDS)
        if self.world is not None:
            self.world.quiet()
            n_devices, split_mode = self.world.layout_for(n_devices, split_mode, ts)
            seed = self.world.agree_seed(seed)
        elif n_devices is None:
            n_devices = 1
        if split_mode is None:
            split_mode = "tensor" if (isinstance(n_devices, int) and n_devices > 1) or ts else "none"
        self.layout = DeviceLayout(n_devices, split_mode, ts)
        if backend_options is not None and not isinstance(backend_options, Mapping):
            raise ConfigError(f"backend_options must be a dict of option names to values, got "
                              f"{_type_name(backend_options)} {_short(backend_options)}")
        options = check_threads(n_threads, dict(backend_options or {}))
        vllm = engine_keywords(
            lambda: resolve_backend_name(backend) if self.world is None else ("numpy" if backend == "auto" else backend),
            options, n_batch, memory_budget, dtype=dtype, gpu_memory_utilization=gpu_memory_utilization,
            enforce_eager=enforce_eager, trust_remote_code=trust_remote_code, quantization=quantization,
            swap_space=swap_space, max_num_batched_tokens=max_num_batched_tokens, disable_log_stats=disable_log_stats)
        options, self._memory_fraction = vllm.backend_options, vllm.memory_fraction
        n_batch = int(vllm.n_batch or n_batch or DEFAULT_N_BATCH)
        if n_threads is not None and self.world is None and resolve_backend_name(backend) != "numpy":
            options.pop("kernel_threads")       # a GPU backend: no compute on CPU threads to count
        if batch_invariant_requested(batch_invariant):
            options["batch_invariant"] = True
        options = with_keyword_options(options, numerics=(numerics, "exact"), cpu_kernels=(cpu_kernels, None),
                                       allreduce=(allreduce, "auto"))
        # options are checked (and the backend set up) before the model file is read
        self.backend = create_backend(backend, self.layout, world=self.world, **options)
        self.model_path = resolve_model(model, quiet=not verbose)
        check_tokenizer(tokenizer, model, self.model_path)
        if self.world is not None:
            self.world.check_model(self.model_path)
        self.model = load_model(self.model_path)
        hp = self.model.hparams
        check_layer_count(n_gpu_layers, hp.n_layer, self.backend.name)
        if n_ctx is None:        # default: 2048, capped at what the model was trained for
            n_ctx = min(DEFAULT_N_CTX, hp.n_ctx_train)
        elif n_ctx > hp.n_ctx_train:
            warnings.warn(f"n_ctx={n_ctx} is beyond the model's trained context of {hp.n_ctx_train}; "
                          "quality may degrade", stacklevel=2)
        if self.layout.split_mode == "tensor" and n_devices > min(hp.n_head_kv):
            warnings.warn(f"{n_devices} devices but only {min(hp.n_head_kv)} KV heads: "
                          "some devices get zero attention slices", stacklevel=2)
        self.tokenizer = with_chat_format(self.model.tokenizer, chat_format)
        self.n_ctx = Count(n_ctx)             # llm.n_ctx, and llama-cpp-python's llm.n_ctx()
        self._cache_types = {"cache_type_k": cache_type_k, "cache_type_v": cache_type_v}
        self.engine = Engine(self.model, n_ctx, self.layout, self.backend, n_batch=n_batch, world=self.world,
                             **self._cache_types)
        # a draft model is read (its weights not yet on a device) before the check: its bytes count too
        speculator = self._speculator(speculation, verbose)
        self.memory = self._check_memory(memory_budget, fit_context, n_batch,
                                         None if speculator is None else speculator.draft)
        if max_model_len is not None and max_model_len > self.n_ctx:
            raise ConfigError(f"max_model_len={max_model_len} is more than the cache holds (n_ctx={self.n_ctx}); "
                              "raise n_ctx or lower max_model_len")
        self.max_model_len = max_model_len
        self._rng = np.random.default_rng(seed)
        self._rng_lock = threading.Lock()
        self.scheduler = Scheduler(ModelRunner(self.engine, self.tokenizer), max_num_seqs=max_num_seqs,
                                   max_waiting=None if max_waiting is None else int(max_waiting),
                                   prefix_caching=enable_prefix_caching,
                                   speculator=speculator)
        # several ranks: rank 0 leads every call, the others follow it (None in one process)
        self._mpi_calls = MpiCalls(self, self.world) if self.world is not None and self.world.size > 1 else None
        self.verbose = verbose

    def _speculator(self, config, verbose: bool):
        """Speculative decoding's proposer for this model (`metatp.speculative`), or None."""
        from metatp.speculative import Speculator

        if config is None:
            return None
        draft = None
        if config.method == "draft":
            from metatp.draft import DraftModel

            if self.world is not None:
                raise ConfigError("a draft model (speculative_model) is not supported under MPI; use "
                                  "speculative_config={'method': 'ngram', ...} there")
            draft = DraftModel.load(config.draft_model, self, verbose)
        return Speculator(config, draft)

    @staticmethod
    def _tensor_split(tensor_split: Any) -> tuple[float, ...] | None:
        """'3,1', a sequence or a 1-D array of shares -> a tuple of floats (the layout checks the values)."""
        from metatp.passes.plan import DeviceLayout

        if tensor_split is None:
            return None
        if isinstance(tensor_split, str):
            return DeviceLayout.parse_split(tensor_split)
        if isinstance(tensor_split, np.ndarray) and tensor_split.ndim == 1:
            tensor_split = tensor_split.tolist()
        if isinstance(tensor_split, (bytes, dict)) or not isinstance(tensor_split, Sequence):
            raise ConfigError(f"tensor_split must be a sequence of per-device shares like [3, 1] or '3,1', "
                              f"got {_type_name(tensor_split)} {_short(tensor_split)}")
        out = []
        for x in tensor_split:
            if isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Real):
                raise ConfigError(f"tensor_split entries must be finite numbers >= 0, got {_short(list(tensor_split))}")
            out.append(float(x))
        return tuple(out)

    def _check_memory(self, budget, fit: bool, n_batch: int, draft=None):
        """Refuse (or shrink n_ctx) before loading when weights + KV + buffers exceed the budget.
        A `draft` model (`metatp.draft.DraftModel`, whole on device 0) counts there, with a cache
        as large as the target's context (shrunk with it)."""
        from metatp.engine import Engine
        from metatp.ir.errors import MemoryPlanError
        from metatp.passes.memory import fit_context, format_bytes, parse_bytes

        mem = self.engine.memory_plan()
        limit, shared = self.backend.memory_budget()
        if budget is not None:
            limit, shared = parse_bytes(budget), False
        if self._memory_fraction is not None:
            if limit is None:
                raise ConfigError(f"gpu_memory_utilization={self._memory_fraction}: the {self.backend.name} backend "
                                  "reports no free memory here to take a fraction of; pass memory_budget instead")
            limit = int(limit * self._memory_fraction)
        if limit is None:
            return mem

        host = self.backend.name == "numpy"   # its devices are host memory: the engine's tables count too

        def draft_need(m) -> int:          # the draft's bytes beside a target plan of m.n_ctx cells
            if draft is None:
                return 0
            dm = draft.memory_plan(m.n_ctx)
            return dm.total(0) + (dm.host if host else 0)

        def need(m) -> list[int]:          # simulated devices share one pool: compare the sum
            extra = m.host if host else 0
            if shared:
                return [sum(m.totals()) + extra + draft_need(m)]
            return [t + extra + (draft_need(m) if d == 0 else 0) for d, t in enumerate(m.totals())]

        def fits(m) -> bool:
            return max(need(m)) <= limit

        if fits(mem):
            return mem

        fitted = fit_context(self.engine.memory_plan, fits, self.n_ctx)
        if fit and fitted > 0:
            self.n_ctx = Count(fitted)
            self.engine = Engine(self.model, fitted, self.layout, self.backend, n_batch=n_batch, world=self.world,
                                 **self._cache_types)
            if draft is not None:
                draft.fit_context(fitted)
            return self.engine.memory_plan()
        totals = need(mem)
        d = max(range(len(totals)), key=lambda j: totals[j])
        where = "in all" if shared else f"on device {d}"
        parts = (f"weights {format_bytes(mem.weights[d])}, KV cache {format_bytes(mem.kv[d])} for "
                 f"n_ctx={self.n_ctx}, buffers {format_bytes(mem.compute[d])}"
                 + (f", host cell tables and masks {format_bytes(mem.host)}" if host else "")
                 + (f", draft model {draft.name} {format_bytes(draft_need(mem))}" if draft is not None and
                    (shared or d == 0) else ""))
        if shared and mem.n_devices > 1:
            parts = f"{mem.n_devices} simulated devices; device 0: " + parts
        advice = (f"n_ctx={fitted} would fit (or pass fit_context=True / --fit)" if fitted > 0 else
                  "even the smallest context does not fit: use more devices or a smaller model"
                  + (" or draft model" if draft is not None else ""))
        raise MemoryPlanError(f"does not fit: needs {format_bytes(totals[d])} {where} ({parts}) but the budget is "
                              f"{format_bytes(limit)}; {advice}")

    # ---------------------------------------------------------------- tokens
    @property
    def n_vocab(self) -> Count:
        """The vocabulary size: `llm.n_vocab`, or llama-cpp-python's `llm.n_vocab()`."""
        return Count(self.model.hparams.n_vocab)

    def token_eos(self) -> int | None:
        """The end-of-sequence token id (llama-cpp-python's name); None if the model has none."""
        return self.tokenizer.eos_id

    def token_bos(self) -> int | None:
        """The beginning-of-sequence token id (llama-cpp-python's name); None if the model has none."""
        return self.tokenizer.bos_id

    def token_nl(self) -> int:
        """The newline token id (llama-cpp-python's name: llama.cpp's linefeed token, "\n" alone)."""
        ids = self.tokenizer.encode("\n", add_bos=False, special=False)
        if len(ids) != 1:
            raise ConfigError(f"this vocabulary has no single newline token (\"\\n\" encodes as {ids})")
        return ids[0]

    def get_tokenizer(self) -> "TokenizerView":
        """The model's tokenizer with the Hugging Face methods vLLM scripts call on
        `LLM.get_tokenizer()` (encode, decode, apply_chat_template, eos_token_id, ...)."""
        from metatp.vllm_compat import TokenizerView

        return TokenizerView(self.tokenizer)

    def tokenize(self, text: str, special: bool = True, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`; honours the model's add_bos flag unless add_bos is given."""
        if isinstance(text, bytes):
            raise ConfigError("tokenize needs text (str), got bytes; decode it first, e.g. data.decode('utf-8')")
        if not isinstance(text, str):
            raise ConfigError(f"tokenize needs text (str), got {_type_name(text)} {_short(text)}")
        return self.tokenizer.encode(text, add_bos=_check_opt_bool("add_bos", add_bos),
                                     special=_check_bool("special", special))

    def detokenize(self, ids: Sequence[int], skip_special: bool = False) -> str:
        """Text of token ids (integers: numpy integer arrays are fine, floats are refused)."""
        return self.tokenizer.decode(self._check_ids(ids, "ids", allow_empty=True),
                                     skip_special=_check_bool("skip_special", skip_special))

    # ---------------------------------------------------------------- scoring
    @mirrored
    def score(self, ids: Sequence[int]) -> np.ndarray:
        """float32 logits [len(ids), n_vocab] at every position of a fresh sequence."""
        ids = self._check_ids(ids, "ids")
        context_budget(len(ids), self.n_ctx, self.max_model_len)
        return self.submit(ids, SamplingParams(max_tokens=0), kind="score").logits()

    def _check_ids(self, ids: Any, name: str = "prompt", allow_empty: bool = False) -> list[int]:
        ids = request_fields.prompt_token_ids(name, ids)
        if not ids and not allow_empty:
            raise ConfigError(f"{name}: need at least one token id")
        return request_fields.vocabulary_ids(name, ids, self.n_vocab)

    def prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        """A prompt (text, or integer token ids) as checked ids (an empty text: the BOS token)."""
        if isinstance(prompt, bytes):
            raise ConfigError("a prompt must be text (str) or token ids, got bytes; decode it first")
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)       # special tokens parsed (not `tokenize`: Llama's differs)
            if not ids:
                bos = self.tokenizer.bos_id
                if bos is None:
                    raise ConfigError("empty prompt, and the model has no BOS token to start from")
                ids = [bos]
            return ids
        return self._check_ids(prompt)

    # ---------------------------------------------------------------- generation core
    def submit(self, prompt_ids: list[int], params: SamplingParams, index: int = 0, kind: str = "generate",
               max_model_len: int | None = None, on_output=None, tenant: str | None = None) -> RequestHandle:
        """Queue one sample (`index` of params.n) of a prompt: the public request entry point that
        `generate`, `score`, streaming and the server share. Returns its `RequestHandle`: iterate
        it, wait for its `result()`, or `cancel()` it; with `on_output`, each output goes to that
        callback instead (a server). QueueFullError when a bounded waiting queue is full.

        Each request has its own random generator: a seeded one draws from its seed (sample
        i > 0 of n from [seed, i]), an unseeded one from a seed taken from the LLM's generator now,
        so its tokens never depend on who shares its steps. Under MPI only rank 0 submits (its
        steps are posted to the other ranks, which follow them: inside a call every rank makes,
        or `serve`). `max_model_len`: this request's cap (the server's), else the LLM's. `tenant`:
        who sends it (a server's API-key tenant; None: anonymous): with params.cache_salt, whose
        prefix-cache blocks it may reuse."""
        if self._mpi_calls is not None and self._mpi_calls.leader is None:
            raise ConfigError(f"rank {self._mpi_calls.world.rank} cannot submit: under MPI rank 0 schedules "
                              "every request and the other ranks follow its steps (call generate / score / the "
                              "completions on every rank, or serve)")
        if params.seed is not None:
            rng = np.random.default_rng(params.seed if index == 0 else [params.seed, index])
            if index:
                params = dataclasses.replace(params, seed=None)
        else:
            with self._rng_lock:
                rng = np.random.default_rng(int(self._rng.integers(2 ** 63)))
        req = Request(prompt_ids, params, rng, self.n_ctx, kind=kind, index=index,
                      max_model_len=self.max_model_len if max_model_len is None else max_model_len,
                      eog_ids=self.tokenizer.eog_ids, tenant=tenant)
        handle = RequestHandle(req, self.scheduler, OutputProcessor(params, self.tokenizer), on_output)
        self.scheduler.submit(req)
        return handle

    # ---------------------------------------------------------------- vLLM-style
    @mirrored
    def generate(self, prompts: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]],
                 sampling_params: SamplingParams | None = None, use_tqdm: Any = False) -> list[RequestOutput]:
        """Generate for each prompt (a string or a list of token ids); vLLM-shaped results.

        All prompts (and the `n` samples of each) run as sequences of one continuous batch;
        each result is what that prompt gives alone. `sampling_params`: one SamplingParams for
        every prompt, or a list of one per prompt; None: `SamplingParams()`, vLLM's defaults
        (temperature 1.0). `use_tqdm` (vLLM's; default False here): a progress bar over the
        prompts when tqdm is installed, or a tqdm-like callable."""
        from metatp.vllm_compat import progress_bar

        prompts = self._prompt_list(prompts)
        if sampling_params is None:
            per_prompt = [SamplingParams()] * len(prompts)
        elif isinstance(sampling_params, SamplingParams):
            per_prompt = [sampling_params] * len(prompts)
        elif isinstance(sampling_params, (list, tuple)) and all(isinstance(x, SamplingParams) for x in sampling_params):
            if len(sampling_params) != len(prompts):
                raise ConfigError(f"sampling_params has {len(sampling_params)} entries for {len(prompts)} prompts")
            per_prompt = list(sampling_params)
        else:
            hint = "; build one with SamplingParams(**d)" if isinstance(sampling_params, dict) else ""
            raise ConfigError(f"sampling_params must be a SamplingParams (or a list of one per prompt), got "
                              f"{_type_name(sampling_params)} {_short(sampling_params)}{hint}")
        all_ids = [self.prompt_ids(p) for p in prompts]      # every prompt checked before any work
        bar = progress_bar(use_tqdm, len(prompts))
        t0 = time.perf_counter()
        groups: list[list[RequestHandle]] = []
        scoring: list[RequestHandle | None] = []     # prompt_logprobs: a scoring pass beside the samples
        try:
            for ids, params in zip(all_ids, per_prompt):     # every sample queued before any step runs
                scoring.append(None if params.prompt_logprobs is None else
                               self.submit(ids, SamplingParams(max_tokens=0, cache_salt=params.cache_salt),
                                           kind="score"))
                groups.append([])
                for i in range(params.n):
                    groups[-1].append(self.submit(ids, params, i))
            outs = []
            for group, params in zip(groups, per_prompt):
                outs.append([_vllm_output(h.result(), params) for h in group])
                if bar is not None:
                    bar.update(1)
            prompt_lps = [None if h is None else prompt_logprob_dicts(
                h.logits(), ids, params.prompt_logprobs, self.tokenizer.token_text if params.detokenize else None)
                for h, ids, params in zip(scoring, all_ids, per_prompt)]
        finally:
            if bar is not None:
                bar.close()
            for h in [h for group in groups for h in group] + [h for h in scoring if h is not None]:
                if not h.done:
                    h.cancel()
        results = []
        for p, ids, group, out, plp in zip(prompts, all_ids, groups, outs, prompt_lps):
            first = min((h.request.t_first for h in group if h.request.t_first is not None), default=None)
            results.append(RequestOutput(
                request_id=uuid.uuid4().hex[:12], prompt=p if isinstance(p, str) else None, prompt_token_ids=ids,
                outputs=out, metrics={"seconds": time.perf_counter() - t0,
                                      "time_to_first_token": None if first is None else first - group[0].request.t_submit},
                prompt_logprobs=plp))
        return results

    def chat(self, messages: Sequence[dict] | Sequence[Sequence[dict]], sampling_params: SamplingParams | None = None,
             use_tqdm: Any = False, chat_template: str | None = None, add_generation_prompt: bool = True,
             chat_template_kwargs: Mapping[str, Any] | None = None) -> list[RequestOutput]:
        """vLLM's `LLM.chat`: one conversation (a list of {"role", "content"} messages) or a list of
        them, each rendered with the model's chat template (or `chat_template`, a Jinja string;
        `chat_template_kwargs` go to it) and generated as `generate` does; each result's `prompt`
        is the rendered text. (Not mirrored itself: every rank renders alike, `generate` is.)"""
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        if not convs:
            raise ConfigError("messages is empty: pass a conversation (a list of message dicts) or a list of them")
        view = self.get_tokenizer()
        add_generation_prompt = _check_bool("add_generation_prompt", add_generation_prompt)
        if chat_template_kwargs is not None and not isinstance(chat_template_kwargs, Mapping):
            raise ConfigError(f"chat_template_kwargs must be a dict, got {_short(chat_template_kwargs)}")
        texts = [view.apply_chat_template(conv, tokenize=False, add_generation_prompt=add_generation_prompt,
                                          chat_template=chat_template, **(chat_template_kwargs or {}))
                 for conv in convs]
        outs = self.generate([self.tokenizer.encode(t, add_bos=None, special=True) for t in texts], sampling_params,
                             use_tqdm=use_tqdm)
        for out, text in zip(outs, texts):
            out.prompt = text
        return outs

    @staticmethod
    def _prompt_list(prompts: Any) -> list:
        """vLLM's prompt forms: a string, a list of ids, or a list of either (numpy arrays too)."""
        if isinstance(prompts, np.ndarray):
            if prompts.ndim == 1:
                return [prompts]
            if prompts.ndim == 2:
                return list(prompts)
            raise ConfigError(f"prompts: an array of token ids must be 1-D or 2-D, got shape {prompts.shape}")
        if isinstance(prompts, str):
            return [prompts]
        if isinstance(prompts, (bytes, dict)) or not isinstance(prompts, Sequence):
            raise ConfigError(f"prompts must be a string, a list of token ids, or a list of those, got "
                              f"{_type_name(prompts)} {_short(prompts)}")
        if not prompts:
            raise ConfigError("prompts is empty: pass at least one prompt")
        if isinstance(prompts[0], numbers.Integral) and not isinstance(prompts[0], bool):
            return [prompts]
        return list(prompts)


def _vllm_output(out: CompletionOutput, params: SamplingParams) -> CompletionOutput:
    """A generation's output with vLLM's output options applied: the matched stop string kept
    (include_stop_str_in_output), no text at all (detokenize=False)."""
    if not params.detokenize:
        return dataclasses.replace(out, text="")
    if params.include_stop_str_in_output and out.finish_reason == "stop" and isinstance(out.stop_reason, str):
        return dataclasses.replace(out, text=out.text + out.stop_reason)
    return out
