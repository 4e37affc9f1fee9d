"""A short chat beside a busy process, with the default kernel threads and with one thread, and
the same idle (plus a batched run). Why: every parallel region of the compiled kernels waits for
its slowest thread, so one process holding a core used to make the default two threads 3-5x
slower than one (csrc/threads.c). The issue's target: beside one busy process, the default
threads take at most 1.5x what one thread takes; idle speed unchanged.

    python -m scripts.contention_bench                   # this tree's interpreter, 3 rounds
    python -m scripts.contention_bench -r 5 --python /work/venvs/base/bin/python --python .venv/bin/python

It starts the busy process itself (`python -c "while True: pass"`), runs each measurement in a
fresh child process (load, one warm-up chat, then `--reps` timed chats of `--tokens` tokens,
greedy, no prefix cache, as `metatp generate` would), alternating the settings and interpreters
round by round (a shared machine drifts), kills the busy process, then runs the idle rounds.
Prints min / median seconds per setting, the busy ratio (default / one thread) and the load
average before and after. Every child is bounded by what is left of `--timeout`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

__all__ = ["main"]

# The measurement, run by each interpreter compared (it may be an older tree: public API only).
_CHILD = r"""
import json, sys, time
from metatp import LLM, SamplingParams
from metatp.backends.numpy import native
threads, reps, tokens, batch, model = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
options = {"kernel_threads": threads} if threads else {}
llm = LLM(model or None, n_ctx=1024, backend="numpy", backend_options=options, enable_prefix_caching=False,
          max_num_seqs=max(batch, 1))
messages = [{"role": "user", "content": "Write a short poem about the sea."}]
def chat():
    return llm.create_chat_completion(messages, max_tokens=tokens, temperature=0)
def batched():
    params = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0)
    return llm.generate([f"Count from {i} to {i + 20}:" for i in range(batch)], params)
run = batched if batch else chat
run()
seconds = []
for _ in range(reps):
    t0 = time.perf_counter()
    run()
    seconds.append(time.perf_counter() - t0)
cap = getattr(native, "team_cap", lambda: None)()
others = getattr(native.lib, "others_load", lambda: None)()
print(json.dumps({"seconds": seconds, "cap": cap, "others": others, "kernels": native.kernel_info()}))
"""


def _loadavg() -> str:
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "?"


def _busy_seconds() -> float:
    """CPU seconds all CPUs have been busy since boot (/proc/stat; 0 where unreadable)."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:8]]
    except (OSError, ValueError):
        return 0.0
    return (v[0] + v[1] + v[2] + v[5] + v[6]) / os.sysconf("SC_CLK_TCK")


def _process_seconds(proc: subprocess.Popen | None) -> float:
    """CPU seconds of a running child (utime + stime), 0 where unknown."""
    if proc is None:
        return 0.0
    try:
        with open(f"/proc/{proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def _child(python: str, threads: int, reps: int, tokens: int, batch: int, model: str, timeout: float,
           busy: subprocess.Popen | None = None) -> dict:
    """One measurement in a fresh process: its JSON plus "third_party" (CPUs other processes than
    this bench kept busy meanwhile: the machine's noise), or {"error": ...}."""
    if timeout <= 5:
        return {"error": "out of time (--timeout)"}
    t0, busy0, mine0 = time.monotonic(), _busy_seconds(), _process_seconds(busy)
    children0 = os.times().children_user + os.times().children_system
    try:
        r = subprocess.run([python, "-c", _CHILD, str(threads), str(reps), str(tokens), str(batch), model],
                           capture_output=True, text=True, timeout=timeout,
                           cwd=tempfile.gettempdir())      # not a source tree: its metatp/ would shadow the install
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    lines = r.stdout.strip().splitlines()
    if r.returncode != 0 or not lines:
        return {"error": (r.stderr.strip().splitlines() or ["exit %d" % r.returncode])[-1]}
    ours = (os.times().children_user + os.times().children_system - children0) + _process_seconds(busy) - mine0
    out = json.loads(lines[-1])
    out["third_party"] = round(max(0.0, _busy_seconds() - busy0 - ours) / (time.monotonic() - t0), 2)
    return out


