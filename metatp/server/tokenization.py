"""The tokenizer routes, in both servers' shapes: llama-server's /tokenize ({"content"} ->
{"tokens"}) and vLLM's ({"prompt"} or {"messages"} -> {"count", "max_model_len", "tokens",
"token_strs"}), /detokenize ({"tokens"} -> llama-server's "content" and vLLM's "prompt", both:
the two bodies are the same), and vLLM's /tokenizer_info (the tokenizer's configuration under
Hugging Face's key names). These are what lm-evaluation-harness's remote tokenizer
(`tokenizer_backend=remote`) speaks: it reads eos_token / bos_token / chat_template from
/tokenizer_info, encodes with {"prompt", "add_special_tokens": false} (special-token text parsed:
it encodes the eos_token's text to find its id) and decodes with {"tokens"} reading "prompt"."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from metatp import request_fields as rf
from metatp.ir.errors import ConfigError
from metatp.openai_messages import chat_messages
from metatp.request_fields import HTTP, FieldError
from metatp.server.fields import BadRequest, as_bad_request, bool_field, is_int
from metatp.server.offload import json_array_in_slices

if TYPE_CHECKING:
    from metatp.server.frontend import Frontend

__all__ = ["tokenize_answer", "detokenize_answer", "tokenizer_info"]


def _json_response(text: str):
    from fastapi.responses import Response

    return Response(text, media_type="application/json")


def _llama_tokenize(srv: "Frontend", body: dict) -> str:
    """llama-server's form: {"content", "add_special", "with_pieces"} -> {"tokens"}."""
    content = body.get("content")
    if not isinstance(content, str):
        raise BadRequest("'content' must be a string", "content")
    # llama-server: add_special adds BOS (and the like) where the model asks for it
    ids = srv.llm.tokenize(content, add_bos=None if bool_field(body, "add_special", False) else False)
    if bool_field(body, "with_pieces", False):
        return '{"tokens":' + json_array_in_slices([{"id": t, "piece": srv.piece(t)} for t in ids]) + "}"
    return '{"tokens":' + json_array_in_slices(ids) + "}"


def _vllm_ids(srv: "Frontend", body: dict) -> list[int]:
    """vLLM's two bodies: a prompt (add_special_tokens default true: BOS where the model asks for
    it) or chat messages rendered by the chat template (add_generation_prompt default true,
    add_special_tokens default false: the template writes what the model needs). Special-token
    text is parsed as the tokens it names, as Hugging Face's tokenizers do."""
    tok = srv.llm.tokenizer
    if "messages" in body:
        if body.get("continue_final_message"):
            raise BadRequest("'continue_final_message' is not supported", "continue_final_message")
        try:
            text = tok.apply_chat_template(chat_messages(body["messages"]),
                                           add_generation_prompt=bool_field(body, "add_generation_prompt", True))
        except FieldError as e:
            raise as_bad_request(e) from None
        except ConfigError as e:            # no chat template, or the template refuses these messages
            raise BadRequest(str(e), "messages") from None
        add = bool_field(body, "add_special_tokens", False)
    else:
        text = body.get("prompt")
        if not isinstance(text, str):
            raise BadRequest(f"'prompt' must be a string, got {json.dumps(text)[:60]}", "prompt")
        add = bool_field(body, "add_special_tokens", True)
    return tok.encode(text, add_bos=None if add else False, special=True)


def tokenize_answer(srv: "Frontend", body: dict):
    """/tokenize's answer: llama-server's for a body with "content", vLLM's for one with "prompt"
    or "messages" (its "model", when given, must be the served one: a 404 otherwise)."""
    if "content" in body or not ("prompt" in body or "messages" in body):
        return _json_response(_llama_tokenize(srv, body))
    srv.check_model(body)
    ids = _vllm_ids(srv, body)
    strs = json_array_in_slices([srv.piece(t) for t in ids]) if bool_field(body, "return_token_strs", False) \
        else "null"
    return _json_response(f'{{"count":{len(ids)},"max_model_len":{srv.max_model_len},"tokens":'
                          f'{json_array_in_slices(ids)},"token_strs":{strs}}}')


def detokenize_answer(srv: "Frontend", body: dict) -> dict:
    """/detokenize's answer: the tokens' text as llama-server's "content" and vLLM's "prompt"."""
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(is_int(t) for t in tokens):
        raise BadRequest("'tokens' must be a list of token ids", "tokens")
    if "model" in body:
        srv.check_model(body)
    text = srv.llm.detokenize(rf.vocabulary_ids("tokens", tokens, srv.llm.n_vocab, HTTP))
    return {"content": text, "prompt": text}


def tokenizer_info(srv: "Frontend") -> dict[str, Any]:
    """vLLM's /tokenizer_info: the tokenizer's configuration under Hugging Face's names (what
    tokenizer_config.json holds), its special tokens' texts, the chat template and the context."""
    tok = srv.llm.tokenizer

    def text(i: int | None) -> str | None:
        return None if i is None else tok.tokens[i]
    info = {"tokenizer_class": type(tok).__name__, "tokenizer_model": tok.model,
            "bos_token": text(tok.bos_id), "eos_token": text(tok.eos_id), "pad_token": text(tok.pad_id),
            "unk_token": text(tok.unk_id), "add_bos_token": bool(tok.add_bos), "vocab_size": srv.llm.n_vocab,
            "model_max_length": srv.max_model_len}
    if tok.chat_template:
        info["chat_template"] = tok.chat_template
    return info
