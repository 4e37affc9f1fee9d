"""Serving throughput: N greedy completions sent at once to a real `metatp serve` (N threads of the
official `openai` client) against the same N sent one after another, as aggregate generated
tokens per second and their ratio, repetitions interleaved so a shared VM's drift moves both.

    python -m scripts.serve_bench --requests 16 --tokens 64 -r 2 -- --numerics q8 -c 4096

Arguments after `--` go to `metatp serve` (the server always gets --parallel N and
--no-prefix-caching, so the repeated prompts are computed every time). Each request has its own
prompt and `ignore_eos`, so every one generates exactly --tokens tokens (checked).
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

__all__ = ["serve_bench", "main"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(base: str, proc: subprocess.Popen, timeout: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"serve_bench: the server exited with code {proc.returncode} before it was ready")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"serve_bench: the server was not ready after {timeout:.0f} s")


def serve_bench(model: str, n_requests: int = 16, n_tokens: int = 64, repetitions: int = 2,
                serve_args: tuple[str, ...] = (), ready_timeout: float = 300) -> list[dict]:
    """One row per repetition: tokens/s of the requests one after another ("serial"), all at once
    ("concurrent") and concurrent / serial."""
    from openai import OpenAI

    port = _free_port()
    cmd = [sys.executable, "-m", "metatp", "serve", "-m", model, "--port", str(port), "--parallel",
           str(n_requests), "--no-prefix-caching", *serve_args]
    log = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        try:
            _wait_ready(base, proc, ready_timeout)
        except RuntimeError as e:
            log.seek(0)
            raise RuntimeError(f"{e}; its last output: {log.read()[-800:]}") from None
        client = OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=600)
        name = client.models.list().data[0].id
        prompts = [f"Request {i}: write a short story about the number {i * 37 % 101}." for i in range(n_requests)]

        def one(prompt: str) -> int:
            r = client.completions.create(model=name, prompt=prompt, max_tokens=n_tokens, temperature=0,
                                          extra_body={"ignore_eos": True})
            got = r.usage.completion_tokens
            if got != n_tokens:
                raise RuntimeError(f"serve_bench: a request generated {got} tokens, not {n_tokens}")
            return got

        one(prompts[0])          # warm-up: plans compiled, kernels built
        rows = []
        for _ in range(repetitions):
            t0 = time.perf_counter()
            serial = sum(one(p) for p in prompts)
            t_serial = time.perf_counter() - t0
            t0 = time.perf_counter()
            with ThreadPoolExecutor(n_requests) as pool:
                concurrent = sum(pool.map(one, prompts))
            t_conc = time.perf_counter() - t0
            rows.append({"serial_tps": serial / t_serial, "concurrent_tps": concurrent / t_conc,
                         "ratio": (concurrent / t_conc) / (serial / t_serial)})
        return rows
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        extra = argv[argv.index("--") + 1:]
        argv = argv[:argv.index("--")]
    p = argparse.ArgumentParser(prog="python -m scripts.serve_bench", description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", default="smollm2-135m")
    p.add_argument("--requests", type=int, default=16, help="requests sent at once (and the server's --parallel)")
    p.add_argument("--tokens", type=int, default=64, help="tokens each request generates")
    p.add_argument("-r", "--repetitions", type=int, default=2)
    a = p.parse_args(argv)
    if a.requests < 1 or a.tokens < 1 or a.repetitions < 1:
        p.error("--requests, --tokens and --repetitions must be positive")
    rows = serve_bench(a.model, a.requests, a.tokens, a.repetitions, tuple(extra))
    print(f"| requests | tokens | serial t/s | concurrent t/s | concurrent / serial |  (serve args: {' '.join(extra)})")
    print("| --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {a.requests} | {a.tokens} | {r['serial_tps']:.2f} | {r['concurrent_tps']:.2f} | {r['ratio']:.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
