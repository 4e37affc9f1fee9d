"""`mpiexec -n 2 metatp serve`: rank 0 serves HTTP and leads, rank 1 follows every step in lock step.

pytest starts the real launcher on loopback (two ranks on this 2-core machine, oversubscribed
while a step runs) and talks to rank 0 with the official `openai` client: concurrent greedy
completions, a streamed one, and on the default model a chat completion and a streamed chat,
each text equal to what `LLM` gives in one process with the same split (two simulated devices).
Then: idle followers do not spin a core (MPICH's blocking receive would); SIGTERM to mpiexec
ends every rank within 30 s with exit code 0; a rank that raises mid-step, or a rank 0 that
cannot bind its port, ends every rank within 30 s, non-zero, the error printed once.

Skips with a reason only where mpi4py, mpiexec, fastapi/uvicorn or openai is missing. Every
wait is bounded.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from support.require import requires
from support.serving import LoopbackPosts, ServeProcess, free_port
from metatp.testing.synth import SynthSpec

needs_mpi = requires("mpi", "serve")

SPEC = SynthSpec(n_layer=4, n_embd=128, n_head=4, n_head_kv=2, n_ff=256, tied=False, seed=21, default_type="Q8_0",
                 n_ctx_train=4096)     # the `path` fixture (tests/conftest.py)
PROMPTS = ["the quick brown fox", "12 34 56", "hello world, hello", "zz"]
N_CTX = "1024"
TS = (3.0, 1.0)


def _metatp() -> list[str]:
    """The installed `metatp` command next to this Python (else `python -m metatp`)."""
    script = Path(sys.executable).with_name("metatp")
    return [str(script)] if script.exists() else [sys.executable, "-m", "metatp"]


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (mpiexec -> hydra proxy -> the ranks), from /proc."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class MpiServer(ServeProcess):
    """`mpiexec -n 2 metatp serve ...` (or -n `n`) on a free port of 127.0.0.1, in a session of its own."""

    name = "mpiexec metatp serve"

    def __init__(self, model: str, *args: str, log: Path, command: list[str] | None = None,
                 port: int | None = None, wait: bool = True, n: int = 2) -> None:
        port = port or free_port()
        env = {"OPENBLAS_NUM_THREADS": "1", "METATP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
               # oversubscribed ranks yield the CPU while they wait inside a step's collective
               "MPIR_CVAR_ENABLE_HEAVY_YIELD": "1", "OMPI_MCA_mpi_yield_when_idle": "1"}
        cmd = ["mpiexec", "-n", str(n), *(command or _metatp()), "serve", "-m", model, "--port", str(port),
               "--backend", "numpy", "-sm", "tensor", "-c", N_CTX, "-a", "m", *args]
        super().__init__(cmd, log=log, port=port, env=env, new_session=True)
        if wait:
            self.wait_ready(180, 0.3)

    def ranks(self) -> list[int]:
        """The pids of the two metatp processes (the ranks)."""
        out = []
        for pid in _descendants(self.proc.pid):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read().split(b"\0")
            except OSError:
                continue
            if b"serve" in cmd:               # not the hydra proxy between mpiexec and the ranks
                out.append(pid)
        return out

    def wait(self, timeout: float) -> int | None:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def kill(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)      # its own session: mpiexec and every rank
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=30)

    stop = kill


def _reference(path: str, prompts: list[str], n: int) -> list[str]:
    """Greedy texts from LLM.generate in this process, the model split as the ranks split it."""
    from metatp.api import LLM
    from metatp.sampling import SamplingParams

    llm = LLM(path, n_ctx=int(N_CTX), backend="numpy", n_devices=2, split_mode="tensor", tensor_split=TS,
              distributed="none")
    outs = llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    return [o.outputs[0].text for o in outs]


@pytest.fixture(scope="module")
def mpi_server(path, tmp_path_factory):
    s = MpiServer(path, "--parallel", "4", "-ts", ",".join(map(str, TS)),
                  log=tmp_path_factory.mktemp("mpi-serve") / "server.log")
    yield s
    s.kill()


@needs_mpi
def test_concurrent_and_streamed_completions_match_one_process(mpi_server, path):
    assert len(mpi_server.ranks()) == 2, mpi_server.text()
    want = _reference(path, PROMPTS, 12)
    c = mpi_server.client()
    got: dict[int, str] = {}

    def one(i: int) -> None:
        r = c.completions.create(model="m", prompt=PROMPTS[i], max_tokens=12, temperature=0,
                                 extra_body={"ignore_eos": True})
        got[i] = r.choices[0].text
    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=180)
    assert [got.get(i) for i in range(len(PROMPTS))] == want
    model = c.models.list().data[0].id
    stream = c.completions.create(model=model, prompt=PROMPTS[0], max_tokens=12, temperature=0, stream=True,
                                  extra_body={"ignore_eos": True})
    assert "".join(ch.choices[0].text for ch in stream if ch.choices) == want[0]
    # a client that goes away mid-stream: its cells are freed on every rank at the next step
    gone = c.completions.create(model=model, prompt=PROMPTS[1], max_tokens=200, temperature=0, stream=True,
                                extra_body={"ignore_eos": True})
    for k, _ in enumerate(gone):
        if k == 2:
            break
    gone.close()
    # the ranks are still in step after all that: a request again, alone
    again = c.completions.create(model=model, prompt=PROMPTS[2], max_tokens=12, temperature=0,
                                 extra_body={"ignore_eos": True})
    assert again.choices[0].text == want[2]


@needs_mpi
def test_idle_followers_do_not_spin(mpi_server):
    """MPICH's blocking receive would burn a core per idle rank; the followers sleep between probes."""
    ranks = mpi_server.ranks()
    assert len(ranks) == 2
    time.sleep(1.0)                         # past the short spin after the last step
    before = {p: _cpu_seconds(p) for p in ranks}
    t0 = time.monotonic()
    time.sleep(3.0)
    wall = time.monotonic() - t0
    used = {p: (_cpu_seconds(p) - before[p]) / wall for p in ranks}
    print(f"idle CPU per rank (fraction of a core): {used}")
    assert all(u < 0.10 for u in used.values()), used


