"""Hostile output constraints through the Python API and the checker itself: a grammar that
crashes the constraint library (SIGSEGV in llguidance) or outruns the time budget is a FieldError
naming the field, and this process lives on; size budgets refuse at entry by name; a schema sent
as a JSON string goes through the one depth-limited parse; guided_choice beyond the library's
2,000-item parser rows still matches exactly its choices; no message carries a library trace."""

from __future__ import annotations

import json
import re
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from metatp import SamplingParams
from metatp import request_fields as rf
from metatp.ir.errors import ConfigError
from metatp.request_fields import FieldError
from metatp.testing.synth import SynthSpec
from support.require import requires

pytestmark = requires("structured")

SPEC = SynthSpec(n_layer=1, n_embd=32, n_head=2, n_head_kv=1, n_ff=64, seed=7)     # the `llm` fixture
LLM_OPTIONS = {"n_ctx": 128}
TRACE = re.compile(r"panicked|backtrace|Traceback|\.rs:\d+|<state>|<grammar>", re.I)


def chained_rules(n: int) -> str:
    """The issue's grammar: n rules, each one "a" and the next (llguidance recurses per link)."""
    return "start: r0\n" + "\n".join(f'r{i}: "a" r{i + 1}' for i in range(n)) + f'\nr{n}: "a"\n'


def alternation(n: int) -> str:
    return "start: " + " | ".join(f'"w{i}"' for i in range(n))


def refusal(call) -> FieldError:
    with pytest.raises(FieldError) as e:
        call()
    assert not TRACE.search(str(e.value)), str(e.value)
    return e.value


@pytest.fixture(scope="module")
def checker():
    from metatp.constraint_check import ConstraintChecker

    c = ConstraintChecker(workers=1)
    yield c
    c.close()


# ---------------------------------------------------------------- the worker: crash, timeout, cache
def test_a_crashing_grammar_is_a_field_error_and_the_checker_lives_on(checker):
    before = (checker.compiles, checker.crashes)
    e = refusal(lambda: checker.check("guided_grammar", chained_rules(3000)))
    assert e.field == "guided_grammar" and "crashed" in str(e) and str(e).startswith("guided_grammar")
    assert (checker.compiles, checker.crashes) == (before[0] + 1, before[1] + 1)
    refusal(lambda: checker.check("guided_grammar", chained_rules(3000)))        # the verdict is kept
    assert checker.compiles == before[0] + 1
    assert "start" in checker.check("guided_grammar", chained_rules(200))         # a fresh worker answers


def test_a_slow_constraint_is_a_timeout_naming_the_limit():
    from metatp.constraint_check import ConstraintChecker

    many = json.dumps([f"w{i}" for i in range(30000)])       # ~0.3 s to compile
    slow = ConstraintChecker(workers=1, time_budget_s=60)
    try:
        slow.check("guided_regex", "a+")            # the worker started: the budget counts the compile only
        slow.time_budget_s = 0.02                    # only the slow compile runs under the tiny budget (a
        t = time.monotonic()                         # trivial one can take longer on a loaded machine)
        e = refusal(lambda: slow.check("guided_choice", many))
        assert time.monotonic() - t < 3 and slow.timeouts == 1
        assert e.field == "guided_choice" and "longer than the limit of 0.02 s" in str(e)
        slow.time_budget_s = 60
        assert slow.check("guided_regex", "b+")     # the killed worker is replaced
        assert slow.timeouts == 1                    # a timeout is not kept: with time, it compiles
        assert "w29999" in slow.check("guided_choice", many)
    finally:
        slow.close()


def test_a_worker_dead_between_checks_is_replaced(checker):
    checker.check("guided_regex", "c+")
    for w in checker._workers:                     # killed from outside (an OOM killer, say)
        if w.proc is not None:
            w.proc.kill()
            w.proc.wait()
    crashes = checker.crashes
    assert checker.check("guided_regex", "d+") and checker.crashes == crashes


def test_a_repeat_costs_no_compile(checker):
    g = checker.check("guided_regex", "[0-9]{3}")
    n = checker.compiles
    t = time.perf_counter()
    assert checker.check("guided_regex", "[0-9]{3}") == g
    assert checker.compiles == n and time.perf_counter() - t < 0.05
    assert checker.submit("guided_regex", "[0-9]{3}").done()           # answered without a thread hop


