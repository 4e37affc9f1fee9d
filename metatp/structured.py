"""Structured output: a request's constraint (JSON, a JSON schema, a regex, a choice, a grammar)
turned into a per-step mask of the tokens that keep the output inside it.

The matching is llguidance's (the constrained-decoding library llama.cpp and vLLM use; the
`structured` extra): `grammar_of` checks a SamplingParams' constraint once and gives the
llguidance grammar text (a bad one is a ConfigError naming the field); `make_guide` builds the
request's `Guide` on the model's tokenizer, whose `allowed()` is this step's mask and whose
`consume(token)` advances it after sampling. The llguidance view of the vocabulary is built once
per tokenizer (about 0.4 s for a 49k vocabulary) and cached.

The masks of a step's constrained requests are computed while its forward pass runs
(`MaskPrefetch`, started and waited for by the model runner, `metatp.runner`).
"""

from __future__ import annotations

import concurrent.futures
import json
import threading
import weakref
from typing import Any

import numpy as np

from metatp.ir.errors import ConfigError, MetatpError

__all__ = ["CONSTRAINT_FIELDS", "grammar_of", "make_guide", "Guide", "lltokenizer", "available", "MaskPrefetch"]

# the SamplingParams fields that constrain the output; at most one may be set
CONSTRAINT_FIELDS = ("json_object", "json_schema", "guided_regex", "guided_choice", "guided_grammar")
_JSON_OPTIONS = {"whitespace_flexible": False}     # compact JSON (", " and ": "): no runs of blanks
_cache: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()
_cache_lock = threading.Lock()


def _llg(field: str = "structured output"):
    try:
        import llguidance
    except ImportError:
        raise ConfigError(f"{field}: structured output (json_object, json_schema, guided_*) needs the llguidance "
                          "package: pip install 'metatp[structured]'") from None
    return llguidance


def available() -> bool:
    """Is llguidance installed?"""
    try:
        import llguidance  # noqa: F401
    except ImportError:
        return False
    return True


def _set(params: Any) -> list[str]:
    return [f for f in CONSTRAINT_FIELDS if getattr(params, f) not in (None, False)]


def _source(params: Any, name: str) -> tuple[str, str]:
    """(llguidance grammar text, nothing checked yet) for the one constraint field `name`."""
    llg = _llg(name)
    v = getattr(params, name)
    if name == "json_object":
        if v is not True:
            raise ConfigError(f"json_object must be True or False, got {v!r}")
        return llg.LLMatcher.grammar_from_json_schema({"type": "object"}, _JSON_OPTIONS), "a JSON object"
    if name == "json_schema":
        if isinstance(v, str):
            try:
                v = json.loads(v)
            except ValueError as e:
                raise ConfigError(f"json_schema: not valid JSON: {e}") from None
        if not isinstance(v, (dict, bool)):
            raise ConfigError(f"json_schema must be a JSON schema (an object), got {type(v).__name__}")
        try:
            return llg.LLMatcher.grammar_from_json_schema(v, _JSON_OPTIONS), "the schema"
        except (ValueError, TypeError) as e:
            raise ConfigError(f"json_schema: {e}") from None
    if name == "guided_regex":
        if not isinstance(v, str):
            raise ConfigError(f"guided_regex must be a string (a regular expression), got {type(v).__name__}")
        return llg.LLMatcher.grammar_from_regex(v), "the regex"
    if name == "guided_choice":
        if not isinstance(v, (list, tuple)) or not v or not all(isinstance(s, str) and s for s in v):
            raise ConfigError(f"guided_choice must be a non-empty list of non-empty strings, got {v!r}"[:200])
        lark = "start: " + " | ".join(json.dumps(s) for s in v)     # each choice a quoted literal
        return llg.LLMatcher.grammar_from_lark(lark), "the choice"
    if not isinstance(v, str) or not v.strip():
        raise ConfigError(f"guided_grammar must be a non-empty string (a Lark or GBNF grammar), got {v!r}"[:200])
    try:
        return llg.grammar_from("grammar", v), "the grammar"     # Lark, or GBNF converted to Lark
    except ValueError as e:
        raise ConfigError(f"guided_grammar: {e}") from None


