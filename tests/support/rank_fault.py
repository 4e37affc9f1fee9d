"""One rank of an `mpiexec` job with a fault injected, then `metatp ARGS` (tests/mpi/test_rank_faults.py).

    mpiexec -n 2 python tests/support/rank_fault.py generate -m MODEL ...

Every rank writes its pid to `$FAULT_DIR/pid<rank>` first (the test checks they all end). The
fault, from the environment:
- `FAULT=SIGNAL:RANK:CALL`: rank RANK sends itself SIGNAL (SIGKILL, SIGSTOP) at its CALL-th
  all-reduce (or send / receive between ranks under -sm layer), inside a step (the other ranks
  are in, or on their way to, that collective); the time goes to `$FAULT_DIR/fault` just before.
- `FAULT=slow:RANK:CALL:SECONDS`: a slow but healthy step instead: rank RANK spins in Python for
  SECONDS at its CALL-th all-reduce or copy (holding the GIL as a busy step would), then goes on.
- `FAULT_VERSION=RANK:VERSION`: rank RANK reports another metatp version (a mixed install).
- `FAULT_CWD=RANK:DIR`: rank RANK runs in DIR, so a relative `-m` names another file there (as
  the same path names different files on two machines).
"""

from __future__ import annotations

import os
import signal
import sys
import time


def _inject(kind: str, at: int, seconds: float, out: str) -> None:
    from metatp.backends.collectives.mpi import MpiCollective

    prepare = MpiCollective.prepare_allreduce
    calls = [0]

    def faulty_at(step):
        def faulty() -> None:
            calls[0] += 1
            if calls[0] == at:
                if kind == "slow":
                    end = time.monotonic() + seconds
                    while time.monotonic() < end:
                        sum(range(1000))
                else:
                    with open(os.path.join(out, "fault"), "w") as f:
                        f.write(repr(time.time()))
                    os.kill(os.getpid(), getattr(signal, kind))
            step()
        return faulty

    def prepare_faulty(self, bufs, active=None, stream=None):
        return faulty_at(prepare(self, bufs, active, stream=stream))
    MpiCollective.prepare_allreduce = prepare_faulty
    _inject_copies(faulty_at)


def _inject_copies(faulty_at) -> None:
    """-sm layer: the same count runs over the sends and receives between ranks (no all-reduce there)."""
    from metatp.backends.collectives.p2p import MpiSendRecv

    send, recv = MpiSendRecv.prepare_send, MpiSendRecv.prepare_recv
    MpiSendRecv.prepare_send = lambda self, buf, dst: faulty_at(send(self, buf, dst))
    MpiSendRecv.prepare_recv = lambda self, buf, src: faulty_at(recv(self, buf, src))


def main() -> int:
    rank = int(os.environ.get("PMI_RANK", "0"))
    out = os.environ["FAULT_DIR"]
    with open(os.path.join(out, f"pid{rank}"), "w") as f:
        f.write(str(os.getpid()))
    version = os.environ.get("FAULT_VERSION")
    if version and int(version.split(":")[0]) == rank:
        import metatp

        metatp.__version__ = version.split(":", 1)[1]
    cwd = os.environ.get("FAULT_CWD")
    if cwd and int(cwd.split(":")[0]) == rank:
        os.chdir(cwd.split(":", 1)[1])
    fault = os.environ.get("FAULT")
    if fault:
        kind, who, at, *rest = fault.split(":")
        if int(who) == rank:
            _inject(kind, int(at), float(rest[0]) if rest else 0.0, out)
    from metatp.cli import main as cli

    return cli(sys.argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
