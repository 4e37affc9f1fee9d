"""vLLM's `LLM` idioms beyond generate: the constructor keywords vLLM scripts pass to `LLM(...)`
(`engine_keywords`: each honoured or refused by name), the Hugging Face-shaped tokenizer
`LLM.get_tokenizer()` returns, and the progress bar of `generate(..., use_tqdm=...)` (drawn only
when tqdm is installed: metatp does not depend on it)."""

from __future__ import annotations

import importlib.util
import numbers
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Sequence

from metatp.ir.errors import ConfigError
from metatp.openai_messages import chat_messages
from metatp.request_fields import short, type_name

if TYPE_CHECKING:
    from metatp.ir.tokenizer import Tokenizer

__all__ = ["TokenizerView", "progress_bar", "VllmKeywords", "engine_keywords", "check_tokenizer"]

# vLLM's dtype names -> the float type metatp computes in ("auto": the backend's own choice)
_DTYPES = {"auto": None, "float32": "f32", "float": "f32", "float16": "f16", "half": "f16", "bfloat16": "bf16"}


@dataclass
class VllmKeywords:
    """What vLLM's constructor keywords change in an `LLM`: backend options (cupy's
    matmul_dtype / kv_dtype / cuda_graphs), the step's token count (n_batch, None: unchanged)
    and the fraction of the backend's free memory the memory plan may use (None: all of it)."""

    backend_options: dict[str, Any] = field(default_factory=dict)
    n_batch: int | None = None
    memory_fraction: float | None = None


def _set_option(options: dict[str, Any], keyword: str, name: str, value: Any) -> None:
    """options[name] = value, unless backend_options already holds another value (a ConfigError naming both)."""
    given = options.get(name)
    if given is not None and given != value:
        raise ConfigError(f"{keyword} asks for backend_options {name}={value!r} but backend_options gives "
                          f"{name}={given!r}; set one")
    options[name] = value


def _dtype_options(dtype: Any, backend_name: str, options: dict[str, Any]) -> None:
    """vLLM's dtype: numpy computes float32 only; cupy stores the KV cache and runs prefill matmuls
    in f16 or f32 (bfloat16 only for the cache, so bfloat16 is refused with the cupy options named)."""
    if not isinstance(dtype, str) or dtype not in _DTYPES:
        raise ConfigError(f"dtype must be one of {', '.join(repr(d) for d in _DTYPES)}, got {short(dtype)}")
    want = _DTYPES[dtype]
    if want is None:
        return
    if backend_name == "numpy":
        if want != "f32":
            raise ConfigError(f"dtype={dtype!r}: the numpy backend computes in float32 only (weights keep their GGUF "
                              "types); pass dtype='auto' or 'float32'")
        return
    if backend_name != "cupy":
        raise ConfigError(f"dtype={dtype!r} has no meaning for backend {backend_name!r}; pass dtype='auto'")
    if want == "bf16":
        raise ConfigError(f"dtype={dtype!r}: the cupy backend's matmuls run in float16 or float32 "
                          "(backend_options matmul_dtype); pass dtype='float16' or 'float32', and "
                          "backend_options={'kv_dtype': 'bf16'} for a bfloat16 KV cache")
    _set_option(options, f"dtype={dtype!r}", "matmul_dtype", want)
    _set_option(options, f"dtype={dtype!r}", "kv_dtype", want)


