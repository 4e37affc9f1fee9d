"""Each request field checked once, for every door a request comes in by: `SamplingParams`, the
llama-cpp-python-style `LLM.create_*` keywords and the HTTP routes (`metatp.server.fields`).

A field's check (its type, its range) is written here once; a wrong value is a `FieldError`
naming the field. It is a `ConfigError` (a ValueError) for the Python API, and the server answers
it as a 400 whose `param` is the field. The two doors word their messages as users know them:
the Python API as Python (`temperature must be >= 0.0, got -1`), the server as OpenAI's JSON
(`'temperature' must be a number >= 0.0 and <= 2.0, got -1`), so a check takes `where` (API or
HTTP) and words its one verdict for that door. The server also holds a few fields to OpenAI's
tighter bounds (`served_hi`: temperature <= 2, n <= 16, ...), which the Python API does not.

Client JSON has one parse, `parse_json`, within `MAX_JSON_DEPTH` (a body, a schema sent as a
string); an output constraint's type and size budget is `constraint_text`, checked before it
reaches the constraint compiler (`metatp.constraint_check`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import re
from dataclasses import dataclass
from typing import Any, Literal, Sequence

import numpy as np

from metatp.ir.errors import ConfigError

__all__ = ["FieldError", "Where", "API", "HTTP", "Integer", "Number", "Flag", "is_integer", "short", "type_name",
           "check_seed", "stop", "token_ids", "logit_bias", "min_tokens", "chat_logprobs", "prompt_token_ids",
           "vocabulary_ids", "MAX_N", "MAX_STOP_STRINGS", "MAX_TOKENS", "TEMPERATURE", "TOP_P", "MIN_P",
           "REPETITION_PENALTY", "FREQUENCY_PENALTY", "PRESENCE_PENALTY", "TOP_K", "TOP_K_LLAMA", "SEED", "N",
           "LOGPROBS", "PROMPT_LOGPROBS", "TOP_LOGPROBS", "MIN_TOKENS", "IGNORE_EOS", "JSON_OBJECT", "STREAM",
           "ECHO", "CHAT_LOGPROBS", "Text", "CACHE_SALT", "MAX_CACHE_SALT", "MAX_JSON_DEPTH", "too_deep",
           "parse_json", "json_depth", "MAX_CONSTRAINT_BYTES", "MAX_CHOICES", "MAX_GRAMMAR_RULES",
           "CONSTRAINT_FIELDS", "constraint_text"]

Where = Literal["api", "http"]
API: Where = "api"        # the Python API: SamplingParams, LLM.create_*
HTTP: Where = "http"      # the OpenAI routes: JSON values, OpenAI's bounds

MAX_N = 1024              # samples per prompt: each is a request held from the call on (the server allows 16)
MAX_STOP_STRINGS = 16     # OpenAI allows 4; the server 16, the Python API any number
MAX_CACHE_SALT = 1024     # characters of vLLM's cache_salt (vLLM suggests 43: 256 random bits in base64)


class FieldError(ConfigError):
    """A request field with a wrong type or value; `field` names it (the server's 400 `param`)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field

    def __reduce__(self):       # pickled whole: under MPI an error reaches the other ranks as itself
        return type(self), (self.field, str(self)), self.__dict__


# ---------------------------------------------------------------- how values are told
def is_integer(v: Any) -> bool:
    """An integer, numpy's too, but not a bool (True is no token id and no count)."""
    return isinstance(v, numbers.Integral) and not isinstance(v, (bool, np.bool_))


def _is_finite_real(v: Any) -> bool:
    return (not isinstance(v, (bool, np.bool_)) and isinstance(v, numbers.Real)
            and (isinstance(v, numbers.Integral) or math.isfinite(v)))


def type_name(v: Any) -> str:
    return type(v).__name__


def short(v: Any, n: int = 60) -> str:
    """repr(v), cut to n characters: a message quotes a value, never a whole payload."""
    r = repr(v)
    return r if len(r) <= n else r[:n - 3] + "..."


def _json(v: Any, n: int | None = None) -> str:
    """v as the client sent it (JSON), cut to n characters where given."""
    text = json.dumps(v)
    return text if n is None else text[:n]


# ---------------------------------------------------------------- one field, one check
@dataclass(frozen=True)
class Integer:
    """An integer field from `lo` (None: unbounded) to `hi` (the server: `served_hi` where set).
    `says`: the Python API's words for what is allowed; `optional`: None is allowed there (the
    server reads null as the field's default before any check)."""

    name: str
    lo: int | None
    hi: int | None = None
    served_hi: int | None = None
    says: str = ""
    optional: bool = False
    says_type: bool = False          # the Python message also names the value's type

    def named(self, name: str) -> "Integer":
        """The same check under another name (max_completion_tokens is max_tokens)."""
        return dataclasses.replace(self, name=name)

    def check(self, v: Any, where: Where = API) -> int | None:
        if v is None and self.optional and where == API:
            return None
        hi = self.served_hi if where == HTTP and self.served_hi is not None else self.hi
        if not is_integer(v) or (self.lo is not None and v < self.lo) or (hi is not None and v > hi):
            raise FieldError(self.name, self._message(v, hi, where))
        return int(v)

    def _message(self, v: Any, hi: int | None, where: Where) -> str:
        if where == HTTP:
            rng = (f" from {self.lo}" if self.lo is not None else "") + (f" to {hi}" if hi is not None else "")
            return f"'{self.name}' must be an integer{rng}, got {_json(v)}"
        return f"{self.name} must be {self.says}, got {v!r}" + (f" ({type_name(v)})" if self.says_type else "")


@dataclass(frozen=True)
class Number:
    """A finite real field in [lo, hi] (lo excluded when `lo_open`; the server: up to `served_hi`
    where set), returned as a Python float (numpy scalars welcome)."""

    name: str
    lo: float
    hi: float = math.inf
    lo_open: bool = False
    served_hi: float | None = None

    def check(self, v: Any, where: Where = API) -> float:
        hi = self.served_hi if where == HTTP and self.served_hi is not None else self.hi
        finite = _is_finite_real(v)
        if not finite or v < self.lo or (self.lo_open and v == self.lo) or v > hi:
            raise FieldError(self.name, self._message(v, hi, finite, where))
        try:
            return float(v) + 0.0      # + 0.0: -0.0 is 0.0
        except OverflowError:          # an integer beyond float64
            raise FieldError(self.name, f"{self.name} must be a finite number, got an integer too large for a "
                                        "float") from None

    def _message(self, v: Any, hi: float, finite: bool, where: Where) -> str:
        bound = f"> {self.lo}" if self.lo_open else f">= {self.lo}"
        if where == HTTP:
            return f"'{self.name}' must be a number {bound} and <= {hi}, got {_json(v)}"
        if not finite:
            return f"{self.name} must be a finite number, got {v!r} ({type_name(v)})"
        return f"{self.name} must be {bound}" + (f" and <= {hi}" if hi != math.inf else "") + f", got {v!r}"


@dataclass(frozen=True)
class Flag:
    """A true-or-false field (numpy's bool too), returned as a Python bool."""

    name: str
    says_type: bool = True           # the Python message also names the value's type

    def check(self, v: Any, where: Where = API) -> bool:
        if isinstance(v, (bool, np.bool_)):
            return bool(v)
        if where == HTTP:
            raise FieldError(self.name, f"'{self.name}' must be true or false, got {_json(v)}")
        raise FieldError(self.name, f"{self.name} must be True or False, got {v!r}"
                                    + (f" ({type_name(v)})" if self.says_type else ""))


@dataclass(frozen=True)
class Text:
    """A non-empty string field of at most `max_len` characters. A message never quotes the
    value (a cache_salt is the client's secret), only its type or length."""

    name: str
    max_len: int

    def check(self, v: Any, where: Where = API) -> str | None:
        if v is None and where == API:
            return None
        if isinstance(v, str) and 0 < len(v) <= self.max_len:
            return v
        quoted = f"'{self.name}'" if where == HTTP else self.name
        got = f"a string of {len(v)} characters" if isinstance(v, str) else (
            _json_type(v) if where == HTTP else type_name(v))
        raise FieldError(self.name, f"{quoted} must be a non-empty string of at most {self.max_len} characters, "
                                    f"got {got}")


def _json_type(v: Any) -> str:
    """v's JSON type, as a client knows it."""
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, (int, float)):
        return "a number"
    return {dict: "an object", list: "an array"}.get(type(v), type_name(v))


