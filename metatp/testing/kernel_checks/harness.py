"""The kernel-check harness: what every family's checks run in.

A `Checker` owns the random generator, makes device arrays (CuPy on a GPU, numpy on the
emulator), runs one case (launch, compare with a float64 reference, optionally time) and keeps
one result row per case; a crashing case becomes a failed row, so one broken kernel does not
hide the others. Outputs are pre-filled with NaN; ``max_rel_err`` is max|out - ref| / max|ref|.
"""

from __future__ import annotations

import time
import traceback
from typing import Callable

import numpy as np

from metatp.backends.cuda import kernels as ck
from metatp.testing.oracles import rel_err

__all__ = ["Arrays", "Checker", "check_compile"]


class Arrays:
    """The few array operations the checks need, on CuPy (a GPU) or numpy (the emulator)."""

    def __init__(self, emulator=None):
        self.emulated = emulator is not None
        if self.emulated:
            self.xp = np
        else:
            import cupy as cp  # noqa: PLC0415

            self.xp = cp

    def dev(self, a):
        return self.xp.array(np.ascontiguousarray(a), copy=True)

    def host(self, a):
        return np.array(a, copy=True) if self.emulated else self.xp.asnumpy(a)

    def full(self, shape, value, dtype=np.float32):
        return self.xp.full(shape, value, dtype=dtype)

    def zeros(self, shape, dtype=np.float32):
        return self.xp.zeros(shape, dtype=dtype)

    def empty_like(self, a):
        return self.xp.empty_like(a)

    def sync(self):
        if not self.emulated:
            self.xp.cuda.runtime.deviceSynchronize()


class Checker:
    """One run of kernel checks: fresh random inputs, NaN-filled outputs, one result row per case."""

    def __init__(self, seed: int, time_reps: int, emulator=None):
        self.arrays = Arrays(emulator)
        self.cp = self.arrays.xp
        self.ck = ck
        self.rng = np.random.default_rng(seed)
        self.time_reps = 0 if emulator is not None else time_reps
        self.results: list[dict] = []

    # device helpers
    def dev(self, a):
        return self.arrays.dev(a)

    def nan(self, shape, dtype=np.float32):
        return self.arrays.full(shape, np.nan, dtype)

    def host(self, a):
        return self.arrays.host(a)

    def sync(self):
        self.arrays.sync()

    def time_us(self, run: Callable[[], None]) -> float | None:
        if self.time_reps <= 0:
            return None
        cp = self.cp
        run()  # warm-up
        times = []
        for _ in range(self.time_reps):
            e0, e1 = cp.cuda.Event(), cp.cuda.Event()
            e0.record()
            run()
            e1.record()
            e1.synchronize()
            times.append(cp.cuda.get_elapsed_time(e0, e1) * 1000.0)
        return float(np.median(times))

    def case(self, name: str, dtype: str, shape, run: Callable[[], None], out: Callable,
             ref, threshold: float, err_fn=rel_err) -> None:
        """Run one case: launch, compare, time. Exceptions become a failed row."""
        row = {"name": name, "dtype": dtype, "shape": str(tuple(shape)), "max_rel_err": None,
               "threshold": threshold, "pass": False, "time_us": None, "error": None}
        try:
            run()
            self.sync()
            err = err_fn(out(), ref)
            row["max_rel_err"] = err
            row["pass"] = bool(err <= threshold)
            try:
                row["time_us"] = self.time_us(run)
            except Exception as e:  # noqa: BLE001 - timing must not fail a correct kernel
                row["error"] = f"timing: {type(e).__name__}: {e}"
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {e}"
            row["traceback"] = traceback.format_exc(limit=6)
        self.results.append(row)

    def fail(self, name: str, e: BaseException) -> None:
        self.results.append({"name": name, "dtype": "-", "shape": "-", "max_rel_err": None,
                             "threshold": None, "pass": False, "time_us": None,
                             "error": f"{type(e).__name__}: {e}",
                             "traceback": traceback.format_exc(limit=6)})

    # ------------------------------------------------------------------ checks


def check_compile(c: Checker) -> None:
    ck = c.ck
    for fam in ck.FAMILIES:
        row = {"name": f"compile:{fam}", "dtype": "-", "shape": "-", "max_rel_err": None,
               "threshold": None, "pass": False, "time_us": None, "error": None}
        try:
            t0 = time.perf_counter()
            ck.compile_all([fam])
            row["time_us"] = (time.perf_counter() - t0) * 1e6
            row["pass"] = True
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {e}"
        c.results.append(row)
