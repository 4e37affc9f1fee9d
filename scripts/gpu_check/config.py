"""What a gpu_check run does (the real thing on a GPU, or a small dry run on the emulator),
its time budget, and the engines every section builds."""

from __future__ import annotations

import time
import warnings
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

SMOLLM2_TYPES = {r: "Q4_1" for r in ("q", "k", "v", "o", "gate", "up", "down")} | {"embd": "Q8_0"}


@dataclass
class Config:
    """What a run does: the real thing on a GPU, or a small dry run on the emulator."""

    emulate: bool = False
    n_layer: int = 30
    kv_lengths: tuple[int, ...] = (128, 2048)
    shape_kv_lengths: tuple[int, ...] = (128, 4096)   # the three model sizes' rows (shapes.py)
    shape_decode_steps: int = 64
    big: bool = False                                # shapes.py: the 8B shapes too
    shapes: tuple[str, ...] = ("135M", "1B", "8B")   # shapes.py: the model sizes run (8B only with `big`)
    decode_steps: int = 64
    prompt_len: int = 16
    greedy_steps: int = 15
    prefill_len: int = 512
    profile_copies: tuple[int, int] = (4, 36)     # a launch's copies in the profile's two graphs
    profile_shapes: tuple[str, ...] = ("135M", "1B")  # the shapes whose decode step the profile times
    profile_kv_lengths: tuple[int, ...] = (128,)
    profile_flush_bytes: int = 0                   # bytes an L2 flush reads; 0: twice the GPU's L2 (profile.py)
    # the kernel variants the shapes and profile sections compare (variants.py), in this order
    variants: tuple[str, ...] = ("default", "before", "q8", "pdl")
    # the speed section's virtual devices on one GPU (issue 44 item 6): (N, split mode, the bar)
    virtual_cases: tuple[tuple[int, str, float], ...] = ((2, "tensor", 0.8), (3, "tensor", 0.8), (2, "layer", 0.95))
    # the throughput section (throughput.py): batched-bench rows, long prompts, `metatp serve`
    bench_batches: tuple[int, ...] = (1, 8, 64, 256)
    crossover_tokens: tuple[int, ...] = (1, 8, 16, 32, 64, 128, 256)   # the many-token products' T (throughput.py)
    crossover_reps: int = 10
    bench_pp: int = 128
    bench_tg: int = 32
    prompt_lengths: tuple[int, ...] = (512, 4096)
    serve_clients: int = 64
    serve_tokens: int = 128

    @classmethod
    def dry_run(cls, n_layer: int = 2) -> Config:
        """`--emulate`: the same sections on the kernel emulator, a tiny model, a few steps."""
        # every emulated launch costs tens of ms (each CUDA thread a fiber): one timed step a shape row
        # and profile graphs of 0 and 1 copies (the same capture and replay code, a third of the launches)
        return cls(emulate=True, n_layer=min(n_layer, 2), kv_lengths=(16, 64), shape_kv_lengths=(16, 64),
                   shape_decode_steps=1, decode_steps=4,
                   prompt_len=12, greedy_steps=3, prefill_len=24, profile_copies=(0, 1), profile_kv_lengths=(16,),
                   profile_flush_bytes=2**16, bench_batches=(1, 2, 4), crossover_tokens=(1, 9, 17), bench_pp=4,
                   bench_tg=3, prompt_lengths=(16, 40), serve_clients=4, serve_tokens=4)

    def spec(self):
        """The synthetic model: SmolLM2-135M's shapes (the real model cannot travel to the GPU
        machine); with `emulate` its head geometry at small widths."""
        from metatp.testing.synth import SynthSpec

        if self.emulate:
            return SynthSpec(arch="llama", n_layer=self.n_layer, n_embd=192, n_head=6, n_head_kv=3,
                             n_ff=128, n_vocab=384, n_ctx_train=8192, rope_base=100000.0, norm_eps=1e-5,
                             tied=True, types=dict(SMOLLM2_TYPES), seed=0)
        return SynthSpec(arch="llama", n_layer=self.n_layer, n_embd=576, n_head=9, n_head_kv=3, n_ff=1536,
                         n_vocab=49152, n_ctx_train=8192, rope_base=100000.0, norm_eps=1e-5, tied=True,
                         types=dict(SMOLLM2_TYPES), seed=0)

    def runtime(self):
        """The CUDA backend's device API: the emulator's with `emulate`, else CuPy's (None)."""
        if self.emulate:
            from metatp.testing import EmuRuntime

            return EmuRuntime()
        return None

    @property
    def vocab(self) -> int:
        return self.spec().n_vocab


def gpu_answers(cfg: Config) -> bool:
    """Does the GPU still answer this process? After a kernel fault (a misaligned or illegal address, a
    trap) the CUDA context keeps a sticky error and every call fails: the rest of a part then belongs
    in a fresh process (`Report.resume`). Always True on the emulator."""
    if cfg.emulate:
        return True
    try:
        import cupy as cp

        cp.cuda.runtime.deviceSynchronize()
        return True
    except Exception:  # noqa: BLE001 - any error here means the context is gone
        return False


class Budget:
    """Seconds left of the whole run (each section checks it before a long step)."""

    def __init__(self, seconds: float) -> None:
        self.end = time.perf_counter() + seconds

    def left(self) -> float:
        return self.end - time.perf_counter()


def layout(n: int, ts=None, split_mode: str = "tensor"):
    from metatp.passes.plan import DeviceLayout

    return DeviceLayout(n, split_mode if n > 1 else "none", ts)


def cupy_engine(cfg: Config, model, n_ctx: int, n: int = 1, ts=None, cache: str = "f32", split_mode: str = "tensor",
                **kw):
    """A cupy engine on `n` (virtual) devices split by `split_mode` ("tensor" / "layer"); `cache`:
    the KV cache type of K and V ("q8_0", ...; default the F32 graph cache, stored as the backend's
    kv_dtype); `kw` go to CupyBackend."""
    from metatp.backends.registry import backend_entry
    from metatp.engine import Engine

    lay = layout(n, ts, split_mode)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return Engine(model, n_ctx, lay, backend_entry("cupy").create(lay, kw, runtime=cfg.runtime()),
                      cache_type_k=cache, cache_type_v=cache)


@contextmanager
def on_emulator():
    """`LLM(backend="cupy")` built inside runs on a fresh `EmuRuntime` (the GPU probe answers yes):
    the dry run's stand-in for a GPU where the section builds an LLM, not an Engine."""
    import metatp.backends as backends
    import metatp.backends.cuda.backend as cuda_backend
    from metatp.testing import EmuRuntime

    saved = backends.gpu_probe, cuda_backend.CupyRuntime
    backends.gpu_probe, cuda_backend.CupyRuntime = (lambda: (True, "")), EmuRuntime
    try:
        yield
    finally:
        backends.gpu_probe, cuda_backend.CupyRuntime = saved


def cupy_llm(cfg: Config, path, **kw):
    """An `LLM` on the cupy backend (on the emulator with `cfg.emulate`); `kw` go to LLM."""
    from metatp import LLM

    with (on_emulator() if cfg.emulate else nullcontext()), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return LLM(str(path), backend="cupy", **kw)


def numpy_engine(model, n_ctx: int, cache: str = "f32"):
    """The reference: the numpy backend on one device, its KV cache of type `cache`."""
    from metatp.backends.registry import backend_entry
    from metatp.engine import Engine

    lay = layout(1)
    return Engine(model, n_ctx, lay, backend_entry("numpy").create(lay, {}), cache_type_k=cache, cache_type_v=cache)
