"""Embeddings: a prompt's final hidden states (after the output norm, before the lm head)
pooled into one L2-normalized vector, and the OpenAI /v1/embeddings request and answer shapes.

The hidden states come out of the graph (`BatchSpec.hidden`: the builder's output is the final
normed hidden state instead of the logits) through the engine's "hidden" logits mode, one
"embed" request per input in the continuous batch (`metatp.scheduler`): several inputs share
steps, and each request's cells are freed when it ends. Pooling happens here, on the host.

Pooling follows the GGUF's `{arch}.pooling_type` (llama.cpp's enum: 0 none, 1 mean, 2 cls,
3 last, 4 rank). A decoder-only model usually has none, or no key at all: then "last" (the last
token's state), vLLM's default for decoder-only models. `LLM(pooling=...)` / `metatp serve
--pooling` override it. llama.cpp's "none" (one vector per token) and "rank" (a reranker's
classifier head) are refused by name.
"""

from __future__ import annotations

import base64
import numbers
from typing import Any, Callable, Sequence

import numpy as np

from metatp.ir.errors import ConfigError, ContextOverflowError
from metatp.request_fields import FieldError, short, type_name

__all__ = ["POOLING_TYPES", "POOLINGS", "check_pooling", "model_pooling", "pool", "l2_normalize",
           "embedding_inputs", "check_lengths", "pooled", "EmbeddingOptions", "embedding_options", "embedding_answer", "MAX_INPUTS"]

# llama.cpp's enum llama_pooling_type, as `{arch}.pooling_type` stores it
POOLING_TYPES = {0: "none", 1: "mean", 2: "cls", 3: "last", 4: "rank"}
POOLINGS = ("mean", "cls", "last")          # what `pool` does
MAX_INPUTS = 2048                           # inputs per request (OpenAI's limit)


def check_pooling(name: Any, what: str = "pooling") -> str | None:
    """A pooling override (None: the model's): mean, cls or last; llama.cpp's other names are
    refused by name, anything else with the choices."""
    if name is None:
        return None
    if not isinstance(name, str):
        raise ConfigError(f"{what} must be one of {', '.join(POOLINGS)} (or None for the model's), got "
                          f"{type_name(name)} {short(name)}")
    if name in POOLINGS:
        return name
    if name == "none":
        raise ConfigError(f"{what} 'none' (one vector per token) is not supported; choose mean, cls or last")
    if name == "rank":
        raise ConfigError(f"{what} 'rank' (a reranker's classifier head) is not supported; choose mean, cls or last")
    raise ConfigError(f"{what} must be one of {', '.join(POOLINGS)}, got {name!r}")


def model_pooling(metadata: dict[str, Any], arch: str) -> str:
    """The pooling a GGUF asks for: its `{arch}.pooling_type`; none or absent: "last" (vLLM's
    default for decoder-only models). A type metatp does not pool (rank) is a ConfigError
    saying how to override it."""
    raw = metadata.get(f"{arch}.pooling_type")
    if raw is None:
        return "last"
    name = POOLING_TYPES.get(int(raw)) if isinstance(raw, numbers.Integral) else None
    if name is None or name == "none" or int(raw) < 0:
        return "last"
    if name not in POOLINGS:
        raise ConfigError(f"the model's pooling type is {name} ({arch}.pooling_type = {raw}), which metatp does not "
                          "pool; pass pooling='mean', 'cls' or 'last' (metatp serve --pooling NAME)")
    return name


def pool(hidden: np.ndarray, how: str) -> np.ndarray:
    """One vector from a prompt's hidden states [n_tokens, n_embd]: their mean, the first row
    (cls: the first token's, as llama.cpp takes it) or the last row."""
    if hidden.ndim != 2 or hidden.shape[0] == 0:
        raise ConfigError(f"pooling needs hidden states [n_tokens, n_embd], got shape {hidden.shape}")
    if how == "mean":
        return hidden.astype(np.float64).mean(axis=0)
    if how == "cls":
        return hidden[0].astype(np.float64)
    if how == "last":
        return hidden[-1].astype(np.float64)
    raise ConfigError(f"pooling must be one of {', '.join(POOLINGS)}, got {how!r}")


def l2_normalize(v: np.ndarray) -> np.ndarray:
    """`v` scaled to unit length, as OpenAI returns embeddings (a zero vector stays zero)."""
    norm = float(np.linalg.norm(v))
    return v / norm if norm > 0 else v


def _is_id(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_))


