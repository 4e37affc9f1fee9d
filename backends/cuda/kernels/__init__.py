"""The kernel families, one module per ``cuda/<family>.cu`` (as ggml-cuda keeps a family's launcher
and its decisions next to its kernel).

Each family module holds its launchers (arrays plus Python ints/floats, launched on the current
stream of the kernel engine in use, `launch.using`, or recorded inside `launch.recording()`), its
`ENTRY_POINTS`, and what the backend asks it: `HANDLERS` ({Op: handler}), `FUSIONS` (its
`handler.FusionRow`s) and `workspace(...)` (its scratch needs). ``ops`` and ``fusion`` assemble
those tables; see docs/kernels.md for adding a kernel.

``from metatp.backends.cuda import kernels as ck``: ``ck.<family>`` is the family module
(``ck.norm.rms_norm``); a name no module here has (``ck.add_inplace``, ``ck.WEIGHT_TYPES``) is
found in the one family module, or `launch`, whose ``__all__`` lists it.
"""

from __future__ import annotations

import time
from types import ModuleType

from metatp.backends.cuda import launch as _launch
from metatp.backends.cuda.kernels import attn, dequant, elementwise, kv, matvec, mmq, mmvq, norm, qkv_rope, rope

__all__ = ["FAMILY_MODULES", "expected_entry_points", "compile_all", "attn", "dequant", "elementwise", "kv", "matvec",
           "mmq", "mmvq", "norm", "qkv_rope", "rope"]

#: family name -> its module, in `launch.FAMILIES` order
FAMILY_MODULES: dict[str, ModuleType] = {m.__name__.rsplit(".", 1)[-1]: m
                                         for m in (dequant, matvec, qkv_rope, mmq, mmvq, norm, rope, kv, attn, elementwise)}
assert tuple(FAMILY_MODULES) == _launch.FAMILIES


def __getattr__(name: str):
    """A launcher or launch helper by its own name, from the one module that exports it."""
    found = {id(v): v for m in (*FAMILY_MODULES.values(), _launch) if name in m.__all__
             for v in (getattr(m, name),)}
    if len(found) != 1:
        raise AttributeError(f"{__name__} has no {name!r}" if not found else
                             f"{__name__}.{name} is exported by several families: name the family")
    return next(iter(found.values()))


def expected_entry_points() -> dict[str, list[str]]:
    """Every extern "C" kernel name the launchers launch, per family (each family module's
    ENTRY_POINTS)."""
    return {fam: list(mod.ENTRY_POINTS) for fam, mod in FAMILY_MODULES.items()}


def compile_all(families=None) -> dict[str, float]:
    """Compile (and load) every family on the current device of the current engine; seconds per family."""
    out = {}
    names = expected_entry_points()
    for fam in families or _launch.FAMILIES:
        t0 = time.perf_counter()
        for n in names[fam]:
            _launch.get_kernel(fam, n)
        out[fam] = time.perf_counter() - t0
    return out
