"""Tokenizer built from GGUF metadata, with the same results as llama.cpp.

The heavy lifting (BPE merges, regex pre-splitting, byte-level mapping) is done by the
HuggingFace `tokenizers` library; this module only configures it the way llama.cpp reads
the same metadata (`src/llama-vocab.cpp`), and does itself the parts llama.cpp does
outside the BPE model, so that ids match llama.cpp's exactly:

- special tokens are cut out of the text first, longest text first, like llama.cpp's
  `tokenizer_st_partition`: control and unknown tokens only when `special=True`,
  user-defined tokens always;
- `tokenizer.ggml.model == "gpt2"`: byte-level BPE with the model's merges, pre-split by
  the regexes llama.cpp uses for `tokenizer.ggml.pre`;
- `tokenizer.ggml.model == "llama"` (SentencePiece BPE): llama.cpp merges adjacent
  symbols into the vocabulary token with the highest score. That is a BPE whose merges
  are every split of every token, ranked by the token's score, with byte fallback to
  `<0xNN>` tokens. A space is prepended to each text fragment that starts the text or
  follows a special token (when `add_space_prefix`), and spaces become U+2581.

Decoding goes through `token_bytes` (llama.cpp's `token_to_piece`), not through HF
decoders, so that a stream of tokens and a whole sequence give the same bytes.
"""

from __future__ import annotations

import codecs
import warnings
from collections.abc import Mapping, Sequence
from functools import cached_property
from typing import Any

from metatp.ir.chat_template import compile_template, render_template
from metatp.ir.errors import ConfigError, ModelFormatError
from metatp.ir.tokenizer_tables import (
    BYTE, BYTE_TO_CHAR, CHAR_TO_BYTE, CONTROL, EOG_TEXTS, EOM_TEXTS, EOT_TEXTS, FIM_MID_TEXTS,
    FIM_PAD_TEXTS, FIM_PRE_TEXTS, FIM_REP_TEXTS, FIM_SEP_TEXTS, FIM_SUF_TEXTS, GPT2, NORMAL,
    PRE_TOKENIZERS, PreTokenizer, SPM_SPACE, TYPE_TO_ATTR, UNKNOWN, UNUSED, USER_DEFINED,
    gpt2_byte_table)

__all__ = ["Tokenizer", "StreamDecoder"]



# ---------------------------------------------------------------- metadata helpers
def _str_list(md: Mapping[str, Any], key: str, required: bool) -> list[str] | None:
    v = md.get(key)
    if v is None:
        if required:
            raise ModelFormatError(f"tokenizer metadata: missing {key!r}")
        return None
    if not isinstance(v, (list, tuple)) or not all(isinstance(x, str) for x in v):
        raise ModelFormatError(f"tokenizer metadata: {key!r} must be a list of strings")
    return list(v)


def _num_list(md: Mapping[str, Any], key: str, n: int, kind: type) -> list | None:
    v = md.get(key)
    if v is None:
        return None
    if not isinstance(v, (list, tuple)) or len(v) < n:
        raise ModelFormatError(f"tokenizer metadata: {key!r} must be a list of at least {n} numbers")
    try:
        return [kind(x) for x in v[:n]]
    except (TypeError, ValueError):
        raise ModelFormatError(f"tokenizer metadata: {key!r} holds a non-number") from None


def _flag(md: Mapping[str, Any], key: str, default: bool) -> bool:
    v = md.get(key)
    if v is None:
        return default
    if not isinstance(v, (bool, int)):
        raise ModelFormatError(f"tokenizer metadata: {key!r} must be a boolean, got {v!r}")
    return bool(v)


def _token_id(md: Mapping[str, Any], key: str, default: int | None, n_vocab: int) -> int | None:
    """A special-token id from the metadata; out-of-range ids fall back like llama.cpp (with a warning)."""
    if default is not None and not 0 <= default < n_vocab:
        default = None
    v = md.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise ModelFormatError(f"tokenizer metadata: {key!r} must be an integer, got {v!r}")
    if not 0 <= v < n_vocab:
        warnings.warn(f"tokenizer metadata: {key} = {v} is outside the vocabulary (size {n_vocab}); ignored",
                      stacklevel=3)
        return default
    return v


