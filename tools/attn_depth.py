"""Attention time per token at depth, from `metatp bench` rows: tg at depth d minus tg at depth 0
(`-n N -d 0,d`), per layout, numerics and KV cache types, and with `--compare llama-cpp` the ratio
to llama.cpp's rows of the same group (measured interleaved with them, so load moves both alike).
Why a difference of two rates: what grows with depth in a decode step is (almost only) attention
reading the cache, and the per-token cost of everything else cancels."""

from __future__ import annotations

__all__ = ["attention_rows", "attention_table"]


def _key(r: dict) -> tuple:
    return (r.get("group"), r["backend"], r["numerics"], r.get("type_k"), r.get("type_v"), r["split_mode"],
            r["n_devices"], r.get("tensor_split"), r["n_gen"])


def attention_rows(rows: list[dict]) -> list[dict]:
    """One row per (layout, numerics, cache types, depth d > 0) with tg rows at depth 0 and d:
    ms_per_token = 1000/ts(d) - 1000/ts(0), and vs_llama_cpp = that over llama.cpp's in the same
    group (None without one)."""
    tg = [r for r in rows if r.get("n_gen") and not r.get("n_prompt") and r.get("avg_ts")]
    at0 = {_key(r): r for r in tg if r["n_depth"] == 0}
    out = []
    for r in tg:
        base = at0.get(_key(r))
        if r["n_depth"] > 0 and base is not None:
            ms = 1000.0 / r["avg_ts"] - 1000.0 / base["avg_ts"]
            out.append(dict(group=r.get("group"), backend=r["backend"], numerics=r["numerics"],
                            type_k=r.get("type_k"), type_v=r.get("type_v"), split_mode=r["split_mode"],
                            n_devices=r["n_devices"], n_gen=r["n_gen"], n_depth=r["n_depth"], ms_per_token=ms))
    ref = {(a["group"], a["n_gen"], a["n_depth"]): a["ms_per_token"] for a in out if a["backend"] == "llama.cpp"}
    for a in out:
        c = ref.get((a["group"], a["n_gen"], a["n_depth"]))
        a["vs_llama_cpp"] = a["ms_per_token"] / c if c and a["backend"] != "llama.cpp" else None
    return out


def attention_table(rows: list[dict]) -> str:
    """The markdown table of `attention_rows` (an empty string when no row has tg at two depths)."""
    att = attention_rows(rows)
    if not att:
        return ""
    lines = ["", "attention per token (tg at depth minus tg at depth 0):", "",
             "| backend | numerics | type_k | type_v | devices | sm | depth | attention ms/token | over llama.cpp's (below 1: faster) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for a in att:
        ratio = f"{a['vs_llama_cpp']:.2f}x" if a["vs_llama_cpp"] is not None else ""
        lines.append(f"| {a['backend']} | {a['numerics']} | {a['type_k']} | {a['type_v']} | {a['n_devices']} | "
                     f"{a['split_mode']} | {a['n_depth']} | {a['ms_per_token']:.2f} | {ratio} |")
    return "\n".join(lines)
