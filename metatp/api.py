"""The public Python API: `LLM` with vLLM-style `generate` and llama-cpp-python-style completions."""

from __future__ import annotations

import os
import time
import uuid
import warnings
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import numpy as np

from metatp.ir.errors import ConfigError, ContextOverflowError
from metatp.sampling import Sampler, SamplingParams

__all__ = ["LLM", "CompletionOutput", "RequestOutput"]

DEFAULT_N_CTX = 2048


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None       # "stop" (EOS / stop string) or "length"
    stop_reason: str | int | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = True
    metrics: dict = field(default_factory=dict)


@dataclass
class _Step:
    token: int | None
    text: str
    finish_reason: str | None = None
    stop_reason: str | int | None = None


class _StopMatcher:
    """Finds stop strings in generated text, holding back any tail that could start one."""

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = list(stops)
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.text = ""          # text seen but not yet released

    def feed(self, piece: str) -> tuple[str, str | None]:
        """Returns (text safe to emit, the stop string hit or None)."""
        self.text += piece
        if self.stops:
            hits = [(self.text.find(s), s) for s in self.stops if s in self.text]
            if hits:
                pos, s = min(hits)
                out, self.text = self.text[:pos], ""
                return out, s
        if self.hold <= 0:
            out, self.text = self.text, ""
            return out, None
        cut = len(self.text)
        for k in range(min(self.hold, len(self.text)), 0, -1):
            tail = self.text[-k:]
            if any(s.startswith(tail) for s in self.stops):
                cut = len(self.text) - k
                break
        out, self.text = self.text[:cut], self.text[cut:]
        return out, None

    def flush(self) -> str:
        out, self.text = self.text, ""
        return out


