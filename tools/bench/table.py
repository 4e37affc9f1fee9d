"""The rows as llama-bench prints them: a markdown table, JSON or CSV."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

from metatp.tools.bench_comm import format_bytes

__all__ = ["MPI_COLUMNS", "COPY_COLUMNS", "COMM_COLUMNS", "format_rows"]


# Under mpiexec: rank 0's wall time inside MPI_Allreduce (-sm tensor rows) or inside its sends /
# receives of the hidden state (-sm layer rows) during the timed runs, per call and per token
MPI_COLUMNS = ("MPI_Allreduce µs/call", "MPI_Allreduce ms/tok")


COPY_COLUMNS = ("MPI Send/Recv µs/call", "MPI Send/Recv ms/tok")


# The communication the dump bills for the row's split (tools/bench_comm.py)
COMM_COLUMNS = ("comm/tok", "comm/pp512")


def format_rows(rows: list[dict], fmt: str) -> str:
    if fmt == "json":
        return json.dumps(rows, indent=2)
    if fmt == "csv":
        buf = io.StringIO()
        keys = [k for k in rows[0] if k != "samples_ts"] if rows else []
        w = csv.DictWriter(buf, fieldnames=keys + ["samples_ts"])
        w.writeheader()
        for r in rows:
            w.writerow({**{k: r[k] for k in keys}, "samples_ts": ";".join(f"{x:.3f}" for x in r["samples_ts"])})
        return buf.getvalue()
    compare = any("vs_llama_cpp" in r for r in rows)
    # llama-bench shows type_k / type_v when they are not the default: here when any metatp row
    # has a cache other than f32
    kv_cols = any((r.get("type_k"), r.get("type_v")) != ("f32", "f32") for r in rows if r["backend"] != "llama.cpp")
    mpi_cols = any(r.get("allreduce_us_per_call") is not None for r in rows)
    copy_cols = any(r.get("copy_us_per_call") is not None for r in rows)
    head = ["model", "size", "backend", "numerics", "devices", "sm", "ts"] + (["type_k", "type_v"] if kv_cols else []) \
        + ["test", "t/s", "vs -sm none", "reductions/tok"] + list(COMM_COLUMNS) \
        + (["vs llama.cpp"] if compare else []) + (list(MPI_COLUMNS) if mpi_cols else []) \
        + (list(COPY_COLUMNS) if copy_cols else [])
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join(["---"] * len(head)) + " |"]
    for r in rows:
        size = Path(r["model_filename"]).stat().st_size / 2**20 if Path(r["model_filename"]).exists() else 0
        ratio = f"{r['vs_none']:.2f}x" if r["vs_none"] is not None else ""
        cells = [r["model_type"], f"{size:.1f} MiB", r["backend"], r["numerics"], str(r["n_devices"]), r["split_mode"],
                 r["tensor_split"]] + ([r.get("type_k", ""), r.get("type_v", "")] if kv_cols else []) \
            + [r["test"], f"{r['avg_ts']:.2f} ± {r['stddev_ts']:.2f}", ratio, str(r["reductions_per_token"]),
               format_bytes(r.get("comm_bytes_per_token")), format_bytes(r.get("comm_bytes_per_prompt"))]
        if compare:
            c = r.get("vs_llama_cpp")
            cells.append(f"{c:.2f}x" if c is not None else "")
        for shown, kind in ((mpi_cols, "allreduce"), (copy_cols, "copy")):
            if shown:
                us, ms = r.get(f"{kind}_us_per_call"), r.get(f"{kind}_ms_per_token")
                cells += [f"{us:.1f}" if us is not None else "", f"{ms:.3f}" if ms is not None else ""]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
