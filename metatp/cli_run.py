"""Parse and run one metatp command with the command line's error contract: every deliberate
error is one line on stderr and a non-zero exit, never a traceback.

`metatp.cli.main` runs the whole command through it; a subcommand's own `main` (batched-bench,
pipeline-bench) builds a parser of just itself and runs it here, without importing the CLI.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from typing import Sequence

from metatp import pipeline
from metatp.cli_args import first_rank
from metatp.cli_options import environment_note
from metatp.ir.errors import ConfigError, MetatpError

__all__ = ["run_command", "check_args"]


def check_args(args: argparse.Namespace) -> None:
    """What argparse's types cannot say: bench's device counts (a list) are >= 1; generate's single
    count is checked by the layout (n_devices); --micro-batches is 1..64 or auto (then applied)."""
    micro = getattr(args, "micro_batches", None)
    if micro is not None:          # every engine of this process reads it (metatp.pipeline)
        os.environ[pipeline.ENV] = str(pipeline.parse_micro_batches(micro, "--micro-batches") or "auto")
    devices = getattr(args, "devices", None)
    if isinstance(devices, str):
        for part in devices.split(","):
            part = part.strip()
            if part and (not part.lstrip("-").isdigit() or int(part) < 1):
                raise ConfigError(f"--devices: device counts must be integers >= 1, got {devices!r}")


def read_prompt_file(path: str) -> str:
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ConfigError(f"cannot read prompt file {path!r}: {e.strerror or e}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"cannot read prompt file {path!r}: it is not UTF-8 text "
                          f"(byte 0x{data[e.start]:02x} at offset {e.start})") from None


def _warning_line(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"metatp: warning: {message}", file=sys.stderr)


def run_command(ap: argparse.ArgumentParser, argv: Sequence[str] | None = None) -> int:
    """Parse `argv` with `ap` (whose subcommands set `func`) and run it; the exit status."""
    try:
        args = ap.parse_args(argv)
    except SystemExit as e:          # --help, or a bad flag (already reported on one line)
        return e.code if isinstance(e.code, int) else 2
    try:
        check_args(args)
        if getattr(args, "file", None):
            args.prompt = read_prompt_file(args.file)
    except MetatpError as e:
        if first_rank():
            print(f"metatp: error: {e}", file=sys.stderr)
        return 1
    warnings.showwarning = _warning_line
    from metatp.backends.distributed import finish_error     # under mpiexec: print once, end every rank

    try:
        return int(args.func(args) or 0)
    except MetatpError as e:
        note = environment_note(str(e))
        return finish_error(e, f"metatp: error: {e}" + (f"\n{note}" if note else ""), 1)
    except KeyboardInterrupt as e:
        return finish_error(e, "\nmetatp: interrupted", 130)
    except BrokenPipeError:
        return 0
    except MemoryError as e:
        return finish_error(e, "metatp: error: out of memory (try a smaller -c / n_ctx or more devices)", 1)
    except RecursionError:
        print("metatp: error: the model is nested too deeply to process (recursion limit)", file=sys.stderr)
        return 1
    except Exception as e:  # a bug: still one line for the user, the traceback on request
        if os.environ.get("METATP_DEBUG"):
            raise
        return finish_error(e, f"metatp: internal error: {type(e).__name__}: {e}\n"
                            "metatp: hint: this is a bug in metatp; rerun with METATP_DEBUG=1 for the traceback", 2)
