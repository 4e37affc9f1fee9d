"""Chat templates other than the GGUF's own: llama-cpp-python's `chat_format` names metatp
knows, and vLLM's `chat_template` argument. Either gives a tokenizer that renders chats with
that template; everything else about the tokenizer is the model's."""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

from metatp.ir.errors import ConfigError

if TYPE_CHECKING:
    from metatp.ir.tokenizer import Tokenizer

__all__ = ["CHAT_FORMATS", "with_chat_template", "with_chat_format"]

# llama-cpp-python's chat_format name -> (its Jinja template, the special tokens it writes)
CHAT_FORMATS: dict[str, tuple[str, tuple[str, ...]]] = {
    "chatml": ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
               "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}",
               ("<|im_start|>", "<|im_end|>")),
    "llama-3": ("{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n'"
                " + m['content'] + '<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}"
                "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}",
                ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")),
}


def with_chat_template(tokenizer: "Tokenizer", template: str) -> "Tokenizer":
    """A copy of `tokenizer` whose chats render with the Jinja `template` (compiled on first use,
    in the same budgeted sandbox as the GGUF's)."""
    if not isinstance(template, str) or not template.strip():
        raise ConfigError(f"chat_template must be a Jinja template string, got {template!r:.60}")
    out = copy.copy(tokenizer)
    out.chat_template = template
    out.__dict__.pop("_compiled_template", None)       # the cached compile of the model's template
    return out


def with_chat_format(tokenizer: "Tokenizer", chat_format: str | None) -> "Tokenizer":
    """`tokenizer` rendering chats in llama-cpp-python's `chat_format` (None: the GGUF's template).
    A name metatp does not know, or a format whose special tokens this vocabulary lacks (its
    turns would be plain text the model never learned to end), is a ConfigError naming chat_format."""
    if chat_format is None:
        return tokenizer
    if not isinstance(chat_format, str) or chat_format not in CHAT_FORMATS:
        raise ConfigError(f"chat_format {chat_format!r} is not supported; metatp knows {', '.join(CHAT_FORMATS)} "
                          "(or None: the chat template stored in the GGUF)")
    template, markers = CHAT_FORMATS[chat_format]
    for marker in markers:
        if len(tokenizer.encode(marker, add_bos=False, special=True)) != 1:
            raise ConfigError(f"chat_format {chat_format!r} writes {marker}, which is not a token of this model; "
                              "use chat_format=None (the GGUF's own template)")
    return with_chat_template(tokenizer, template)
