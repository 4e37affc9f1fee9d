"""The OpenAI response shapes, written once: completions and chat completions, whole or as
stream chunks, with usage and logprobs. `LLM.create_completion` / `create_chat_completion` and
the HTTP routes (`metatp.server.app`) both build their answers here, so a field added or fixed
is added or fixed for both.

Logprobs come from the step outputs (`metatp.output_processor.StepOutput`: token, logprob, top
alternatives); `piece(token)` gives a token's text as the client sees it.
"""

from __future__ import annotations

import time
import uuid
from typing import Callable, Iterable, Sequence

__all__ = ["response_id", "usage", "text_choice", "text_completion", "chat_delta", "chat_choice",
           "chat_completion", "chat_chunk", "tool_call_deltas", "completion_logprobs", "chat_logprobs", "top_by_piece",
           "echo_logprobs", "join_logprobs", "vllm_prompt_logprobs"]

Piece = Callable[[int], str]


def response_id(kind: str) -> tuple[str, int]:
    """A fresh id ("cmpl-…" / "chatcmpl-…") and the creation time, as OpenAI stamps a response."""
    return f"{kind}-{uuid.uuid4().hex}", int(time.time())


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _head(cid: str, obj: str, created: int, model: str) -> dict:
    return {"id": cid, "object": obj, "created": created, "model": model}


def _with_usage(body: dict, use: dict | None, stream_usage: bool | None) -> dict:
    """`use` as the body's usage; in a stream with include_usage, the chunks carry usage null."""
    if use is not None:
        body["usage"] = use
    elif stream_usage:
        body["usage"] = None
    return body


# ---------------------------------------------------------------- completions
def text_choice(index: int, text: str, finish: str | None, logprobs: dict | None = None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}


def text_completion(cid: str, created: int, model: str, choices: list[dict], use: dict | None = None,
                    stream_usage: bool | None = None) -> dict:
    """A completion (with `use`), or one stream chunk of it (`use` None; usage null with
    `stream_usage`; the last chunk of such a stream has no choices and the usage)."""
    return _with_usage({**_head(cid, "text_completion", created, model), "choices": choices}, use, stream_usage)


def top_by_piece(top: dict[int, float] | None, piece: Piece) -> dict[str, float]:
    """OpenAI's completions logprobs key alternatives by text: two tokens with one text (byte
    pieces of a character) keep the likelier value."""
    out: dict[str, float] = {}
    for t, v in sorted((top or {}).items(), key=lambda kv: -kv[1]):
        out.setdefault(piece(t), v)
    return out


def completion_logprobs(outs: Iterable, piece: Piece) -> dict:
    """The completions logprobs object of these outputs (tokens, token_logprobs, top_logprobs,
    text_offset within this piece of text): the tokens of their text (`StepOutput.tokens`), each
    named by the text it adds, so the tokens spell the text (an end token adds "", a stop string's
    tokens are not listed)."""
    toks = [t for o in outs for t in o.tokens]
    offsets, at = [], 0
    for t in toks:
        offsets.append(at)
        at += len(t.text)
    return {"tokens": [t.text for t in toks], "token_logprobs": [t.logprob for t in toks],
            "top_logprobs": [top_by_piece(t.top_logprobs, piece) for t in toks], "text_offset": offsets}


def echo_logprobs(ids: list[int], entries: list, piece: Piece) -> dict:
    """The completions logprobs object of an echoed prompt: `entries` from
    `metatp.logprobs.prompt_logprobs` (the first token's value and alternatives are null)."""
    offsets, at = [], 0
    for t in ids:
        offsets.append(at)
        at += len(piece(t))
    return {"tokens": [piece(t) for t in ids],
            "token_logprobs": [None if e is None else e[0] for e in entries],
            "top_logprobs": [None if e is None else top_by_piece(e[1], piece) for e in entries],
            "text_offset": offsets}


