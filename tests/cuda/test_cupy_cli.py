"""`metatp batched-bench --backend cupy` and `metatp serve --backend cupy` (issue 46 item 4), on the
CPU emulator with a tiny synthetic model: the table's rows come, and the server answers concurrent
completions of the official openai client with each request's solo tokens.

The server runs as `python3 scripts/gpu_check --serve --emulate ARGS` (what the GPU check's
throughput section starts, without --emulate on the GPU): `metatp serve ARGS` whose cupy backend
runs on the emulator.
"""

from __future__ import annotations

import json
import sys
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from metatp.testing.synth import SynthSpec
from metatp.tools import batched_bench
from support.require import requires
from support.serving import ServeProcess, free_port

ROOT = Path(__file__).resolve().parents[2]
SPEC = SynthSpec(n_layer=1, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, tied=False, seed=13, default_type="Q8_0",
                 n_ctx_train=4096)     # the `path` fixture (tests/conftest.py)


@requires("emulator")
def test_batched_bench_rows_on_the_cupy_backend(path, capsys, monkeypatch):
    import metatp.backends as backends
    import metatp.backends.cuda.backend as cuda_backend
    from metatp.testing import EmuRuntime

    monkeypatch.setattr(backends, "gpu_probe", lambda: (True, ""))
    monkeypatch.setattr(cuda_backend, "CupyRuntime", EmuRuntime)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert batched_bench.main(["-m", path, "--backend", "cupy", "-npp", "4", "-ntg", "3", "-npl", "1,3",
                                   "-o", "jsonl"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [(r["b"], r["pp"], r["tg"], r["n_kv"]) for r in rows] == [(1, 4, 3, 7), (3, 4, 3, 21)]
    assert all(r["s_pp"] > 0 and r["s_tg"] > 0 and r["program"] == "metatp" for r in rows)


@requires("emulator", "serve")
def test_serve_on_the_cupy_backend_answers_concurrent_clients_with_solo_tokens(path, tmp_path):
    import openai

    port = free_port()
    cmd = [sys.executable, str(ROOT / "scripts" / "gpu_check"), "--serve", "--emulate", "-m", path, "--backend",
           "cupy", "--port", str(port), "-a", "m", "-np", "4", "-c", "256"]
    server = ServeProcess(cmd, log=tmp_path / "serve.log", port=port, env={"PYTHONUNBUFFERED": "1"})
    try:
        server.wait_ready(300, 0.5)
        client = openai.OpenAI(base_url=server.base + "/v1", api_key="unused", timeout=300, max_retries=0)
        prompts = [[3 + i, 40 + 2 * i, 7] for i in range(4)]

        def complete(p):
            r = client.completions.create(model="m", prompt=p, max_tokens=4, temperature=0,
                                          extra_body={"ignore_eos": True})
            assert r.usage.completion_tokens == 4
            return r.choices[0].text

        solo = [complete(p) for p in prompts]
        with ThreadPoolExecutor(4) as pool:
            assert list(pool.map(complete, prompts)) == solo
    finally:
        server.stop()
    assert "serving" in server.text()
