"""Every CUDA kernel against a float64 reference, one check module per kernel family.

Used by `tests/test_cuda_kernels.py` (on the CPU emulator, and on a GPU when there is one)
and by `scripts/gpu_kernels_check.py` / `scripts/gpu_check` (on a GPU, timed). A group name
("matvec_multi", "attn_decode", ...) selects one check function; `check_all_kernels` runs
groups and returns one dict per case: name, dtype, shape, max_rel_err, threshold, pass,
time_us (median of ``time_reps`` timed launches; None when not timed) and error.
"""

from __future__ import annotations

from typing import Callable

from metatp.backends.cuda.launch import using
from metatp.backends.cuda.runtime import CupyRuntime
from metatp.testing.cuda_emulator import Emulator
from metatp.testing.kernel_checks import attn, dequant, elementwise, kv, matvec, mmq, mmvq, norm, qkv_rope, rope
from metatp.testing.kernel_checks.harness import Checker, check_compile

__all__ = ["FAMILY_CHECKS", "CHECK_NAMES", "CHECKS", "check_all_kernels", "markdown_table"]

#: kernel family -> its check groups (the module that holds them)
FAMILY_CHECKS = {m.__name__.rsplit(".", 1)[-1]: m.CHECKS for m in (dequant, matvec, qkv_rope, mmq, mmvq, norm, rope, kv, attn, elementwise)}

#: group name -> check function, in run order
CHECKS: dict[str, Callable[[Checker], None]] = {"compile": check_compile}
for _mod in (dequant, matvec, qkv_rope, mmq, mmvq, norm, rope, kv, attn, elementwise):
    for _name in _mod.CHECKS:
        CHECKS[_name] = getattr(_mod, f"check_{_name}")
CHECK_NAMES = tuple(CHECKS)


def check_all_kernels(names=None, *, seed: int = 0, time_reps: int = 5, emulate: bool = False,
                      engine=None) -> list[dict]:
    """Run the kernel checks (all, or the groups in `names`); one dict per case.

    emulate: run the kernels on the CPU emulator instead of a GPU (no timing). engine: the
    runtime to launch on (a CupyRuntime whose modules were compiled ahead), else a new one."""
    names = list(CHECK_NAMES if names is None else names)
    for n in names:
        if n not in CHECKS:
            raise ValueError(f"unknown check {n!r}; known: {CHECK_NAMES}")
    try:
        engine = engine if engine is not None else _engine(emulate)
        chk = Checker(seed, time_reps, engine if emulate else None)
    except Exception as e:  # noqa: BLE001 - no cupy / no GPU / no compiler
        return [{"name": "setup", "dtype": "-", "shape": "-", "max_rel_err": None, "threshold": None,
                 "pass": False, "time_us": None, "error": f"{type(e).__name__}: {e}"}]
    with using(engine):
        for n in names:
            try:
                CHECKS[n](chk)
            except Exception as e:  # noqa: BLE001 - a crashing group becomes a failed row
                chk.fail(n, e)
    return chk.results


def _engine(emulate: bool):
    """The kernel engine the checks launch on: the emulator, or CuPy's NVRTC runtime."""
    return Emulator() if emulate else CupyRuntime()


def markdown_table(results: list[dict]) -> str:
    lines = ["| name | dtype | shape | max rel err | threshold | pass | time µs |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        err = "-" if r.get("max_rel_err") is None else f"{r['max_rel_err']:.2e}"
        thr = "-" if r.get("threshold") is None else f"{r['threshold']:.0e}"
        tus = "-" if r.get("time_us") is None else f"{r['time_us']:.1f}"
        ok = "yes" if r["pass"] else "**NO**"
        lines.append(f"| {r['name']} | {r['dtype']} | {r['shape']} | {err} | {thr} | {ok} | {tus} |")
    return "\n".join(lines)