def _hf():
    """Import `tokenizers` lazily: everything but building a tokenizer works without it."""
    try:
        import tokenizers
    except ImportError as e:  # pragma: no cover - it is a declared dependency
        raise ConfigError("the 'tokenizers' package is required to tokenize text (pip install tokenizers)") from e
    return tokenizers


# ---------------------------------------------------------------- the tokenizer
class Tokenizer:
    """Text <-> token ids for one GGUF model, matching llama.cpp's tokenization.

    Build it with `Tokenizer.from_metadata(md)`, where `md` maps GGUF keys to plain values.
    """

    n_vocab: int
    bos_id: int | None
    eos_id: int | None
    eot_id: int | None
    unk_id: int | None
    pad_id: int | None
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    eog_ids: frozenset[int]
    chat_template: str | None

    def __init__(self, md: Mapping[str, Any]) -> None:
        """Prefer `from_metadata`; this reads and checks the metadata and builds the HF model."""
        model = md.get("tokenizer.ggml.model")
        if model is None:
            raise ModelFormatError("tokenizer metadata: missing 'tokenizer.ggml.model'")
        if model not in ("gpt2", "llama"):
            raise ModelFormatError(
                f"unsupported tokenizer model {model!r} (tokenizer.ggml.model); "
                "metatp supports 'gpt2' (byte-level BPE) and 'llama' (SentencePiece BPE)")
        self.model: str = model

        tokens = _str_list(md, "tokenizer.ggml.tokens", required=True)
        assert tokens is not None
        n = len(tokens)
        if n == 0:
            raise ModelFormatError("tokenizer metadata: 'tokenizer.ggml.tokens' is empty")
        # llama.cpp renames empty tokens so that they can never match text
        self.tokens: list[str] = [t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens)]
        self.n_vocab = n
        self._token_to_id: dict[str, int] = {}
        for i, t in enumerate(self.tokens):
            j = self._token_to_id.setdefault(t, i)
            if j != i:
                raise ModelFormatError(f"tokenizer metadata: duplicate token {t!r} at ids {j} and {i}")

        types = _num_list(md, "tokenizer.ggml.token_type", n, int) or [1] * n
        self.token_types: list[int] = types
        self.scores: list[float] = _num_list(md, "tokenizer.ggml.scores", n, float) or [0.0] * n
        self._attrs: list[int] = [TYPE_TO_ATTR.get(t, 0) for t in types]

        spm = model == "llama"
        if spm:
            self.pre = None
            self._pre = None
            add_bos_default = True
        else:
            pre = md.get("tokenizer.ggml.pre")
            if pre is None:
                warnings.warn("tokenizer metadata: no 'tokenizer.ggml.pre'; using llama.cpp's 'default' "
                              "pre-tokenizer (tokenization may be degraded)", stacklevel=3)
                pre = "default"
            if not isinstance(pre, str):
                raise ModelFormatError(f"tokenizer metadata: 'tokenizer.ggml.pre' must be a string, got {pre!r}")
            self.pre = pre
            if pre not in PRE_TOKENIZERS:
                warnings.warn(f"tokenizer: unknown pre-tokenizer {pre!r} (tokenizer.ggml.pre); falling back to "
                              "the GPT-2 regex, token ids may differ from llama.cpp's", stacklevel=3)
            self._pre = PRE_TOKENIZERS.get(pre, PreTokenizer([GPT2]))
            add_bos_default = self._pre.add_bos

        self.add_space_prefix = _flag(md, "tokenizer.ggml.add_space_prefix", spm)
        self.add_bos = _flag(md, "tokenizer.ggml.add_bos_token", add_bos_default)
        self.add_eos = _flag(md, "tokenizer.ggml.add_eos_token", False)

        self.bos_id = _token_id(md, "tokenizer.ggml.bos_token_id", 1 if spm else None, n)
        self.eos_id = _token_id(md, "tokenizer.ggml.eos_token_id", 2 if spm else None, n)
        self.unk_id = _token_id(md, "tokenizer.ggml.unknown_token_id", 0 if spm else None, n)
        self.pad_id = _token_id(md, "tokenizer.ggml.padding_token_id", None, n)
        self.eot_id = _token_id(md, "tokenizer.ggml.eot_token_id", None, n)
        eom_id = _token_id(md, "tokenizer.ggml.eom_token_id", None, n)
        self.eog_ids = self._find_eog(md, eom_id)

        tmpl = md.get("tokenizer.chat_template")
        if tmpl is not None and not isinstance(tmpl, str):
            raise ModelFormatError("tokenizer metadata: 'tokenizer.chat_template' must be a string")
        self.chat_template = tmpl or None

        # special tokens cut out of the text before BPE, longest first (llama.cpp sorts by byte length)
        special = [i for i, a in enumerate(self._attrs) if a & (CONTROL | USER_DEFINED | UNKNOWN)]
        special.sort(key=lambda i: (-len(self.tokens[i].encode("utf-8")), i))
        self._special_order: list[int] = special

        self._pieces: list[bytes | None] = [None] * n
        self._check_coverage(spm)
        self._hf_tok = self._build_spm() if spm else self._build_bpe(md)

    @classmethod
    def from_metadata(cls, md: Mapping[str, Any]) -> "Tokenizer":
        """Build the tokenizer from GGUF key/values (`{key: field.contents()}`)."""
        return cls(md)

    # ------------------------------------------------------------ construction
    def _find_eog(self, md: Mapping[str, Any], eom_id: int | None) -> frozenset[int]:
        """End-of-generation ids, found like llama.cpp: metadata ids plus well-known token texts.

        Tokens found this way are treated as control tokens even if the file says otherwise,
        as llama.cpp does.
        """
        n = self.n_vocab
        fim = {}
        for what, texts in (("pre", FIM_PRE_TEXTS), ("suf", FIM_SUF_TEXTS), ("mid", FIM_MID_TEXTS),
                            ("pad", FIM_PAD_TEXTS), ("rep", FIM_REP_TEXTS), ("sep", FIM_SEP_TEXTS)):
            fim[what] = _token_id(md, f"tokenizer.ggml.fim_{what}_token_id", None, n)
            if fim[what] is None:
                fim[what] = self._first_with_text(texts)
        if self.eot_id is None:
            self.eot_id = self._first_with_text(EOT_TEXTS)
        if eom_id is None:
            eom_id = self._first_with_text(EOM_TEXTS)
        for i in (self.eot_id, eom_id, *fim.values()):
            if i is not None:
                self._attrs[i] |= CONTROL

        eog = {fim[k] for k in ("pad", "rep", "sep") if fim[k] is not None}
        for t in EOG_TEXTS:
            i = self._token_to_id.get(t)
            if i is not None:
                eog.add(i)
                self._attrs[i] |= CONTROL
        eog.update(i for i in (self.eos_id, self.eot_id, eom_id) if i is not None)

        texts = {self.tokens[i]: i for i in eog}
        # gpt-oss / solar-open: "<|end|>" ends a message, not the generation
        if "<|end|>" in texts and (("<|return|>" in texts and "<|call|>" in texts)
                                   or ("<|calls|>" in texts and "<|flush|>" in texts)):
            eog.discard(texts["<|end|>"])
            self._attrs[texts["<|end|>"]] = USER_DEFINED
        if "<|tool_response>" in texts and "</s>" in texts:
            eog.discard(texts["</s>"])
            self._attrs[texts["</s>"]] = NORMAL

        # control tokens named "unused" are unused (they still render as text when asked)
        for i, a in enumerate(self._attrs):
            if a & CONTROL and "unused" in self.tokens[i]:
                self._attrs[i] |= UNUSED
        return frozenset(eog)

    def _check_coverage(self, spm: bool) -> None:
        """A vocabulary must be able to write text, or text outside it would silently tokenize
        to nothing. SentencePiece always can (unknown token, id 0 by default, like llama.cpp)."""
        if spm:
            return
        # Real vocabularies lack a few bytes (control characters, bytes UTF-8 never uses): those
        # are refused when met (encode); a vocabulary without printable ASCII is refused here.
        table = gpt2_byte_table()
        missing = [b for b in range(0x20, 0x7F) if table[b] not in self._token_to_id]
        if missing:
            raise ModelFormatError(f"tokenizer metadata: the byte-level BPE vocabulary lacks the symbols of "
                                   f"{len(missing)} printable ASCII bytes (e.g. {chr(missing[0])!r}); it cannot "
                                   "represent ordinary text")

    def _first_with_text(self, texts: tuple[str, ...]) -> int | None:
        return next((self._token_to_id[t] for t in texts if t in self._token_to_id), None)

    def _build_bpe(self, md: Mapping[str, Any]):
        """Byte-level BPE ('gpt2'): the model's vocab and merges, llama.cpp's pre-split regexes."""
        hf = _hf()
        merges_raw = _str_list(md, "tokenizer.ggml.merges", required=True)
        assert merges_raw is not None and self._pre is not None
        vocab = self._token_to_id
        merges: list[tuple[str, str]] = []
        dropped = 0
        for m in merges_raw:
            pos = m.find(" ", 1)  # llama.cpp splits at the first space after the first character
            a, b = (m[:pos], m[pos + 1:]) if pos > 0 else ("", "")
            if a in vocab and b in vocab and a + b in vocab:
                merges.append((a, b))
            else:
                dropped += 1
        if dropped:
            warnings.warn(f"tokenizer: {dropped} of {len(merges_raw)} merges refer to tokens missing from the "
                          "vocabulary; they are ignored", stacklevel=4)
        bpe = hf.models.BPE(vocab=dict(vocab), merges=merges, ignore_merges=self._pre.ignore_merges)
        tok = hf.Tokenizer(bpe)
        steps = [hf.pre_tokenizers.Split(hf.Regex(r), behavior="isolated") for r in self._pre.regexes]
        steps.append(hf.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
        tok.pre_tokenizer = hf.pre_tokenizers.Sequence(steps)
        return tok

    def _build_spm(self):
        """SentencePiece BPE ('llama') as a HF BPE whose merges reproduce llama.cpp's score order.

        llama.cpp repeatedly merges the adjacent pair whose concatenation is the vocabulary token
        with the highest score (leftmost on ties). Listing every split (a, b) of every token t,
        ordered by t's score, gives HF's BPE the same choices. Byte tokens are never merge parts
        or results; characters missing from the vocabulary fall back to <0xNN> tokens.
        """
        hf = _hf()
        vocab = self._token_to_id
        is_byte = [bool(a & BYTE) for a in self._attrs]
        ranked: list[tuple[float, int, int, str, str]] = []
        for i, t in enumerate(self.tokens):
            if is_byte[i] or len(t) < 2:
                continue
            for k in range(1, len(t)):
                a = vocab.get(t[:k])
                if a is None or is_byte[a]:
                    continue
                b = vocab.get(t[k:])
                if b is None or is_byte[b]:
                    continue
                ranked.append((-self.scores[i], i, k, t[:k], t[k:]))
        ranked.sort()
        unk = self.tokens[self.unk_id] if self.unk_id is not None else None
        bpe = hf.models.BPE(vocab=dict(vocab), merges=[(a, b) for *_, a, b in ranked],
                            byte_fallback=True, unk_token=unk, fuse_unk=False)
        return hf.Tokenizer(bpe)

    # ------------------------------------------------------------ encoding
    def encode(self, text: str, add_bos: bool | None = None, special: bool = True) -> list[int]:
        """Token ids of `text`.

        add_bos: None follows the model's `tokenizer.ggml.add_bos_token` (llama.cpp's default
        when absent: True for SentencePiece and llama3-style BPE, False for other BPE).
        special: parse control tokens written in the text (e.g. "<|im_start|>") as single
        tokens, like llama.cpp's parse_special; user-defined tokens are always parsed.
        The model's add_eos flag is not applied: an encoded prompt is meant to be continued.
        """
        if not isinstance(text, str):
            raise ConfigError(f"encode() needs a str, got {type(text).__name__}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ConfigError(f"text to encode is not valid Unicode ({e.reason} at position {e.start})") from None
        out: list[int] = []
        if self.add_bos if add_bos is None else add_bos:
            if self.bos_id is None:
                raise ConfigError("this model has no BOS token (tokenizer.ggml.bos_token_id), cannot add one")
            out.append(self.bos_id)
        prev_special = True
        for frag in self._partition(text, special):
            if isinstance(frag, int):
                out.append(frag)
                prev_special = True
            else:
                out.extend(self._encode_fragment(frag, prev_special))
                prev_special = False
        return out

    def _partition(self, text: str, special: bool) -> list[str | int]:
        """Split text into raw fragments and special-token ids (llama.cpp's tokenizer_st_partition)."""
        frags: list[str | int] = [text] if text else []
        for tid in self._special_order:
            if not special and self._attrs[tid] & (CONTROL | UNKNOWN):
                continue
            tok = self.tokens[tid]
            if tok not in text:
                continue
            out: list[str | int] = []
            for f in frags:
                if isinstance(f, int) or tok not in f:
                    out.append(f)
                    continue
                for k, part in enumerate(f.split(tok)):
                    if k:
                        out.append(tid)
                    if part:
                        out.append(part)
            frags = out
        return frags

    def _encode_fragment(self, frag: str, prev_special: bool) -> list[int]:
        if self.model == "llama":
            if self.add_space_prefix and prev_special:
                frag = " " + frag
            frag = frag.replace(" ", SPM_SPACE)
        # encode_batch, not encode: it lets other threads run while it works (encode holds the GIL
        # throughout: 1-2 s for a 1 MB text, which stalled the server's event loop as long)
        ids = self._hf_tok.encode_batch([frag], add_special_tokens=False)[0].ids
        if self.model == "gpt2":
            # the BPE model drops bytes missing from the vocabulary without a word: refuse instead
            if "".join(self.tokens[i] for i in ids) != "".join(BYTE_TO_CHAR[b] for b in frag.encode("utf-8")):
                raise ConfigError(f"this model's vocabulary cannot represent the text: "
                                  f"{self._first_unrepresentable(frag)!r} has no byte token")
        elif not ids and frag:
            raise ConfigError(f"this model's vocabulary cannot represent the text {frag[:40]!r}")
        return ids

    def _first_unrepresentable(self, frag: str) -> str:
        table = gpt2_byte_table()
        for ch in frag:
            if any(table[b] not in self._token_to_id for b in ch.encode("utf-8")):
                return ch
        return frag[:40]

    # ------------------------------------------------------------ decoding
    def _check_id(self, token_id: int) -> int:
        if isinstance(token_id, bool) or not 0 <= int(token_id) < self.n_vocab:
            raise ConfigError(f"token id {token_id!r} is outside the vocabulary (0..{self.n_vocab - 1})")
        return int(token_id)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token contributes to the text (llama.cpp's token_to_piece, special=True).

        Byte-level BPE maps characters back through the GPT-2 byte table; SentencePiece turns
        '▁' into a space and <0xNN> into that byte; control, unknown and user-defined tokens give
        their text; unused tokens give nothing. Partial UTF-8 is expected: join before decoding.
        """
        i = self._check_id(token_id)
        piece = self._pieces[i]
        if piece is None:
            piece = self._pieces[i] = self._make_piece(i)
        return piece

    def token_text(self, token_id: int) -> str:
        """One token's text alone, a part of a UTF-8 character replaced (how OpenAI's logprobs
        name a token: the server and `LLM.create_*` alike)."""
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    def _make_piece(self, i: int) -> bytes:
        attr, text = self._attrs[i], self.tokens[i]
        if attr & (CONTROL | UNKNOWN | USER_DEFINED):
            return text.encode("utf-8")
        if attr & NORMAL:
            if self.model == "gpt2":
                return b"".join(bytes([CHAR_TO_BYTE[c]]) if c in CHAR_TO_BYTE else c.encode("utf-8")
                                for c in text)
            return text.replace(SPM_SPACE, " ").encode("utf-8")
        if attr & BYTE:
            if len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
                try:
                    return bytes([int(text[3:5], 16)])
                except ValueError:
                    pass
            return text.encode("utf-8")
        return b""

    def is_special(self, token_id: int) -> bool:
        """True for control and unknown tokens: the ones `skip_special` leaves out of the text."""
        return bool(self._attrs[self._check_id(token_id)] & (CONTROL | UNKNOWN))

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        """Text of a token sequence: the tokens' bytes joined, invalid UTF-8 shown as U+FFFD.

        This is the concatenation of the tokens' pieces (what llama.cpp prints while generating),
        so decoding a continuation keeps its leading space.
        """
        parts = [self.token_bytes(i) for i in ids if not (skip_special and self.is_special(i))]
        return b"".join(parts).decode("utf-8", errors="replace")

    # ------------------------------------------------------------ chat
    @cached_property
    def _compiled_template(self):
        """The chat template compiled in a budgeted sandbox (the template is untrusted code)."""
        return compile_template(self.chat_template)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Render messages with the model's Jinja chat template (as HF transformers does).

        The template sees `messages`, `add_generation_prompt`, `bos_token`, `eos_token`,
        `raise_exception()` and any extra keyword arguments (e.g. `tools`).
        The result contains special-token text: encode it with `special=True`, no extra BOS
        if the template already writes one. The template runs in a budgeted sandbox
        (`ir.chat_template`): one that loops, recurses or grows without bound raises
        `ModelFormatError`; `raise_exception()` (the messages break its rules) raises `ConfigError`.
        """
        if self.chat_template is None:
            raise ConfigError("this model has no chat template (tokenizer.chat_template); "
                              "use plain-text prompts instead")
        bos = self.tokens[self.bos_id] if self.bos_id is not None else ""
        eos = self.tokens[self.eos_id] if self.eos_id is not None else ""
        return render_template(self._compiled_template, messages=messages,
                               add_generation_prompt=add_generation_prompt, bos_token=bos, eos_token=eos, **kwargs)


class StreamDecoder:
    """Turns a stream of token ids into text pieces without ever emitting half a UTF-8 character.

    Tokens can carry partial characters (byte tokens, byte-level BPE pieces); the bytes of an
    unfinished character are held back until it completes. Bytes that can never form a
    character come out as U+FFFD.
    """

    def __init__(self, tok: Tokenizer, skip_special: bool = False) -> None:
        self.tok = tok
        self.skip_special = skip_special
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token_id: int) -> str:
        """Add one token; return the text that became complete (may be "")."""
        if self.skip_special and self.tok.is_special(token_id):
            return ""
        return self._dec.decode(self.tok.token_bytes(token_id))

    @property
    def holds_partial(self) -> bool:
        """Bytes of an unfinished character are held (the last token's text is not whole yet)."""
        return bool(self._dec.getstate()[0])

    def flush(self) -> str:
        """Return what is left; an unfinished character at the end becomes U+FFFD."""
        out = self._dec.decode(b"", final=True)
        self._dec.reset()
        return out
