"""`compilewatch run -- CMD ...`: rendering of compilewatch.tracing.runner results.

The child's stdout stays the child's; the verdict goes to stderr (so a pipeline sees the program's
own output). With --json the child's stdout is sent to stderr and stdout carries only the JSON.
"""

from __future__ import annotations

import sys
from typing import Annotated, List, Optional

import typer
from rich.markup import escape

from cli import output
from cli.options import JsonOpt
from compilewatch.tracing import runner
from compilewatch.tracing.watch_events import WatchEvent, WatchSummary


class _Live:
    """Prints each finding once while the program runs (the same line from many events: once)."""

    def __init__(self) -> None:
        self.seen: set[str] = set()

    def __call__(self, ev: WatchEvent) -> None:
        if not ev.problem:
            return
        from compilewatch.tracing.watch_events import summarize

        for f in summarize([ev]).findings:
            line = f.text.split(" — known torch failure", 1)[0]
            if line in self.seen:
                continue
            self.seen.add(line)
            style = "red" if f.severity == "failure" else "yellow"
            output.err.print(f"[{style}]compilewatch[/] (pid {ev.pid}): {escape(line)}")


def _child_stdout_to_stderr():
    """With --json the child's stdout goes to our stderr (stdout carries only JSON)."""
    import io
    import subprocess

    try:
        sys.stderr.fileno()
        return sys.stderr
    except (AttributeError, OSError, io.UnsupportedOperation):  # a captured stderr (tests): drop it
        return subprocess.DEVNULL


def run_cmd(
    command: Annotated[Optional[List[str]], typer.Argument(help="The program to run, after --.")] = None,
    report: Annotated[Optional[str], typer.Option("--report", "-r", help="Write every event as JSONL to FILE.")] = None,
    timeline: Annotated[Optional[str], typer.Option("--timeline", help="Write a Chrome trace-event timeline (Perfetto) to FILE.json.")] = None,
    stall_after: Annotated[float, typer.Option("--stall-after", help="Seconds a compile may run before it counts as a stall (all stacks dumped).")] = 300.0,
    repair: Annotated[bool, typer.Option("--repair", help="Put stuck FX tracing state back when it is found.")] = False,
    strict: Annotated[bool, typer.Option("--strict", hidden=True, help="The default since 0.x: kept so scripts that pass it keep working.")] = False,
    strict_risks: Annotated[bool, typer.Option("--strict-risks", help="Also exit 1 when the program exited 0 and the watcher saw only risks (no harm observed).")] = False,
    as_json: JsonOpt = False,
) -> None:
    """Run a Python program with the cross-thread watcher installed, without editing it.

    Reports FX-flag leaks (setter and victim threads, both stacks), module calls through another
    thread's patched nn.Module.__call__, stuck tracing state, compile stalls and silent eager
    fallbacks.

    Exit code: EXIT_RULE

    Examples:

      compilewatch run -- python train.py --epochs 1

      compilewatch run --report watch.jsonl --stall-after 120 \\
        -- python -m mypkg.train

      compilewatch run --timeline race.json \\
        -- torchrun --nproc-per-node 2 train.py
    """
    from cli.cache_explain import LookupEvents, print_after  # issue 38: every cache miss explained

    lookups = LookupEvents(None if as_json else _Live())
    result = runner.run_watched(command or [], report=report, timeline=timeline, stall_after=stall_after,
                                repair=repair, on_event=lookups,
                                stdout=_child_stdout_to_stderr() if as_json else None)
    explained = lookups.explain()
    if as_json:
        output.print_json({**output.jsonable(result), "cache_explain": output.jsonable(explained)})
    else:
        _render(result)
        print_after(explained, output.err)
    raise typer.Exit(exit_code(result, strict_risks=strict_risks))


EXIT_RULE = ("the program's own code when it is not 0 (killed by signal N: 128+N); otherwise 1 when the watcher "
             "saw a failure or could not watch fully, and with --strict-risks also when it saw a risk; else 0.")
run_cmd.__doc__ = run_cmd.__doc__.replace("EXIT_RULE", EXIT_RULE)


