"""Checking untrusted output constraints without trusting the constraint library: each unseen
constraint is compiled in a worker process (`metatp.constraint_worker`) under a time budget,
and its verdict is kept, keyed by the constraint's text, so a repeat costs nothing (a timeout is
not kept: a busy machine may have caused it).

A worker that crashes (llguidance overflows its stack on deeply chained rules: SIGSEGV) or runs
past `time_budget_s` is killed and replaced; the request gets a FieldError naming its field and
what happened, never the library's trace. The size budget (`metatp.request_fields.
constraint_text`) is checked before any of this, in the caller. `submit` returns a
concurrent.futures Future, so an event loop awaits it (`asyncio.wrap_future`) instead of waiting.
"""

from __future__ import annotations

import atexit
import collections
import concurrent.futures
import json
import os
import queue
import selectors
import subprocess
import sys
import threading
import time
from typing import Callable

from metatp.ir.errors import ConfigError
from metatp.request_fields import FieldError

__all__ = ["ConstraintChecker", "default_checker", "TIME_BUDGET_S", "WORKERS"]

TIME_BUDGET_S = 5.0          # one compile; llguidance takes ~0.5 s on 100,000 choices, ~30 s on a 1 MB alternation
START_TIMEOUT_S = 60.0       # a worker's start (Python and llguidance imported), on a busy machine
WORKERS = 2                  # compiles at once (each a process); more wait their turn
CACHE_ENTRIES = 1024
CACHE_BYTES = 64 << 20       # grammar text kept, all verdicts together