def embedding_inputs(value: Any, tokenize: Callable[[str], list[int]], n_vocab: int) -> tuple[list[list[int]], bool]:
    """OpenAI's `input` (a string, a list of strings, a list of token ids, or a list of those)
    as token id lists, and whether it was one input (a string or one id list). Errors are
    FieldErrors naming `input` (the server's 400)."""
    def fail(msg: str) -> FieldError:
        return FieldError("input", f"'input' {msg}")

    def ids_of(item: Any, where: str) -> list[int]:
        if isinstance(item, str):
            if not item:
                raise fail(f"{where}is an empty string; each input must have text")
            ids = tokenize(item)
            if not ids:
                raise fail(f"{where}gives no tokens")
            return ids
        if isinstance(item, np.ndarray) and item.ndim == 1 and np.issubdtype(item.dtype, np.integer):
            item = item.tolist()
        if isinstance(item, (list, tuple)) and item and all(_is_id(t) for t in item):
            bad = [int(t) for t in item if not 0 <= int(t) < n_vocab]
            if bad:
                raise fail(f"{where}has token id {bad[0]}, out of range for a vocabulary of {n_vocab}")
            return [int(t) for t in item]
        if isinstance(item, (list, tuple)) and not item:
            raise fail(f"{where}is an empty list; each input needs at least one token")
        raise fail(f"{where}must be a string or a list of token ids, got {type_name(item)} {short(item)}")

    if isinstance(value, str):
        return [ids_of(value, "")], True
    if isinstance(value, np.ndarray):
        value = list(value) if value.ndim == 2 else value
    if isinstance(value, (list, tuple, np.ndarray)) and len(value) and all(_is_id(t) for t in value):
        return [ids_of(value, "")], True
    if not isinstance(value, (list, tuple)):
        raise fail(f"must be a string, a list of strings, a list of token ids or a list of those, got "
                   f"{type_name(value)} {short(value)}")
    if not value:
        raise fail("is an empty list; pass at least one input")
    if len(value) > MAX_INPUTS:
        raise fail(f"has {len(value)} inputs; at most {MAX_INPUTS} per request")
    return [ids_of(item, f"[{i}] ") for i, item in enumerate(value)], False


def check_lengths(ids_list: Sequence[Sequence[int]], n_ctx: int, max_model_len: int | None) -> None:
    """Every input fits one request (`scheduler.context_budget`'s rule): a ContextOverflowError
    naming the input and its length otherwise (an embedding is never truncated unasked)."""
    limit = n_ctx if max_model_len is None else min(n_ctx, max_model_len)
    for i, ids in enumerate(ids_list):
        if len(ids) > limit:
            where = "input" if len(ids_list) == 1 else f"input[{i}]"
            raise ContextOverflowError(
                f"{where} has {len(ids)} tokens but a request may hold at most {limit} (n_ctx {n_ctx}"
                f"{'' if max_model_len is None else f', max_model_len {max_model_len}'}); shorten it")


def pooled(hidden: Sequence[np.ndarray], how: str, normalize: bool = True) -> list[np.ndarray]:
    """Each input's embedding from its hidden states: pooled, L2-normalized unless asked not to."""
    vectors = [pool(h, how) for h in hidden]
    return [l2_normalize(v) if normalize else v for v in vectors]


class EmbeddingOptions:
    """The answer's form a /v1/embeddings body asks for (checked by `embedding_options`)."""

    def __init__(self, encoding_format: str = "float") -> None:
        self.encoding_format = encoding_format


def embedding_options(body: dict, n_embd: int) -> EmbeddingOptions:
    """`encoding_format` ("float" or "base64"), `dimensions` (only the model's own: truncating
    is not done) and `user` (a string, unused) of a /v1/embeddings body; a FieldError naming
    the field otherwise."""
    fmt = body.get("encoding_format")
    fmt = "float" if fmt is None else fmt
    if fmt not in ("float", "base64"):
        raise FieldError("encoding_format", f"'encoding_format' must be 'float' or 'base64', got {short(fmt)}")
    dims = body.get("dimensions")
    if dims is not None:
        if not _is_id(dims) or dims <= 0:
            raise FieldError("dimensions", f"'dimensions' must be a positive integer, got {short(dims)}")
        if dims != n_embd:
            raise FieldError("dimensions", f"'dimensions' {dims} is not supported: this model's embeddings have "
                                           f"{n_embd} dimensions, and metatp does not shorten them; leave it out")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise FieldError("user", f"'user' must be a string, got {type_name(user)} {short(user)}")
    return EmbeddingOptions(fmt)


def _encoded(v: Sequence[float], fmt: str) -> list[float] | str:
    """One embedding as OpenAI sends it: floats, or base64 of little-endian float32 bytes."""
    if fmt == "base64":
        return base64.b64encode(np.asarray(v, dtype="<f4").tobytes()).decode("ascii")
    return [float(x) for x in v]


def embedding_answer(vectors: Sequence[Sequence[float]], model: str, n_prompt_tokens: int,
                     encoding_format: str = "float") -> dict:
    """OpenAI's /v1/embeddings answer (llama-cpp-python's create_embedding returns the same)."""
    return {"object": "list",
            "data": [{"object": "embedding", "index": i, "embedding": _encoded(v, encoding_format)}
                     for i, v in enumerate(vectors)],
            "model": model,
            "usage": {"prompt_tokens": n_prompt_tokens, "total_tokens": n_prompt_tokens}}
