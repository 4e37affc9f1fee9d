"""Structured output: a request's constraint (JSON, a JSON schema, a regex, a choice, a grammar)
turned into a per-step mask of the tokens that keep the output inside it.

The matching is llguidance's (the constrained-decoding library llama.cpp and vLLM use; the
`structured` extra). A constraint comes from the client, so it is never compiled here first:
`grammar_of` checks a SamplingParams' constraint for type and size where the request enters
(`metatp.request_fields.constraint_text`), then has it compiled in a worker process under a time
budget (`metatp.constraint_check`: a crash or a hang costs that process, not this one); a bad
one is a FieldError naming the field. `check_constraint` is the same as a Future, for an event
loop. `make_guide` builds the request's `Guide` on the model's tokenizer from a cached pristine
matcher (a copy: a repeated constraint compiles once), whose `allowed()` is this step's mask and
whose `consume(token)` advances it after sampling. The llguidance view of the vocabulary is built
once per tokenizer (about 0.4 s for a 49k vocabulary) and cached.

The masks of a step's constrained requests are computed while its forward pass runs
(`MaskPrefetch`, started and waited for by the model runner, `metatp.runner`).
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
import weakref
from typing import Any

import numpy as np

from metatp.constraint_worker import library_message
from metatp.ir.errors import ConfigError, MetatpError
from metatp.request_fields import CONSTRAINT_FIELDS, FieldError, constraint_text

__all__ = ["CONSTRAINT_FIELDS", "grammar_of", "check_constraint", "constraint_of", "make_guide", "Guide",
           "lltokenizer", "available", "MaskPrefetch", "matcher_for", "prepare"]

MATCHERS_PER_TOKENIZER = 64      # pristine matchers kept per vocabulary (a big grammar's can take MBs)
_cache: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()
_cache_lock = threading.Lock()
_matchers: "weakref.WeakKeyDictionary[Any, collections.OrderedDict[str, Any]]" = weakref.WeakKeyDictionary()
_matchers_lock = threading.Lock()


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


def constraint_of(params: Any) -> tuple[str, str] | None:
    """(field, text for the compiler) of a SamplingParams-like object's one constraint, checked
    for type and size; None when it sets none. Two set is a FieldError naming the first."""
    names = _set(params)
    if not names:
        return None
    if len(names) > 1:
        raise FieldError(names[0], f"{names[0]}: set at most one of {', '.join(CONSTRAINT_FIELDS)}; got "
                                   f"{', '.join(names)}")
    name = names[0]
    text = constraint_text(name, getattr(params, name))
    _llg(name)
    return name, text


def check_constraint(field: str, text: str, tok: Any = None) -> concurrent.futures.Future:
    """A Future of the checked grammar of constraint `field` = `text` (`constraint_of`), or of
    the FieldError naming the field. With a tokenizer, the matcher is also built (off the
    caller's thread), so the request's `make_guide` only copies it."""
    from metatp.constraint_check import default_checker

    then = None if tok is None else (lambda grammar: matcher_for(grammar, tok))
    return default_checker().submit(field, text, then)


def prepare(tok: Any) -> None:
    """Build llguidance's view of the vocabulary now (about 0.4 s, some 0.2 s of it holding the
    GIL, which would stall a server's event loop on its first constrained request): for a server,
    before it takes requests. A no-op without llguidance."""
    if available():
        lltokenizer(tok)


def grammar_of(params: Any) -> str | None:
    """The checked llguidance grammar of a SamplingParams' constraint, None when it has none.
    More than one constraint, one over the size budget, or one the compiler refuses, crashes on
    or takes too long over, is a FieldError naming the field (the caller's process is safe)."""
    c = constraint_of(params)
    return None if c is None else check_constraint(*c).result()


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


def matcher_for(grammar: str, tok: Any) -> Any:
    """A pristine llguidance matcher of `grammar` on tokenizer `tok`, built once and kept (the
    last MATCHERS_PER_TOKENIZER per tokenizer); callers consume copies (`deep_copy`), never it."""
    with _matchers_lock:
        kept = _matchers.get(tok)
        if kept is not None and grammar in kept:
            kept.move_to_end(grammar)
            return kept[grammar]
    m = _llg().LLMatcher(lltokenizer(tok), grammar, log_level=0)
    if m.is_error():
        raise ConfigError(f"the output constraint is invalid: {library_message(m.get_error())}")
    with _matchers_lock:
        kept = _matchers.setdefault(tok, collections.OrderedDict())
        kept[grammar] = m
        while len(kept) > MATCHERS_PER_TOKENIZER:
            kept.popitem(last=False)
    return m


class Guide:
    """One request's matcher: `allowed()` is the mask of the tokens allowed next (a bool array
    of n_vocab), `consume(tok)` takes the sampled token and says whether the output is complete
    (the grammar accepts nothing more but the end of the text)."""

    def __init__(self, grammar: str, tok: Any) -> None:
        self.n_vocab = tok.n_vocab
        self.matcher = matcher_for(grammar, tok).deep_copy()
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
            raise MetatpError(f"structured output: token {tok} does not fit the constraint "
                              f"({library_message(self.matcher.get_error(), 200)})")
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
