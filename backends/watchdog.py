"""Faults across ranks: the version check at start, and a heartbeat that ends a job whose rank went silent.

The ranks of an `mpiexec` job run in lock step, so a rank that stops answering leaves every
other rank waiting inside a collective, and a blocking MPI call cannot be interrupted from
Python. What ends such a job:

- a rank that *dies* (SIGKILL, a segfault, the OOM killer): the launcher itself. MPICH's hydra
  sees the exit and kills every other rank within milliseconds (measured: 0.02 s), printing
  "YOUR APPLICATION TERMINATED WITH THE EXIT STRING: Killed (signal 9)". Nothing here is
  faster, and the others are killed with SIGKILL, so they cannot add a line of their own;
- a rank that is *alive but silent* (SIGSTOP, a machine that froze, a network that dropped):
  this heartbeat. Every rank's `Heartbeat` thread sends a one-byte beat to every other rank
  each `interval` seconds on a communicator of its own, and reads theirs. A peer not heard from
  for `METATP_RANK_TIMEOUT` seconds (default 20) makes this rank print one line naming it, run
  the fault hooks (a server fails its requests in flight with an HTTP 500), and exit; the launcher
  then kills the rest (hydra sends SIGKILL, which ends a stopped process too, and now and then
  reports that kill after our line with its "Killed (signal 9)" block; should a stopped peer on
  this machine outlive that, a detached checker kills it a few seconds later).

Why a heartbeat and not a step deadline: the beats come from a thread of their own, so a
healthy rank beats through any step, however slow (a long prefill, the first step compiling
kernels, a rank 0 running the single-device baseline of `metatp bench` alone), and through an
idle server; only a rank whose process is not running falls silent. What it does not see is a
rank that runs but never reaches the collective (a deadlock in the program); the lock step
(rank 0's tokens on every rank) is what keeps that from happening.

One line, printed once: when several ranks lose the same peer, rank r waits `STAGGER_S` more
seconds for each lower rank it still hears from, so the lowest one reports and ends the job
first. A rank that exits normally says goodbye first (`stop`), so a follower leaving before rank 0
has shut its server down is not a fault; a rank that was itself stopped and resumed (Ctrl-Z on the
whole job) restarts its clocks instead of blaming the others.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
from typing import Any, Callable

from metatp.backends.rank_errors import every_rank, first_disagreeing
from metatp.ir.errors import ConfigError, MetatpError

__all__ = ["RankLostError", "TIMEOUT_ENV", "DEFAULT_TIMEOUT_S", "rank_timeout", "check_versions", "Heartbeat",
           "add_fault_hook", "remove_fault_hook", "watch"]

TIMEOUT_ENV = "METATP_RANK_TIMEOUT"
DEFAULT_TIMEOUT_S = 20.0
STAGGER_S = 1.0             # extra wait per lower rank still heard from (one line, printed once)
_TAG = 0x6862               # the heartbeat's MPI tag (on a communicator of its own)
_BEAT, _BYE = 0, 1


class RankLostError(MetatpError):
    """Another rank of the MPI job stopped answering; the job is ending (requests in flight fail)."""


def rank_timeout(environ: dict | None = None) -> float | None:
    """Seconds a rank may go unheard before the job ends: `METATP_RANK_TIMEOUT` (default 20;
    0 or "off": no heartbeat). A value that is not a number is a ConfigError naming it."""
    raw = (environ if environ is not None else os.environ).get(TIMEOUT_ENV, "").strip()
    if not raw:
        return DEFAULT_TIMEOUT_S
    if raw.lower() in ("0", "off", "none"):
        return None
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise ConfigError(f"{TIMEOUT_ENV}={raw!r}: give the seconds a rank may go unheard (a number > 0), "
                          "or 0 / off for no heartbeat")
    return value


def _version() -> str:
    # the parent package is imported before any module of it; reading it from sys.modules keeps
    # this module from importing the API layer (metatp/__init__ imports the LLM, which imports us)
    return str(getattr(sys.modules.get("metatp"), "__version__", "unknown"))


def check_versions(world: Any) -> list[tuple[str, str, int]]:
    """Every rank runs the same metatp (rank 0's tokens and plans must mean the same everywhere):
    a ConfigError every rank raises alike otherwise. Returns every rank's (version, host, pid)."""
    seen = world.comm.allgather((_version(), world.host, os.getpid()))
    r = first_disagreeing(seen)
    if r is not None:
        raise every_rank(ConfigError(
            f"ranks run different versions of metatp: rank 0 on {seen[0][1]} has {seen[0][0]} but rank {r} on "
            f"{seen[r][1]} has {seen[r][0]}; install the same metatp on every machine"))
    return seen


# ---------------------------------------------------------------- what to do before the job ends
_HOOKS: list[Callable[[RankLostError], None]] = []
_HOOK_GRACE_S = 1.0         # after the hooks: time for a server's error responses to go out


def add_fault_hook(hook: Callable[[RankLostError], None]) -> None:
    """Call `hook(error)` (from the heartbeat thread) before this rank ends on a lost peer; it
    must return promptly (a server fails its requests in flight so that their clients hear)."""
    _HOOKS.append(hook)


def remove_fault_hook(hook: Callable[[RankLostError], None]) -> None:
    if hook in _HOOKS:
        _HOOKS.remove(hook)


class Heartbeat:
    """Beats to, and listens for, every other rank of `comm` (a thread; see the module doc).

    `peers`: every rank's (version, host, pid), for the line that names the silent one. `on_lost`
    (tests) replaces the default end (hooks, one line, `os._exit(1)`)."""

    def __init__(self, comm: Any, timeout: float, peers: list[tuple[str, str, int]] | None = None,
                 interval: float | None = None, on_lost: Callable[[int, float], None] | None = None) -> None:
        from mpi4py import MPI

        self._mpi = MPI
        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.timeout = float(timeout)
        self.interval = interval if interval is not None else min(1.0, self.timeout / 4)
        self.peers = peers
        self.on_lost = on_lost or self._end_job
        now = time.monotonic()
        self.last_seen = {r: now for r in range(self.size) if r != self.rank}
        self._sends: list[Any] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="metatp-heartbeat", daemon=True)

    def start(self) -> "Heartbeat":
        self._thread.start()
        return self

    def stop(self, bye: bool = True) -> None:
        """Stop beating; with `bye`, tell the others this rank is leaving (not lost)."""
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        if bye:
            self._send_all(_BYE)
            deadline = time.monotonic() + 1.0
            while self._sends and time.monotonic() < deadline:
                self._reap()
                time.sleep(0.01)

    # ---------------------------------------------------------------- the thread
    def _run(self) -> None:
        tick = min(0.5, self.timeout / 10)        # default: 2 wake-ups a second, a beat each second
        last_tick = next_beat = time.monotonic()
        while not self._stop.is_set():
            now = time.monotonic()
            if now - last_tick > max(3 * self.interval, 2.0):
                # this rank was paused itself (stopped and resumed): the others are not to blame
                self.last_seen = {r: now for r in self.last_seen}
            last_tick = now
            if now >= next_beat:
                self._send_all(_BEAT)
                next_beat = now + self.interval
            self._drain(now)
            self._reap()
            lost = self._lost(now)
            if lost is not None:
                self.on_lost(lost, now - self.last_seen[lost])
                return
            self._stop.wait(tick)

    def _send_all(self, kind: int) -> None:
        import numpy as np

        for r in self.last_seen:
            buf = np.array([kind], np.int8)
            self._sends.append((self.comm.Isend(buf, dest=r, tag=_TAG), buf))

    def _reap(self) -> None:
        self._sends = [(req, buf) for req, buf in self._sends if not req.Test()]

    def _drain(self, now: float) -> None:
        import numpy as np

        status = self._mpi.Status()
        buf = np.zeros(1, np.int8)
        while self.comm.Iprobe(source=self._mpi.ANY_SOURCE, tag=_TAG, status=status):
            src = status.Get_source()
            self.comm.Recv(buf, source=src, tag=_TAG)
            if buf[0] == _BYE:
                self.last_seen.pop(src, None)
            elif src in self.last_seen:
                self.last_seen[src] = now

    def _lost(self, now: float) -> int | None:
        """The silent peer this rank should report now, if any: past the timeout, plus STAGGER_S
        per lower rank still heard from (that one reports first)."""
        silent = [r for r, t in self.last_seen.items() if now - t > self.timeout]
        if not silent:
            return None
        heard = sum(1 for r, t in self.last_seen.items() if r < self.rank and now - t <= self.timeout)
        worst = max(silent, key=lambda r: now - self.last_seen[r])
        return worst if now - self.last_seen[worst] > self.timeout + STAGGER_S * heard else None

    def describe(self, rank: int) -> str:
        if self.peers is None:
            return f"rank {rank}"
        _, host, pid = self.peers[rank]
        return f"rank {rank} (pid {pid} on {host})"

    def _end_job(self, lost: int, silent_for: float) -> None:
        """The default end: fail what the hooks hold, print one line, exit; the launcher ends the rest."""
        what = (f"{self.describe(lost)} has not answered for {silent_for:.1f} s (stopped, frozen or "
                f"unreachable?); ending every rank")
        err = RankLostError(what)
        if _HOOKS:
            for hook in list(_HOOKS):
                try:
                    hook(err)
                except Exception:  # noqa: BLE001 -- the job ends either way
                    pass
            time.sleep(_HOOK_GRACE_S)
        print(f"metatp: error: {what} [rank {self.rank}; {TIMEOUT_ENV}={self.timeout:g}]", file=sys.stderr,
              flush=True)
        try:
            sys.stdout.flush()
        except Exception:  # noqa: BLE001 -- a closed stdout must not keep this rank alive
            pass
        time.sleep(0.25)            # let the launcher forward the line before the job is torn down
        self._end_stopped_peer(lost)
        os._exit(1)

    def _end_stopped_peer(self, lost: int) -> None:
        """A fallback for a lost peer on this machine that is *stopped* (SIGSTOP, a debugger): the
        launcher ends the job once this rank exits, but a stopped process ignores every signal
        but SIGKILL until it is resumed, so a launcher that asks it to terminate first waits on
        it forever. A small detached checker kills the peer if it is still that same stopped
        process `_STOPPED_GRACE_S` after this rank is gone (normally the launcher has ended it
        by then and the checker does nothing). A peer elsewhere, or one still running, is left
        to the launcher."""
        if self.peers is None:
            return
        _, host, pid = self.peers[lost]
        stat = _proc_stat(pid)
        if host != socket.gethostname() or stat is None or stat[0] not in ("T", "t"):
            return
        import subprocess

        try:
            subprocess.Popen([sys.executable, "-c", _CHECKER, str(pid), stat[1], str(_STOPPED_GRACE_S)],
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True, close_fds=True)
        except OSError:
            pass


