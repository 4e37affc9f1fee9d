"""`LLM`'s llama-cpp-python completions: `create_completion` (also `llm(prompt)`) and
`create_chat_completion`, OpenAI-shaped answers whole or streamed (`metatp.openai_answers`), with
llama-cpp-python's keyword arguments and defaults.

`LLM` inherits them from `CompletionMethods`, which reads the LLM's `submit`, `prompt_ids`,
`tokenizer`, `model_path`, `n_ctx` and `max_model_len`. Each request is a sequence of its own in
the LLM's continuous batch, so completions from several threads share its steps.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator, Sequence

from metatp import request_fields
from metatp.llama_compat import response_format_constraint
from metatp.logprobs import prompt_logprobs
from metatp.mpi_calls import mirrored
from metatp.openai_answers import ChatAnswer, TextAnswer
from metatp.openai_messages import chat_prompt_ids
from metatp.output_processor import StepOutput
from metatp.sampling import SamplingParams
from metatp.scheduler import context_budget

__all__ = ["CompletionMethods"]


class CompletionMethods:
    """llama-cpp-python's completion half of `LLM` (see the module doc); a mixin, not used on its own."""

    @mirrored
    def create_completion(self, prompt: str | Sequence[int], max_tokens: int | None = 16, temperature: float = 0.8,
                          top_p: float = 0.95, top_k: int = 40, min_p: float = 0.05, stop: str | list[str] | None = None,
                          stream: bool = False, seed: int | None = None, repeat_penalty: float = 1.0,
                          echo: bool = False, logprobs: int | None = None, **penalties: Any) -> dict | Iterator[dict]:
        """OpenAI-style text completion (a dict, or chunks when stream=True), as llama-cpp-python returns.
        `logprobs`: each generated token's log-probability and the `logprobs` most likely
        alternatives (0-20); with `echo`, the prompt's tokens' too (the first has none), as
        llama-cpp-python and the server's /v1/completions give them."""
        params = _completion_params(max_tokens, temperature, top_p, top_k, min_p, stop, seed, repeat_penalty).with_keywords(penalties)
        stream, echo = request_fields.STREAM.check(stream), request_fields.ECHO.check(echo)
        if logprobs is not None:
            params = dataclasses.replace(params, logprobs=logprobs)         # SamplingParams checks the count
        ids = self.prompt_ids(prompt)
        scored = None           # echo with logprobs: the prompt's tokens scored too (first: None), as the server does
        if echo and params.logprobs is not None:
            context_budget(len(ids), self.n_ctx, self.max_model_len)
            logits = self.submit(ids, SamplingParams(max_tokens=0), kind="score").logits()
            scored = [prompt_logprobs(logits, ids, params.logprobs)]
        answer = TextAnswer(str(self.model_path), [ids], 1, self.tokenizer.token_text, self.tokenizer.decode,
                            echo=echo, logprobs=params.logprobs, scored=scored,
                            echo_text=[prompt] if isinstance(prompt, str) else None)
        return self._answer(answer, ids, params, stream)

    __call__ = create_completion

    @mirrored
    def create_chat_completion(self, messages: list[dict], max_tokens: int | None = None, temperature: float = 0.2,
                               top_p: float = 0.95, top_k: int = 40, min_p: float = 0.05,
                               stop: str | list[str] | None = None, stream: bool = False, seed: int | None = None,
                               repeat_penalty: float = 1.0, logprobs: bool = False, top_logprobs: int | None = None,
                               tools: list[dict] | None = None, tool_choice: str | dict | None = None,
                               parallel_tool_calls: bool | None = None, response_format: dict | None = None,
                               **penalties: Any) -> dict | Iterator[dict]:
        """OpenAI-style chat completion using the GGUF's chat template.

        Message content may be a string, None, or OpenAI content parts of type "text". `logprobs`:
        each generated token's log-probability, with the `top_logprobs` (0-20) most likely
        alternatives, as OpenAI's chat answers carry them. `response_format`: {"type": "json_object"}
        (with llama-cpp-python's "schema": that JSON schema) or OpenAI's {"type": "json_schema",
        "json_schema": {"schema": ...}}, enforced by the structured-output engine. `tools` / `tool_choice` /
        `parallel_tool_calls`: OpenAI's tool calling (metatp.tool_calls), the answer's
        `message.tool_calls` as llama-cpp-python returns them; not with a `response_format`."""
        from metatp.tool_calls import constrain, plan_tools, tool_request
        from metatp.tool_formats import detect_format

        plan = plan_tools(tool_request(tools, tool_choice, parallel_tool_calls), detect_format(self.tokenizer.chat_template))
        params = _completion_params(max_tokens, temperature, top_p, top_k, min_p, stop, seed, repeat_penalty).with_keywords(penalties)
        constraint = response_format_constraint(response_format)
        if constraint:
            params = dataclasses.replace(params, **constraint)
        stream, logprobs = request_fields.STREAM.check(stream), request_fields.CHAT_LOGPROBS.check(logprobs)
        count = request_fields.chat_logprobs(logprobs, request_fields.TOP_LOGPROBS.check(top_logprobs))
        if count is not None:
            params = dataclasses.replace(params, logprobs=count)
        params = constrain(params, plan)
        ids = chat_prompt_ids(self.tokenizer, messages, plan)
        answer = ChatAnswer(str(self.model_path), ids, 1, self.tokenizer.token_text, logprobs=logprobs, tools=plan)
        return self._answer(answer, ids, params, stream)

    def _answer(self, answer: Any, ids: list[int], params: SamplingParams, stream: bool) -> dict | Iterator[dict]:
        """One request's OpenAI answer (`metatp.openai_answers`): whole, or its stream chunks."""
        if not stream:
            return answer.whole([list(self._stream(ids, params))])

        def gen() -> Iterator[dict]:
            yield from answer.head()
            for step in self._stream(ids, params):
                yield from answer.chunks(0, step)
            yield from answer.tail()
        return gen()

    def _stream(self, prompt_ids: list[int], params: SamplingParams) -> Iterator[StepOutput]:
        """Yields text pieces as tokens are generated; the last step carries finish_reason.
        The stream is a sequence of its own in the shared batch (closing it frees its cells)."""
        yield from self.submit(prompt_ids, params)


def _completion_params(max_tokens, temperature, top_p, top_k, min_p, stop, seed, repeat_penalty) -> SamplingParams:
    """llama-cpp-python's keyword arguments as SamplingParams (top_k <= 0: disabled; seed -1: random)."""
    top_k = request_fields.TOP_K_LLAMA.check(top_k)
    if request_fields.is_integer(seed) and seed == -1:
        seed = None          # llama.cpp's "random seed"
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                          top_k=top_k if top_k > 0 else -1, min_p=min_p, stop=stop, seed=seed,
                          repetition_penalty=repeat_penalty)
