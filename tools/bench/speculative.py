"""`metatp bench --speculative ngram|draft`: one sequence's tokens/s with and without speculative
decoding, measured in one invocation (their repetitions interleaved), on a quoting prompt (the
output repeats the prompt: n-gram lookup's best case) and a free-writing one, with the
acceptance rate (drafted tokens kept), the tokens each verification step gave, and whether
the greedy tokens were the same (they must be).

Each row's t/s is generated tokens over the request's wall time (its prompt's prefill included,
the same in both); the first run of each setup warms up (plans) and is not counted.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

__all__ = ["PROMPTS", "run_speculative", "format_speculative"]

_PASSAGE = ("The lighthouse stood at the edge of the cliff, its white tower streaked with salt. Every evening "
            "the keeper climbed the one hundred and twelve steps, trimmed the wick, polished the great lens and "
            "wrote the weather in a leather book. Ships passed in the night and never knew his name, but they "
            "knew his light, and that was enough for him.")
PROMPTS = {
    "quote": f"{_PASSAGE}\n\nCopy the paragraph above exactly, word for word.\n\n{_PASSAGE[:60]}",
    "free": "Write a short story about a dragon who learns to bake bread.\n\nOnce upon a time,",
}


def run_speculative(llm_kwargs: dict[str, Any], speculative_config: dict[str, Any], n_gen: int,
                    repetitions: int, progress=None) -> list[dict]:
    """Rows (one per prompt) of plain vs speculative decoding of `n_gen` greedy tokens."""
    from metatp import LLM, SamplingParams

    plain = LLM(**llm_kwargs)
    spec = LLM(**llm_kwargs, speculative_config=speculative_config)
    params = SamplingParams(max_tokens=n_gen, temperature=0, ignore_eos=True)
    stats = spec.scheduler.speculator.stats
    rows = []
    for name, prompt in PROMPTS.items():
        times: dict[str, list[float]] = {"plain": [], "spec": []}
        tokens: dict[str, list[int]] = {}
        drafted0, accepted0, steps0, emitted0 = stats.drafted, stats.accepted, stats.steps, stats.emitted
        for rep in range(repetitions + 1):
            for key, llm in (("plain", plain), ("spec", spec)):
                t0 = time.perf_counter()
                out = llm.generate([prompt], params)[0].outputs[0]
                dt = time.perf_counter() - t0
                tokens[key] = out.token_ids
                if rep:
                    times[key].append(len(out.token_ids) / dt)
            if rep == 0:
                drafted0, accepted0, steps0, emitted0 = stats.drafted, stats.accepted, stats.steps, stats.emitted
        drafted, accepted = stats.drafted - drafted0, stats.accepted - accepted0
        steps, emitted = stats.steps - steps0, stats.emitted - emitted0
        row = {"prompt": name, "method": speculative_config["method"], "k": speculative_config["num_speculative_tokens"],
               "n_gen": n_gen, "plain_ts": statistics.fmean(times["plain"]), "spec_ts": statistics.fmean(times["spec"]),
               "acceptance": accepted / drafted if drafted else 0.0,
               "tokens_per_step": emitted / steps if steps else 1.0,
               "same_tokens": tokens["plain"] == tokens["spec"]}
        row["speedup"] = row["spec_ts"] / row["plain_ts"]
        rows.append(row)
        if progress:
            progress(row)
    return rows


def format_speculative(rows: list[dict], output: str = "md") -> str:
    """The rows as a markdown table (or json / csv)."""
    if output == "json":
        import json

        return json.dumps(rows, indent=2)
    cols = ["prompt", "method", "k", "n_gen", "plain_ts", "spec_ts", "speedup", "acceptance", "tokens_per_step",
            "same_tokens"]

    def cell(r: dict, c: str) -> str:
        v = r[c]
        return f"{v:.2f}" if isinstance(v, float) else str(v)

    if output == "csv":
        return "\n".join([",".join(cols)] + [",".join(cell(r, c) for c in cols) for r in rows])
    head = ["prompt", "method", "k", "tokens", "t/s plain", "t/s speculative", "speed-up", "acceptance",
            "tokens/step", "same tokens"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(cell(r, c) for c in cols) + " |" for r in rows]
    return "\n".join(lines)
