"""vLLM's `LLM` idioms beyond generate: the Hugging Face-shaped tokenizer `LLM.get_tokenizer()`
returns, and the progress bar of `generate(..., use_tqdm=...)` (drawn only when tqdm is
installed: metatp does not depend on it)."""

from __future__ import annotations

import importlib.util
import numbers
from typing import TYPE_CHECKING, Any, Sequence

from metatp.ir.errors import ConfigError
from metatp.openai_messages import chat_messages
from metatp.request_fields import short, type_name

if TYPE_CHECKING:
    from metatp.ir.tokenizer import Tokenizer

__all__ = ["TokenizerView", "progress_bar"]


class TokenizerView:
    """The GGUF tokenizer behind the methods and attributes of a Hugging Face tokenizer that vLLM
    scripts use: encode / decode / batch_decode / __call__ / apply_chat_template /
    convert_ids_to_tokens, eos_token_id, bos_token_id, pad_token_id, eos_token, bos_token,
    vocab_size, len(). Special tokens written in text are parsed, as HF parses added tokens."""

    def __init__(self, tokenizer: "Tokenizer") -> None:
        self._tok = tokenizer

    @property
    def vocab_size(self) -> int:
        return self._tok.n_vocab

    def __len__(self) -> int:
        return self._tok.n_vocab

    @property
    def eos_token_id(self) -> int | None:
        return self._tok.eos_id

    @property
    def bos_token_id(self) -> int | None:
        return self._tok.bos_id

    @property
    def pad_token_id(self) -> int | None:
        return self._tok.pad_id

    @property
    def eos_token(self) -> str | None:
        return None if self._tok.eos_id is None else self._tok.tokens[self._tok.eos_id]

    @property
    def bos_token(self) -> str | None:
        return None if self._tok.bos_id is None else self._tok.tokens[self._tok.bos_id]

    @property
    def chat_template(self) -> str | None:
        return self._tok.chat_template

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; add_special_tokens: the model's BOS where it adds one."""
        return self._tok.encode(text, add_bos=None if add_special_tokens else False, special=True)

    def __call__(self, text: str | Sequence[str], add_special_tokens: bool = True) -> dict[str, list]:
        """{"input_ids": ..., "attention_mask": ...} for a text or a list of texts, as HF's call."""
        if isinstance(text, str):
            ids = self.encode(text, add_special_tokens)
            return {"input_ids": ids, "attention_mask": [1] * len(ids)}
        many = [self.encode(t, add_special_tokens) for t in text]
        return {"input_ids": many, "attention_mask": [[1] * len(ids) for ids in many]}

    def decode(self, ids: int | Sequence[int], skip_special_tokens: bool = False) -> str:
        """The text of token ids (one id alone too, as HF allows)."""
        if isinstance(ids, numbers.Integral) and not isinstance(ids, bool):
            ids = [int(ids)]
        return self._tok.decode(ids, skip_special=skip_special_tokens)

    def batch_decode(self, sequences: Sequence[Sequence[int]], skip_special_tokens: bool = False) -> list[str]:
        return [self.decode(ids, skip_special_tokens) for ids in sequences]

    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> str | list[str]:
        """The vocabulary's token strings (as stored in the GGUF, e.g. 'Ġthe' for byte-level BPE)."""
        if isinstance(ids, numbers.Integral) and not isinstance(ids, bool):
            return self._token(ids)
        return [self._token(i) for i in ids]

    def _token(self, token_id: Any) -> str:
        if isinstance(token_id, bool) or not isinstance(token_id, numbers.Integral) \
                or not 0 <= token_id < self._tok.n_vocab:
            raise ConfigError(f"token id {short(token_id)} is outside the vocabulary (0..{self._tok.n_vocab - 1})")
        return self._tok.tokens[int(token_id)]

    def apply_chat_template(self, conversation: list[dict], tokenize: bool = True, add_generation_prompt: bool = False,
                            chat_template: str | None = None, **kwargs: Any) -> str | list[int]:
        """The chat rendered with the model's template (or `chat_template`): token ids, as HF
        returns by default, or the text with tokenize=False. The ids are what `LLM.chat` feeds the model."""
        from metatp.chat_formats import with_chat_template

        tok = self._tok if chat_template is None else with_chat_template(self._tok, chat_template)
        text = tok.apply_chat_template(chat_messages(conversation), add_generation_prompt=add_generation_prompt,
                                       **kwargs)
        return tok.encode(text, add_bos=None, special=True) if tokenize else text


def progress_bar(use_tqdm: Any, total: int) -> Any | None:
    """vLLM's use_tqdm: False (none), True (a tqdm bar when tqdm is installed, else none), or a
    callable made like tqdm (`use_tqdm(total=..., desc=...)`). The bar has update(n) and close()."""
    if isinstance(use_tqdm, bool):
        if not use_tqdm or importlib.util.find_spec("tqdm") is None:
            return None
        from tqdm.auto import tqdm

        return tqdm(total=total, desc="Processed prompts")
    if callable(use_tqdm):
        return use_tqdm(total=total, desc="Processed prompts")
    raise ConfigError(f"use_tqdm must be True, False or a tqdm-like callable, got {type_name(use_tqdm)} "
                      f"{short(use_tqdm)}")

