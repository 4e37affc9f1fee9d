"""Request fields of the OpenAI routes: each is read from the body and checked by its one check
in `metatp.request_fields` (with OpenAI's bounds and wording); a wrong type or value is a
`BadRequest` (OpenAI's error object, status 400) naming the field. `sampling_params` builds
`SamplingParams`; the route-specific refusals (fields metatp does not implement, structured
output given twice) are here."""

from __future__ import annotations

import asyncio
import json
import types
from typing import Any

from metatp import request_fields as rf
from metatp.ir.errors import ConfigError
from metatp.request_fields import HTTP, FieldError, Flag, Integer, Number
from metatp.sampling import SamplingParams
from metatp.tool_calls import ToolPlan, plan_tools, tool_request
from metatp.tool_formats import ToolFormat


class BadRequest(Exception):
    """A request the server refuses: OpenAI's error object with an HTTP status."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.kind = message, param, code, status, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


# ---------------------------------------------------------------- request field checks
is_int = rf.is_integer


def as_bad_request(e: FieldError) -> BadRequest:
    """A field's refusal (metatp.request_fields) as the 400 that names it."""
    return BadRequest(str(e), e.field)


def read(body: dict, spec: Integer | Number | Flag, default: Any = None) -> Any:
    """The body's value of `spec`'s field, checked as the server checks it (OpenAI's bounds and
    wording); absent or null: `default`."""
    v = body.get(spec.name)
    if v is None:
        return default
    try:
        return spec.check(v, HTTP)
    except FieldError as e:
        raise as_bad_request(e) from None


def bool_field(body: dict, name: str, default: bool) -> bool:
    """A true-or-false field of the body (stream, echo, include_usage...); absent or null: `default`."""
    return read(body, Flag(name), default)


# body field -> the SamplingParams constraint it sets (vLLM's guided_*, llama-server's json_schema / grammar)
_CONSTRAINT_FIELDS = {"guided_json": "json_schema", "guided_regex": "guided_regex", "guided_choice": "guided_choice",
                      "guided_grammar": "guided_grammar", "json_schema": "json_schema", "grammar": "guided_grammar"}


def _response_format(v: Any) -> dict[str, Any]:
    """OpenAI's response_format: text (no constraint), json_object (llama-server's: with an optional
    `schema` it is enforced), or json_schema {name, schema, strict}."""
    if not isinstance(v, dict) or v.get("type") not in ("text", "json_object", "json_schema"):
        raise BadRequest("'response_format' must be an object with 'type' one of text, json_object, json_schema; "
                         f"got {json.dumps(v)[:80]}", "response_format")
    if v["type"] == "text":
        return {}
    if v["type"] == "json_object":
        # llama-server's form: json_object with a "schema" constrains to that schema (not any object)
        schema = v.get("schema")
        if schema is None:
            return {"json_object": True}
        if not isinstance(schema, (dict, str)):
            raise BadRequest("'response_format.schema' must be a JSON schema (an object), got "
                             f"{json.dumps(schema)[:80]}", "response_format")
        return {"json_schema": schema}
    spec = v.get("json_schema")
    if not isinstance(spec, dict):
        raise BadRequest("'response_format.json_schema' must be an object {name, schema, strict}, got "
                         f"{json.dumps(spec)[:80]}", "response_format")
    if "name" in spec and not isinstance(spec["name"], str):
        raise BadRequest("'response_format.json_schema.name' must be a string", "response_format")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise BadRequest("'response_format.json_schema.strict' must be true or false", "response_format")
    if spec.get("schema") is None:         # OpenAI's schema is optional: then any JSON object
        return {"json_object": True}
    return {"json_schema": spec["schema"]}    # strict or not, the schema is enforced


def constraint_fields(body: dict) -> tuple[dict[str, Any], str | None]:
    """The structured-output fields of a body as SamplingParams keywords, and the field that set
    them (at most one may: a second one is a BadRequest naming it)."""
    given: list[tuple[str, dict[str, Any]]] = []
    for k in ("response_format", *_CONSTRAINT_FIELDS):
        if body.get(k) is None:
            continue
        kwargs = _response_format(body[k]) if k == "response_format" else {_CONSTRAINT_FIELDS[k]: body[k]}
        if kwargs:                  # response_format text constrains nothing
            given.append((k, kwargs))
    if len(given) > 1:
        raise BadRequest(f"'{given[1][0]}' cannot be combined with '{given[0][0]}': set one output constraint",
                         given[1][0])
    return (given[0][1], given[0][0]) if given else ({}, None)


async def check_constraint(body: dict, tokenizer: Any) -> None:
    """The body's output constraint checked and compiled off the event loop (a worker process
    under size and time budgets, `metatp.structured.check_constraint`), its matcher built for
    `tokenizer`; a refusal, a crash or a timeout is a BadRequest naming the body's field. The
    verdict is kept, so `sampling_params` then finds it at once."""
    from metatp import structured
    from metatp.request_fields import CONSTRAINT_FIELDS

    constraint, source = constraint_fields(body)
    if source is None:
        return
    try:
        given = types.SimpleNamespace(**{**dict.fromkeys(CONSTRAINT_FIELDS), **constraint})
        c = await asyncio.to_thread(structured.constraint_of, given)      # linear in the constraint's size
        if c is not None:
            await asyncio.wrap_future(structured.check_constraint(*c, tokenizer))
    except ConfigError as e:        # a FieldError, or the matcher refusing it
        raise BadRequest(f"'{source}': {e}", source) from None


