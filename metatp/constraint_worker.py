"""The constraint compiler's own process: a request's output constraint (JSON, a JSON schema, a
regex, a choice, a grammar) turned into llguidance's grammar text and checked, away from the
server or the caller's process.

Why a process: llguidance (Rust) recurses per nested rule and a grammar of a few thousand chained
rules overflows its stack (SIGSEGV, no exception to catch), and a big alternation can take tens
of seconds. Here a crash or a hang costs this process only; `metatp.constraint_check` starts it
(`python -m metatp.constraint_worker`), sends one JSON line per constraint on stdin, reads one JSON
line back (the first, "ready", once llguidance is imported), and kills and replaces it on a
crash or past its time budget.

The check is llguidance's `validate_grammar`, then a short walk of the output on a byte
vocabulary that meets the matcher's limits (2,000 items a parser row) before generation would.
Each check runs on a thread with half the stack a thread of the server gets (`check_stack_bytes`:
half the stack limit this process inherits, which sets a Linux thread's default; 4 MiB where it
is unlimited): a grammar that passes here needed at most half the stack the server's threads
have when they build its matcher. This module imports only the standard library and llguidance.
"""

from __future__ import annotations

import json
import os
import re
import sys
import threading
from typing import Any

__all__ = ["Refused", "compile_constraint", "library_message", "choice_regex", "check_stack_bytes", "main"]

CHECK_STACK_BYTES = 4 << 20          # where the stack limit is unlimited (or unknown)
JSON_OPTIONS = {"whitespace_flexible": False}     # compact JSON (", " and ": "): no runs of blanks
_PANIC = re.compile(r"panicked at|stack backtrace|RUST_BACKTRACE|\.rs:\d+|/\.cargo/|/rustc/", re.I)


class Refused(Exception):
    """The constraint is not one llguidance accepts; the message says why, without internals."""


def library_message(text: str, limit: int = 300) -> str:
    """llguidance's error `text` as one line a client may read: its "Error:" line (or its first),
    cut to `limit` characters; a panic or backtrace becomes a plain "internal error"."""
    lines = [ln.strip() for ln in str(text).strip().splitlines() if ln.strip()]
    if not lines:
        return "refused by the constraint library"
    if any(_PANIC.search(ln) for ln in lines):
        return "the constraint library failed on it (an internal error of the library)"
    line = next((ln for ln in lines if ln.startswith("Error:")), lines[0])
    line = line.removeprefix("Error:").strip()
    return line if len(line) <= limit else line[:limit - 3] + "..."


def choice_regex(choices: list[str]) -> str:
    """One regex matching exactly the given strings: every character but an ASCII letter or digit
    written as \\x{hex}, so no choice can change the pattern. One regex is one lexeme to
    llguidance, where an alternation of literals would be one parser item per choice (its rows
    stop at 2,000 items, mid-generation)."""
    return "|".join("".join(c if c.isascii() and c.isalnum() else f"\\x{{{ord(c):x}}}" for c in s) for s in choices)


def _source(field: str, text: str, llg: Any) -> tuple[str, str]:
    """(llguidance grammar, what it is called in messages) for the constraint `field` = `text`."""
    if field == "json_object":
        return llg.LLMatcher.grammar_from_json_schema({"type": "object"}, JSON_OPTIONS), "the JSON object"
    if field == "json_schema":
        try:
            return llg.LLMatcher.grammar_from_json_schema(json.loads(text), JSON_OPTIONS), "the schema"
        except (ValueError, TypeError) as e:
            raise Refused(f"the schema is invalid: {library_message(e)}") from None
    if field == "guided_regex":
        return llg.LLMatcher.grammar_from_regex(text), "the regex"
    if field == "guided_choice":
        return llg.LLMatcher.grammar_from_regex(choice_regex(json.loads(text))), "the choice"
    if field == "guided_grammar":
        try:
            return llg.grammar_from("grammar", text), "the grammar"     # Lark, or GBNF converted to Lark
        except ValueError as e:
            raise Refused(f"the grammar is invalid: {library_message(e)}") from None
    raise Refused(f"{field} is not a constraint field")


