"""`Llama`: metatp's `LLM` with llama-cpp-python's types, so a script written for
`from llama_cpp import Llama` runs with `from metatp import Llama`.

Everything is `LLM`'s (the constructor takes llama-cpp-python's keywords, `__call__` is
`create_completion`, `n_ctx()` / `n_vocab()` / `token_eos()` ... are there) except the two
methods whose types differ between the libraries: llama-cpp-python's `tokenize` takes UTF-8
bytes (str works too) and does not parse special tokens unless asked, and its `detokenize`
returns bytes. `LLM` keeps metatp's and vLLM's str types, which the server and metatp's own
callers use."""

from __future__ import annotations

from typing import Sequence

from metatp import request_fields
from metatp.api import LLM
from metatp.ir.errors import ConfigError

__all__ = ["Llama"]


class Llama(LLM):
    """`LLM` with llama-cpp-python's tokenize / detokenize (see the module doc)."""

    def tokenize(self, text: bytes | str, add_bos: bool = True, special: bool = False) -> list[int]:
        """Token ids of UTF-8 `text` (bytes, as llama-cpp-python takes; or str). `add_bos`: the
        model's BOS where the model adds one (llama.cpp's add_special); `special`: parse control
        tokens written in the text (llama.cpp's parse_special)."""
        if isinstance(text, (bytes, bytearray)):
            try:
                text = bytes(text).decode("utf-8")
            except UnicodeDecodeError as e:
                raise ConfigError(f"tokenize: text is not valid UTF-8 ({e.reason} at byte {e.start})") from None
        add_bos = request_fields.Flag("add_bos").check(add_bos)
        return super().tokenize(text, special=special, add_bos=None if add_bos else False)

    def detokenize(self, tokens: Sequence[int], prev_tokens: Sequence[int] | None = None,
                   special: bool = False) -> bytes:
        """The bytes of token ids (llama-cpp-python's return type; `.decode()` for text). `special`:
        control tokens' text included. `prev_tokens` (the tokens before, for context) are checked
        and change nothing: a token's bytes here do not depend on the tokens before it."""
        ids = self._check_ids(tokens, "tokens", allow_empty=True)
        if prev_tokens is not None:
            self._check_ids(prev_tokens, "prev_tokens", allow_empty=True)
        special = request_fields.Flag("special").check(special)
        tok = self.tokenizer
        return b"".join(tok.token_bytes(i) for i in ids if special or not tok.is_special(i))
