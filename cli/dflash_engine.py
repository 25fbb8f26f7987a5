"""The multi-device part of `dflash train`: rendering the engine's report, and its exit code."""

from __future__ import annotations

from typing import Any

import typer

from cli import output


def render_engine(report: Any) -> None:
    o = output.out
    o.print(f"engine: {report.outcome} — {len(report.target_devices)} target worker(s) "
            f"[{', '.join(report.target_devices)}], {len(report.drafter_devices)} drafter replica(s) "
            f"[{', '.join(report.drafter_devices)}], guard {report.guard}", markup=False)
    for v in report.verdicts:
        o.print(f"  → {v}", markup=False)
    if report.failure is not None:
        output.err.print(f"[red]{report.failure.thread} failed:[/]")
        output.err.print(report.failure.traceback, markup=False, highlight=False)
    if report.outcome == "stalled":
        for name, frames in report.stacks.items():
            output.err.print(f"[bold]{name}[/]")
            for f in list(frames)[-8:]:
                output.err.print(f"    {f}", markup=False, highlight=False)


def exit_code(report: Any) -> int:
    return {"ok": 0, "interrupted": 130}.get(report.outcome, 1)


def finish(report: Any, code: int | None = None) -> None:
    """Exit with the report's code (or `code`: 143 for a SIGTERM). Threads still blocked inside torch (a
    stall) cannot be stopped, and letting the interpreter tear down under them can abort the process:
    leave at once then."""
    import os
    import sys

    code = exit_code(report) if code is None else code
    if any(t.alive for t in report.threads):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    if code:
        raise typer.Exit(code)