def test_a_grammar_past_the_parser_rows_is_refused_before_generation(checker):
    e = refusal(lambda: checker.check("guided_grammar", alternation(5000)))     # rows stop at 2,000 items
    assert e.field == "guided_grammar" and "too complex" in str(e) and "max is 2000" in str(e), str(e)
    assert checker.check("guided_grammar", alternation(1500))
    assert checker.check("json_schema", json.dumps({"enum": [f"v{i}" for i in range(10_000)]}))


def test_library_messages_lose_their_traces():
    from metatp.constraint_worker import library_message

    panic = "thread '<unnamed>' panicked at parser/src/earley/parser.rs:1234:9:\nindex out of bounds\nstack backtrace:"
    assert library_message(panic) == "the constraint library failed on it (an internal error of the library)"
    dump = ("Parser Error: row too big\n<state>\nTokens: x\n</state><grammar>\nstart: ...\n"
            "Error: Current row has 2002 items")
    assert library_message(dump) == "Current row has 2002 items"
    assert library_message("x" * 1000, 50) == "x" * 47 + "..."


# ---------------------------------------------------------------- the Python API
def test_python_api_survives_the_crashing_grammar(llm):
    e = refusal(lambda: llm.generate("hi", SamplingParams(temperature=0.0, guided_grammar=chained_rules(3000), max_tokens=4)))
    assert isinstance(e, ConfigError) and e.field == "guided_grammar"
    out = llm.generate("hi", SamplingParams(temperature=0.0, guided_choice=["yes", "no"], max_tokens=4))[0].outputs[0]
    assert out.text in ("yes", "no")


@pytest.mark.parametrize("kw, field, words", [
    (dict(guided_grammar=alternation(30000)), "guided_grammar", f"over the limit of {rf.MAX_CONSTRAINT_BYTES} bytes"),
    (dict(guided_regex="a" * (rf.MAX_CONSTRAINT_BYTES + 1)), "guided_regex", "over the limit"),
    (dict(guided_choice=["x"] * (rf.MAX_CHOICES + 1)), "guided_choice", f"over the limit of {rf.MAX_CHOICES}"),
    (dict(guided_choice=["y" * 1000] * 300), "guided_choice", "over the limit"),
    (dict(guided_grammar="\n".join(f"r{i}: \"a\"" for i in range(rf.MAX_GRAMMAR_RULES + 1))), "guided_grammar",
     f"over the limit of {rf.MAX_GRAMMAR_RULES}"),
    (dict(json_schema="[" * 3000 + "]" * 3000), "json_schema", f"nested deeper than {rf.MAX_JSON_DEPTH} levels"),
    (dict(json_schema={"enum": [f"v{i}" for i in range(100_000)]}), "json_schema", "over the limit"),
    (dict(json_schema='{"type": "object",'), "json_schema", "not valid JSON"),
    (dict(json_schema={"type": "object", "x": {1, 2}}), "json_schema", "must be JSON data"),
])
def test_budgets_refuse_at_entry_by_name(kw, field, words):
    t = time.perf_counter()
    e = refusal(lambda: SamplingParams(**kw))
    assert e.field == field and str(e).startswith(field) and words in str(e), str(e)
    assert time.perf_counter() - t < 1.0          # no compile: the budget is checked first


def test_a_schema_dict_too_deep_is_refused_without_recursion():
    deep: dict = {}
    node = deep
    for _ in range(5000):          # deeper than Python's recursion limit: json.dumps alone would fail
        node["items"] = {}
        node = node["items"]
    e = refusal(lambda: SamplingParams(json_schema=deep))
    assert e.field == "json_schema" and "nested deeper" in str(e)


def test_ten_thousand_choices_give_one_of_them(llm):
    choices = [f"option {i}" for i in range(10_000)]
    for temperature in (0.0, 1.0):
        out = llm.generate("pick:", SamplingParams(guided_choice=choices, max_tokens=16, temperature=temperature,
                                                   seed=3))[0].outputs[0]
        assert out.text in choices and out.finish_reason == "stop", out.text


