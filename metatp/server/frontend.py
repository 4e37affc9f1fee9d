"""The server's face of one LLM: prompts to token ids, requests started on the scheduler with
their outputs delivered onto the event loop, cancellation, usage and token pieces for logprobs,
and what a failed request answers (a device's failure: 503)."""

from __future__ import annotations

import asyncio
import json
import os
import time
from functools import cached_property
from typing import TYPE_CHECKING, Any, Awaitable, Callable

from metatp.ir.errors import ConfigError, ContextOverflowError, DeviceError, DeviceMemoryError
from metatp.sampling import SamplingParams
from metatp.openai_api import usage
from metatp.requests import RequestHandle
from metatp.output_processor import StepOutput
from metatp.scheduler import QueueFullError, context_budget
from metatp.server.fields import BadRequest, is_int
from metatp.server.ranks import served_world
from metatp.server.tenants import request_tenant

if TYPE_CHECKING:
    from metatp.api import LLM


class _Submissions:
    """The requests one HTTP request has submitted so far. Submitting may run on another thread
    while the handler is cancelled (its client gone): `abandon` cancels what is there and marks
    the batch, and `add` cancels a request that arrives after that (cancel is idempotent, so a
    request seen by both is simply cancelled once)."""

    def __init__(self) -> None:
        self.handles: list[RequestHandle] = []
        self.abandoned = False

    def add(self, handle: RequestHandle, srv: "Frontend") -> bool:
        """Keep `handle`; False (and it is cancelled) when the batch was abandoned meanwhile."""
        self.handles.append(handle)
        if self.abandoned:
            srv.cancel([handle])
            return False
        return True

    def abandon(self, srv: "Frontend") -> None:
        self.abandoned = True
        srv.cancel(list(self.handles))


def _text_chars(content: Any) -> int:
    """Characters of a chat message's text: a string, or the strings and text parts of a list."""
    if isinstance(content, str):
        return len(content)
    if not isinstance(content, list):
        return 0
    texts = (p.get("text") if isinstance(p, dict) else p for p in content)
    return sum(len(t) for t in texts if isinstance(t, str))


class DeviceUnavailable(BadRequest):
    """503 for a request the device could not run: out of memory (a batch or context that does not
    fit now; Retry-After, as what fits still runs) or a device that failed (it runs nothing more)."""

    def __init__(self, e: DeviceError) -> None:
        oom = isinstance(e, DeviceMemoryError)
        super().__init__(str(e), None, "device_out_of_memory" if oom else "device_failed", 503, "server_error")
        self.headers = {"Retry-After": "1"} if oom else {}


def request_failure(err: BaseException) -> BadRequest:
    """What a request that failed while it ran answers: 503 for a device's error, else 500."""
    if isinstance(err, DeviceError):
        return DeviceUnavailable(err)
    return BadRequest(f"generation failed: {err}", None, "generation_failed", 500, "server_error")