class LLM:
    """A GGUF model on one or more (simulated or real) devices.

    `model`: a GGUF path or a known model name; None is the default small model.
    `n_ctx`: context size; default 2048, capped at the model's trained context.
    `n_devices`/`split_mode`/`tensor_split` follow llama.cpp (-sm tensor -ts 3,1).
    `numerics`: "exact" (float32) or "llamacpp" (numpy backend only: round activations and the KV
    cache as llama.cpp's CPU backend does, to compare logits with it).
    `memory_budget`: bytes per device ("8GiB"); default: what the backend reports free. The memory
    plan is checked before any weight is loaded; `fit_context=True` shrinks n_ctx to fit instead
    of refusing.
    `cpu_kernels` (numpy backend): few-token steps use compiled C kernels over int8-coded weights
    (built on first use with the machine's C compiler; ~3x faster decode). None: when they build;
    False: pure numpy; True: fail if they cannot be built. METATP_CPU_KERNELS=0 turns them off.
    """

    def __init__(self, model: str | os.PathLike | None = None, n_ctx: int | None = None, backend: str = "auto",
                 n_devices: int = 1, split_mode: str | None = None, tensor_split: Sequence[float] | None = None,
                 seed: int = 0, n_batch: int = 512, numerics: str = "exact", memory_budget: int | str | None = None,
                 fit_context: bool = False, verbose: bool = False, cpu_kernels: bool | None = None) -> None:
        from metatp.backends import create_backend
        from metatp.engine import Engine
        from metatp.ir.loader import load_model
        from metatp.models import resolve_model
        from metatp.passes.plan import DeviceLayout

        if n_ctx is not None and (isinstance(n_ctx, bool) or not isinstance(n_ctx, int) or n_ctx <= 0):
            raise ConfigError(f"n_ctx must be a positive integer, got {n_ctx!r}")
        if isinstance(n_batch, bool) or not isinstance(n_batch, int) or n_batch <= 0:
            raise ConfigError(f"n_batch must be a positive integer, got {n_batch!r}")
        if split_mode is None:
            split_mode = "tensor" if (isinstance(n_devices, int) and n_devices > 1) or tensor_split else "none"
        ts = None
        if tensor_split is not None:
            ts = DeviceLayout.parse_split(tensor_split) if isinstance(tensor_split, str) else tuple(tensor_split)
        self.layout = DeviceLayout(n_devices, split_mode, ts)
        self.model_path = resolve_model(model, quiet=not verbose)
        self.model = load_model(self.model_path)
        hp = self.model.hparams
        if n_ctx is None:        # default: 2048, capped at what the model was trained for
            n_ctx = min(DEFAULT_N_CTX, hp.n_ctx_train)
        elif n_ctx > hp.n_ctx_train:
            warnings.warn(f"n_ctx={n_ctx} is beyond the model's trained context of {hp.n_ctx_train}; "
                          "quality may degrade", stacklevel=2)
        if self.layout.split_mode == "tensor" and n_devices > min(hp.n_head_kv):
            warnings.warn(f"{n_devices} devices but only {min(hp.n_head_kv)} KV heads: "
                          "some devices get zero attention slices", stacklevel=2)
        self.tokenizer = self.model.tokenizer
        self.backend = create_backend(backend, self.layout, numerics, cpu_kernels)
        self.n_ctx = n_ctx
        self.engine = Engine(self.model, n_ctx, self.layout, self.backend, n_batch=n_batch)
        self.memory = self._check_memory(memory_budget, fit_context, n_batch)
        self._rng = np.random.default_rng(seed)
        self.verbose = verbose

    def _check_memory(self, budget, fit: bool, n_batch: int):
        """Refuse (or shrink n_ctx) before loading when weights + KV + buffers exceed the budget."""
        from metatp.engine import Engine
        from metatp.ir.errors import MemoryPlanError
        from metatp.passes.memory import fit_context, format_bytes, parse_bytes

        mem = self.engine.memory_plan()
        limit, shared = self.backend.memory_budget()
        if budget is not None:
            limit, shared = parse_bytes(budget), False
        if limit is None:
            return mem

        def need(m) -> list[int]:          # simulated devices share one pool: compare the sum
            return [sum(m.totals())] if shared else m.totals()

        def fits(m) -> bool:
            return max(need(m)) <= limit

        if fits(mem):
            return mem

        def engine_for(n_ctx: int) -> Engine:
            return Engine(self.model, n_ctx, self.layout, self.backend, n_batch=n_batch)

        fitted = fit_context(lambda n: engine_for(n).memory_plan(), fits, self.n_ctx)
        if fit and fitted > 0:
            self.n_ctx = fitted
            self.engine = engine_for(fitted)
            return self.engine.memory_plan()
        totals = need(mem)
        d = max(range(len(totals)), key=lambda j: totals[j])
        where = "in all" if shared else f"on device {d}"
        parts = (f"weights {format_bytes(mem.weights[d])}, KV cache {format_bytes(mem.kv[d])} for "
                 f"n_ctx={self.n_ctx}, buffers {format_bytes(mem.compute[d])}")
        if shared and mem.n_devices > 1:
            parts = f"{mem.n_devices} simulated devices; device 0: " + parts
        advice = (f"n_ctx={fitted} would fit (or pass fit_context=True / --fit)" if fitted > 0 else
                  "even the smallest context does not fit: use more devices or a smaller model")
        raise MemoryPlanError(f"does not fit: needs {format_bytes(totals[d])} {where} ({parts}) but the budget is "
                              f"{format_bytes(limit)}; {advice}")

    # ---------------------------------------------------------------- tokens
    @property
    def n_vocab(self) -> int:
        return self.model.hparams.n_vocab

    def tokenize(self, text: str, special: bool = True, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`; honours the model's add_bos flag unless add_bos is given."""
        return self.tokenizer.encode(text, add_bos=add_bos, special=special)

    def detokenize(self, ids: Sequence[int], skip_special: bool = False) -> str:
        return self.tokenizer.decode(list(ids), skip_special=skip_special)

    # ---------------------------------------------------------------- scoring
    def score(self, ids: Sequence[int]) -> np.ndarray:
        """float32 logits [len(ids), n_vocab] at every position of a fresh sequence."""
        ids = self._check_ids(ids)
        if len(ids) > self.n_ctx:
            raise ContextOverflowError(f"{len(ids)} tokens do not fit in the context of {self.n_ctx} (n_ctx)")
        self.engine.reset()
        return self.engine.forward(ids, all_logits=True)

    def _check_ids(self, ids: Sequence[int]) -> list[int]:
        ids = [int(i) for i in ids]
        if not ids:
            raise ConfigError("need at least one token id")
        bad = [i for i in ids if not 0 <= i < self.n_vocab]
        if bad:
            raise ConfigError(f"token id {bad[0]} is out of range for a vocabulary of {self.n_vocab}")
        return ids

    def _prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenize(prompt)
            if not ids:
                bos = self.tokenizer.bos_id
                if bos is None:
                    raise ConfigError("empty prompt, and the model has no BOS token to start from")
                ids = [bos]
            return ids
        return self._check_ids(prompt)

    # ---------------------------------------------------------------- generation core
    def _stream(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[_Step]:
        """Yields text pieces as tokens are generated; the last step carries finish_reason."""
        from metatp.ir.tokenizer import StreamDecoder

        if len(prompt_ids) > self.n_ctx:
            raise ContextOverflowError(
                f"the prompt has {len(prompt_ids)} tokens but the context holds {self.n_ctx} (n_ctx); "
                "shorten the prompt or raise n_ctx")
        budget = self.n_ctx - len(prompt_ids) + 1      # the last token needs no KV slot of its own
        max_tokens = params.max_tokens if params.max_tokens is not None else budget
        if max_tokens == 0:
            yield _Step(None, "", "length")
            return
        sampler = Sampler(params, self._rng)
        stops = _StopMatcher(params.stop or [])
        dec = StreamDecoder(self.tokenizer, skip_special=True)
        eog = set() if params.ignore_eos else set(self.tokenizer.eog_ids)
        stop_ids = set(params.stop_token_ids)
        self.engine.reset()
        logits = self.engine.forward(prompt_ids)
        history = list(prompt_ids)
        n = 0
        while True:
            tok = sampler(logits, history)
            history.append(tok)
            n += 1
            if tok in eog or tok in stop_ids:
                yield _Step(tok, stops.feed(dec.flush())[0] + stops.flush(), "stop", tok if tok in stop_ids else None)
                return
            text, hit = stops.feed(dec.push(tok))
            if hit is not None:
                yield _Step(tok, text, "stop", hit)
                return
            if n >= max_tokens or n >= budget:
                tail, hit = stops.feed(dec.flush())
                yield _Step(tok, text + tail + (stops.flush() if hit is None else ""),
                            "stop" if hit is not None else "length", hit)
                return
            yield _Step(tok, text)
            logits = self.engine.forward([tok])

    def _run(self, prompt_ids: list[int], params: SamplingParams) -> tuple[list[int], str, str, Any]:
        ids: list[int] = []
        pieces: list[str] = []
        finish, reason = "length", None
        for step in self._stream(prompt_ids, params):
            if step.token is not None:
                ids.append(step.token)
            pieces.append(step.text)
            if step.finish_reason:
                finish, reason = step.finish_reason, step.stop_reason
        return ids, "".join(pieces), finish, reason

    # ---------------------------------------------------------------- vLLM-style
    def generate(self, prompts: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]],
                 sampling_params: SamplingParams | None = None) -> list[RequestOutput]:
        """Generate for each prompt (a string or a list of token ids); vLLM-shaped results."""
        params = sampling_params or SamplingParams()
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]          # type: ignore[list-item]
        results = []
        for p in prompts:
            ids = self._prompt_ids(p)
            t0 = time.perf_counter()
            out_ids, text, finish, reason = self._run(ids, params)
            results.append(RequestOutput(
                request_id=uuid.uuid4().hex[:12], prompt=p if isinstance(p, str) else None, prompt_token_ids=ids,
                outputs=[CompletionOutput(0, text, out_ids, finish, reason)],
                metrics={"seconds": time.perf_counter() - t0}))
        return results

    # ---------------------------------------------------------------- llama-cpp-python-style
    def create_completion(self, prompt: str | Sequence[int], max_tokens: int | None = 16, temperature: float = 0.8,
                          top_p: float = 0.95, top_k: int = 40, min_p: float = 0.05, stop: str | list[str] | None = None,
                          stream: bool = False, seed: int | None = None, repeat_penalty: float = 1.0,
                          echo: bool = False) -> dict | Iterator[dict]:
        """OpenAI-style text completion (a dict, or chunks when stream=True), as llama-cpp-python returns."""
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                top_k=top_k if top_k > 0 else -1, min_p=min_p, stop=stop, seed=seed,
                                repetition_penalty=repeat_penalty)
        ids = self._prompt_ids(prompt)
        cid = f"cmpl-{uuid.uuid4()}"
        created = int(time.time())
        model_name = str(self.model_path)
        prefix = (prompt if isinstance(prompt, str) else self.detokenize(ids)) if echo else ""

        def chunk(text: str, finish: str | None) -> dict:
            return {"id": cid, "object": "text_completion", "created": created, "model": model_name,
                    "choices": [{"text": text, "index": 0, "logprobs": None, "finish_reason": finish}]}

        if stream:
            def gen() -> Iterator[dict]:
                if prefix:
                    yield chunk(prefix, None)
                for step in self._stream(ids, params):
                    if step.text or step.finish_reason:
                        yield chunk(step.text, step.finish_reason)
            return gen()
        out_ids, text, finish, _ = self._run(ids, params)
        res = chunk(prefix + text, finish)
        res["usage"] = {"prompt_tokens": len(ids), "completion_tokens": len(out_ids),
                        "total_tokens": len(ids) + len(out_ids)}
        return res

    __call__ = create_completion

    def create_chat_completion(self, messages: list[dict], max_tokens: int | None = None, temperature: float = 0.2,
                               top_p: float = 0.95, top_k: int = 40, min_p: float = 0.05,
                               stop: str | list[str] | None = None, stream: bool = False, seed: int | None = None,
                               repeat_penalty: float = 1.0) -> dict | Iterator[dict]:
        """OpenAI-style chat completion using the GGUF's chat template."""
        if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
            raise ConfigError("messages must be a list of {'role': ..., 'content': ...} dicts")
        prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        ids = self.tokenize(prompt, special=True)
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                                top_k=top_k if top_k > 0 else -1, min_p=min_p, stop=stop, seed=seed,
                                repetition_penalty=repeat_penalty)
        cid = f"chatcmpl-{uuid.uuid4()}"
        created = int(time.time())
        model_name = str(self.model_path)
        if stream:
            def gen() -> Iterator[dict]:
                yield {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model_name,
                       "choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]}
                for step in self._stream(ids, params):
                    if step.text or step.finish_reason:
                        delta = {"content": step.text} if step.text else {}
                        yield {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model_name,
                               "choices": [{"index": 0, "delta": delta, "finish_reason": step.finish_reason}]}
            return gen()
        out_ids, text, finish, _ = self._run(ids, params)
        return {"id": cid, "object": "chat.completion", "created": created, "model": model_name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                             "finish_reason": finish}],
                "usage": {"prompt_tokens": len(ids), "completion_tokens": len(out_ids),
                          "total_tokens": len(ids) + len(out_ids)}}