def exit_code(result: runner.RunResult, *, strict_risks: bool = False) -> int:
    """`compilewatch run`'s exit code (EXIT_RULE; README and docs/run.md state the same rule)."""
    if result.exit_code != 0:
        return result.exit_code
    if not result.processes:
        return 0  # nothing imported torch: nothing was watched, nothing found
    if not result.summary.ok or strict_risks and result.summary.risks:
        return 1
    return 0


WATCHED = {"trace": ("trace window", "trace windows"), "compile": ("compile", "compiles"),
           "span": ("span", "spans"), "warm": ("warm pass", "warm passes")}


def summary_line(s: WatchSummary) -> str:
    """The head of a watch summary, in the findings' own units: how many failures and risks were listed
    (each one finding, however often it recurred), then what was watched. `4 failure(s)` over two
    listed findings read as a miscount: events and findings are counted apart."""
    fails = [f for f in s.findings if f.severity == "failure"]
    risks = [f for f in s.findings if f.severity != "failure"]
    if s.ok and not risks:
        head = "ok"
    elif fails:
        head = output.count(len(fails), "failure")
    else:
        head = "ok" if s.ok else "not fully watched"
    if risks:
        head += ", " + output.count(len(risks), "risk") + " (no harm observed)"
    events = sum(f.count for f in s.findings)
    if s.findings and events != len(s.findings):
        head += f" ({events} events)"
    watched = [output.count(s.counts[k], *WATCHED[k]) for k in WATCHED if s.counts.get(k)]
    return head + ("; watched " + ", ".join(watched) if watched else "")


def render_summary(s: WatchSummary, console) -> None:
    style = "green" if s.ok else "red"
    console.print(f"[{style}][bold]{escape(summary_line(s))}[/][/]")
    if s.setter_threads:
        console.print(f"setter thread(s): {escape(', '.join(s.setter_threads))}")
    if s.victim_threads:
        console.print(f"victim thread(s): {escape(', '.join(s.victim_threads))}")
    if s.stalled_threads:
        console.print(f"threads inside compilation at a stall: {escape(', '.join(s.stalled_threads))}")
    for v in s.verdicts:
        console.print(f"[bold]→[/] {escape(v)}")
    for p in s.first_problems[:3]:
        if p.get("error") and p.get("kind") in ("compile_failed", "trace_failed"):
            console.print(f"  {escape(p['thread'])} stack ({escape(p['kind'])}):")
            for f in p.get("stack", [])[-6:]:
                console.print(f"      {escape(f)}")
        for key in ("victim_stack",):
            if p.get(key):
                console.print(f"  {escape(p['thread'])} stack:")
                for f in p[key][-6:]:
                    console.print(f"      {escape(f)}")
        for st in p.get("setters", [])[:2]:
            console.print(f"  {escape(st['thread'])} ({escape(st['tracer'])} tracing {escape(st['target'])}) stack:")
            for f in st.get("stack", [])[-6:]:
                console.print(f"      {escape(f)}")
    for a in s.advice:
        console.print(f"[dim]fix:[/] {escape(a)}")


def shown_command(argv: list[str]) -> str:
    """The command as one line: an argument holding a line break (a multi-line `-c` program) in quotes,
    its breaks written as \\n; the rest as typed."""
    return " ".join(("'" + a.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r") + "'")
                    if ("\n" in a or "\r" in a) else a for a in argv)


def _render(r: runner.RunResult) -> None:
    e = output.err
    e.print(f"[bold]compilewatch run[/] {escape(shown_command(r.command))}: exit {r.exit_code} after {output.fmt_seconds(r.wall_s)}, "
            f"watched {len(r.processes)} process(es) {list(r.processes)}")
    if r.signals:
        import signal

        names = ", ".join(signal.Signals(s).name for s in r.signals)
        e.print(f"forwarded {names} to the program's process group")
    if not r.processes:
        e.print("no watched process imported torch: nothing to report")
        return
    render_summary(r.summary, e)
    if r.summary.remote_cache is not None:
        per = ", ".join(f"{k} {c.get('hit', 0)} hit / {c.get('miss', 0)} miss" for k, c in sorted(r.summary.remote_cache.items()))
        e.print(f"torch's remote caches: {per or 'on, not used (nothing compiled)'}")
    if r.report:
        e.print(f"report: {escape(r.report)}")
    if r.timeline:
        e.print(f"timeline: {escape(r.timeline)} (open it in https://ui.perfetto.dev)")