class Frontend:
    """The LLM, its scheduler in driver mode, and the request handlers' shared helpers."""

    def __init__(self, llm: "LLM", model_name: str, max_model_len: int | None = None) -> None:
        self.llm = llm
        self.model_name = model_name
        self.names = {model_name, str(llm.model_path), os.path.basename(str(llm.model_path))}
        self.sched = llm.scheduler              # its limits are the LLM's (max_num_seqs, max_waiting)
        parallel = self.sched.max_num_seqs
        # one request's cap (prompt + completion): given, the LLM's, else llama-server's slot n_ctx/np,
        # so that one huge max_tokens cannot reserve the cache every other request waits for
        self.max_model_len = max_model_len or llm.max_model_len or max(1, llm.n_ctx // parallel)
        if not 0 < self.max_model_len <= llm.n_ctx:
            raise ConfigError(f"max_model_len must be from 1 to n_ctx={llm.n_ctx}, got {self.max_model_len}")
        self.created = int(time.time())
        self.requests_total = 0
        self.world = served_world(llm)
        if self.world is not None:
            self.sched.lead(self.world)        # rank 0 posts every step to the other ranks
            from metatp.backends.watchdog import add_fault_hook

            add_fault_hook(self.sched.abandon)  # a lost rank: requests in flight answer 500, then the job ends

    def request(self, ids: list[int], params: SamplingParams, index: int, on_output,
                kind: str = "generate") -> RequestHandle:
        """Queue a request (its outputs go to `on_output`). Under MPI rank 0 makes it alone: the
        other ranks are in `follow`; the tokens reach them in the step batches. Its tenant is
        the handler's (`metatp.server.tenants.request_tenant`, bound by the auth check)."""
        return self.llm.submit(ids, params, index, kind=kind, max_model_len=self.max_model_len,
                               on_output=on_output, tenant=request_tenant())

    def check_model(self, body: dict) -> str:
        """The served model's name for the body's `model` (its name, alias or path; absent: the
        served one); a model this server does not serve is a 404 model_not_found (OpenAI's and vLLM's)."""
        m = body.get("model", self.model_name)
        if m is None:
            return self.model_name
        if not isinstance(m, str):
            raise BadRequest(f"'model' must be a string, got {json.dumps(m)[:60]}", "model")
        if m not in self.names:
            raise BadRequest(f"the model {m!r} does not exist; this server serves {self.model_name!r}", "model",
                             "model_not_found", 404)
        return self.model_name

    def prompt_ids(self, prompt: Any) -> list[list[int]]:
        """A completions prompt (text, token ids, or a list of either) as token id lists. A text
        or an id list too long for a request is refused before it is tokenized or checked."""
        llm = self.llm
        if isinstance(prompt, str):
            self.check_prompt_chars(len(prompt), "prompt")
            return [llm.prompt_ids(prompt)]
        if isinstance(prompt, list) and prompt:
            if all(is_int(t) for t in prompt):
                return [self._ids(prompt)]
            if all(isinstance(p, str) for p in prompt):
                for p in prompt:
                    self.check_prompt_chars(len(p), "prompt")
                return [llm.prompt_ids(p) for p in prompt]
            if all(isinstance(p, list) and p and all(is_int(t) for t in p) for p in prompt):
                return [self._ids(p) for p in prompt]
        raise BadRequest("'prompt' must be a string, a list of strings, a list of token ids or a list of those",
                         "prompt")

    @cached_property
    def longest_token(self) -> int:
        """The most bytes any one token of the vocabulary stands for (at least 1)."""
        tok = self.llm.tokenizer
        return max(1, max((len(tok.token_bytes(i)) for i in range(self.llm.n_vocab)), default=1))

    @property
    def max_prompt_chars(self) -> int:
        """The most characters a prompt that fits a request can have: every token stands for at
        most `longest_token` bytes and every character for at least one byte."""
        return self.max_model_len * self.longest_token

    def check_prompt_chars(self, n_chars: int, field: str) -> None:
        """Refuse, before tokenizing it, a prompt text that cannot fit a request (a 400 naming the
        field, with the context length: what llama-server and vLLM answer for a prompt that does
        not fit, only without tokenizing megabytes first)."""
        if n_chars > self.max_model_len:        # short texts pass without looking at the vocabulary
            limit = self.max_prompt_chars
            if n_chars > limit:
                raise BadRequest(
                    f"'{field}' has {n_chars} characters, more than a request of at most {self.max_model_len} "
                    f"tokens (max_model_len) can hold: no token of this model stands for more than "
                    f"{self.longest_token} bytes, so at most {limit} characters fit; shorten the prompt",
                    field, "context_length_exceeded")

    def check_chat_chars(self, messages: Any) -> None:
        """`check_prompt_chars` for chat messages: their text (content strings and text parts)
        before the template renders it; a template adds text around it, so more cannot fit.
        Malformed messages pass here and are refused by name when they are rendered."""
        if isinstance(messages, list):
            self.check_prompt_chars(sum(_text_chars(m.get("content")) for m in messages if isinstance(m, dict)),
                                    "messages")

    def check_max_tokens(self, body: dict, ids_list: list[list[int]]) -> None:
        """A max_tokens (or max_completion_tokens) the body asks for that cannot fit after a prompt
        is a 400 naming the field and the numbers, as vLLM answers (the Python API caps it
        instead). Left out, the default is capped silently: the client asked for nothing."""
        field = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
        wanted = body.get(field)
        if not is_int(wanted):
            return                                  # absent (null) here; a bad value was refused by name already
        for ids in ids_list:
            try:
                room = context_budget(len(ids), self.llm.n_ctx, self.max_model_len)
            except ContextOverflowError:
                return                              # the prompt itself does not fit: submitting refuses it by name
            if wanted > room:
                raise BadRequest(
                    f"'{field}' is too large: {wanted}. A request may hold at most {self.max_model_len} tokens "
                    f"(max_model_len; n_ctx {self.llm.n_ctx}) and the prompt has {len(ids)}, so at most {room} "
                    f"can be generated ({wanted} > {self.max_model_len} - {len(ids)}); lower {field} or shorten "
                    "the prompt", field, "context_length_exceeded")

    def _ids(self, ids: list[int]) -> list[int]:
        try:                                    # too long: refused before checking millions of ids one by one
            context_budget(len(ids), self.llm.n_ctx, self.max_model_len)
        except ContextOverflowError as e:
            raise BadRequest(str(e), "prompt", "context_length_exceeded") from None
        bad = [t for t in ids if not 0 <= t < self.llm.n_vocab]
        if bad:
            raise BadRequest(f"token id {bad[0]} is out of range for a vocabulary of {self.llm.n_vocab}", "prompt")
        return list(ids)

    def piece(self, tok: int) -> str:
        return self.llm.tokenizer.token_text(tok)

    async def start(self, ids_list: list[list[int]], params: SamplingParams, kind: str = "generate",
                    streamed: bool = True, run: Callable[..., Awaitable] | None = None
                    ) -> tuple[list[RequestHandle], asyncio.Queue]:
        """Queue n requests per prompt (kind "score": one per prompt, its logits at every
        position); their outputs arrive on one queue as (choice index, output): each request's
        handle is its one sink (`RequestHandle` with on_output: the output processor runs there,
        on the stepping thread, and a stop string ends the request). streamed=False (an
        answer sent whole): a request's outputs are held on the stepping thread's side and queued
        together when it finishes, one wake of the event loop a request instead of one a token
        (16 concurrent requests woke it 16 times a step, and its turns took the cores from the
        kernels' threads: 16 served requests ran at 0.6x the rate of the same through the API).
        `run` (the server's `Offload`): submit there, off the event loop (a submit copies the
        prompt and builds a constraint's guide); without it, submit here. A device that failed
        refuses at once (DeviceUnavailable, 503): nothing is queued for it."""
        fault = self.llm.backend.fault
        if fault is not None:
            raise DeviceUnavailable(fault.again())
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        held: dict[int, list] = {}          # streamed=False: each unfinished choice's outputs so far

        def put_all(items: list) -> None:
            for item in items:
                queue.put_nowait(item)

        def on_output(out: StepOutput, choice: int) -> None:
            if streamed:
                loop.call_soon_threadsafe(queue.put_nowait, (choice, out))
                return
            items = held.setdefault(choice, [])
            items.append((choice, out))
            if out.finish_reason is not None or out.error is not None:
                del held[choice]
                loop.call_soon_threadsafe(put_all, items)
        batch = _Submissions()
        try:
            if run is None:
                self._submit_all(ids_list, params, kind, on_output, batch)
            else:
                await run(self._submit_all, ids_list, params, kind, on_output, batch)
        except BaseException:
            batch.abandon(self)
            raise
        self.requests_total += kind == "generate"
        return batch.handles, queue

    def _submit_all(self, ids_list: list[list[int]], params: SamplingParams, kind: str, on_output,
                    batch: "_Submissions") -> None:
        """Submit every choice of every prompt into `batch`; a full queue is a 503 and a prompt past
        the cap (context_budget) a 400, with what was submitted cancelled."""
        self.check_vocabulary(params)
        try:
            for p, ids in enumerate(ids_list):
                for i in range(params.n):
                    choice = p * params.n + i
                    if not batch.add(self.request(ids, params, i, lambda o, c=choice: on_output(o, c), kind), self):
                        return
        except QueueFullError as e:
            raise BadRequest(str(e), None, "server_busy", 503, "server_error") from None
        except ContextOverflowError as e:
            raise BadRequest(str(e), "prompt", "context_length_exceeded") from None

    def check_vocabulary(self, params: SamplingParams) -> None:
        """Token ids a request names (logit_bias keys, stop_token_ids) lie in the vocabulary: a
        400 naming the field otherwise (the fields' own checks cannot know the model)."""
        n_vocab = self.llm.n_vocab
        for name, ids in (("logit_bias", params.logit_bias or {}), ("stop_token_ids", params.stop_token_ids)):
            bad = [t for t in ids if not 0 <= t < n_vocab]
            if bad:
                raise BadRequest(f"'{name}': token id {bad[0]} is outside the vocabulary of {n_vocab}", name)

    def cancel(self, handles: list[RequestHandle]) -> None:
        for h in handles:
            if not h.done:
                h.cancel()

    def usage(self, ids_list: list[list[int]], n: int, completion: int) -> dict:
        return usage(sum(len(ids) for ids in ids_list), completion)   # the prompt counted once however many samples (n)
