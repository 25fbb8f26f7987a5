"""The multi-device part of `dflash train`: device options, and rendering the engine's report."""

from __future__ import annotations

from typing import Annotated, Any, Optional

import typer

from cli import output
from compilewatch.errors import BadInput

TargetDevicesOpt = Annotated[Optional[str], typer.Option(
    "--target-devices", help="Target workers, one thread per entry: 0,1,2,3,4 (cpu and repeats allowed). "
                             "With --drafter-devices: train with the multi-device engine.")]
DrafterDevicesOpt = Annotated[Optional[str], typer.Option(
    "--drafter-devices", help="Drafter replicas, one thread per entry: 5,6,7. Every replica's step is compiled "
                              "in the main thread first, one device after another; then compiling is frozen.")]
NoPrewarmOpt = Annotated[bool, typer.Option(
    "--no-prewarm", help="Engine: skip the sequential prewarm (the seeds' race: for experiments only).")]
NoGuardOpt = Annotated[bool, typer.Option("--no-guard", help="Engine: do not freeze compiles during training.")]
StallOpt = Annotated[float, typer.Option("--stall-after", help="Engine: no step for this many seconds = stall: "
                                                              "dump every thread's stack and stop.")]


def parse_engine_devices(spec: str, option: str) -> tuple[str, ...]:
    """`0,1,cuda:2,cpu,cpu` -> validated device names; a device may repeat (several threads on it)."""
    from compilewatch.devices.spec import parse_device

    items = [x for x in spec.split(",") if x.strip()]
    if not items:
        raise BadInput(f"{option}: no devices given", hint=f"e.g. {option} 0,1,2 or {option} cpu,cpu")
    try:
        return tuple(parse_device(x) for x in items)
    except BadInput as e:
        raise BadInput(f"{option}: {e.message}", hint=e.hint) from None


def engine_devices(targets: str | None, drafters: str | None) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
    if targets is None and drafters is None:
        return None
    if targets is None or drafters is None:
        raise BadInput("--target-devices and --drafter-devices go together",
                       hint="e.g. --target-devices 0,1,2,3,4 --drafter-devices 5,6,7")
    return parse_engine_devices(targets, "--target-devices"), parse_engine_devices(drafters, "--drafter-devices")


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


def finish(report: Any) -> None:
    """Exit with the report's code. Threads still blocked inside torch (a stall) cannot be stopped,
    and letting the interpreter tear down under them can abort the process: leave at once then."""
    import os
    import sys

    code = exit_code(report)
    if any(t.alive for t in report.threads):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    if code:
        raise typer.Exit(code)
