"""tools/attn_depth.py: attention per token from bench rows (tg at depth minus tg at depth 0)."""

from __future__ import annotations

import pytest

from metatp.tools.attn_depth import attention_rows, attention_table
from support.require import requires


def _row(backend: str, depth: int, ts: float, group: int = 0, type_k: str = "f16", n_prompt: int = 0) -> dict:
    return dict(group=group, backend=backend, numerics="q8" if backend == "numpy" else "llama.cpp", type_k=type_k,
                type_v=type_k, split_mode="none", n_devices=1, n_gen=32, n_prompt=n_prompt, n_depth=depth, avg_ts=ts)


def test_attention_is_the_difference_of_per_token_times_and_compares_within_a_group():
    rows = [_row("numpy", 0, 100.0), _row("numpy", 1536, 50.0), _row("llama.cpp", 0, 50.0),
            _row("llama.cpp", 1536, 25.0), _row("numpy", 0, 200.0, group=1, type_k="q8_0"),
            _row("numpy", 1536, 100.0, group=1, type_k="q8_0"), _row("numpy", 0, 400.0, n_prompt=512)]
    att = {(a["backend"], a["type_k"]): a for a in attention_rows(rows)}
    assert set(att) == {("numpy", "f16"), ("llama.cpp", "f16"), ("numpy", "q8_0")}
    assert att["numpy", "f16"]["ms_per_token"] == pytest.approx(10.0)       # 20 ms - 10 ms
    assert att["llama.cpp", "f16"]["ms_per_token"] == pytest.approx(20.0)
    assert att["numpy", "f16"]["vs_llama_cpp"] == pytest.approx(0.5)
    assert att["numpy", "q8_0"]["vs_llama_cpp"] is None                      # no llama.cpp row in group 1
    table = attention_table(rows)
    assert "| numpy | q8 | f16 | f16 | 1 | none | 1536 | 10.00 | 0.50x |" in table


def test_no_table_without_tg_at_two_depths():
    assert attention_table([_row("numpy", 1536, 50.0)]) == ""
    assert attention_rows([]) == []


@requires("cpu_kernels")
def test_attn_bench_times_the_kernel_per_layer(capsys):
    from scripts import attn_bench

    wall, cpu = attn_bench.time_attention(130, 1, "q8_0", q8=True, layers=2, reps=1)
    assert 0 < wall < 5 and 0 <= cpu < 5
    assert attn_bench.main(["--depth", "70", "--threads", "1", "--types", "f16", "--layers", "1", "--reps", "1"]) == 0
    assert "| f16 | no | 70 | 1 |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        attn_bench.main(["--types", "f7"])