def grammar_of(params: Any) -> str | None:
    """The checked llguidance grammar of a SamplingParams' constraint, None when it has none.
    More than one constraint, or one llguidance refuses, is a ConfigError naming the field."""
    names = _set(params)
    if not names:
        return None
    if len(names) > 1:
        raise ConfigError(f"{names[0]}: set at most one of {', '.join(CONSTRAINT_FIELDS)}; got {', '.join(names)}")
    name = names[0]
    grammar, what = _source(params, name)
    err = _llg().LLMatcher.validate_grammar(grammar, None)
    if err:
        raise ConfigError(f"{name}: {what} is invalid: {err.strip()}"[:1000])
    return grammar


class _Vocab:
    """Our tokenizer as llguidance's TokenizerWrapper expects it: every token's bytes (control
    tokens marked with a leading 0xff, llguidance's convention for special tokens), EOS and BOS,
    and a text -> ids function."""

    is_tokenizer_wrapper = True

    def __init__(self, tok: Any) -> None:
        n = tok.n_vocab
        self.eos_token_id = tok.eos_id if tok.eos_id is not None else min(tok.eog_ids, default=0)
        self.bos_token_id = tok.bos_id
        self.special_token_ids = [i for i in range(n) if tok.is_special(i)]
        special = set(self.special_token_ids)
        self.tokens = [(b"\xff" if i in special else b"") + tok.token_bytes(i) for i in range(n)]
        self._tok = weakref.ref(tok)      # weak: the cache entry must not keep its own key alive

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        tok = self._tok()
        return [] if tok is None else tok.encode(text, add_bos=False, special=False)


def lltokenizer(tok: Any) -> Any:
    """llguidance's LLTokenizer for our Tokenizer `tok`, built once and cached (it is expensive)."""
    with _cache_lock:
        lt = _cache.get(tok)
        if lt is None:
            llg = _llg()
            lt = llg.LLTokenizer(_Vocab(tok), n_vocab=tok.n_vocab, eos_token=sorted(tok.eog_ids) or None)
            _cache[tok] = lt
        return lt


class Guide:
    """One request's matcher: `allowed()` is the mask of the tokens allowed next (a bool array
    of n_vocab), `consume(tok)` takes the sampled token and says whether the output is complete
    (the grammar accepts nothing more but the end of the text)."""

    def __init__(self, grammar: str, tok: Any) -> None:
        llg = _llg()
        self.n_vocab = tok.n_vocab
        self.matcher = llg.LLMatcher(lltokenizer(tok), grammar, log_level=0)
        if self.matcher.is_error():
            raise ConfigError(f"the output constraint is invalid: {self.matcher.get_error()}"[:1000])
        self._words = np.zeros((self.n_vocab + 31) // 32, dtype=np.int32)
        self._mask: np.ndarray | None = None      # this step's, once computed (`prefetch`)

    def prefetch(self) -> None:
        """Compute this step's mask now (a worker thread, while the forward pass runs)."""
        if self._mask is None:
            w = self._words
            self.matcher.unsafe_compute_mask_ptr(w.ctypes.data, w.nbytes)
            self._mask = np.unpackbits(w.view(np.uint8), bitorder="little", count=self.n_vocab).view(np.bool_)

    def allowed(self) -> np.ndarray:
        """This step's mask: True where the token may come next."""
        self.prefetch()
        return self._mask

    def consume(self, tok: int) -> bool:
        """Advance past the sampled token; True when the output is complete."""
        self._mask = None
        if not self.matcher.consume_token(int(tok)):
            why = self.matcher.get_error().strip().splitlines()
            raise MetatpError(f"structured output: token {tok} does not fit the constraint"
                              + (f" ({why[-1][:200]})" if why else ""))
        return self.matcher.is_stopped()


def make_guide(params: Any, tok: Any) -> Guide | None:
    """The request's Guide, or None when its SamplingParams set no constraint (no work at all)."""
    grammar = getattr(params, "constraint", None)
    return None if grammar is None else Guide(grammar, tok)


class MaskPrefetch:
    """The masks of a step's constrained requests, computed in one worker thread while the step's
    forward pass runs (the kernels and llguidance both release the GIL), so that sampling finds
    them ready: `start(guides)` before the pass, `wait()` after it."""

    def __init__(self) -> None:
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: concurrent.futures.Future | None = None

    def start(self, guides: list[Guide]) -> None:
        if not guides:
            return
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="metatp-masks")
        self._pending = self._pool.submit(lambda: [g.prefetch() for g in guides])

    def wait(self) -> None:
        """Until the masks are computed; an error computing one shows again when it is sampled."""
        if self._pending is not None:
            concurrent.futures.wait([self._pending])
            self._pending = None
