"""Every op is complete: a builder, a row in the compiler's table, a numpy kernel and a CUDA handler.

A new op that lacks a piece fails here with the list of what is missing, instead of failing at run
time on the first model that uses it. A piece that is deliberately absent is listed in
UNSUPPORTED with the reason; an entry there that is no longer true fails too, so the list stays
honest. The CUDA side is found by introspection only (the `CUDA_OPS` table keyed by Op in
`CUDA_MODULES`), so the check survives that backend being split up.
Also: every kernel name a launcher asks for is an extern "C" entry point of its family's .cu
(after the C preprocessor, when `cpp` is installed).
"""

from __future__ import annotations

import importlib
import re
import subprocess
from pathlib import Path

import pytest

from metatp.ir import ops
from metatp.ir.ops import OPS, Op
from metatp.passes.rules import OP_RULES, RULES
from support.require import requires

PIECES = ("builder", "rule", "numpy kernel", "cuda handler")

# (op, piece) -> why it is absent on purpose. Empty today: every op has every piece.
UNSUPPORTED: dict[tuple[Op, str], str] = {}

# Where the CUDA op handlers (CUDA_OPS) and the launchers' entry-point table live.
CUDA_MODULES = ("metatp.backends.cuda.ops",)
LAUNCH_MODULES = ("metatp.backends.cuda.kernels",)


def _builder(op: Op) -> object | None:
    if op is Op.NONE:
        return ops.new_tensor                    # leaves: weights, inputs, KV cache
    return ops.BUILDERS.get(op)


def _numpy_kernel(op: Op) -> object | None:
    from metatp.backends.numpy.kernels import KERNELS

    return KERNELS.get(op)


def _cuda_handlers() -> tuple[dict[Op, object], str]:
    """{op: handler} from the CUDA_OPS table, and where it was found."""
    tried = []
    for name in CUDA_MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError as e:
            tried.append(f"{name} ({e.__class__.__name__})")
            continue
        table = getattr(mod, "CUDA_OPS", None)
        if isinstance(table, dict) and table:
            return {op: h for op, h in table.items() if isinstance(op, Op)}, f"{name}.CUDA_OPS"
        tried.append(f"{name} (no CUDA_OPS table)")
    pytest.fail("could not find the CUDA op handlers; looked in " + "; ".join(tried))


def _needs_kernel(op: Op) -> bool:
    return OPS[op].runs_kernel                   # leaves and pure views run nothing


def _missing() -> dict[Op, list[str]]:
    cuda, _ = _cuda_handlers()
    have = {
        "builder": lambda op: _builder(op) is not None,
        "rule": lambda op: op in OP_RULES,
        "numpy kernel": lambda op: not _needs_kernel(op) or _numpy_kernel(op) is not None,
        "cuda handler": lambda op: not _needs_kernel(op) or op in cuda,
    }
    out: dict[Op, list[str]] = {}
    for op in Op:
        gaps = [p for p in PIECES if not have[p](op) and (op, p) not in UNSUPPORTED]
        if gaps:
            out[op] = gaps
    return out


def test_every_op_has_every_piece():
    missing = _missing()
    assert not missing, "ops missing pieces (add them, or an UNSUPPORTED entry with the reason): " + "; ".join(
        f"{op.name}: {', '.join(gaps)}" for op, gaps in missing.items())


def test_unsupported_entries_are_still_true():
    cuda, _ = _cuda_handlers()
    present = {"builder": lambda op: _builder(op) is not None, "rule": lambda op: op in OP_RULES,
               "numpy kernel": lambda op: _numpy_kernel(op) is not None, "cuda handler": lambda op: op in cuda}
    stale = [f"{op.name}: {piece}" for (op, piece) in UNSUPPORTED if present[piece](op)]
    assert not stale, f"listed as unsupported but present (remove from UNSUPPORTED): {stale}"


def test_kernel_tables_have_no_unknown_or_kernel_less_ops():
    """A kernel registered for a leaf or a pure view would never run: a sign of a wrong OpInfo."""
    from metatp.backends.numpy.kernels import KERNELS

    cuda, where = _cuda_handlers()
    for table, name in ((KERNELS, "numpy KERNELS"), (cuda, where)):
        idle = sorted(op.name for op in table if not _needs_kernel(op))
        assert not idle, f"{name} has handlers for ops that run no kernel (OpInfo.runs_kernel=False): {idle}"


def test_op_rules_agree_with_op_info():
    """View ops (and only they) are lowered by their row; RULES is the split column of the table."""
    assert set(RULES) == set(OP_RULES) == set(Op)
    wrong = [op.name for op in Op if (OP_RULES[op].lower_view is not None) != OPS[op].is_view]
    assert not wrong, f"lower_view must be set exactly for the ops with OpInfo.is_view: {wrong}"
    assert all(RULES[op] is OP_RULES[op].split for op in Op)


# ---------------------------------------------------------------- CUDA entry points


def _launch_module():
    for name in LAUNCH_MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        if hasattr(mod, "expected_entry_points"):
            return mod
    pytest.fail(f"no module with expected_entry_points() among {LAUNCH_MODULES}")


def _backend_sources() -> list[Path]:
    import metatp.backends as backends

    return sorted(Path(backends.__file__).parent.rglob("*.py"))


_LAUNCH = re.compile(r"""launch\(\s*"(\w+)"\s*,\s*(f?)"([^"]+)"\s*,""")


def test_every_launched_kernel_name_is_an_expected_entry_point():
    expected = _launch_module().expected_entry_points()
    bad, n = [], 0
    for path in _backend_sources():
        for family, is_f, name in _LAUNCH.findall(path.read_text(encoding="utf-8")):
            n += 1
            pattern = re.sub(r"\\\{[^}]*\\\}", r"\\w+", re.escape(name)) if is_f else re.escape(name)
            names = expected.get(family, [])
            if not any(re.fullmatch(pattern, e) for e in names):
                bad.append(f"{path.name}: launch({family!r}, {'f' if is_f else ''}{name!r})")
    assert n > 0, "found no launch(\"family\", \"name\", ...) calls under backends/ (update this test's pattern)"
    assert not bad, f"launched names that no entry of expected_entry_points() matches: {bad}"


_ENTRY = re.compile(r'extern\s+"C"\s+__global__\s+void\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?(\w+)\s*\(')


@requires("cpp")   # expands the entry-point macros
def test_expected_entry_points_are_declared_in_the_cu_sources():
    ck = _launch_module()
    problems = []
    for family, names in ck.expected_entry_points().items():
        r = subprocess.run(["cpp", "-P", "-w", "-undef"], input=ck.module_source(family), capture_output=True,
                           text=True, timeout=60)
        assert r.returncode == 0, f"cpp failed on {family}.cu: {r.stderr[:500]}"
        declared = set(_ENTRY.findall(r.stdout))
        missing = sorted(set(names) - declared)
        if missing:
            problems.append(f"{family}.cu lacks {missing}")
    assert not problems, "; ".join(problems)