# ---------------------------------------------------------------- the fields
MAX_TOKENS = Integer("max_tokens", 0, says="an integer >= 0 or None", optional=True)
TEMPERATURE = Number("temperature", 0.0, served_hi=2.0)
TOP_P = Number("top_p", 0.0, 1.0, lo_open=True)
MIN_P = Number("min_p", 0.0, 1.0)
REPETITION_PENALTY = Number("repetition_penalty", 0.0, lo_open=True, served_hi=10.0)
FREQUENCY_PENALTY = Number("frequency_penalty", -2.0, 2.0)
PRESENCE_PENALTY = Number("presence_penalty", -2.0, 2.0)
TOP_K = Integer("top_k", -1, says="-1/0 (disabled) or a positive integer")
TOP_K_LLAMA = Integer("top_k", None, says="an integer (<= 0 disables it)")        # llama-cpp-python's keyword
SEED = Integer("seed", 0, served_hi=2 ** 63 - 1, says="an integer >= 0 or None (a random seed)", optional=True,
               says_type=True)       # numpy's generators refuse negative seeds
N = Integer("n", 1, MAX_N, served_hi=16, says=f"an integer from 1 to {MAX_N} (samples per prompt)")
LOGPROBS = Integer("logprobs", 0, 20, says="None or an integer from 0 to 20", optional=True)
PROMPT_LOGPROBS = Integer("prompt_logprobs", 0, 20, says="None or an integer from 0 to 20", optional=True)
TOP_LOGPROBS = Integer("top_logprobs", 0, 20, says="None or an integer from 0 to 20", optional=True)
MIN_TOKENS = Integer("min_tokens", 0, says="an integer >= 0")
IGNORE_EOS = Flag("ignore_eos", says_type=False)
JSON_OBJECT = Flag("json_object", says_type=False)
STREAM = Flag("stream")
ECHO = Flag("echo")
CHAT_LOGPROBS = Flag("logprobs")      # chat's logprobs: yes or no (the count is top_logprobs)
PARALLEL_TOOL_CALLS = Flag("parallel_tool_calls")     # may one answer hold several tool calls (metatp.tool_calls)
CACHE_SALT = Text("cache_salt", MAX_CACHE_SALT)   # vLLM's: prefix-cache hits only among requests with this salt