@needs_mpi
def test_sigterm_ends_every_rank_cleanly(path, tmp_path):
    s = MpiServer(path, log=tmp_path / "term.log")
    try:
        ranks = s.ranks()
        assert len(ranks) == 2
        r = s.client().completions.create(model="m", prompt="hi", max_tokens=3, temperature=0)
        assert r.choices[0].finish_reason in ("length", "stop")
        s.proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        rc = s.wait(30)
        while any(_alive(p) for p in ranks) and time.monotonic() - t0 < 30:
            time.sleep(0.1)
        took = time.monotonic() - t0
        assert rc == 0, f"mpiexec exited with {rc} after SIGTERM:\n{s.text()[-3000:]}"
        assert not any(_alive(p) for p in ranks) and took < 30
        text = s.text()
        assert not any(bad in text for bad in ("Traceback", "metatp: error", "BAD TERMINATION")), text[-3000:]
    finally:
        s.kill()


FAILING = """\
import sys
from metatp.backends.distributed import launched_rank
from metatp.engine import Engine

if launched_rank() == 1:                  # this rank's third step raises
    calls = [0]
    run = Engine.run

    def failing(self, items):
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("rank 1 fails on purpose")
        return run(self, items)
    Engine.run = failing
from metatp.cli import main
raise SystemExit(main(sys.argv[1:]))
"""


@needs_mpi
def test_a_failing_follower_ends_every_rank(path, tmp_path):
    import httpx

    script = tmp_path / "failing_serve.py"
    script.write_text(FAILING)
    s = MpiServer(path, log=tmp_path / "fail.log", command=[sys.executable, str(script)])
    try:
        ranks = s.ranks()
        t0 = time.monotonic()
        try:                                      # rank 0 is aborted while it answers
            httpx.post(s.base + "/v1/completions", json={"prompt": "hi", "max_tokens": 8, "ignore_eos": True},
                       timeout=30)
        except httpx.HTTPError:
            pass
        rc = s.wait(30)
        while any(_alive(p) for p in ranks) and time.monotonic() - t0 < 30:
            time.sleep(0.1)
        assert rc not in (None, 0), f"mpiexec: {rc}\n{s.text()[-3000:]}"
        assert not any(_alive(p) for p in ranks)
        assert s.text().count("rank 1 fails on purpose") == 1, s.text()[-3000:]
    finally:
        s.kill()