def compile_constraint(field: str, text: str) -> str:
    """llguidance's checked grammar for the constraint `field` given as `text` (the JSON of a
    schema or a choice list; the regex or grammar itself), or Refused saying what is wrong."""
    import llguidance as llg

    try:
        grammar, what = _source(field, text, llg)
        err = llg.LLMatcher.validate_grammar(grammar, None)
    except Refused:
        raise
    except BaseException as e:        # pyo3's PanicException is a BaseException
        raise Refused(library_message(e)) from None
    if err:
        raise Refused(f"{what} is invalid: {library_message(err)}")
    limit = _walk_for_limits(grammar, llg)
    if limit:
        raise Refused(f"{what} is too complex for the matcher: {library_message(limit)}")
    return grammar


class _ByteVocab:
    """A vocabulary of the 256 bytes and an end token: llguidance's TokenizerWrapper for a walk."""

    is_tokenizer_wrapper = True
    eos_token_id, bos_token_id, special_token_ids = 256, None, [256]
    tokens = [bytes([b]) for b in range(256)] + [b"\xff<eos>"]

    def __call__(self, text: str | bytes) -> list[int]:
        return list(text.encode() if isinstance(text, str) else text)


_byte_tokenizer: Any = None
_LIMIT = re.compile(r"max is \d+|too complex|fuel", re.I)
WALK_BYTES = 16


def _walk_for_limits(grammar: str, llg: Any) -> str:
    """A limit of the matcher that generation would meet (llguidance's parser rows stop at 2,000
    items: an alternation of more literals fails at its first byte), found by walking the first
    WALK_BYTES bytes of the output twice (the lowest allowed byte each step, then the highest);
    "" when none shows. Only limit errors count: a grammar naming the model's special tokens
    cannot be walked here and is left to the real matcher."""
    global _byte_tokenizer
    if _byte_tokenizer is None:
        _byte_tokenizer = llg.LLTokenizer(_ByteVocab(), n_vocab=257)
    first = llg.LLMatcher(_byte_tokenizer, grammar, log_level=0)
    if first.is_error():
        return ""
    for m, pick in ((first.deep_copy(), min), (first, max)):
        for _ in range(WALK_BYTES):
            mask = m.compute_bitmask()
            allowed = [b for b in range(256) if mask[b >> 3] >> (b & 7) & 1]
            if m.is_error() or not allowed or not m.consume_token(pick(allowed)):
                break
        if m.is_error() and _LIMIT.search(m.get_error()):
            return m.get_error()
    return ""


def check_stack_bytes() -> int:
    """Half the stack a thread gets by default here (glibc sizes it by RLIMIT_STACK)."""
    try:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_STACK)
    except (ImportError, OSError, ValueError):
        return CHECK_STACK_BYTES
    if soft == resource.RLIM_INFINITY or soft <= 0:
        return CHECK_STACK_BYTES
    return max(soft // 2, 1 << 20)


def _answer(request: dict) -> dict:
    result: dict = {}

    def run() -> None:
        try:
            result["grammar"] = compile_constraint(request["field"], request["text"])
        except Refused as e:
            result["refused"] = str(e)
        except BaseException as e:      # anything else: still one clean line
            result["refused"] = library_message(f"{type(e).__name__}: {e}")

    threading.stack_size(check_stack_bytes())
    t = threading.Thread(target=run, name="metatp-constraint-check")
    t.start()
    t.join()
    return result


def main() -> None:
    """Answer one JSON line per JSON line on stdin until it closes. The answers go to the stdout
    this process started with; anything else printing to stdout lands on stderr instead."""
    out = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    import llguidance  # noqa: F401  (imported before "ready": a compile's time budget is the compile's)

    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        if line.strip():
            out.write(json.dumps(_answer(json.loads(line))) + "\n")
            out.flush()


if __name__ == "__main__":
    main()