def check_seed(name: str, seed: Any) -> int | None:
    """A random seed: None (random) or an integer >= 0 (SamplingParams' seed, LLM's seed)."""
    return SEED.named(name).check(seed)


def stop(v: Any, where: Where = API) -> list[str] | None:
    """Stop strings: a string or a list of them (the server: at most MAX_STOP_STRINGS); empty
    strings stop nothing and are dropped."""
    if v is None:
        return None
    if isinstance(v, str):
        v = [v]
    kinds = list if where == HTTP else (list, tuple)
    if not isinstance(v, kinds) or not all(isinstance(s, str) for s in v) \
            or (where == HTTP and len(v) > MAX_STOP_STRINGS):
        if where == HTTP:
            raise FieldError("stop", f"'stop' must be a string or a list of at most {MAX_STOP_STRINGS} strings, got "
                                     f"{_json(v, 80)}")
        raise FieldError("stop", f"stop must be a string or a list of strings, got {v!r}")
    return [s for s in v if s]


def token_ids(name: str, v: Any, where: Where = API) -> list[int]:
    """A list of token ids (integers >= 0) a request names, such as stop_token_ids."""
    kinds = list if where == HTTP else (list, tuple)
    if not isinstance(v, kinds) or not all(is_integer(i) and i >= 0 for i in v):
        if where == HTTP:
            raise FieldError(name, f"'{name}' must be a list of token ids (integers >= 0), got {_json(v, 80)}")
        raise FieldError(name, f"{name} must be a list of token ids (integers >= 0), got {v!r}")
    return [int(i) for i in v]


