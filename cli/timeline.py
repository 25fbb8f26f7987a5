"""`compilewatch timeline REPORT.jsonl -o FILE.json`: a watcher report as a Perfetto timeline."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.markup import escape

from cli import output
from cli.options import JsonOpt
from cli.lazy import lazy

timeline_lib = lazy("compilewatch.tracing.timeline")


def timeline_cmd(
    report: Annotated[str, typer.Argument(help="A JSONL event report (compilewatch run --report, compilewatch.watch(report=...)).")],
    out: Annotated[str, typer.Option("--output", "-o", help="Where to write the Chrome trace-event JSON.")] = "timeline.json",
    as_json: JsonOpt = False,
) -> None:
    """Convert a watcher event report into a timeline that Perfetto (https://ui.perfetto.dev) and
    chrome://tracing open: one track per thread, a slice per trace window, dynamo compile and span,
    markers for leaks, stuck state, stalls and recompiles, arrows from setter to victim.

    Examples:

      compilewatch timeline watch.jsonl -o race.json
    """
    info = timeline_lib.convert(report, out)
    output.emit(info, as_json, _render)


def _render(i: timeline_lib.TimelineInfo) -> None:
    output.out.print(f"wrote {escape(i.path)}: {i.slices} slice(s), {i.instants} marker(s), {len(i.threads)} thread track(s) "
                     f"in {i.processes} process(es), {i.problems} problem(s)")
    output.out.print("open it at https://ui.perfetto.dev (Open trace file) or chrome://tracing (Load)")