_STOPPED_GRACE_S = 5.0

# argv: pid, its start time (/proc stat field 22), seconds to wait; kills it only if it is the same,
# still stopped, process then
_CHECKER = """
import os, signal, sys, time
pid, started, wait = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
time.sleep(wait)
try:
    with open(f"/proc/{pid}/stat") as f:
        rest = f.read().rsplit(")", 1)[1].split()
    if rest[0] in ("T", "t") and rest[19] == started:
        os.kill(pid, signal.SIGKILL)
except (OSError, IndexError):
    pass
"""


def _proc_stat(pid: int) -> tuple[str, str] | None:
    """(state letter, start time) of process `pid` on this machine (Linux /proc), None if unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            rest = f.read().rsplit(")", 1)[1].split()
        return rest[0], rest[19]
    except (OSError, IndexError):
        return None


_HEARTBEAT: Heartbeat | None = None


def watch(world: Any) -> Heartbeat | None:
    """At the start of an MPI job of several ranks (every rank calls it, `init_world`): check that
    the ranks run the same metatp, then start the heartbeat (unless METATP_RANK_TIMEOUT=0). The
    heartbeat says goodbye when the process exits normally."""
    global _HEARTBEAT
    if world.size <= 1 or _HEARTBEAT is not None:
        return _HEARTBEAT
    try:
        timeout = rank_timeout()
    except ConfigError as e:
        raise every_rank(e) from None
    peers = check_versions(world)
    if timeout is None:
        return None
    import atexit

    _HEARTBEAT = Heartbeat(world.comm.Dup(), timeout, peers).start()
    atexit.register(_HEARTBEAT.stop)        # runs before mpi4py's MPI_Finalize (registered earlier)
    return _HEARTBEAT