def _bias(b: Any) -> bool:
    return _is_finite_real(b) and -100 <= b <= 100


def logit_bias(v: Any, where: Where = API) -> dict[int, float]:
    """OpenAI's logit_bias: token id -> bias from -100 to 100 (the server's JSON keys are the ids
    as strings of digits). None: no bias ({})."""
    if v is None:
        return {}
    if not isinstance(v, dict):
        if where == HTTP:
            raise FieldError("logit_bias", f"'logit_bias' must be an object of token id -> bias, got {_json(v, 80)}")
        raise FieldError("logit_bias", f"logit_bias must be a dict of token id -> bias, got {type_name(v)}")
    out: dict[int, float] = {}
    for k, b in v.items():
        if where == HTTP:
            if not (k.isascii() and k.isdigit() and len(k) <= 18):
                raise FieldError("logit_bias", f"'logit_bias' keys must be token ids (integers >= 0), got "
                                               f"{_json(k, 40)}")
            if not _bias(b):
                raise FieldError("logit_bias", f"'logit_bias' values must be numbers from -100 to 100, got "
                                               f"{_json(b, 40)} for token {k}")
        else:
            if not is_integer(k) or k < 0:
                raise FieldError("logit_bias", f"logit_bias: token ids must be integers >= 0, got {k!r}")
            if not _bias(b):
                raise FieldError("logit_bias", f"logit_bias: the bias of token {int(k)} must be a number from -100 "
                                               f"to 100, got {b!r}")
        out[int(k)] = float(b) + 0.0
    return out


def min_tokens(v: Any, max_tokens: int | None) -> int:
    """vLLM's min_tokens: an integer >= 0, at most max_tokens when that is given."""
    v = MIN_TOKENS.check(v)
    if max_tokens is not None and v > max_tokens:
        raise FieldError("min_tokens", f"min_tokens must be <= max_tokens={max_tokens}, got {v}")
    return v


def chat_logprobs(logprobs: bool, top_logprobs: int | None, where: Where = API) -> int | None:
    """Chat's logprobs (yes/no) and top_logprobs (0-20, checked) as SamplingParams' logprobs:
    None when not asked; top_logprobs alone is refused."""
    if top_logprobs and not logprobs:
        raise FieldError("top_logprobs", "'top_logprobs' needs 'logprobs': true" if where == HTTP
                         else "top_logprobs needs logprobs=True")
    return int(top_logprobs or 0) if logprobs else None


def prompt_token_ids(name: str, ids: Any) -> list[int]:
    """A sequence of integer token ids (list, tuple, range, 1-D numpy integer array) as ints.

    Floats are refused rather than truncated (a float id is almost always a mixed-up array)."""
    if isinstance(ids, np.ndarray):
        if ids.ndim != 1 or not (np.issubdtype(ids.dtype, np.integer) or ids.size == 0):
            raise FieldError(name, f"{name} must be a 1-D array of integer token ids, got an array of "
                                   f"shape {ids.shape} and dtype {ids.dtype}")
        return [int(i) for i in ids]
    if isinstance(ids, (str, bytes, dict, set, frozenset)) or not isinstance(ids, (Sequence, range)):
        raise FieldError(name, f"{name} must be a list of integer token ids, got {type_name(ids)} {short(ids)}")
    out = []
    for k, i in enumerate(ids):
        if not is_integer(i):
            raise FieldError(name, f"{name}[{k}] must be an integer token id, got {i!r} ({type_name(i)})")
        out.append(int(i))
    return out