def _flag(name: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise ConfigError(f"{name} must be True or False, got {type_name(v)} {short(v)}")
    return v


def engine_keywords(backend_name: Callable[[], str], backend_options: dict[str, Any], n_batch: int | None,
                    memory_budget: Any, *, dtype: Any = "auto", gpu_memory_utilization: Any = None,
                    enforce_eager: Any = False, trust_remote_code: Any = False, quantization: Any = None,
                    swap_space: Any = None, max_num_batched_tokens: Any = None,
                    disable_log_stats: Any = True) -> VllmKeywords:
    """vLLM's `LLM(...)` engine keywords checked and mapped onto metatp (each honoured or a
    ConfigError naming it, never dropped). `backend_name()`: the backend the LLM will run on
    (asked only when a keyword depends on it); `backend_options`, `n_batch`, `memory_budget`:
    what the caller gave beside them (a contradiction names both).

    dtype: "auto" (the backend's types), "float32" (numpy: what it computes; cupy: f32 KV cache and
    matmuls), "float16" (cupy's defaults; refused on numpy), "bfloat16" refused by name.
    gpu_memory_utilization: the fraction (0, 1] of the memory the backend reports free that the
    memory plan may use (vLLM's fraction of the GPU; here of each device's free memory).
    enforce_eager: True turns the cupy backend's CUDA graphs off (numpy captures nothing).
    trust_remote_code: accepted either way: a GGUF carries no code to run.
    quantization: None or "gguf" (the file's own tensor types); any other method is refused.
    swap_space: GiB of CPU swap for preempted sequences; accepted: metatp preempts by
    recomputing (as vLLM's V1 engine does), so no swap space is used.
    max_num_batched_tokens: the most tokens one step feeds (metatp's n_batch).
    disable_log_stats: True (vLLM's LLM default: the LLM logs no periodic stats); False is
    refused (metatp's LLM has no stats logger; `metatp serve` exposes /metrics)."""
    out = VllmKeywords(backend_options=dict(backend_options))
    if dtype != "auto":
        _dtype_options(dtype, backend_name(), out.backend_options)
    if gpu_memory_utilization is not None:
        u = gpu_memory_utilization
        if isinstance(u, bool) or not isinstance(u, numbers.Real) or not 0 < u <= 1:
            raise ConfigError(f"gpu_memory_utilization must be a fraction in (0, 1], got {short(u)}")
        if memory_budget is not None:
            raise ConfigError(f"gpu_memory_utilization={u} and memory_budget={short(memory_budget)} both bound "
                              "the memory per device; give one")
        out.memory_fraction = float(u)
    if _flag("enforce_eager", enforce_eager) and backend_name() == "cupy":
        _set_option(out.backend_options, "enforce_eager=True", "cuda_graphs", False)
    _flag("trust_remote_code", trust_remote_code)
    if quantization is not None and (not isinstance(quantization, str) or quantization.lower() != "gguf"):
        raise ConfigError(f"quantization={short(quantization)} is not supported: metatp runs GGUF files, whose "
                          "tensor types are the quantization (vLLM's name for it is 'gguf'); pass None or 'gguf'")
    if swap_space is not None and (isinstance(swap_space, bool) or not isinstance(swap_space, numbers.Real)
                                   or swap_space < 0):
        raise ConfigError(f"swap_space must be a size in GiB >= 0, got {short(swap_space)}")
    if max_num_batched_tokens is not None:
        m = max_num_batched_tokens
        if isinstance(m, bool) or not isinstance(m, numbers.Integral) or m <= 0:
            raise ConfigError(f"max_num_batched_tokens must be a positive integer, got {short(m)}")
        if n_batch is not None and n_batch != m:
            raise ConfigError(f"max_num_batched_tokens={m} and n_batch={n_batch} both set the tokens of a "
                              "step; give one")
        out.n_batch = int(m)
    if not _flag("disable_log_stats", disable_log_stats):
        raise ConfigError("disable_log_stats=False: metatp's LLM has no periodic stats logger; pass True (vLLM's "
                          "LLM default), or read /metrics from `metatp serve`")
    return out


def check_tokenizer(tokenizer: Any, model: Any, model_path: str | os.PathLike) -> None:
    """vLLM's `tokenizer` keyword: metatp reads the tokenizer from the GGUF, so only None or the
    model itself (the name or path given as `model`, or the same file) is accepted."""
    if tokenizer is None:
        return
    if not isinstance(tokenizer, (str, os.PathLike)):
        raise ConfigError(f"tokenizer must be a model name or path, got {type_name(tokenizer)} {short(tokenizer)}")
    if model is not None and os.fspath(tokenizer) == os.fspath(model):
        return
    if os.fspath(tokenizer) == os.fspath(model_path):
        return
    try:
        if os.path.samefile(tokenizer, model_path):
            return
    except OSError:
        pass
    raise ConfigError(f"tokenizer={short(os.fspath(tokenizer))} is not the model ({short(os.fspath(model_path))}): "
                      "metatp uses the tokenizer inside the GGUF; pass tokenizer=None")


class TokenizerView:
    """The GGUF tokenizer behind the methods and attributes of a Hugging Face tokenizer that vLLM
    scripts use: encode / decode / batch_decode / __call__ / apply_chat_template /
    convert_ids_to_tokens, eos_token_id, bos_token_id, pad_token_id, eos_token, bos_token,
    vocab_size, len(). Special tokens written in text are parsed, as HF parses added tokens."""

    def __init__(self, tokenizer: "Tokenizer") -> None:
        self._tok = tokenizer

    @property
    def vocab_size(self) -> int:
        return self._tok.n_vocab

    def __len__(self) -> int:
        return self._tok.n_vocab

    @property
    def eos_token_id(self) -> int | None:
        return self._tok.eos_id

    @property
    def bos_token_id(self) -> int | None:
        return self._tok.bos_id

    @property
    def pad_token_id(self) -> int | None:
        return self._tok.pad_id

    @property
    def eos_token(self) -> str | None:
        return None if self._tok.eos_id is None else self._tok.tokens[self._tok.eos_id]

    @property
    def bos_token(self) -> str | None:
        return None if self._tok.bos_id is None else self._tok.tokens[self._tok.bos_id]

    @property
    def chat_template(self) -> str | None:
        return self._tok.chat_template

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; add_special_tokens: the model's BOS where it adds one."""
        return self._tok.encode(text, add_bos=None if add_special_tokens else False, special=True)

    def __call__(self, text: str | Sequence[str], add_special_tokens: bool = True) -> dict[str, list]:
        """{"input_ids": ..., "attention_mask": ...} for a text or a list of texts, as HF's call."""
        if isinstance(text, str):
            ids = self.encode(text, add_special_tokens)
            return {"input_ids": ids, "attention_mask": [1] * len(ids)}
        many = [self.encode(t, add_special_tokens) for t in text]
        return {"input_ids": many, "attention_mask": [[1] * len(ids) for ids in many]}

    def decode(self, ids: int | Sequence[int], skip_special_tokens: bool = False) -> str:
        """The text of token ids (one id alone too, as HF allows)."""
        if isinstance(ids, numbers.Integral) and not isinstance(ids, bool):
            ids = [int(ids)]
        return self._tok.decode(ids, skip_special=skip_special_tokens)

    def batch_decode(self, sequences: Sequence[Sequence[int]], skip_special_tokens: bool = False) -> list[str]:
        return [self.decode(ids, skip_special_tokens) for ids in sequences]

    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> str | list[str]:
        """The vocabulary's token strings (as stored in the GGUF, e.g. 'Ġthe' for byte-level BPE)."""
        if isinstance(ids, numbers.Integral) and not isinstance(ids, bool):
            return self._token(ids)
        return [self._token(i) for i in ids]

    def _token(self, token_id: Any) -> str:
        if isinstance(token_id, bool) or not isinstance(token_id, numbers.Integral) \
                or not 0 <= token_id < self._tok.n_vocab:
            raise ConfigError(f"token id {short(token_id)} is outside the vocabulary (0..{self._tok.n_vocab - 1})")
        return self._tok.tokens[int(token_id)]

    def apply_chat_template(self, conversation: list[dict], tokenize: bool = True, add_generation_prompt: bool = False,
                            chat_template: str | None = None, **kwargs: Any) -> str | list[int]:
        """The chat rendered with the model's template (or `chat_template`): token ids, as HF
        returns by default, or the text with tokenize=False. The ids are what `LLM.chat` feeds the model."""
        from metatp.chat_formats import with_chat_template

        tok = self._tok if chat_template is None else with_chat_template(self._tok, chat_template)
        text = tok.apply_chat_template(chat_messages(conversation), add_generation_prompt=add_generation_prompt,
                                       **kwargs)
        return tok.encode(text, add_bos=None, special=True) if tokenize else text


def progress_bar(use_tqdm: Any, total: int) -> Any | None:
    """vLLM's use_tqdm: False (none), True (a tqdm bar when tqdm is installed, else none), or a
    callable made like tqdm (`use_tqdm(total=..., desc=...)`). The bar has update(n) and close()."""
    if isinstance(use_tqdm, bool):
        if not use_tqdm or importlib.util.find_spec("tqdm") is None:
            return None
        from tqdm.auto import tqdm

        return tqdm(total=total, desc="Processed prompts")
    if callable(use_tqdm):
        return use_tqdm(total=total, desc="Processed prompts")
    raise ConfigError(f"use_tqdm must be True, False or a tqdm-like callable, got {type_name(use_tqdm)} "
                      f"{short(use_tqdm)}")

