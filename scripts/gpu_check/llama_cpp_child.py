"""llama.cpp's side of the `llama-cpp` section, run in its own process (gpu_check's `llama_cpp`
starts it): the CUDA libraries it needs are found through LD_LIBRARY_PATH, which only a new
process reads, and a crash or an abort in ggml must not take gpu_check's other rows with it.

    python3 scripts/gpu_check/llama_cpp_child.py '{"model": "m.gguf", "n_gpu_layers": -1, ...}'

Measures what llama-bench does, through llama-cpp-python's low-level API: decode one token a
step after the KV cache holds `kv_len` cells (tg at depth), and a prompt of `prefill` tokens in
one batch (pp). Flash attention is llama-bench's default, `auto`. The last stdout line is the
result as JSON; llama.cpp's own log goes to stderr (the parent keeps it in a file).
Standard library, numpy and llama_cpp only: it runs from a bare source tree.
"""

from __future__ import annotations

import json
import re
import statistics
import sys
import time
from pathlib import Path


def offloaded_layers(log: str) -> tuple[int, int] | None:
    """(layers on the GPU, layers in all) from llama.cpp's load log ('offloaded 31/31 layers to GPU')."""
    m = re.search(r"offloaded (\d+)/(\d+) layers to GPU", log)
    return (int(m.group(1)), int(m.group(2))) if m else None


class Runner:
    """A model loaded once and one context for every measurement (n_ctx covers the deepest one)."""

    def __init__(self, lib, model_path: str, n_gpu_layers: int, n_ctx: int, n_batch: int) -> None:
        import llama_cpp

        self.lib = lib
        t0 = time.perf_counter()
        # The high-level class loads the model (and its tokenizer, which must parse); the context
        # is made here so flash attention can be `auto`, which Llama(flash_attn=bool) cannot say.
        self.llm = llama_cpp.Llama(model_path, n_gpu_layers=n_gpu_layers, n_ctx=256, n_batch=256, verbose=True)
        params = type(self.llm.context_params).from_buffer_copy(self.llm.context_params)
        params.n_ctx, params.n_batch, params.n_ubatch, params.n_seq_max = n_ctx, n_batch, min(n_batch, 512), 1
        params.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_AUTO
        self.ctx = lib.llama_init_from_model(self.llm.model, params)
        if not self.ctx:
            raise RuntimeError(f"llama_init_from_model failed (n_ctx={n_ctx}, n_batch={n_batch})")
        self.n_batch = lib.llama_n_batch(self.ctx)
        self.batch = lib.llama_batch_init(self.n_batch, 0, 1)
        self.n_vocab = self.llm.n_vocab()
        self.load_s = time.perf_counter() - t0

    def _decode(self, tokens: list[int], pos0: int) -> None:
        """The tokens at positions pos0.. in calls of at most n_batch; logits of the last only."""
        lib, batch = self.lib, self.batch
        for start in range(0, len(tokens), self.n_batch):
            chunk = tokens[start:start + self.n_batch]
            for i, tok in enumerate(chunk):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos0 + start + i, 1
                batch.seq_id[i][0], batch.logits[i] = 0, start + i == len(tokens) - 1
            batch.n_tokens = len(chunk)
            rc = lib.llama_decode(self.ctx, batch)
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc}")
        lib.llama_synchronize(self.ctx)

    def _clear(self) -> None:
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.ctx), True)

    def tokens(self, n: int, seed: int) -> list[int]:
        import numpy as np

        return [int(t) for t in np.random.default_rng(seed).integers(1, self.n_vocab, n)]

    def decode_tok_s(self, kv_len: int, steps: int, warmup: int = 4) -> float:
        """Tokens/s of single-token steps at depth kv_len (as gpu_check times metatp's: `warmup`
        steps first, then `steps` timed, each synchronized)."""
        self._clear()
        if kv_len:
            self._decode(self.tokens(kv_len, 1), 0)
        step_tokens = self.tokens(warmup + steps, 2)
        for i, tok in enumerate(step_tokens[:warmup]):
            self._decode([tok], kv_len + i)
        t0 = time.perf_counter()
        for i, tok in enumerate(step_tokens[warmup:]):
            self._decode([tok], kv_len + warmup + i)
        return steps / (time.perf_counter() - t0)

    def prefill_tok_s(self, n: int, reps: int = 3) -> float:
        """Tokens/s of an n-token prompt into an empty cache (pp n): the median of `reps` after a warm-up."""
        ids = self.tokens(n, 3)
        times = []
        for _ in range(reps + 1):
            self._clear()
            t0 = time.perf_counter()
            self._decode(ids, 0)
            times.append(time.perf_counter() - t0)
        return n / statistics.median(times[1:])

    def close(self) -> None:
        self.lib.llama_batch_free(self.batch)
        self.lib.llama_free(self.ctx)


def run(args: dict) -> dict:
    """Load, measure every KV length and the prompt, and say what llama.cpp was (version, GPU offload)."""
    import llama_cpp
    from llama_cpp import llama_cpp as lib

    kv_lengths = [int(k) for k in args["kv_lengths"]]
    steps, prefill = int(args["steps"]), int(args["prefill"])
    n_ctx = -(-(max(kv_lengths + [prefill]) + steps + 16) // 256) * 256
    runner = Runner(lib, args["model"], int(args["n_gpu_layers"]), n_ctx, int(args.get("n_batch", 512)))
    out = {"version": getattr(llama_cpp, "__version__", "?"), "gpu_offload": bool(lib.llama_supports_gpu_offload()),
           "load_s": runner.load_s, "n_ctx": n_ctx, "decode": {}}
    for kv_len in kv_lengths:
        out["decode"][str(kv_len)] = runner.decode_tok_s(kv_len, steps)
    out["prefill"] = runner.prefill_tok_s(prefill) if prefill else None
    runner.close()
    return out


def main(argv: list[str]) -> int:
    result = run(json.loads(argv[0]))
    sys.stderr.flush()
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    # Run as a file, Python put this folder first on the path: its modules (profile.py) would
    # shadow the standard library's for what llama_cpp imports (lazily, in `run`).
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
    sys.exit(main(sys.argv[1:]))