def vocabulary_ids(name: str, ids: list[int], n_vocab: int, where: Where = API) -> list[int]:
    """Integer token ids that must lie in a vocabulary of `n_vocab` (a prompt, ids to detokenize)."""
    bad = [i for i in ids if not 0 <= i < n_vocab]
    if bad:
        prefix = "" if where == HTTP else f"{name}: "
        raise FieldError(name, f"{prefix}token id {bad[0]} is out of range for a vocabulary of {n_vocab}")
    return list(ids)


# ---------------------------------------------------------------- JSON from clients, bounded
MAX_JSON_DEPTH = 64       # arrays and objects nested; far above any OpenAI request, far below Python's recursion

# a JSON string (escapes included) or one bracket: strings are skipped so brackets inside them do not count
_OPENS = np.zeros(256, np.int8)
_OPENS[[ord("["), ord("{")]] = 1
_OPENS[[ord("]"), ord("}")]] = -1
_SCAN = 1 << 20         # bytes of structure a step of the depth scan takes (bounds its memory)


def too_deep(raw: bytes | str, max_depth: int = MAX_JSON_DEPTH) -> bool:
    """Does the JSON text `raw` nest arrays and objects deeper than `max_depth`? Free for one with
    fewer brackets than that; else strings are cut out with bytes operations (escaped backslashes,
    then escaped quotes, then every other piece between quotes) and the depth is a running sum over
    what is left, a megabyte at a time: tens of milliseconds for 10 MB whatever it holds, where a
    scan token by token held the server's GIL for seconds (a prompt of 10 MB of brackets).
    Unbalanced quotes or brackets are left for the parser, which refuses them."""
    if isinstance(raw, str):
        raw = raw.encode("utf-8", "surrogatepass")
    if raw.count(b"[") + raw.count(b"{") <= max_depth:
        return False
    structure = b"".join(raw.replace(b"\\\\", b"").replace(b'\\"', b"").split(b'"')[0::2])
    depth = 0
    for i in range(0, len(structure), _SCAN):
        steps = _OPENS[np.frombuffer(structure, np.uint8, min(_SCAN, len(structure) - i), i)]
        running = np.cumsum(steps, dtype=np.int64) + depth
        if running.size and running.max() > max_depth:
            return True
        depth = int(running[-1]) if running.size else depth
    return False


def parse_json(raw: bytes | str, field: str, what: str = "", max_depth: int = MAX_JSON_DEPTH) -> Any:
    """Client JSON (a body, a schema sent as a string) parsed once, within `max_depth` (Python's
    parser recurses per level: a text 10^5 deep would be a RecursionError); a FieldError naming
    `field` when it is too deep or not JSON. `what` names the text in the message (default: field)."""
    what = what or field
    if too_deep(raw, max_depth):
        raise FieldError(field, f"{what} is nested deeper than {max_depth} levels")
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise FieldError(field, f"{what} is not valid JSON: {e}") from None


def json_depth(v: Any, max_depth: int = MAX_JSON_DEPTH) -> int:
    """How deep Python data (dicts and lists) nests, counted without recursion and given up past
    `max_depth` (max_depth + 1 is returned then)."""
    deepest, stack = 0, [(v, 1)]
    while stack:
        x, d = stack.pop()
        if isinstance(x, (dict, list, tuple)):
            if d > max_depth:
                return d
            deepest = max(deepest, d)
            stack.extend((y, d + 1) for y in (x.values() if isinstance(x, dict) else x))
    return deepest


