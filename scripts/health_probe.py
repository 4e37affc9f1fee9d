"""Worst /health latency while hostile requests run against `metatp serve` (default model):
`python -m scripts.health_probe` starts the server on a loopback port, polls /health every 10 ms
from a thread during each request and prints a Markdown table (docs/reliability.md); it stops the
server at the end. Issue 48's figures: /health must answer within 100 ms meanwhile."""
import subprocess
import sys
import threading
import time

import httpx

port = 18231
srv = subprocess.Popen([sys.executable, "-m", "metatp.cli", "serve", "-c", "2048", "--parallel", "4", "--port", str(port)],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
base = f"http://127.0.0.1:{port}"
try:
    for _ in range(600):
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200: break
        except Exception: pass
        time.sleep(0.2)
    def probe(stop, out):
        with httpx.Client(base_url=base, timeout=30) as c:
            while not stop.is_set():
                t = time.perf_counter(); c.get("/health"); out.append(time.perf_counter() - t); time.sleep(0.01)
    def case(name, body, path="/v1/chat/completions"):
        stop, lat = threading.Event(), []
        th = threading.Thread(target=probe, args=(stop, lat)); th.start(); time.sleep(0.1)
        t = time.perf_counter()
        r = httpx.post(base + path, json=body, timeout=300)
        took = time.perf_counter() - t
        stop.set(); th.join()
        msg = r.json().get("error", {}).get("message", "")[:90] if r.status_code != 200 else "ok"
        print(f"| {name} | {r.status_code} | {took:.2f} s | {max(lat)*1000:.0f} ms | {sorted(lat)[len(lat)//2]*1000:.0f} ms | {len(lat)} | {msg} |", flush=True)
    model = httpx.get(base + "/v1/models").json()["data"][0]["id"]
    chat = lambda **kw: {"model": model, "messages": [{"role": "user", "content": "Pick one."}], "max_tokens": 8, "temperature": 0, **kw}
    print("| request | status | took | worst /health | median /health | probes | answer |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    case("small chat", chat())
    case("3,000 chained rules", chat(guided_grammar="start: r0\n" + "\n".join(f'r{i}: "a" r{i+1}' for i in range(3000)) + '\nr3000: "a"\n'))
    case("1 MB grammar", chat(guided_grammar="start: " + " | ".join(f'"w{i}"' for i in range(100000))))
    deep = '{"a": ' * 3000 + '1' + '}' * 3000
    case("3,000-deep schema string", chat(guided_json=deep))
    case("10,000 choices", chat(guided_choice=[f"c{i}" for i in range(10000)], max_tokens=16))
    case("100k enum", chat(response_format={"type": "json_schema", "json_schema": {"name": "e", "schema": {"enum": [f"v{i}" for i in range(100000)]}}}))
    case("10 MB prompt", {"model": model, "prompt": "a" * 10_000_000, "max_tokens": 4}, "/v1/completions")
    case("1 MB /tokenize", {"content": "hello world " * 90000}, "/tokenize")
finally:
    srv.terminate(); srv.wait(30)
