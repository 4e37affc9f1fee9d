"""Step 0: one line per prerequisite in about 10 seconds, so a fresh machine that lacks one
(yaml, gguf, CuPy, a device, a kernel that compiles and runs) fails fast and says why."""

from __future__ import annotations

import time
import warnings

import numpy as np

from scripts.gpu_check.config import Config
from scripts.gpu_check.report import Report

PREFLIGHT_SECONDS = 10.0


def preflight(rep: Report, cfg: Config) -> bool:
    """True when the GPU run can go on (with `cfg.emulate`: when the emulator can run; GPU
    items are then reported, absent or not)."""
    t_end = time.perf_counter() + PREFLIGHT_SECONDS
    state: dict = {"emulate": cfg.emulate}

    def item(name: str, fn, required: bool) -> bool:
        if time.perf_counter() > t_end:
            rep.add("preflight", name, f"skipped (preflight over {PREFLIGHT_SECONDS:.0f} s)", False if required else None)
            return False
        try:
            result, ok = fn(state)
        except Exception as e:  # noqa: BLE001 - each item says what went wrong
            result, ok = f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"[:240], False
        if ok is False and not required:
            ok = None
        rep.add("preflight", name, result, ok)
        return ok is not False

    gpu_needed = not cfg.emulate
    ok = item("yaml", _pf_yaml, True)
    ok &= item("gguf", _pf_gguf, True)
    item("numpy", lambda st: (np.__version__, True), True)
    ok &= item("cupy", _pf_cupy, gpu_needed)
    item("nvrtc", _pf_nvrtc, gpu_needed)
    item("cuda headers", _pf_headers, gpu_needed)
    ok &= item("gpu", _pf_gpu, gpu_needed)
    ok &= item("trivial RawKernel", _pf_kernel, gpu_needed)
    item("nccl", _pf_nccl, False)
    item("free memory", _pf_memory, False)
    if cfg.emulate:
        from metatp.testing import emulator_available

        return item("kernel emulator (g++)", lambda st: ("available" if emulator_available() else "no g++",
                                                         emulator_available()), True) and bool(ok)
    return bool(ok)


def _absent(st: dict, what: str) -> tuple[str, bool | None]:
    """A GPU item that cannot be had: a failure on a GPU run, a plain note with --emulate."""
    return (f"absent ({what})", None if st["emulate"] else False)


def _pf_yaml(st):
    import yaml

    return f"{yaml.__version__}", True


def _pf_gguf(st):
    from importlib.metadata import version

    import gguf  # noqa: F401 - imports yaml through gguf.metadata

    try:
        return version("gguf"), True
    except Exception:  # noqa: BLE001 - a wheel without metadata on the path
        return "imported", True


def _pf_cupy(st):
    try:
        import cupy
    except Exception as e:  # noqa: BLE001
        return _absent(st, f"cupy not importable: {type(e).__name__}: {e}")
    st["cupy"] = cupy
    return cupy.__version__ + ("" if int(cupy.__version__.split(".")[0]) >= 14 else
                               " (13.x: None kernel arguments are not NULL; metatp passes 0 itself)"), True


def _pf_nvrtc(st):
    if "cupy" not in st:
        return _absent(st, "no cupy")
    from cupy.cuda import nvrtc

    return ".".join(map(str, nvrtc.getVersion())), True


def _pf_headers(st):
    if "cupy" not in st:
        return _absent(st, "no cupy")
    from cupy._core import core

    opts = core.assemble_cupy_compiler_options(())
    std = next((o for o in opts if "std=" in o), "?")
    return f"found ({std}, {len([o for o in opts if o.startswith('-I')])} include dirs)", True


def _pf_gpu(st):
    cupy = st.get("cupy")
    if cupy is None:
        return _absent(st, "no cupy")
    if not cupy.cuda.is_available():
        return _absent(st, "cupy sees no CUDA device")
    rt = cupy.cuda.runtime
    props = rt.getDeviceProperties(0)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    st["gpus"] = rt.getDeviceCount()
    return (f"{st['gpus']} x {name} (sm {props['major']}.{props['minor']}), driver {rt.driverGetVersion()}, "
            f"runtime {rt.runtimeGetVersion()}"), True


def _pf_kernel(st):
    if "gpus" not in st:
        return _absent(st, "no GPU")
    from metatp.backends.cuda import runtime

    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        usable, why = runtime.gpu_probe()
    return (f"compiled and ran in {time.perf_counter() - t0:.1f} s" if usable else why), usable


def _pf_nccl(st):
    if "cupy" not in st:
        return _absent(st, "no cupy")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from cupy.cuda import nccl
    if not getattr(nccl, "available", False):
        return "not available to cupy (multi-GPU all-reduce uses the copy-and-add butterfly)", None
    return f"{nccl.get_version()}", True


def _pf_memory(st):
    if "gpus" not in st:
        return _absent(st, "no GPU")
    cupy = st["cupy"]
    parts = []
    for g in range(st["gpus"]):
        with cupy.cuda.Device(g):
            free, total = cupy.cuda.runtime.memGetInfo()
        parts.append(f"GPU {g}: {free / 2**30:.1f} of {total / 2**30:.1f} GiB free")
    return "; ".join(parts), True
