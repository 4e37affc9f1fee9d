"""The compiled decode attention alone, at depth: one call per layer over caches laid out as the
graph lays them (cells of n_head_kv rows side by side), for each cache type and thread count.
Why: `metatp bench -d` gives attention per token as a difference of two decode rates, which a
shared machine makes noisy; this times the kernel itself (the best of `--reps` sweeps over all
layers, wall and CPU time), the default model's shapes by default.

    python -m scripts.attn_bench --depth 1536 --threads 1,2 --types f32,f16,q8_0 [--q8]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from metatp.backends.numpy.native import prepare_attention
from metatp.backends.numpy.native.kv import kv_quantize
from metatp.ir.models.common import KV_CACHE_TYPES

__all__ = ["time_attention", "main"]


def _cache(rng, n: int, hkv: int, d: int, name: str) -> np.ndarray:
    """A random cache (n cells, hkv rows of d) stored as `name`, viewed (hkv, n, row) as the kernel reads it."""
    x = rng.standard_normal((n * hkv, d)).astype(np.float32)
    ty = int(KV_CACHE_TYPES[name])
    stored = x if ty == 0 else x.astype(np.float16) if ty == 1 else kv_quantize(x, ty)
    return stored.reshape(n, hkv, -1).transpose(1, 0, 2)


def time_attention(depth: int, threads: int, name: str, q8: bool = False, layers: int = 30, heads: int = 9,
                   kv_heads: int = 3, head_dim: int = 64, reps: int = 20, seed: int = 0) -> tuple[float, float]:
    """(wall, CPU) seconds per layer of one decode token's attention over depth + 1 cells, the best of reps."""
    rng = np.random.default_rng(seed)
    ty = int(KV_CACHE_TYPES[name])
    n = depth + 1
    calls = []
    for _ in range(layers):
        q = rng.standard_normal((heads, 1, head_dim)).astype(np.float32)
        k, v = _cache(rng, n, kv_heads, head_dim, name), _cache(rng, n, kv_heads, head_dim, name)
        out = np.empty((1, heads, head_dim), np.float32)
        calls.append(prepare_attention(q, k, v, np.zeros((1, n), np.float32), head_dim ** -0.5, 0.0, None, out,
                                       threads, ty, ty, q8=q8))
    wall = cpu = float("inf")
    for _ in range(reps):
        t0, c0 = time.perf_counter(), time.process_time()
        for run in calls:
            run(n)
        wall, cpu = min(wall, time.perf_counter() - t0), min(cpu, time.process_time() - c0)
    return wall / layers, cpu / layers


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m scripts.attn_bench", description=__doc__.splitlines()[0])
    p.add_argument("--depth", default="1536", help="cache depths, comma-separated")
    p.add_argument("--threads", default="1,2")
    p.add_argument("--types", default="f32,f16,q8_0", help=f"of {','.join(KV_CACHE_TYPES)}")
    p.add_argument("--q8", action="store_true", help='numerics "q8": integer Q.K for a q8_0 K cache')
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--reps", type=int, default=20)
    a = p.parse_args(argv)
    bad = [t for t in a.types.split(",") if t not in KV_CACHE_TYPES]
    if bad:
        p.error(f"--types: unknown cache type(s) {bad}")
    print("| type | q8 | depth | threads | wall us/layer | cpu us/layer | ms/token (wall x layers) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for depth in (int(x) for x in a.depth.split(",")):
        for name in a.types.split(","):
            for threads in (int(x) for x in a.threads.split(",")):
                wall, cpu = time_attention(depth, threads, name, a.q8, a.layers, reps=a.reps)
                print(f"| {name} | {'yes' if a.q8 else 'no'} | {depth} | {threads} | {wall * 1e6:.0f} | {cpu * 1e6:.0f} "
                      f"| {wall * a.layers * 1e3:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
