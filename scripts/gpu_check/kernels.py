"""Step 2: every CUDA kernel against numpy on fresh random inputs (`metatp.testing.kernel_checks`,
timed), one row per kernel group."""

from __future__ import annotations

import time

from scripts.gpu_check.config import Config
from scripts.gpu_check.isolate import hand_on_if_lost
from scripts.gpu_check.report import Report


def section_kernels(rep: Report, cfg: Config, groups: list[str] | None = None) -> None:
    """The kernel checks (all, or `groups`), a group at a time, a row per kernel group. After a group
    that failed, a GPU whose context no longer answers (a fault's sticky error) ends this process's
    checks: the groups left are handed on (`Report.resume`) to run in a fresh process."""
    from metatp.testing import kernel_checks as gkc

    t0 = time.perf_counter()
    engine = None if cfg.emulate else _precompiled_runtime(rep)
    names = list(gkc.CHECK_NAMES if groups is None else groups)
    results: list[dict] = []
    for i, name in enumerate(names):
        got = gkc.check_all_kernels([name], time_reps=3, emulate=cfg.emulate, engine=engine)
        results += got
        if hand_on_if_lost(rep, cfg, any(not r["pass"] for r in got), "kernels", name, "kernels", names[i + 1:]):
            break
    rep.kernel_table = gkc.markdown_table(results)
    by_group: dict[str, list[dict]] = {}
    for r in results:
        by_group.setdefault(r["name"].split(":")[0], []).append(r)
    for name, rows in by_group.items():
        bad = [r for r in rows if not r["pass"]]
        worst = max((r["max_rel_err"] for r in rows if r.get("max_rel_err") is not None), default=None)
        res = f"{len(rows) - len(bad)}/{len(rows)} pass"
        if worst is not None:
            res += f", worst rel err {worst:.1e}"
        if bad:
            res += "; failing: " + ", ".join(f"{r['dtype']} ({r.get('error') or r.get('max_rel_err')})"
                                             for r in bad[:3])
        rep.add("kernels", name, res, not bad)
    rep.add("kernels", "time", f"{time.perf_counter() - t0:.1f} s (NVRTC compile included)", None)


def _precompiled_runtime(rep: Report):
    """A CuPy runtime with every kernel module compiled at once (`CupyRuntime.precompile`, as the
    backend does before its first step); the row gives the wall time against the modules' sum.
    None (the checks make their own runtime and report why) when CuPy cannot start."""
    from metatp.backends.cuda.launch import FAMILIES
    from metatp.backends.cuda.runtime import CupyRuntime

    try:
        rt = CupyRuntime()
        t0 = time.perf_counter()
        seconds = rt.precompile([rt.current_gpu()], FAMILIES)
    except Exception as e:  # noqa: BLE001 - the checks' setup row says what is missing
        rep.add("kernels", "NVRTC compile, all modules at once", f"{type(e).__name__}: {e}", False)
        return None
    wall = time.perf_counter() - t0
    slowest = max(seconds, key=seconds.get) if seconds else "-"
    rep.add("kernels", "NVRTC compile, all modules at once",
            f"{wall:.1f} s wall for {len(seconds)} modules ({sum(seconds.values()):.1f} s summed; slowest "
            f"{slowest} {seconds.get(slowest, 0.0):.1f} s)", None)
    return rt
