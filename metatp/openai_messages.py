"""OpenAI chat messages as the prompt's token ids, written once for `LLM.create_chat_completion`
and the server's /v1/chat/completions: the messages are checked and normalised (content as
text), rendered with the GGUF's chat template and tokenized with its special tokens.

Every refusal is a `FieldError` naming "messages" (a ConfigError for the Python API, a 400 with
param "messages" for the server), with the message that names the part that is wrong.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from metatp.ir.errors import ConfigError
from metatp.request_fields import FieldError, short, type_name

if TYPE_CHECKING:
    from metatp.ir.tokenizer import Tokenizer

__all__ = ["chat_messages", "chat_prompt_ids"]


def _content(i: int, content: Any) -> str:
    """A chat message's content as text: a string, None (no content: ""), or OpenAI content parts
    of type "text" (joined with newlines, as vLLM does)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):
        texts = []
        for k, part in enumerate(content):
            if isinstance(part, str):
                texts.append(part)
                continue
            if not isinstance(part, dict) or "type" not in part:
                raise FieldError("messages", f"messages[{i}]['content'][{k}] must be a content part like "
                                             f"{{'type': 'text', 'text': ...}}, got {short(part)}")
            if part["type"] != "text":
                raise FieldError("messages", f"messages[{i}]['content'][{k}] has type {part['type']!r}; this model "
                                             "takes text only (content parts of type 'text')")
            text = part.get("text")
            if not isinstance(text, str):
                raise FieldError("messages", f"messages[{i}]['content'][{k}]['text'] must be a string, got "
                                             f"{short(text)}")
            texts.append(text)
        return "\n".join(texts)
    raise FieldError("messages", f"messages[{i}]['content'] must be a string, None or a list of text content parts, "
                                 f"got {type_name(content)} {short(content)}")


def chat_messages(messages: Any) -> list[dict]:
    """OpenAI-style messages, normalised for the template: content always a string."""
    if isinstance(messages, (str, bytes, dict)) or not isinstance(messages, Sequence):
        raise FieldError("messages", f"messages must be a list of {{'role': ..., 'content': ...}} dicts, "
                                     f"got {type_name(messages)} {short(messages)}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise FieldError("messages", f"messages[{i}] must be a dict with a 'role', got {short(m)}")
        if not isinstance(m["role"], str):
            raise FieldError("messages", f"messages[{i}]['role'] must be a string, got {short(m['role'])}")
        out.append({**m, "content": _content(i, m.get("content"))})
    return out


def chat_prompt_ids(tokenizer: "Tokenizer", messages: Any) -> list[int]:
    """The token ids of `messages` rendered by the model's chat template (with the generation
    prompt), special tokens parsed, as the model expects a chat turn. A missing template, or one
    that refuses these messages (raise_exception), is a FieldError naming "messages" too."""
    try:
        text = tokenizer.apply_chat_template(chat_messages(messages), add_generation_prompt=True)
    except FieldError:
        raise
    except ConfigError as e:
        raise FieldError("messages", str(e)) from None
    ids = tokenizer.encode(text, add_bos=None, special=True)
    if not ids:
        raise FieldError("messages", "the chat template rendered these messages as an empty prompt")
    return ids
