"""Chat templates are untrusted code from the model file: compile and render them in jinja2's
sandbox with a time and size budget, so a hostile template ends in a typed error, not a hang.

Every operation that could build a huge value (`*`, `**`, `+`, `%`, `~`, width-taking string
methods, `.format`, the risky filters) is checked before it runs; a per-thread trace function
enforces the deadline; there is no loader, so include/import/extends fail.
"""

from __future__ import annotations

import json
import math
import re
import string
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from metatp.ir.errors import ConfigError, ModelFormatError

__all__ = ["compile_template", "render_template", "TEMPLATE_SECONDS", "TEMPLATE_MAX_CHARS",
           "TEMPLATE_TOTAL_CHARS", "TEMPLATE_MAX_INT_BITS"]


def compile_template(source: str):
    """`source` compiled in the budgeted sandbox; ModelFormatError if it does not compile in budget."""
    env = _template_environment()
    try:
        with _template_budget():
            return env.from_string(source)
    except _TemplateBudgetError as e:
        raise ModelFormatError(f"the model's chat template (tokenizer.chat_template) {e}") from None
    except RecursionError:
        raise ModelFormatError("the model's chat template (tokenizer.chat_template) is nested too "
                               "deeply to compile") from None
    except Exception as e:      # TemplateSyntaxError, or anything the compiler chokes on
        raise ModelFormatError(f"the model's chat template (tokenizer.chat_template) does not compile: "
                               f"{type(e).__name__}: {e}") from None



def render_template(template, **context: Any) -> str:
    """Render a compiled template with `context` under the budget (see the module doc)."""
    from jinja2 import TemplateError, TemplateNotFound
    from jinja2.sandbox import SecurityError

    where = "the model's chat template (tokenizer.chat_template)"
    gen = None
    try:
        with _template_budget() as budget:
            gen = template.generate(**context)
            out: list[str] = []
            for piece in gen:
                budget.charge(len(piece))
                out.append(piece)
            return "".join(out)
    except _TemplateRaised as e:
        raise ConfigError(f"chat template: {e}") from None
    except _TemplateBudgetError as e:
        raise ModelFormatError(f"{where} {e}") from None
    except (TemplateNotFound, SecurityError) as e:
        raise ModelFormatError(f"{where} is not allowed to do this: {type(e).__name__}: {e}") from None
    except TemplateError as e:
        raise ConfigError(f"chat template: {e}") from None
    except RecursionError:
        raise ModelFormatError(f"{where} recurses without end") from None
    except MemoryError:
        raise ModelFormatError(f"{where} ran out of memory") from None
    except Exception as e:      # the template's own bug: 1/0, a bad type, an int too large to print...
        raise ModelFormatError(f"{where} failed: {type(e).__name__}: {e}") from None
    finally:
        if gen is not None:     # closed here, with no budget running, not later by the GC
            gen.close()


# ---------------------------------------------------------------- the template sandbox
TEMPLATE_SECONDS = 2.0            # one render (or compile) of a chat template
TEMPLATE_MAX_CHARS = 1 << 22      # the rendered prompt, and any one string or list the template builds
TEMPLATE_TOTAL_CHARS = 1 << 26    # everything the checked operations build in one render, added up
TEMPLATE_MAX_INT_BITS = 1 << 14   # integers the template computes (~4900 decimal digits)

_BUDGET = threading.local()       # the budget of the render running on this thread


class _TemplateBudgetError(Exception):
    """A chat template went over its time or size budget."""


class _TemplateRaised(Exception):
    """The template called raise_exception(): the messages break its rules (the user's error)."""


class _Budget:
    """Deadline and size accounting for one render, checked from a trace function (time) and
    from every operation of the sandbox that can build a large value (size)."""

    def __init__(self) -> None:
        self.deadline = time.perf_counter() + TEMPLATE_SECONDS
        self.total = 0

    def charge(self, n: int, what: str = "output") -> None:
        if n > TEMPLATE_MAX_CHARS:
            raise _TemplateBudgetError(f"builds a {what} of {n} items (the limit is {TEMPLATE_MAX_CHARS})")
        self.total += n
        if self.total > TEMPLATE_TOTAL_CHARS:
            raise _TemplateBudgetError(f"builds more than {TEMPLATE_TOTAL_CHARS} characters in all")
        self.check_time()

    def check_time(self) -> None:
        if time.perf_counter() > self.deadline:
            raise _TemplateBudgetError(f"ran longer than {TEMPLATE_SECONDS:g} s (an endless or huge loop)")

    def trace(self, frame, event, arg):
        """sys.settrace hook: every call checks the clock, template code also every line."""
        if time.perf_counter() > self.deadline:
            raise _TemplateBudgetError(f"ran longer than {TEMPLATE_SECONDS:g} s (an endless or huge loop)")
        return self.trace if frame.f_code.co_filename == "<template>" else None