def join_logprobs(prompt: dict | None, generated: dict | None, shift: int) -> dict | None:
    """An echoed prompt's logprobs followed by the generated ones (their offsets moved past the
    `shift` characters of the prompt's text)."""
    if prompt is None or generated is None:
        return generated if prompt is None else prompt
    return {"tokens": prompt["tokens"] + generated["tokens"],
            "token_logprobs": prompt["token_logprobs"] + generated["token_logprobs"],
            "top_logprobs": prompt["top_logprobs"] + generated["top_logprobs"],
            "text_offset": prompt["text_offset"] + [o + shift for o in generated["text_offset"]]}


def vllm_prompt_logprobs(ids: list[int], entries: list, piece: Piece) -> list[dict | None]:
    """vLLM's `prompt_logprobs` field: per prompt token (None for the first) a map from token id
    to its logprob, rank among the vocabulary (1 = likeliest) and text, for the prompt's own
    token and the top alternatives."""
    out: list[dict | None] = []
    for t, e in zip(ids, entries):
        if e is None:
            out.append(None)
            continue
        lp, top, own = e
        ranked = sorted(top.items(), key=lambda kv: (-kv[1], kv[0]))
        rank = {tok: r + 1 for r, (tok, _) in enumerate(ranked)}
        d = {str(t): {"logprob": lp, "rank": own, "decoded_token": piece(t)}}
        for tok, v in ranked:
            d.setdefault(str(tok), {"logprob": v, "rank": rank[tok], "decoded_token": piece(tok)})
        out.append(d)
    return out


# ---------------------------------------------------------------- chat
def chat_delta(index: int, text: str | None, finish: str | None, logprobs: dict | None = None,
               role: bool = False, tool_calls: list[dict] | None = None) -> dict:
    """A stream chunk's choice: the role first (`role`), then content pieces or tool-call pieces
    (`tool_call_deltas`), then the finish."""
    delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
    if tool_calls:
        delta["tool_calls"] = tool_calls
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}


def tool_call_deltas(calls: list[dict]) -> list[list[dict]]:
    """Tool calls as a stream sends them, one delta after another (OpenAI's shape): a call's
    first delta has its index, id, type and name with empty arguments; its arguments follow."""
    out = []
    for k, c in enumerate(calls):
        fn = c["function"]
        out.append([{"index": k, "id": c["id"], "type": "function", "function": {"name": fn["name"],
                                                                                "arguments": ""}}])
        out.append([{"index": k, "function": {"arguments": fn["arguments"]}}])
    return out


def chat_choice(index: int, text: str | None, finish: str | None, logprobs: dict | None = None,
                tool_calls: list[dict] | None = None) -> dict:
    """A whole answer's choice; with tool calls, `message.tool_calls` (content None when the
    model wrote nothing beside them)."""
    message: dict = {"role": "assistant", "content": text}
    if tool_calls:
        message["tool_calls"] = tool_calls
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish}


def chat_completion(cid: str, created: int, model: str, choices: list[dict], use: dict) -> dict:
    return {**_head(cid, "chat.completion", created, model), "choices": choices, "usage": use}


def chat_chunk(cid: str, created: int, model: str, choices: list[dict], use: dict | None = None,
               stream_usage: bool | None = None) -> dict:
    return _with_usage({**_head(cid, "chat.completion.chunk", created, model), "choices": choices}, use,
                       stream_usage)


def chat_logprobs(outs: Sequence, piece: Piece) -> dict:
    """The chat logprobs object: per token of the message's text (`StepOutput.tokens`: an end
    token adds "", a stop string's tokens are not listed) the text it adds, its logprob, bytes and
    alternatives."""
    def entry(text: str, logprob: float) -> dict:
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}
    return {"content": [{**entry(t.text, t.logprob),
                         "top_logprobs": [entry(piece(a), v) for a, v in (t.top_logprobs or {}).items()]}
                        for o in outs for t in o.tokens]}