def test_a_checked_constraint_with_a_tokenizer_leaves_its_matcher_built(llm):
    from metatp import structured

    grammar = structured.check_constraint("guided_regex", "x[yz]q", llm.tokenizer).result()
    kept = structured.matcher_for(grammar, llm.tokenizer)
    assert structured.matcher_for(grammar, llm.tokenizer) is kept                # built once, by the check
    a, b = structured.Guide(grammar, llm.tokenizer), structured.Guide(grammar, llm.tokenizer)
    assert a.matcher is not kept and b.matcher is not kept                      # each request its own copy
    x = next(t for t in range(llm.n_vocab) if llm.tokenizer.token_bytes(t) == b"x")
    before = b.allowed().copy()
    assert not a.consume(x) and (a.allowed() != before).any()                   # a moved on
    assert (b.allowed() == before).all()                                        # b did not


# ---------------------------------------------------------------- one JSON parse, bounded
def nested(kids):
    return st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=3), kids, max_size=3)


# strings full of what a depth scan could mistake for structure: quotes, backslashes, brackets
tricky_text = st.text(max_size=5) | st.text(alphabet='a"\\[]{}é', max_size=8)
json_values = st.recursive(st.none() | st.booleans() | st.integers() | tricky_text, nested, max_leaves=30)


def nesting(v) -> int:
    if isinstance(v, list):
        return 1 + max(map(nesting, v), default=0)
    if isinstance(v, dict):
        return 1 + max(map(nesting, v.values()), default=0)
    return 0


@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(v=json_values, limit=st.integers(0, 6))
def test_the_bounded_parse_is_json_loads_within_the_limit(v, limit):
    text = json.dumps(v, ensure_ascii=limit % 2 == 0)
    assert rf.too_deep(text, limit) == (nesting(v) > limit) == (rf.json_depth(v, limit) > limit)
    if nesting(v) <= limit:
        assert rf.parse_json(text, "f", max_depth=limit) == v
    else:
        with pytest.raises(FieldError, match="nested deeper") as e:
            rf.parse_json(text, "f", max_depth=limit)
        assert e.value.field == "f"


# ---------------------------------------------------------------- choices as one regex: exactly them
class ByteVocab:
    """A tokenizer of single bytes (and EOS) for llguidance: each choice is spelled byte by byte."""

    is_tokenizer_wrapper = True
    eos_token_id, bos_token_id, special_token_ids = 256, None, [256]
    tokens = [bytes([b]) for b in range(256)] + [b"\xff<eos>"]

    def __call__(self, text):
        return list(text.encode() if isinstance(text, str) else text)


@pytest.fixture(scope="module")
def byte_tokenizer():
    import llguidance

    return llguidance.LLTokenizer(ByteVocab(), n_vocab=257)


def accepts(byte_tokenizer, grammar: str, text: str) -> bool:
    import llguidance

    m = llguidance.LLMatcher(byte_tokenizer, grammar, log_level=0)
    return all(m.consume_token(b) for b in text.encode()) and m.is_accepting()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(choices=st.lists(st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=6), min_size=1,
                        max_size=6, unique=True),
       other=st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=6))
def test_choice_regex_matches_exactly_the_choices(byte_tokenizer, choices, other):
    import llguidance

    from metatp.constraint_worker import choice_regex

    grammar = llguidance.LLMatcher.grammar_from_regex(choice_regex(choices))
    assert llguidance.LLMatcher.validate_grammar(grammar, None) == ""
    for c in choices:
        assert accepts(byte_tokenizer, grammar, c), c
    assert accepts(byte_tokenizer, grammar, other) == (other in choices)


@pytest.mark.parametrize("text", ['["a\\\\", [[[1]]]]', '{"k\\\\": "\\\\\\"[", "v": [[{}]]}', '["\\"", [[[0]]]]'])
def test_the_depth_scan_reads_escapes_as_the_parser_does(text):
    """Strings ending in an escaped backslash, or holding escaped quotes and brackets, end where
    json.loads says they do: the brackets after them count, the ones inside do not."""
    v = json.loads(text)
    assert nesting(v) == 4
    assert rf.too_deep(text, 3) and not rf.too_deep(text, 4)