class _template_budget:
    """Context manager: a fresh budget for this thread and the clock-checking trace function
    (the previous trace function, e.g. a debugger's or coverage's, comes back afterwards)."""

    def __enter__(self) -> _Budget:
        self.outer = getattr(_BUDGET, "current", None)
        self.budget = _BUDGET.current = _Budget()
        self.old_trace = sys.gettrace()
        sys.settrace(self.budget.trace)
        return self.budget

    def __exit__(self, *exc: object) -> None:
        sys.settrace(self.old_trace)
        _BUDGET.current = self.outer


def _charge(n: int, what: str) -> None:
    b = getattr(_BUDGET, "current", None)
    if b is not None:
        b.charge(n, what)


def _sized(v: Any) -> Any:
    """Charge a value the template built (strings and lists) against the budget."""
    if isinstance(v, (str, list, tuple)):
        _charge(len(v), "string" if isinstance(v, str) else "list")
    return v


def _check_int(v: int) -> None:
    if v.bit_length() > TEMPLATE_MAX_INT_BITS:
        raise _TemplateBudgetError(f"computes an integer of more than {TEMPLATE_MAX_INT_BITS} bits")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _seq_len(v: Any) -> int | None:
    return len(v) if isinstance(v, (str, list, tuple)) else None


def _check_binop(op: str, a: Any, b: Any) -> None:
    """Refuse, before computing it, a result that would be too large to build."""
    if op == "**" and _is_int(a) and _is_int(b) and b > 0 and abs(a) > 1:
        if b * math.log2(abs(a)) > TEMPLATE_MAX_INT_BITS:
            raise _TemplateBudgetError(f"computes {a} ** {b}, an integer of more than {TEMPLATE_MAX_INT_BITS} bits")
    elif op == "*":
        if _is_int(a) and _is_int(b):
            if a.bit_length() + b.bit_length() > TEMPLATE_MAX_INT_BITS + 1:
                raise _TemplateBudgetError(f"computes an integer of more than {TEMPLATE_MAX_INT_BITS} bits")
        else:
            n, k = (_seq_len(a), b) if _seq_len(a) is not None else (_seq_len(b), a)
            if n is not None and _is_int(k) and n * k > TEMPLATE_MAX_CHARS:
                raise _TemplateBudgetError(f"repeats a sequence {k} times ({n * k} items; the limit is "
                                           f"{TEMPLATE_MAX_CHARS})")
    elif op == "+":
        na, nb = _seq_len(a), _seq_len(b)
        if na is not None and nb is not None and na + nb > TEMPLATE_MAX_CHARS:
            raise _TemplateBudgetError(f"builds a value of {na + nb} items (the limit is {TEMPLATE_MAX_CHARS})")
    elif op == "%" and isinstance(a, str):
        _check_printf(a)


_PRINTF_WIDE = re.compile(r"%[#0\- +]*(\*|\d{6,})|%[#0\- +]*\d*\.(\*|\d{6,})")


def _check_printf(fmt: str) -> None:
    if _PRINTF_WIDE.search(fmt):
        raise _TemplateBudgetError("formats with a huge or computed field width ('%*s', '%1000000s')")


