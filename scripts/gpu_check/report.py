"""The results table: rows as they come (printed at once), the environment, tracebacks, and the
markdown + JSON written at the end."""

from __future__ import annotations

import json
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class Report:
    """Rows of the results table, plus the environment and any tracebacks."""

    rows: list[dict] = field(default_factory=list)
    env: dict = field(default_factory=dict)
    details: list[str] = field(default_factory=list)
    kernel_table: str = ""
    extra: list[str] = field(default_factory=list)     # further sections of the written report
    t0: float = field(default_factory=time.perf_counter)
    sink: Any = None        # a part's process (`isolate.RowSink`): rows and tracebacks also go there

    def add(self, section: str, check: str, result: str, ok: bool | None) -> None:
        """One row; `ok` None is a plain note (info), False a failure."""
        status = "pass" if ok else ("FAIL" if ok is False else "info")
        row = {"section": section, "check": check, "result": result, "status": status}
        self.rows.append(row)
        print(f"[{time.perf_counter() - self.t0:6.1f}s] {section:8s} {check}: {result} ({status})", flush=True)
        if self.sink is not None:
            self.sink.put("rows", row)

    def fail(self, section: str, what: str, e: BaseException) -> None:
        """A FAIL row for an exception, its traceback kept for the written report."""
        self.add(section, what, f"{type(e).__name__}: {e}"[:300], False)
        self.details.append(f"### {section}: {what}\n```\n{traceback.format_exc()}```")
        if self.sink is not None:
            self.sink.put("details", self.details[-1])

    def step(self, section: str, what: str, fn, *args):
        """fn(*args), or None with a FAIL row for its exception: one failure must not hide the other steps."""
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001
            self.fail(section, what, e)
            return None

    def resume(self, part: str) -> None:
        """Ask for `part` (what is left of this one) to run next in a fresh process: after a fault's
        sticky error this process can no longer use the GPU. Without a parent to ask (one process
        for the whole run) the rest runs here and fails fast, as before."""
        if self.sink is not None:
            self.sink.put("resume", part)

    def markdown(self) -> str:
        lines = ["| section | check | result | status |", "| --- | --- | --- | --- |"]
        for r in self.rows:
            lines.append(f"| {r['section']} | {r['check']} | {r['result'].replace('|', '/')} | {r['status']} |")
        return "\n".join(lines)

    def failures(self) -> int:
        """FAIL rows so far (a step that adds one failed)."""
        return sum(r["status"] == "FAIL" for r in self.rows)

    @property
    def passed(self) -> bool:
        return all(r["status"] != "FAIL" for r in self.rows)


def write_outputs(rep: Report, out: Path | None) -> None:
    """Print the table; with `out`, write it (plus the kernel table and tracebacks) and a .json copy."""
    env = ", ".join(f"{k}={v}" for k, v in rep.env.items())
    text = [f"metatp gpu_check — {time.strftime('%Y-%m-%d %H:%M:%S')}", "", f"Environment: {env}", "",
            rep.markdown(), ""]
    print("\n" + "\n".join(text), flush=True)
    if out is None:
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    body = "\n".join(text)
    if rep.kernel_table:
        body += "\n## Kernel checks\n\n" + rep.kernel_table + "\n"
    if rep.extra:
        body += "\n## Profiles\n\n" + "\n".join(rep.extra)
    if rep.details:
        body += "\n## Failures\n\n" + "\n\n".join(rep.details) + "\n"
    out.write_text(body, encoding="utf-8")
    out.with_suffix(".json").write_text(json.dumps({"env": rep.env, "rows": rep.rows}, indent=1, default=str),
                                        encoding="utf-8")
    print(f"wrote {out} and {out.with_suffix('.json')}", flush=True)
