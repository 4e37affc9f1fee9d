"""Each part of a GPU run in a process of its own, so one faulting kernel costs one part, not the run.

A kernel that reads a misaligned or illegal address, traps or times out leaves a *sticky* error:
the process's CUDA context is unusable and every later call fails at once. In one process, a
fault in the first section (the kernel checks) would leave a GPU session's only call with no
speed rows at all. So on a GPU (`--isolate`, the default there) the parent runs the preflight and
the environment rows itself, then starts `python3 scripts/gpu_check --part NAME ...` for each part
in turn: the child runs that part with the time left, prints its rows as they come (the parent
echoes them) and streams them as JSON lines into a file the parent reads back. A child that dies
or runs past the time left is one FAIL row with its exit status and last lines; the next part
starts in a fresh process with a fresh context. Kernels compiled by one part are loaded from
CuPy's on-disk kernel cache by the next (`CHILD_START_S` of overhead a part, counted by `plan.py`).
"""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from scripts.gpu_check.config import Config, gpu_answers
from scripts.gpu_check.report import Report

#: seconds a part's process needs before its first row on the H200 (Python, CuPy, metatp, the CUDA
#: context, the kernel modules from CuPy's disk cache): a guess, counted once per part by plan.py
CHILD_START_S = 4.0
#: seconds a child may run past the time left before it is killed (its own guards stop it first)
GRACE_S = 20.0
TAIL_LINES = 15

__all__ = ["CHILD_START_S", "RowSink", "hand_on_if_lost", "load_rows", "run_child"]


def hand_on_if_lost(rep: Report, cfg: Config, failed: bool, section: str, after: str, part: str,
                    left: list[str]) -> bool:
    """After a step of a part: when it `failed` and the GPU no longer answers (a sticky error), a FAIL
    row `after <step>`, the rest (`part:left`) asked to run next in a fresh process, and True: the
    caller stops. False (go on) otherwise."""
    if not failed or gpu_answers(cfg):
        return False
    rep.add(section, f"after {after}", f"the GPU's context is lost (a sticky error: the rows above); {len(left)} "
            "left for a fresh process", False)
    if left:
        rep.resume(f"{part}:{','.join(left)}")
    return True


class RowSink:
    """The child's side: every row, failure traceback, kernel table and profile the part adds, as
    JSON lines in `path` (flushed as they come, so a child that dies keeps what it had)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file = path.open("a", encoding="utf-8")

    def put(self, kind: str, value) -> None:
        self._file.write(json.dumps({kind: value}, default=str) + "\n")
        self._file.flush()

    def finish(self, rep: Report) -> None:
        """The part's kernel table and profiles (set at its end), then the mark of a clean exit."""
        if rep.kernel_table:
            self.put("kernel_table", rep.kernel_table)
        for text in rep.extra:
            self.put("extra", text)
        self.put("done", True)
        self._file.close()


def load_rows(path: Path) -> dict:
    """What a child streamed: rows, details, kernel tables, profiles, the parts it asks to run next in a
    fresh process (`Report.resume`), and whether it finished."""
    out: dict = {"rows": [], "details": [], "kernel_table": [], "extra": [], "resume": [], "done": False}
    if not path.exists():
        return out
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            (kind, value), = json.loads(line).items()
        except (ValueError, AttributeError):
            continue                       # a line cut short by the child's death
        if kind == "done":
            out["done"] = True
        elif kind in out:
            out[kind].append(value)
    return out


def merge(rep: Report, got: dict) -> None:
    """A child's rows and texts into the parent's report (already printed by the child)."""
    rep.rows.extend(got["rows"])
    rep.details.extend(got["details"])
    rep.extra.extend(got["extra"])
    if got["kernel_table"]:
        rep.kernel_table = "\n\n".join(filter(None, [rep.kernel_table, *got["kernel_table"]]))


def run_child(rep: Report, part: str, section: str, argv: list[str], seconds: float, folder: Path,
              grace: float = GRACE_S) -> tuple[bool, list[str]]:
    """Run `argv` (a part's command line, to which `--rows FILE --prior FILE` are added) for at most
    `seconds` + `grace`, echoing its output; merge what it streamed into `rep`. (finished cleanly, the
    parts it asks to run next); not finished (a fault, a signal, the time limit) is a FAIL row in `section`."""
    rows, prior = folder / f"part-{_file_name(part)}.jsonl", folder / f"prior-{_file_name(part)}.json"
    rows.unlink(missing_ok=True)
    prior.write_text(json.dumps(rep.rows, default=str), encoding="utf-8")
    cmd = [*argv, "--rows", str(rows), "--prior", str(prior), "--t0-offset", f"{time.perf_counter() - rep.t0:.3f}"]
    tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
    t0 = time.perf_counter()
    # its own process group: a part's servers and mpiexec go with it when the time is up
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
    killed = threading.Event()

    def kill() -> None:
        killed.set()
        _kill_group(proc)

    timer = threading.Timer(max(seconds, 0.0) + grace, kill)
    timer.start()
    # `timeout` around the run ends the parent with SIGTERM: the part (its own session, so the device
    # machine would keep it running into the next call) must go with it
    previous = signal.signal(signal.SIGTERM, _exit_on_term)
    try:
        for line in proc.stdout:
            sys.stdout.write(line)
            sys.stdout.flush()
            tail.append(line.rstrip("\n"))
        rc = proc.wait()
    finally:
        timer.cancel()
        signal.signal(signal.SIGTERM, previous)
        if proc.poll() is None:
            _kill_group(proc)
            proc.wait()
    got = load_rows(rows)
    merge(rep, got)
    if got["done"] and rc == 0 and not killed.is_set():
        return True, got["resume"]
    how = (f"killed after {time.perf_counter() - t0:.0f} s (time left was {seconds:.0f} s)" if killed.is_set()
           else f"ended with {_status_text(rc)}" + ("" if got["done"] else " before finishing"))
    rep.add(section, f"{part}: its process", f"{how} after {len(got['rows'])} rows; the next part runs in a fresh "
            "process", False)
    rep.details.append(f"### {part}: the last {len(tail)} lines of its process\n```\n" + "\n".join(tail) + "\n```")
    return False, got["resume"]


def _exit_on_term(signum: int, frame) -> None:
    raise SystemExit(128 + signum)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        proc.kill()


def _status_text(rc: int) -> str:
    if rc < 0:
        try:
            return f"signal {signal.Signals(-rc).name}"
        except ValueError:
            return f"signal {-rc}"
    return f"exit status {rc}"


def _file_name(part: str) -> str:
    return "".join(c if c.isalnum() or c in "-_" else "-" for c in part)