def _check_format(fmt: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    """str.format: refuse literal widths of a million or more, and computed widths ('{:{w}}') fed a big int."""
    try:
        fields = list(string.Formatter().parse(fmt))
    except ValueError:
        return      # str.format itself will reject it
    computed = False
    for _, name, spec, _ in fields:
        if spec:
            if re.search(r"\d{7,}", spec):
                raise _TemplateBudgetError(f"formats with a field width of a million or more ({spec!r})")
            computed = computed or "{" in spec
    if computed and any(_is_int(v) and v > TEMPLATE_MAX_CHARS for v in [*args, *kwargs.values()]):
        raise _TemplateBudgetError("formats with a computed field width over the limit")


_WIDTH_METHODS = frozenset({"center", "ljust", "rjust", "zfill"})


def _check_call(obj: Any, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
    """String methods whose arguments set the size of the result."""
    fn = getattr(obj, "__wrapped__", obj)
    owner = getattr(fn, "__self__", None)
    name = getattr(fn, "__name__", "")
    if not isinstance(owner, str):
        return
    if name in _WIDTH_METHODS and args and _is_int(args[0]) and args[0] > TEMPLATE_MAX_CHARS:
        raise _TemplateBudgetError(f"pads a string to {args[0]} characters (the limit is {TEMPLATE_MAX_CHARS})")
    elif name == "expandtabs":
        size = args[0] if args else kwargs.get("tabsize", 8)
        if _is_int(size) and size * (owner.count("\t") + 1) > TEMPLATE_MAX_CHARS:
            raise _TemplateBudgetError("expands tabs past the size limit")
    elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        _check_replace(owner, args[0], args[1])
    elif name == "join" and args and isinstance(args[0], (list, tuple)):
        _check_join(args[0], owner)
    elif name in ("format", "format_map"):
        _check_format(owner, args if name == "format" else (), kwargs if name == "format" else
                      (args[0] if args and isinstance(args[0], Mapping) else {}))


def _check_join(parts: Sequence[Any], sep: Any) -> None:
    sep_len = len(sep) if isinstance(sep, str) else 0
    if sum(len(p) for p in parts if isinstance(p, str)) + sep_len * max(len(parts) - 1, 0) > TEMPLATE_MAX_CHARS:
        raise _TemplateBudgetError("joins strings past the size limit")


def _check_replace(s: str, old: str, new: str) -> None:
    n = (len(s) + 1) if old == "" else s.count(old)
    if len(s) + n * (len(new) - len(old)) > TEMPLATE_MAX_CHARS:
        raise _TemplateBudgetError("replaces text past the size limit")


def _template_environment():
    """jinja2's immutable sandbox, with budgeted operators, string methods, filters and concatenation
    (`~`), no loader (include/import/extends find nothing), and HF's helper functions."""
    from jinja2 import DictLoader
    from jinja2.compiler import CodeGenerator
    from jinja2.ext import loopcontrols
    from jinja2.filters import FILTERS
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class BudgetCodeGenerator(CodeGenerator):
        def visit_Concat(self, node, frame) -> None:      # `a ~ b` builds strings without a binop
            self.write("environment.metatp_concat((")
            for arg in node.nodes:
                self.visit(arg, frame)
                self.write(", ")
            self.write("))")

    class BudgetSandbox(ImmutableSandboxedEnvironment):
        code_generator_class = BudgetCodeGenerator
        intercepted_binops = frozenset({"*", "**", "+", "%", "//"})

        def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
            _check_binop(operator, left, right)
            out = super().call_binop(context, operator, left, right)
            if _is_int(out):
                _check_int(out)
            return _sized(out)

        def call(__self, __context, __obj, *args: Any, **kwargs: Any) -> Any:   # noqa: N805 (jinja's names)
            _check_call(__obj, args, kwargs)
            return _sized(super().call(__context, __obj, *args, **kwargs))

        @staticmethod
        def metatp_concat(parts: tuple) -> str:
            texts = [p if isinstance(p, str) else str(p) for p in parts]
            _charge(sum(len(t) for t in texts), "string")
            return "".join(texts)

    def raise_exception(message: str):
        raise _TemplateRaised(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        if _is_int(indent) and indent > 64:
            raise _TemplateBudgetError(f"asks tojson for an indent of {indent}")
        return _sized(json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                                 sort_keys=sort_keys))

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    def width_filter(name: str, arg_at: int, default: int):
        f = FILTERS[name]

        def checked(*args: Any, **kwargs: Any) -> str:
            w = args[arg_at] if len(args) > arg_at else kwargs.get("width", default)
            if _is_int(w) and w > TEMPLATE_MAX_CHARS:
                raise _TemplateBudgetError(f"asks the {name} filter for a width of {w}")
            if isinstance(w, str) and len(w) > 1024:
                raise _TemplateBudgetError(f"asks the {name} filter for a {len(w)}-character indent")
            return _sized(f(*args, **kwargs))
        return checked

    def replace_filter(eval_ctx, s: Any, old: Any, new: Any, count: Any = None) -> str:
        if isinstance(s, str) and isinstance(old, str) and isinstance(new, str):
            _check_replace(s, old, new)
        return _sized(FILTERS["replace"](eval_ctx, s, old, new, count))

    def format_filter(value: Any, *args: Any, **kwargs: Any) -> str:
        if isinstance(value, str):
            _check_printf(value)
        return _sized(FILTERS["format"](value, *args, **kwargs))

    def join_filter(eval_ctx, value: Any, d: str = "", attribute: Any = None) -> str:
        if isinstance(value, (list, tuple)):
            _check_join(value, d)
        return _sized(FILTERS["join"](eval_ctx, value, d, attribute))

    from jinja2.utils import pass_eval_context

    env = BudgetSandbox(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols], loader=DictLoader({}))
    env.filters["tojson"] = tojson
    env.filters["center"] = width_filter("center", 1, 80)
    env.filters["indent"] = width_filter("indent", 1, 4)
    env.filters["replace"] = pass_eval_context(replace_filter)
    env.filters["format"] = format_filter
    env.filters["join"] = pass_eval_context(join_filter)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env
