"""Soak: many generate calls with random prompts and sampling parameters in one process.

Checks that memory stays flat (no per-call growth) and that results are deterministic for a
fixed seed. `python -m scripts.soak --calls 1000` runs the long version on a tiny synthetic model.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import os
import tempfile
import time
from pathlib import Path

import numpy as np

__all__ = ["soak", "current_rss"]


def current_rss() -> int:
    """Resident set size of this process in bytes (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


def soak(model_path: str | os.PathLike, n_calls: int, seed: int = 0, n_ctx: int = 96) -> dict:
    """Run `n_calls` random generate calls; return a digest of all outputs and RSS readings."""
    from metatp import LLM, SamplingParams

    rng = np.random.default_rng(seed)
    llm = LLM(str(model_path), n_ctx=n_ctx, backend="numpy", seed=seed)
    vocab = llm.n_vocab
    h = hashlib.sha256()
    rss = []
    t0 = time.perf_counter()
    warm = max(n_calls // 10, 1)
    for i in range(n_calls):
        n_prompt = int(rng.integers(1, n_ctx // 2))
        prompt = [int(x) for x in rng.integers(2, vocab, n_prompt)]
        params = SamplingParams(
            max_tokens=int(rng.integers(0, n_ctx)), temperature=float(rng.choice([0.0, 0.5, 1.0, 1.5])),
            top_k=int(rng.choice([-1, 1, 5, 50])), top_p=float(rng.choice([1.0, 0.9, 0.5])),
            min_p=float(rng.choice([0.0, 0.05])), seed=int(rng.integers(0, 2**31)),
            stop=[str(rng.choice(["ee", "a", "zz"]))] if rng.random() < 0.3 else None, ignore_eos=bool(rng.random() < 0.5))
        out = llm.generate([prompt], params)[0].outputs[0]
        assert len(prompt) + len(out.token_ids) <= n_ctx + 1
        h.update(np.asarray(out.token_ids, dtype=np.int64).tobytes())
        h.update(out.finish_reason.encode())
        if i == warm or i == n_calls - 1:
            gc.collect()
            rss.append(current_rss())
    return {"calls": n_calls, "digest": h.hexdigest(), "rss_after_warmup": rss[0], "rss_end": rss[-1],
            "seconds": time.perf_counter() - t0}


def main() -> int:
    from metatp.testing.synth import SynthSpec, write_synthetic_gguf

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("-m", "--model", default=None, help="GGUF to use (default: a tiny synthetic model)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model
        if path is None:
            path = Path(tmp) / "tiny.gguf"
            write_synthetic_gguf(path, SynthSpec(n_layer=1, n_embd=32, n_head=2, n_head_kv=1, n_ff=64, seed=args.seed))
        r = soak(path, args.calls, args.seed)
        again = soak(path, args.calls, args.seed)
    grow = (r["rss_end"] - r["rss_after_warmup"]) / 2**20
    same = r["digest"] == again["digest"]
    print(f"{r['calls']} calls in {r['seconds']:.1f} s; RSS after warm-up {r['rss_after_warmup'] / 2**20:.1f} MiB, "
          f"at end {r['rss_end'] / 2**20:.1f} MiB (growth {grow:+.1f} MiB); digest {r['digest'][:16]}, "
          f"repeat run {'identical' if same else 'DIFFERENT'}")
    return 0 if grow < 20 and same else 1


if __name__ == "__main__":
    raise SystemExit(main())