def _given(body: dict, name: str) -> bool:
    """Does the body set `name` to something other than nothing (None, "", [], {})?"""
    return body.get(name) not in (None, "", [], {})


def refuse_unimplemented_completion(body: dict) -> None:
    """/v1/completions fields that would change the answer and that metatp does not implement are
    refused by name rather than ignored: `best_of` other than n, and a `suffix`. Their neutral
    values (best_of = n, an empty suffix) pass; fields OpenAI keeps as metadata (user, metadata,
    store) and names it does not define are left alone, as vLLM and llama-server do."""
    n = body.get("n", 1)
    if _given(body, "best_of") and body["best_of"] != n:
        raise BadRequest(f"'best_of' is not supported (only best_of equal to n, {json.dumps(n)}), got "
                         f"{json.dumps(body['best_of'])[:40]}", "best_of")
    if _given(body, "suffix"):
        raise BadRequest("'suffix' (text after the completion) is not supported", "suffix")


def refuse_unimplemented_chat(body: dict) -> None:
    """/v1/chat/completions fields metatp does not implement, refused by name: the deprecated
    functions / function_call (send tools / tool_choice: `tool_plan`), audio output and
    predicted outputs. Their neutral values (function_call "none"/"auto" without functions,
    modalities ["text"]) pass; metadata fields are left alone, as for completions."""
    if _given(body, "functions"):
        raise BadRequest("'functions' (deprecated by OpenAI) is not supported: send the functions as 'tools'",
                         "functions")
    if _given(body, "function_call") and body["function_call"] not in ("none", "auto"):
        raise BadRequest("'function_call' (deprecated by OpenAI) is not supported: use 'tool_choice', got "
                         f"{json.dumps(body['function_call'])[:60]}", "function_call")
    if _given(body, "audio"):
        raise BadRequest("'audio': audio output is not supported", "audio")
    if _given(body, "modalities") and body["modalities"] != ["text"]:
        raise BadRequest(f"'modalities': output other than [\"text\"] is not supported, got "
                         f"{json.dumps(body['modalities'])[:60]}", "modalities")
    if _given(body, "prediction"):
        raise BadRequest("'prediction' (predicted outputs) is not supported", "prediction")


def tool_plan(body: dict, fmt: ToolFormat) -> ToolPlan | None:
    """The body's tools, tool_choice and parallel_tool_calls checked (a 400 naming the field:
    tools[i].function.parameters for a bad schema, tool_choice for an unknown name) and planned
    for the chat template's tool format `fmt`; None when the answer calls no tool. A plan that
    constrains the output cannot be combined with the body's own constraint: a 400 naming it."""
    try:
        plan = plan_tools(tool_request(body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls"),
                                       HTTP), fmt)
    except FieldError as e:
        raise as_bad_request(e) from None
    source = constraint_fields(body)[1]
    if plan is not None and plan.schema is not None and source is not None:
        raise BadRequest(f"'{source}' cannot be combined with tools under tool_choice {plan.request.choice!r} (or "
                         "the generic tool format, which constrains the answer to tool calls or a response)", source)
    return plan


def sampling_params(body: dict, logprobs: int | None, default_max: int | None) -> SamplingParams:
    """OpenAI's sampling fields (and llama-server's/vLLM's top_k, min_p, ignore_eos, min_tokens,
    stop_token_ids, cache_salt; structured output: OpenAI's response_format, vLLM's guided_json / guided_regex /
    guided_choice / guided_grammar, llama-server's json_schema / grammar) as SamplingParams."""
    max_tokens = read(body, rf.MAX_TOKENS)
    if body.get("max_completion_tokens") is not None:
        max_tokens = read(body, rf.MAX_TOKENS.named("max_completion_tokens"))
    top_k = read(body, rf.TOP_K, -1)
    constraint, source = constraint_fields(body)
    stop_ids = body.get("stop_token_ids")
    try:
        return SamplingParams(
            max_tokens=max_tokens if max_tokens is not None else default_max,
            temperature=read(body, rf.TEMPERATURE, 1.0), top_p=read(body, rf.TOP_P, 1.0),
            top_k=top_k if top_k > 0 else -1, min_p=read(body, rf.MIN_P, 0.0),
            repetition_penalty=read(body, rf.REPETITION_PENALTY, 1.0),
            seed=read(body, rf.SEED), stop=rf.stop(body.get("stop"), HTTP),
            ignore_eos=read(body, rf.IGNORE_EOS, False), logprobs=logprobs, n=read(body, rf.N, 1),
            frequency_penalty=read(body, rf.FREQUENCY_PENALTY, 0.0),
            presence_penalty=read(body, rf.PRESENCE_PENALTY, 0.0),
            logit_bias=rf.logit_bias(body.get("logit_bias"), HTTP) or None, min_tokens=read(body, rf.MIN_TOKENS, 0),
            stop_token_ids=[] if stop_ids is None else rf.token_ids("stop_token_ids", stop_ids, HTTP),
            cache_salt=read(body, rf.CACHE_SALT), **constraint)
    except ConfigError as e:        # a FieldError names its field; SamplingParams' other messages start with it
        msg = str(e)
        name = e.field if isinstance(e, FieldError) else msg.split(" ", 1)[0].rstrip(":")
        if source is not None and name in constraint:        # the body's own name for it
            raise BadRequest(f"'{source}': {msg}", source) from None
        raise BadRequest(msg, name if name in body else None) from None