@needs_mpi
def test_rank0_that_cannot_serve_ends_every_rank(path, tmp_path):
    """Rank 0's server exiting (here: its port is taken) stops the followers too."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        s = MpiServer(path, log=tmp_path / "bind.log", port=port, wait=False)
        try:
            rc = s.wait(120)                      # bounded: the model loads first
            assert rc not in (None, 0), f"mpiexec: {rc}\n{s.text()[-3000:]}"
            assert s.text().lower().count("address already in use") == 1, s.text()[-3000:]
        finally:
            s.kill()


@needs_mpi
def test_default_model_chat_and_stream_match_one_process(default_model, tmp_path):
    from metatp.api import LLM

    path = str(default_model)
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    llm = LLM(path, n_ctx=int(N_CTX), backend="numpy", n_devices=2, split_mode="tensor", distributed="none")
    want_chat = llm.create_chat_completion(msgs, max_tokens=12, temperature=0)["choices"][0]["message"]["content"]
    assert want_chat.strip()
    want_text = _reference_llm(llm, "The capital of France is", 10)
    del llm
    s = MpiServer(path, "--parallel", "2", log=tmp_path / "real.log")
    try:
        c = s.client()
        model = c.models.list().data[0].id
        r = c.chat.completions.create(model=model, messages=msgs, max_tokens=12, temperature=0)
        assert r.choices[0].message.content == want_chat
        stream = c.chat.completions.create(model=model, messages=msgs, max_tokens=12, temperature=0, stream=True)
        assert "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices) == want_chat
        done = c.completions.create(model=model, prompt="The capital of France is", max_tokens=10, temperature=0,
                                    extra_body={"ignore_eos": True})
        assert done.choices[0].text == want_text
        s.proc.send_signal(signal.SIGINT)         # Ctrl-C on the launcher: a clean end as well
        assert s.wait(30) == 0, s.text()[-3000:]
    finally:
        s.kill()


def _reference_llm(llm, prompt: str, n: int) -> str:
    from metatp.sampling import SamplingParams

    return llm.generate([prompt], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))[0].outputs[0].text


def _recording(engine, log: list) -> None:
    """Record, per step, the cache's owners before the step and the logits it returned."""
    run = engine.run

    def recorded(items):
        owners = engine.cells.owner.copy()
        outs = run(items)
        log.append((owners, outs))
        return outs
    engine.run = recorded


def test_step_batches_replay_the_same_steps(path):
    """No MPI needed: a follower replaying rank 0's StepBatches (admissions, a cancelled stream's
    free, chunked prompts, n=2) runs the same steps on the same cache cells with the same logits."""
    import numpy as np

    from metatp.api import LLM
    from metatp.sampling import SamplingParams
    from metatp.lockstep import STOP, StepBatch, follow

    def make() -> LLM:
        return LLM(path, n_ctx=256, backend="numpy", n_devices=2, split_mode="tensor", n_batch=8,
                   distributed="none", max_num_seqs=3)
    lead, rest = make(), make()
    posts: list = []
    lead.scheduler.lead(LoopbackPosts(0, posts))
    led: list = []
    _recording(lead.engine, led)
    stream = lead.create_completion(PROMPTS[0], max_tokens=50, temperature=0, stream=True)
    next(stream), next(stream)
    stream.close()                                        # cancelled: freed at the next step
    lead.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0.8, seed=5, n=2))
    assert lead.engine.cells.n_used == 0
    assert posts and all(isinstance(p, StepBatch) for p in posts)
    assert any(op[0] == "free" for p in posts for op in p.ops)
    followed: list = []
    _recording(rest.engine, followed)
    assert follow(rest.engine, LoopbackPosts(1, posts + [STOP])) == len(led)
    for (own_a, outs_a), (own_b, outs_b) in zip(led, followed):
        assert np.array_equal(own_a, own_b)
        assert all((a is None and b is None) or np.array_equal(a, b) for a, b in zip(outs_a, outs_b))
    assert rest.engine.cells.n_used == 0 and not rest.engine.cells.live


def test_an_llm_not_spread_over_the_launched_ranks_is_refused(monkeypatch):
    """Under mpiexec -n 2, an LLM with distributed='none' would serve the whole model twice on one port."""
    from types import SimpleNamespace

    from metatp.ir.errors import ConfigError
    from metatp.server import create_app, refuse_mpi

    monkeypatch.setenv("PMI_SIZE", "2")
    refuse_mpi()                                    # the CLI's early call: nothing to refuse yet
    with pytest.raises(ConfigError, match="not spread over them"):
        create_app(SimpleNamespace(world=None))
    refuse_mpi(SimpleNamespace(world=SimpleNamespace(size=2)))
