"""Request fields of the OpenAI routes, checked once: a wrong type or value is a `BadRequest`
(OpenAI's error object, status 400) naming the field; `sampling_params` builds `SamplingParams`."""

from __future__ import annotations

import json
import math
import numbers
from typing import Any

from metatp.ir.errors import ConfigError
from metatp.sampling import SamplingParams


class BadRequest(Exception):
    """A request the server refuses: OpenAI's error object with an HTTP status."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.kind = message, param, code, status, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


# ---------------------------------------------------------------- request field checks
def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def int_field(body: dict, name: str, default: Any, lo: int | None = None, hi: int | None = None,
              nullable: bool = True) -> Any:
    v = body.get(name, default)
    if v is None and nullable:
        return default
    if not is_int(v) or (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f" from {lo}" if lo is not None else ""
        rng += f" to {hi}" if hi is not None else ""
        raise BadRequest(f"'{name}' must be an integer{rng}, got {json.dumps(v)}", name)
    return v


def num_field(body: dict, name: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = body.get(name, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not (is_int(v) or math.isfinite(v)) \
            or v < lo or v > hi or (lo_open and v == lo):
        raise BadRequest(f"'{name}' must be a number {'>' if lo_open else '>='} {lo} and <= {hi}, got {json.dumps(v)}",
                         name)
    return float(v)


def bool_field(body: dict, name: str, default: bool) -> bool:
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise BadRequest(f"'{name}' must be true or false, got {json.dumps(v)}", name)
    return v


def stop_field(body: dict) -> list[str] | None:
    v = body.get("stop")
    if v is None:
        return None
    if isinstance(v, str):
        return [v]
    if isinstance(v, list) and all(isinstance(s, str) for s in v) and len(v) <= 16:
        return v
    raise BadRequest(f"'stop' must be a string or a list of at most 16 strings, got {json.dumps(v)[:80]}", "stop")


def logit_bias_field(body: dict) -> dict[int, float] | None:
    """OpenAI's logit_bias: a JSON object of token ids (as strings) -> bias from -100 to 100."""
    v = body.get("logit_bias")
    if v is None:
        return None
    if not isinstance(v, dict):
        raise BadRequest(f"'logit_bias' must be an object of token id -> bias, got {json.dumps(v)[:80]}", "logit_bias")
    out: dict[int, float] = {}
    for k, b in v.items():
        if not (k.isascii() and k.isdigit() and len(k) <= 18):
            raise BadRequest(f"'logit_bias' keys must be token ids (integers >= 0), got {json.dumps(k)[:40]}",
                             "logit_bias")
        if isinstance(b, bool) or not isinstance(b, numbers.Real) or not (is_int(b) or math.isfinite(b)) \
                or not -100 <= b <= 100:
            raise BadRequest(f"'logit_bias' values must be numbers from -100 to 100, got {json.dumps(b)[:40]} "
                             f"for token {k}", "logit_bias")
        out[int(k)] = float(b)
    return out


def token_ids_field(body: dict, name: str) -> list[int]:
    v = body.get(name)
    if v is None:
        return []
    if not isinstance(v, list) or not all(is_int(t) and t >= 0 for t in v):
        raise BadRequest(f"'{name}' must be a list of token ids (integers >= 0), got {json.dumps(v)[:80]}", name)
    return v


# body field -> the SamplingParams constraint it sets (vLLM's guided_*, llama-server's json_schema / grammar)
_CONSTRAINT_FIELDS = {"guided_json": "json_schema", "guided_regex": "guided_regex", "guided_choice": "guided_choice",
                      "guided_grammar": "guided_grammar", "json_schema": "json_schema", "grammar": "guided_grammar"}


def _response_format(v: Any) -> dict[str, Any]:
    """OpenAI's response_format: text (no constraint), json_object, or json_schema {name, schema, strict}."""
    if not isinstance(v, dict) or v.get("type") not in ("text", "json_object", "json_schema"):
        raise BadRequest("'response_format' must be an object with 'type' one of text, json_object, json_schema; "
                         f"got {json.dumps(v)[:80]}", "response_format")
    if v["type"] == "text":
        return {}
    if v["type"] == "json_object":
        return {"json_object": True}
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
    """/v1/chat/completions fields metatp does not implement, refused by name: tools, functions,
    audio output and predicted outputs. Their neutral values (tool_choice "none"/"auto" without
    tools, modalities ["text"]) pass; metadata fields are left alone, as for completions."""
    for name in ("tools", "functions"):
        if _given(body, name):
            raise BadRequest(f"'{name}': tool and function calling is not supported", name)
    for name in ("tool_choice", "function_call"):
        if _given(body, name) and body[name] not in ("none", "auto"):
            raise BadRequest(f"'{name}': tool and function calling is not supported, got {json.dumps(body[name])[:60]}",
                             name)
    if _given(body, "audio"):
        raise BadRequest("'audio': audio output is not supported", "audio")
    if _given(body, "modalities") and body["modalities"] != ["text"]:
        raise BadRequest(f"'modalities': output other than [\"text\"] is not supported, got "
                         f"{json.dumps(body['modalities'])[:60]}", "modalities")
    if _given(body, "prediction"):
        raise BadRequest("'prediction' (predicted outputs) is not supported", "prediction")


def _named(message: str, body: dict) -> str | None:
    """The field a SamplingParams error names (its messages start with it), if the body has it."""
    name = message.split(" ", 1)[0].rstrip(":")
    return name if name in body else None


def sampling_params(body: dict, logprobs: int | None, default_max: int | None) -> SamplingParams:
    """OpenAI's sampling fields (and llama-server's/vLLM's top_k, min_p, ignore_eos, min_tokens,
    stop_token_ids; structured output: OpenAI's response_format, vLLM's guided_json / guided_regex /
    guided_choice / guided_grammar, llama-server's json_schema / grammar) as SamplingParams."""
    max_tokens = int_field(body, "max_tokens", None, 0)
    if "max_completion_tokens" in body and body["max_completion_tokens"] is not None:
        max_tokens = int_field(body, "max_completion_tokens", None, 0)
    top_k = int_field(body, "top_k", -1, -1)
    constraint, source = constraint_fields(body)
    try:
        return SamplingParams(
            max_tokens=max_tokens if max_tokens is not None else default_max,
            temperature=num_field(body, "temperature", 1.0, 0.0, 2.0), top_p=num_field(body, "top_p", 1.0, 0.0, 1.0, True),
            top_k=top_k if top_k > 0 else -1, min_p=num_field(body, "min_p", 0.0, 0.0, 1.0),
            repetition_penalty=num_field(body, "repetition_penalty", 1.0, 0.0, 10.0, True),
            seed=int_field(body, "seed", None, 0, 2 ** 63 - 1), stop=stop_field(body),
            ignore_eos=bool_field(body, "ignore_eos", False), logprobs=logprobs, n=int_field(body, "n", 1, 1, 16),
            frequency_penalty=num_field(body, "frequency_penalty", 0.0, -2.0, 2.0),
            presence_penalty=num_field(body, "presence_penalty", 0.0, -2.0, 2.0), logit_bias=logit_bias_field(body),
            min_tokens=int_field(body, "min_tokens", 0, 0), stop_token_ids=token_ids_field(body, "stop_token_ids"),
            **constraint)
    except ConfigError as e:
        msg = str(e)
        if source is not None and msg.split(" ", 1)[0].rstrip(":") in constraint:   # the body's own name for it
            raise BadRequest(f"'{source}': {msg}", source) from None
        raise BadRequest(msg, _named(msg, body)) from None


# ---------------------------------------------------------------- the app