class _Worker:
    """One `python -m metatp.constraint_worker` process, started on first use."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None
        self._pending = b""
        self._ready = False

    def spawn(self) -> None:
        """Start the process unless it runs (subprocess execs at once: no Python state is forked)."""
        if self.proc is None or self.proc.poll() is not None:
            env = {**os.environ, "RUST_BACKTRACE": "0", "PYTHONUNBUFFERED": "1"}
            self.proc = subprocess.Popen([sys.executable, "-m", "metatp.constraint_worker"], stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, close_fds=True)
            self._pending = b""
            self._ready = False

    def ready(self) -> None:
        """Spawned, and past its "ready" line (Python and llguidance imported); a ConfigError if not."""
        self.spawn()
        if not self._ready:
            if not isinstance(self._read_line(time.monotonic() + START_TIMEOUT_S), bytes):
                self.stop()
                raise ConfigError("structured output: the constraint compiler process did not start "
                                  f"(python -m metatp.constraint_worker, within {START_TIMEOUT_S:g} s)")
            self._ready = True

    def ask(self, field: str, text: str, timeout: float) -> dict | str:
        """The worker's answer ({"grammar"} or {"refused"}), or "crashed" / "timeout" (it is then
        stopped), or "gone" (it was dead before it got the constraint); `timeout` counts the
        compile only, not a fresh worker's start."""
        self.ready()
        try:
            self.proc.stdin.write((json.dumps({"field": field, "text": text}) + "\n").encode())
            self.proc.stdin.flush()
        except OSError:           # it had died before this constraint reached it
            self.stop()
            return "gone"
        line = self._read_line(time.monotonic() + timeout)
        if not isinstance(line, bytes):
            self.stop()
            return line
        return json.loads(line)

    def _read_line(self, deadline: float) -> bytes | str:
        """The next answer line, or "timeout" (none by `deadline`), or "crashed" (the output closed)."""
        fd = self.proc.stdout.fileno()
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while b"\n" not in self._pending:
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    return "timeout"
                chunk = os.read(fd, 1 << 20)
                if not chunk:             # EOF: the process died (SIGSEGV, SIGKILL, ...)
                    return "crashed"
                self._pending += chunk
        line, _, self._pending = self._pending.partition(b"\n")
        return line

    def stop(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()
            for f in (self.proc.stdin, self.proc.stdout):
                try:
                    f.close()
                except OSError:
                    pass
            self.proc = None


class ConstraintChecker:
    """Compiles constraints in `workers` worker processes, each compile within `time_budget_s`;
    keeps the verdicts (a grammar or a refusal message) by (field, text), the last
    `cache_entries` within `cache_bytes`."""

    def __init__(self, workers: int = WORKERS, time_budget_s: float = TIME_BUDGET_S,
                 cache_entries: int = CACHE_ENTRIES, cache_bytes: int = CACHE_BYTES) -> None:
        self.time_budget_s = time_budget_s
        self._idle: queue.Queue[_Worker] = queue.Queue()
        self._workers = [_Worker() for _ in range(workers)]
        for w in self._workers:
            self._idle.put(w)
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="metatp-constraints")
        self._verdicts: collections.OrderedDict[tuple[str, str], tuple[bool, str]] = collections.OrderedDict()
        self._bytes = 0
        self._limits = (cache_entries, cache_bytes)
        self._lock = threading.Lock()
        self.compiles = 0          # worker round trips (a cache hit makes none)
        self.crashes = 0
        self.timeouts = 0

    # ------------------------------------------------------------ the verdict cache
    def cached(self, field: str, text: str) -> tuple[bool, str] | None:
        """(ok, grammar or refusal) when this constraint was checked before, else None."""
        with self._lock:
            v = self._verdicts.get((field, text))
            if v is not None:
                self._verdicts.move_to_end((field, text))
            return v

    def _remember(self, field: str, text: str, verdict: tuple[bool, str]) -> None:
        with self._lock:
            key = (field, text)
            if key in self._verdicts:
                return
            self._verdicts[key] = verdict
            self._bytes += len(text) + len(verdict[1])
            entries, size = self._limits
            while len(self._verdicts) > entries or (self._bytes > size and len(self._verdicts) > 1):
                (f, t), (_, g) = self._verdicts.popitem(last=False)
                self._bytes -= len(t) + len(g)

    # ------------------------------------------------------------ checking
    def _compile(self, field: str, text: str) -> tuple[bool, str, bool]:
        """(ok, grammar or refusal, whether the verdict may be kept): a timeout is not kept, as a
        busy machine may have caused it; a crash is (the library's, on this constraint)."""
        worker = self._idle.get()
        try:
            self.compiles += 1
            answer = worker.ask(field, text, self.time_budget_s)
            if answer == "gone":                 # not this constraint's doing: once more, on a fresh one
                answer = worker.ask(field, text, self.time_budget_s)
        finally:
            self._idle.put(worker)
        if answer in ("crashed", "gone"):
            self.crashes += 1
            return False, ("the constraint compiler crashed on it (rules nested or chained too deeply?); "
                           "simplify it"), True
        if answer == "timeout":
            self.timeouts += 1
            return False, f"compiling it took longer than the limit of {self.time_budget_s:g} s; simplify it", False
        if "grammar" in answer:
            return True, answer["grammar"], True
        return False, answer["refused"], True

    def _verdict(self, field: str, text: str) -> tuple[bool, str]:
        v = self.cached(field, text)
        if v is None:
            ok, result, keep = self._compile(field, text)
            v = (ok, result)
            if keep:
                self._remember(field, text, v)
        return v

    def _check(self, field: str, text: str, then: Callable[[str], None] | None) -> str:
        ok, result = self._verdict(field, text)
        if not ok:
            raise FieldError(field, f"{field}: {result}")
        if then is not None:
            then(result)
        return result

    def submit(self, field: str, text: str, then: Callable[[str], None] | None = None) -> concurrent.futures.Future:
        """A Future of llguidance's grammar for the constraint `field` = `text` (already within
        the size budget), or of the FieldError naming the field; `then(grammar)` runs on the
        checker's thread once it is known (to build the matcher there, off the caller's)."""
        v = self.cached(field, text)
        if v is not None and then is None:        # a repeat: no thread hop
            f: concurrent.futures.Future = concurrent.futures.Future()
            if v[0]:
                f.set_result(v[1])
            else:
                f.set_exception(FieldError(field, f"{field}: {v[1]}"))
            return f
        return self._pool.submit(self._check, field, text, then)

    def check(self, field: str, text: str) -> str:
        """llguidance's grammar for the constraint, or a FieldError naming the field (blocking)."""
        return self.submit(field, text).result()

    def close(self) -> None:
        """Stop the worker processes (a later check starts them again)."""
        for w in self._workers:
            w.stop()


_default: ConstraintChecker | None = None
_default_lock = threading.Lock()


def default_checker() -> ConstraintChecker:
    """The process's checker, shared by SamplingParams and the server (started on first use)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = ConstraintChecker()
            atexit.register(_default.close)
        return _default
