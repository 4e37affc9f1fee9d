"""`metatp serve` over time: a few hundred requests of random valid and invalid shapes against ONE
server process on a tiny synthetic model, from a few concurrent clients (threads), with the
official `openai` client and raw httpx.

Shapes (drawn from a seeded generator, so every run sends the same plan): completions and chat,
greedy and seeded (`n` up to 3), logprobs, stop strings, unknown fields, streams read to the end,
streams closed mid-way (cancels), clients that time out, malformed bodies, bad parameters, a
prompt longer than the context, a wrong API key.

The server's RSS after the soak is within `RSS_TOLERANCE` of its RSS after the warm-up
(`WARMUP` requests of the same kinds first: the engine's LRU of compiled batch shapes churns, and
the allocator's high-water mark climbs for a few hundred requests before it levels off); no KV
cell is in use; the /metrics sequence counters add up (accepted = finished + cancelled + failed,
failed = 0, accepted = what the clients submitted); and every valid greedy or seeded answer equals
the same request's answer on the idle server before the soak (its solo run), streamed or not.

Bounded: `--soak-requests N` (or $METATP_SOAK_REQUESTS) soak requests after the warm-up; the default
`DEFAULT_REQUESTS` takes about 20 s on two busy cores (2000: about 50 s). The figures (requests by
kind and outcome, RSS before/after and every `CHECKPOINT` requests, KV cells, the counters) are
printed to the terminal even under `pytest -q`, and recorded as the test's `soak` property (JUnit XML).
"""

from __future__ import annotations

import json
import os
import random
import re
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from metatp.testing.synth import SynthSpec
from support.require import requires
from support.serving import ServeProcess, free_port, optional_import

pytestmark = requires("serve")
httpx = optional_import("httpx")

KEY = "soak-key"
SEED = 2028
DEFAULT_REQUESTS = 400                       # after the warm-up
WARMUP = 500                                 # requests before the "before" RSS
CLIENTS = 4
N_CTX, PARALLEL = 4096, 8                    # 512 cells a sequence
POOL = 18                                    # distinct valid requests, each run solo first
CHECKPOINT = 100                             # an RSS sample every CHECKPOINT soak requests (printed)
RSS_TOLERANCE = (16 << 20, 0.05)             # allowed growth: 16 MiB + 5% of the warmed-up RSS
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
SPEC = SynthSpec(n_layer=2, n_embd=64, n_head=4, n_head_kv=2, n_ff=128, tied=False, seed=28, default_type="Q8_0",
                 n_ctx_train=N_CTX, chat_template=TEMPLATE)     # the `path` fixture (tests/conftest.py)
MODEL = "soak.gguf"
WORDS = "the a fox over lazy dog red blue one two three sky river stone light quick".split()
LOGPROB_TOL = 1e-4


# ---------------------------------------------------------------- the plan
@dataclass
class Case:
    """One request of the plan: `kind` says how it is sent and checked."""

    kind: str            # greedy | seeded | chat | stream | cancel | timeout | malformed | too_long | auth
    body: dict | str
    chat: bool = False
    pool: int | None = None       # the solo-run entry whose answer it must equal
    seqs: int = 0                 # sequences it submits (n), when valid
    param: str | None = None      # the `param` a 400 names