# ---------------------------------------------------------------- output constraints: type and size
# the SamplingParams fields that constrain the output; at most one may be set
CONSTRAINT_FIELDS = ("json_object", "json_schema", "guided_regex", "guided_choice", "guided_grammar")
MAX_CONSTRAINT_BYTES = 256 << 10    # a schema, regex, grammar or all choices (UTF-8): compiles within seconds
MAX_CHOICES = 50_000
MAX_GRAMMAR_RULES = 5_000           # rule and terminal definitions (Lark "name:", GBNF "name ::=")
_RULE = re.compile(r"^[ \t]*[?!]?[A-Za-z_][\w.-]*[ \t]*(?:::=|:)", re.M)     # Lark's "rule.2:" too


def _within(name: str, what: str, n_bytes: int) -> None:
    if n_bytes > MAX_CONSTRAINT_BYTES:
        raise FieldError(name, f"{name}: {what} is {n_bytes} bytes, over the limit of {MAX_CONSTRAINT_BYTES} bytes")


def _utf8_len(s: str) -> int:
    return len(s.encode("utf-8", "surrogatepass"))


def constraint_text(name: str, v: Any) -> str:
    """The constraint field `name` = `v` checked for type and size (`MAX_CONSTRAINT_BYTES`,
    `MAX_CHOICES`, `MAX_GRAMMAR_RULES`, a JSON schema within `MAX_JSON_DEPTH`) and written as the
    text the constraint compiler takes: a schema or the choices as JSON, a regex or grammar as
    itself. Cheap (linear, bounded): it runs where the request enters, before any compile."""
    if name == "json_object":
        if v is not True:
            raise FieldError(name, f"json_object must be True or False, got {v!r}")
        return ""
    if name == "json_schema":
        if isinstance(v, str):
            _within(name, "the schema", len(v) if len(v) > MAX_CONSTRAINT_BYTES else _utf8_len(v))
            v = parse_json(v, name, "json_schema (a JSON string)")
        if not isinstance(v, (dict, bool)):
            raise FieldError(name, f"json_schema must be a JSON schema (an object), got {type_name(v)}")
        if json_depth(v) > MAX_JSON_DEPTH:
            raise FieldError(name, f"json_schema is nested deeper than {MAX_JSON_DEPTH} levels")
        try:
            text = json.dumps(v, ensure_ascii=False)
        except (TypeError, ValueError) as e:
            raise FieldError(name, f"json_schema must be JSON data: {e}") from None
        _within(name, "the schema", _utf8_len(text))
        return text
    if name == "guided_regex":
        if not isinstance(v, str):
            raise FieldError(name, f"guided_regex must be a string (a regular expression), got {type_name(v)}")
        _within(name, "the regex", len(v) if len(v) > MAX_CONSTRAINT_BYTES else _utf8_len(v))
        return v
    if name == "guided_choice":
        if isinstance(v, (list, tuple)) and len(v) > MAX_CHOICES:       # before looking at each
            raise FieldError(name, f"guided_choice: {len(v)} choices, over the limit of {MAX_CHOICES}")
        if not isinstance(v, (list, tuple)) or not v or not all(isinstance(s, str) and s for s in v):
            raise FieldError(name, f"guided_choice must be a non-empty list of non-empty strings, got {short(v, 200)}")
        _within(name, "the choices together", sum(map(_utf8_len, v)))
        return json.dumps(list(v), ensure_ascii=False)
    if name == "guided_grammar":
        if not isinstance(v, str) or not v.strip():
            raise FieldError(name, f"guided_grammar must be a non-empty string (a Lark or GBNF grammar), got "
                                   f"{short(v, 200)}")
        _within(name, "the grammar", len(v) if len(v) > MAX_CONSTRAINT_BYTES else _utf8_len(v))
        rules = len(_RULE.findall(v))
        if rules > MAX_GRAMMAR_RULES:
            raise FieldError(name, f"guided_grammar: the grammar defines {rules} rules, over the limit of "
                                   f"{MAX_GRAMMAR_RULES}")
        return v
    raise FieldError(name, f"{name} is not one of the constraint fields {', '.join(CONSTRAINT_FIELDS)}")
