"""Step 1: the environment (GPU, driver, CUDA runtime, CuPy, NVRTC, NCCL, cuBLAS) as info rows."""

from __future__ import annotations

import sys
import warnings

import numpy as np

from scripts.gpu_check.config import Config
from scripts.gpu_check.report import Report


def section_env(rep: Report, cfg: Config) -> bool:
    """GPU, driver, runtime, library versions. False when there is no usable GPU (with
    `cfg.emulate`: when the kernel emulator cannot run)."""
    from metatp.backends.cuda import runtime
    from metatp.testing import emulator_available

    rep.env["python"] = sys.version.split()[0]
    rep.env["numpy"] = np.__version__
    if cfg.emulate:
        rep.env["gpu"] = "none: CPU kernel emulator (dry run)"
        rep.add("env", "gpu", rep.env["gpu"], None)
        return emulator_available()
    try:
        import cupy

        rep.env["cupy"] = cupy.__version__
    except Exception as e:  # noqa: BLE001
        rep.add("env", "cupy", f"not importable: {e}", False)
        return False
    if not runtime.gpu_available():
        rep.add("env", "GPU", "cupy sees no CUDA device", False)
        return False
    rt = cupy.cuda.runtime
    props = rt.getDeviceProperties(0)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    rep.env.update({"gpu": name, "gpus": rt.getDeviceCount(), "sm": f"{props['major']}.{props['minor']}",
                    "sms": props.get("multiProcessorCount"), "memory_GiB": round(props["totalGlobalMem"] / 2**30, 1),
                    "driver": rt.driverGetVersion(), "runtime": rt.runtimeGetVersion()})
    try:
        from cupy.cuda import nvrtc

        rep.env["nvrtc"] = ".".join(map(str, nvrtc.getVersion()))
    except Exception as e:  # noqa: BLE001
        rep.env["nvrtc"] = f"unavailable ({type(e).__name__})"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from cupy.cuda import nccl
        rep.env["nccl"] = nccl.get_version() if nccl.available else "unavailable"
    except Exception as e:  # noqa: BLE001
        rep.env["nccl"] = f"unavailable ({type(e).__name__})"
    from metatp.backends.cuda.runtime import CupyRuntime

    rep.env["cublas"] = "yes" if CupyRuntime().gemm_available() else "no (prefill uses matvec)"
    for k in ("gpu", "gpus", "sm", "driver", "runtime", "cupy", "nvrtc", "nccl", "cublas"):
        rep.add("env", k, str(rep.env.get(k)), None)
    return True