def _busy_process() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def _summary(seconds: list[float]) -> str:
    return f"min {min(seconds):.3f} s  median {statistics.median(seconds):.3f} s  (n={len(seconds)})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m scripts.contention_bench", description=__doc__.splitlines()[0])
    p.add_argument("-r", "--rounds", type=int, default=3, help="alternated rounds per setting")
    p.add_argument("--reps", type=int, default=3, help="timed chats per child process")
    p.add_argument("--tokens", type=int, default=24)
    p.add_argument("--batch", type=int, default=16, help="sequences of the idle batched run (0: none)")
    p.add_argument("--model", default="", help="a GGUF path or known name (default: the default model)")
    p.add_argument("--python", action="append", help="an interpreter to measure (repeat to compare trees; "
                                                     "default: this one)")
    p.add_argument("--timeout", type=float, default=900, help="seconds for the whole run")
    args = p.parse_args(argv)
    pythons = args.python or [sys.executable]
    if args.model and os.path.exists(args.model):
        args.model = os.path.abspath(args.model)         # the children run in the temp folder
    deadline = time.monotonic() + args.timeout
    results: dict[tuple[str, str], list[float]] = {}
    noise: dict[tuple[str, str], list[float]] = {}

    def measure(phase: str, label: str, python: str, threads: int, batch: int = 0) -> None:
        out = _child(python, threads, args.reps, args.tokens, batch, args.model, deadline - time.monotonic(),
                     busy if phase == "busy" else None)
        key = (python, f"{phase} {label}")
        if "error" in out:
            print(f"  {python} {phase} {label}: {out['error']}", flush=True)
            return
        results.setdefault(key, []).extend(out["seconds"])
        noise.setdefault(key, []).append(out["third_party"])
        print(f"  {python} {phase} {label}: " + " ".join(f"{s:.3f}" for s in out["seconds"])
              + f"  (cap {out.get('cap')}; governor saw {out.get('others')} CPUs of others; third-party load "
              f"{out['third_party']} CPUs; {out['kernels']})", flush=True)

    print(f"load average before: {_loadavg()}  ({os.cpu_count()} CPUs); third-party load: CPUs kept busy by "
          "processes other than this bench during each measurement (noise)", flush=True)
    busy = _busy_process()
    try:
        time.sleep(0.5)
        for _ in range(args.rounds):
            for python in pythons:
                measure("busy", "default threads", python, 0)
                measure("busy", "-t 1", python, 1)
    finally:
        busy.kill()
        busy.wait()
    time.sleep(1.0)
    for _ in range(args.rounds):
        for python in pythons:
            measure("idle", "default threads", python, 0)
            measure("idle", "-t 1", python, 1)
            if args.batch:
                measure("idle", f"batched B={args.batch}", python, 0, args.batch)
    print(f"load average after: {_loadavg()}")
    print()
    for python in pythons:
        print(python)
        for (py, setting), seconds in results.items():
            if py == python:
                print(f"  {setting:28s} {_summary(seconds)}  third-party load "
                      f"{min(noise[py, setting]):.2f}-{max(noise[py, setting]):.2f} CPUs")
        default, one = results.get((python, "busy default threads")), results.get((python, "busy -t 1"))
        if default and one:
            print(f"  busy ratio default / -t 1: min {min(default) / min(one):.2f}x  "
                  f"median {statistics.median(default) / statistics.median(one):.2f}x  (target <= 1.5x)")
        batched = results.get((python, f"idle batched B={args.batch}"))
        if batched:
            print(f"  idle batched: {args.batch * args.tokens / statistics.median(batched):.1f} tokens/s (median)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