def _words(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def _pool(rng: random.Random) -> list[tuple[bool, dict]]:
    """POOL valid requests with a reproducible answer: (chat?, body)."""
    out = []
    for i in range(POOL):
        chat = i % 3 == 2
        body: dict = {"max_tokens": rng.randint(1, 16), "ignore_eos": rng.random() < 0.7}
        if i % 4 == 1:
            body |= {"temperature": 0.9, "seed": rng.randint(0, 10 ** 6), "n": rng.randint(2, 3)}
        else:
            body["temperature"] = 0
        if rng.random() < 0.4:
            body["stop"] = rng.sample(["e", "th", " o", "\n", "ab", "x"], rng.randint(1, 2))
        if chat:
            body["messages"] = [{"role": "user", "content": _words(rng, 1, 8)}]
            if rng.random() < 0.5:
                body |= {"logprobs": True, "top_logprobs": rng.randint(0, 3)}
        else:
            body["prompt"] = _words(rng, 1, 10)
            if rng.random() < 0.5:
                body["logprobs"] = rng.randint(0, 3)
        out.append((chat, body))
    return out


MALFORMED = [
    ("{not json", None), ("[1, 2]", None), ('"a string"', None),
    ({"prompt": "x", "max_tokens": -1}, "max_tokens"), ({"prompt": "x", "max_tokens": "ten"}, "max_tokens"),
    ({"prompt": "x", "temperature": "hot"}, "temperature"), ({"prompt": "x", "top_p": 0}, "top_p"),
    ({"prompt": "x", "n": 0}, "n"), ({"prompt": "x", "n": 99}, "n"), ({"prompt": "x", "stop": 5}, "stop"),
    ({"prompt": "x", "stream": "yes"}, "stream"), ({"prompt": [1, "a"]}, "prompt"), ({"prompt": [10 ** 9]}, "prompt"),
    ({"max_tokens": 3}, "prompt"), ({"prompt": "x", "model": "no-such-model"}, "model"),
    ({"prompt": "x", "logprobs": 99}, "logprobs"), ({"prompt": "x", "seed": -1}, "seed"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
]
MALFORMED_CHAT = [
    ({"messages": "hi"}, "messages"), ({"messages": [{"content": "no role"}]}, "messages"),
    ({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"), ({}, "messages"),
]


def plan(n: int, rng: random.Random, pool: list[tuple[bool, dict]]) -> list[Case]:
    """n requests of random shapes (valid ones reuse the pool, sometimes with unknown fields)."""
    kinds = ["greedy"] * 24 + ["seeded"] * 8 + ["chat"] * 12 + ["stream"] * 16 + ["cancel"] * 8 + ["timeout"] * 5 \
        + ["malformed"] * 18 + ["too_long"] * 3 + ["auth"] * 3
    greedy = [i for i, (c, b) in enumerate(pool) if not c and "seed" not in b]
    seeded = [i for i, (c, b) in enumerate(pool) if "seed" in b]
    chats = [i for i, (c, b) in enumerate(pool) if c]
    cases = []
    for _ in range(n):
        kind = rng.choice(kinds)
        if kind in ("greedy", "seeded", "chat", "stream"):
            i = rng.choice({"greedy": greedy, "seeded": seeded, "chat": chats}.get(kind, range(len(pool))))
            chat, body = pool[i]
            body = dict(body)
            if rng.random() < 0.3:                     # fields this server does not know are ignored
                body |= {"user": "soak", "frobnicate": {"x": 1}, "metadata": None}
            if kind == "stream":
                body |= {"stream": True, "stream_options": {"include_usage": rng.random() < 0.5}}
            cases.append(Case(kind, body, chat, i, body.get("n", 1)))
        elif kind == "cancel":
            chat = rng.random() < 0.3
            body = {"max_tokens": 400, "ignore_eos": True, "stream": True, "temperature": 0}
            body |= {"messages": [{"role": "user", "content": _words(rng, 1, 4)}]} if chat \
                else {"prompt": _words(rng, 1, 6), "n": rng.randint(1, 2)}
            cases.append(Case(kind, body, chat, seqs=body.get("n", 1)))
        elif kind == "timeout":
            cases.append(Case(kind, {"prompt": _words(rng, 1, 6), "max_tokens": 400, "ignore_eos": True}, seqs=1))
        elif kind == "malformed":
            chat = rng.random() < 0.25
            body, param = rng.choice(MALFORMED_CHAT if chat else MALFORMED)
            cases.append(Case(kind, body, chat, param=param))
        elif kind == "too_long":
            cases.append(Case(kind, {"prompt": [7] * (N_CTX + rng.randint(1, 50)), "max_tokens": 2}, param="prompt"))
        else:
            cases.append(Case(kind, {"prompt": "x", "max_tokens": 2}))
    return cases


# ---------------------------------------------------------------- one server, its figures
class Server(ServeProcess):
    def __init__(self, model: str, log: Path) -> None:
        port = free_port()
        super().__init__([sys.executable, "-m", "metatp", "serve", "-m", model, "--port", str(port), "--backend",
                          "numpy", "-c", str(N_CTX), "--parallel", str(PARALLEL), "--api-key", KEY],
                         log=log, port=port, env={"METATP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
        self.wait_ready(120, 0.2)

    def rss(self) -> int:
        """The server process's resident set, in bytes (/proc/<pid>/status)."""
        text = Path(f"/proc/{self.proc.pid}/status").read_text()
        return int(re.search(r"^VmRSS:\s+(\d+) kB", text, re.M).group(1)) * 1024

    def metrics(self) -> dict[str, float]:
        text = httpx.get(self.base + "/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).text
        return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(metatp_[a-z_]+) ([0-9.e+-]+)$", text, re.M)}

    def wait_idle(self, timeout: float) -> dict[str, float]:
        """/metrics once nothing runs, waits or holds a KV cell (or the time is up)."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            busy = m["metatp_kv_cells_used"] or m["metatp_requests_running"] or m["metatp_requests_waiting"]
            if not busy or time.monotonic() > deadline:
                return m
            time.sleep(0.2)


def _path(case: Case) -> str:
    return "/v1/chat/completions" if case.chat else "/v1/completions"


def _answer(resp: dict, chat: bool) -> list[tuple]:
    """The comparable part of a non-streamed answer, per choice: text, finish reason, tokens and
    their log-probabilities when asked for."""
    out = []
    for c in sorted(resp["choices"], key=lambda c: c["index"]):
        text = c["message"]["content"] if chat else c["text"]
        lp = c.get("logprobs")
        if lp and chat:
            toks, vals = [e["token"] for e in lp["content"]], [e["logprob"] for e in lp["content"]]
        elif lp:
            toks, vals = lp["tokens"], lp["token_logprobs"]
        else:
            toks, vals = None, None
        out.append((text, c["finish_reason"], toks, vals))
    return out


def _same(got: list[tuple], want: list[tuple], streamed: bool) -> bool:
    """Equal answers: text and finish reason per choice (and, not streamed, the tokens, with
    log-probabilities within LOGPROB_TOL)."""
    if len(got) != len(want):
        return False
    for g, w in zip(got, want):
        if g[:2] != w[:2]:
            return False
        if not streamed and (g[2] != w[2] or (g[3] is not None and any(abs(a - b) > LOGPROB_TOL
                                                                        for a, b in zip(g[3], w[3])))):
            return False
    return True


@dataclass
class Tally:
    """What the clients saw (shared by the threads under `lock`)."""

    kinds: Counter = field(default_factory=Counter)
    outcomes: Counter = field(default_factory=Counter)
    seqs_sent: int = 0            # sequences of valid requests that reached the server for sure
    seqs_maybe: int = 0           # those of requests whose client timed out (submitted or not)
    mismatches: list = field(default_factory=list)
    errors: list = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def note(self, case: Case, outcome: str, sure: bool = True) -> None:
        with self.lock:
            self.kinds[case.kind] += 1
            self.outcomes[outcome] += 1
            if sure:
                self.seqs_sent += case.seqs
            else:
                self.seqs_maybe += case.seqs


class Client:
    """One client thread's connections: an openai client and an httpx client."""

    def __init__(self, server: Server) -> None:
        self.server = server
        self.oa = server.client(KEY)
        self.http = httpx.Client(base_url=server.base, headers={"Authorization": f"Bearer {KEY}"}, timeout=120)

    def close(self) -> None:
        self.oa.close()
        self.http.close()

    def openai_call(self, chat: bool, body: dict, stream: bool) -> list[tuple]:
        """A pool request through the openai client; the answer as `_answer` shapes it."""
        body = dict(body)
        known = {k: body.pop(k) for k in list(body) if k in ("max_tokens", "temperature", "seed", "n", "stop",
                                                              "logprobs", "top_logprobs", "stream_options")}
        extra = body                                       # ignore_eos, unknown fields
        if chat:
            msgs = extra.pop("messages")
            r = self.oa.chat.completions.create(model=MODEL, messages=msgs, stream=stream, extra_body=extra, **known)
        else:
            prompt = extra.pop("prompt")
            r = self.oa.completions.create(model=MODEL, prompt=prompt, stream=stream, extra_body=extra, **known)
        if not stream:
            return _answer(r.model_dump(), chat)
        text: dict[int, str] = {}
        finish: dict[int, str | None] = {}
        usage = None
        for ch in r:
            usage = ch.usage or usage
            for c in ch.choices:
                piece = (c.delta.content or "") if chat else c.text
                text[c.index] = text.get(c.index, "") + piece
                finish[c.index] = c.finish_reason or finish.get(c.index)
        if known.get("stream_options", {}).get("include_usage") and usage is None:
            raise AssertionError("a stream with include_usage ended without usage")
        return [(text[i], finish[i], None, None) for i in sorted(text)]

    def run(self, case: Case, solo: list[list[tuple]], tally: Tally) -> None:
        try:
            self._run(case, solo, tally)
        except Exception as e:  # noqa: BLE001 - every unexpected error is reported, with its request
            with tally.lock:
                tally.errors.append(f"{case.kind} {json.dumps(case.body)[:160]}: {type(e).__name__}: {e}")

    def _run(self, case: Case, solo: list[list[tuple]], tally: Tally) -> None:
        if case.kind in ("greedy", "seeded", "chat", "stream"):
            got = self.openai_call(case.chat, case.body, case.kind == "stream")
            if not _same(got, solo[case.pool], case.kind == "stream"):
                with tally.lock:
                    tally.mismatches.append((case.kind, case.body, got, solo[case.pool]))
            tally.note(case, "answered")
        elif case.kind == "cancel":
            with self.http.stream("POST", _path(case), json=case.body) as resp:
                assert resp.status_code == 200, resp.read()
                lines = resp.iter_lines()
                for _ in range(random.Random(json.dumps(case.body)).randint(1, 3)):
                    assert next(lines).startswith("data: ")
                    next(lines)
            tally.note(case, "cancelled mid-stream")       # the response closed before its end
        elif case.kind == "timeout":
            try:
                r = self.http.post(_path(case), json=case.body, timeout=httpx.Timeout(0.25))
            except httpx.TimeoutException:
                tally.note(case, "client timed out", sure=False)
            else:
                assert r.status_code == 200, r.text
                tally.note(case, "answered before the timeout")
        else:
            key = "wrong" if case.kind == "auth" else KEY
            headers = {"Authorization": f"Bearer {key}"}
            if isinstance(case.body, str):
                r = self.http.post(_path(case), content=case.body, headers={**headers,
                                                                           "Content-Type": "application/json"})
            else:
                r = self.http.post(_path(case), json=case.body, headers=headers)
            want = 401 if case.kind == "auth" else 404 if case.param == "model" else 400   # an unknown model: 404
            assert r.status_code == want, f"{r.status_code}: {r.text[:300]}"
            err = r.json()["error"]
            assert set(err) >= {"message", "type", "param", "code"} and "Traceback" not in r.text, r.text
            if case.kind != "auth":
                assert err["param"] == case.param, r.text
            if case.kind == "too_long":
                assert err["code"] == "context_length_exceeded", r.text
            tally.note(case, f"refused {want}")


def _drive(server: Server, cases: list[Case], solo: list[list[tuple]], tally: Tally) -> None:
    """Send `cases` from CLIENTS threads (case k to thread k % CLIENTS, each in plan order)."""
    def worker(k: int) -> None:
        client = Client(server)
        try:
            for case in cases[k::CLIENTS]:
                client.run(case, solo, tally)
        finally:
            client.close()
    threads = [threading.Thread(target=worker, args=(k,), daemon=True) for k in range(CLIENTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=900)
    assert not any(t.is_alive() for t in threads), "a soak client is still waiting after 15 minutes"


def _requests(config) -> int:
    n = config.getoption("soak_requests", None) or os.environ.get("METATP_SOAK_REQUESTS") or DEFAULT_REQUESTS
    return int(n)


@pytest.fixture(scope="module")
def soak_server(path, tmp_path_factory):
    link = tmp_path_factory.mktemp("soak") / MODEL
    link.symlink_to(path)
    s = Server(str(link), log=tmp_path_factory.mktemp("soak-log") / "server.log")
    yield s
    s.stop()


def _mib(b: float) -> str:
    return f"{b / (1 << 20):.1f} MiB"


def test_soak(soak_server, request, capsys, record_property):
    server = soak_server
    t0 = time.monotonic()
    n = _requests(request.config)
    rng = random.Random(SEED)
    pool = _pool(rng)
    warmup, cases = plan(WARMUP, rng, pool), plan(n, rng, pool)
    tally = Tally()

    solo_client = Client(server)                # the solo runs: one at a time on the idle server
    solo = [solo_client.openai_call(chat, body, False) for chat, body in pool]
    solo_client.close()
    tally.seqs_sent += sum(b.get("n", 1) for _, b in pool)

    _drive(server, warmup, solo, tally)
    server.wait_idle(60)
    rss_before, trend = server.rss(), []
    for at in range(0, len(cases), CHECKPOINT):
        _drive(server, cases[at:at + CHECKPOINT], solo, tally)
        m = server.wait_idle(120)
        trend.append(server.rss())
    rss_after = trend[-1]
    wall = time.monotonic() - t0

    accepted, finished = m["metatp_sequences_accepted_total"], m["metatp_sequences_finished_total"]
    cancelled, failed = m["metatp_sequences_cancelled_total"], m["metatp_sequences_failed_total"]
    figures = {
        "requests": len(pool) + len(warmup) + len(cases), "solo runs": len(pool), "warm-up": len(warmup),
        "soak": len(cases), "by kind": dict(sorted(tally.kinds.items())),
        "outcomes": dict(sorted(tally.outcomes.items())), "clients": CLIENTS,
        "rss before (after warm-up)": _mib(rss_before), "rss after": _mib(rss_after),
        "rss growth": _mib(rss_after - rss_before), f"rss every {CHECKPOINT} (MiB)": [round(r / (1 << 20)) for r in trend],
        "kv cells used": m["metatp_kv_cells_used"],
        "sequences accepted": accepted, "finished": finished, "cancelled": cancelled, "failed": failed,
        "client-side sequences": f"{tally.seqs_sent} sure + up to {tally.seqs_maybe} of timed-out clients",
        "steps": m["metatp_steps_total"], "most sequences in a step": m["metatp_step_sequences_max"],
        "generated tokens": m["metatp_generation_tokens_total"], "wall": f"{wall:.1f} s",
    }
    record_property("soak", figures)
    with capsys.disabled():                     # shown under `pytest -q` too
        print("\nserving soak: " + "; ".join(f"{k}: {v}" for k, v in figures.items()), flush=True)

    assert not tally.errors, "\n".join(tally.errors[:20])
    assert not tally.mismatches, "answers that differ from their solo run:\n" + "\n".join(
        f"{kind} {json.dumps(body)}\n  got  {got}\n  solo {want}" for kind, body, got, want in tally.mismatches[:10])
    assert sum(tally.kinds.values()) == len(warmup) + len(cases)
    assert m["metatp_kv_cells_used"] == 0 and m["metatp_requests_running"] == 0 and m["metatp_requests_waiting"] == 0
    assert accepted == finished + cancelled + failed and failed == 0, figures
    assert tally.seqs_sent <= accepted <= tally.seqs_sent + tally.seqs_maybe, figures
    assert cancelled >= tally.outcomes["cancelled mid-stream"], figures
    allowed = RSS_TOLERANCE[0] + RSS_TOLERANCE[1] * rss_before
    assert rss_after - rss_before <= allowed, f"the server's RSS grew by {_mib(rss_after - rss_before)} " \
                                              f"(allowed {_mib(allowed)}): {figures}"
    assert server.proc.poll() is None, server.text()[-3000:]
