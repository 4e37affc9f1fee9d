"""Check every metatp CUDA kernel against a float64 reference on a GPU (or the CPU emulator).

    python -m scripts.gpu_kernels_check            # markdown table, exit 1 on a failure
    python -m scripts.gpu_kernels_check matvec attn_decode --reps 20
    python -m scripts.gpu_kernels_check --emulate      # no GPU: kernels as host C++

The checks, one module per kernel family, and the references live in test support
(`metatp.testing.kernel_checks`, `metatp.testing.oracles`); this is their
command line. `tests/test_cuda_kernels.py` runs the same checks. `scripts/mmq_crossover.py` beside it
times the three MUL_MAT paths (matvec, the tiled mmq kernel, dequantize + cuBLAS) over token counts.
"""

from __future__ import annotations

import sys

from metatp.testing.kernel_checks import CHECK_NAMES, check_all_kernels, markdown_table

__all__ = ["CHECK_NAMES", "check_all_kernels", "markdown_table", "main"]


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("names", nargs="*", help=f"check groups (default all): {' '.join(CHECK_NAMES)}")
    ap.add_argument("--reps", type=int, default=5, help="timed launches per case (0: no timing)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--emulate", action="store_true", help="run on the CPU emulator (g++) instead of a GPU")
    args = ap.parse_args(argv)
    results = check_all_kernels(args.names or None, seed=args.seed, time_reps=args.reps, emulate=args.emulate)
    print(markdown_table(results))
    bad = [r for r in results if not r["pass"]]
    for r in bad:
        if r.get("error"):
            print(f"\n{r['name']} [{r['dtype']}]: {r['error']}", file=sys.stderr)
            if r.get("traceback"):
                print(r["traceback"], file=sys.stderr)
    print(f"\n{len(results) - len(bad)}/{len(results)} passed")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
