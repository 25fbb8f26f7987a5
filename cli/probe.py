"""`compilewatch probe TARGET`: rendering of compilewatch.devices.probe reports."""

from __future__ import annotations

import os
import sys
from typing import Annotated, Optional

import typer
from rich.markup import escape
from rich.table import Table

from cli import output
from cli.options import BackendOpt, DeviceListOpt, JsonOpt
from cli.lazy import lazy

probe_lib = lazy("compilewatch.devices.probe")
from compilewatch.errors import BadInput
from compilewatch.torchinfo import check_cache_dir_usable
from compilewatch.tracing.targets import builtin_targets, check_backend


def probe_cmd(
    target: Annotated[Optional[str], typer.Argument(help="Built-in target, module:callable or file.py:callable.")] = None,
    list_: Annotated[bool, typer.Option("--list", help="List the built-in targets and exit.")] = False,
    device: DeviceListOpt = "cpu",
    backend: BackendOpt = "inductor",
    threads: Annotated[int, typer.Option("--threads", help="Run the target in N threads at once, cold (0: one run here).")] = 0,
    timeout: Annotated[float, typer.Option("--timeout", help="With --threads: seconds before a thread counts as hung.")] = 300.0,
    keep_cache: Annotated[bool, typer.Option("--keep-cache", help="With --threads: use the current inductor cache dir instead of a fresh one.")] = False,
    fresh_cache: Annotated[bool, typer.Option("--fresh-cache", help="Single run: compile into a fresh, temporary cache dir.")] = False,
    no_reset: Annotated[bool, typer.Option("--no-reset", help="Single run: keep what dynamo already compiled in this process.")] = False,
    timeline: Annotated[Optional[str], typer.Option("--timeline", help="Also write a Chrome trace-event timeline (Perfetto) to FILE.json.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Run TARGET under instrumentation and report what compile machinery it touched.

    Examples:

      compilewatch probe create_block_mask

      compilewatch probe flex_attention --device cuda:0

      compilewatch probe flex_attention --threads 3 --device 0,1,2 --timeout 120

      compilewatch probe mypkg.train:step --json
    """
    if list_:
        targets = builtin_targets(backend)
        rows = [{"name": t.name, "description": t.description} for t in targets.values()]
        if as_json:
            output.print_json(rows)
        else:
            table = Table("target", "what it runs", box=None)
            for r in rows:
                table.add_row(r["name"], r["description"])
            output.out.print(table)
        return
    if not target:
        raise BadInput("missing TARGET", hint="give a built-in (see --list), module:callable or file.py:callable")
    if threads < 0:
        raise BadInput(f"--threads must be >= 0, got {threads}")
    check_cache_dir_usable()  # before torch._dynamo is imported: it creates the cache dir
    check_backend(backend)
    watcher = _timeline_watcher(timeline, stall_after=max(1.0, timeout / 2) if threads else 300.0)
    from cli import cache_explain  # issue 38: the probe's cache misses explained, its compile time by phase

    if threads:
        with cache_explain.recording(temp_caches="compilewatch-threads-" if not keep_cache else None) as explained:
            report = probe_lib.probe_threads(target, threads, devices=device, backend=backend, timeout=timeout,
                                             fresh_cache=not keep_cache)
        _close_timeline(watcher, timeline)
        if as_json:
            output.print_json({**output.jsonable(report), "cache_explain": output.jsonable(explained)})
        else:
            output.emit(report, False, _render_threads)
            cache_explain.print_after(explained, output.out)
        hung = any(t.outcome == "hang" for t in report.threads)
        if hung:  # hung daemon threads can block interpreter shutdown inside torch: leave now
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)
        raise typer.Exit(1 if report.failed else 0)
    with cache_explain.recording(temp_caches="compilewatch-probe-" if fresh_cache else None) as explained:
        report = probe_lib.probe(target, device=device.split(",")[0], backend=backend, reset=not no_reset,
                                 fresh_cache=fresh_cache)
    _close_timeline(watcher, timeline)
    if as_json:
        output.print_json({**output.jsonable(report), "cache_explain": output.jsonable(explained)})
    else:
        output.emit(report, False, _render_single)
        cache_explain.print_after(explained, output.out)
    raise typer.Exit(0 if report.ok else 1)


def _timeline_watcher(path: Optional[str], stall_after: float):
    """A watcher that records the run for `--timeline` (it writes the file on close); with --threads
    it reports a compile still running at half the timeout as a stall, stacks included."""
    if path is None:
        return None
    from compilewatch.tracing.watcher import Watcher

    return Watcher(timeline=path, stall_after=stall_after).install()


def _close_timeline(watcher, path: Optional[str]) -> None:
    """Write the timeline (the watcher writes it on close) and say where, as `compilewatch run` does (stderr)."""
    if watcher is None:
        return
    watcher.close()
    output.err.print(f"timeline: {escape(str(path))} (open it in https://ui.perfetto.dev)")


def _render_single(r: probe_lib.ProbeReport) -> None:
    o = output.out
    o.print(f"[bold]probe {r.target}[/] on {r.device} (backend {r.backend}, torch {r.torch_version}) "
            f"in {output.fmt_seconds(r.wall_s)}")
    o.print(f"Tracer.trace entries: [bold]{len(r.traces)}[/]"
            + (f"  per thread: {r.traces_per_thread}  per tracer: {r.traces_per_tracer}" if r.traces else ""))
    for i, t in enumerate(r.traces, 1):
        o.print(f"  [bold]#{i}[/] {t.tracer}{' (nested)' if t.nested else ''} traced {escape(t.target)} in thread {escape(t.thread)}, "
                f"is_compiling()={t.compiling}, {output.fmt_seconds(t.duration_s)}"
                + (f", raised {escape(t.error.splitlines()[0])}" if t.error else ""))
        for f in t.stack[-8:]:
            o.print(f"      {escape(str(f))}")
    c = r.counters
    o.print(f"dynamo: {c.frames_total} frame compile(s), {len(r.compiles)} compile window(s), "
            f"{c.recompiles} recompile(s), {c.graph_breaks} graph break(s)")
    o.print(f"inductor FX-graph cache: {c.fxgraph_cache_hit} hit / {c.fxgraph_cache_miss} miss / "
            f"{c.fxgraph_cache_bypass} bypass;  AOTAutograd cache: {c.autograd_cache_hit} hit / "
            f"{c.autograd_cache_miss} miss  (cache dir {r.cache_dir})")
    for reason in c.recompile_reasons:
        o.print(f"  recompile: {escape(reason)}")
    for reason in c.graph_break_reasons:
        o.print(f"  graph break: {escape(reason)}")
    o.print(f"FX flag after: {r.fx_flag_after}; tracing state left set: {r.stuck_after}")
    for v in r.verdicts:
        o.print(f"[bold]→[/] {escape(v)}")


def _render_threads(r: probe_lib.ThreadsReport) -> None:
    o = output.out
    o.print(f"[bold]probe {r.target} --threads {len(r.threads)}[/] (backend {r.backend}, torch {r.torch_version}, "
            f"cold start, cache dir {r.cache_dir}) in {output.fmt_seconds(r.wall_s)}")
    table = Table("thread", "device", "outcome", "time", "error", box=None)
    for t in r.threads:
        style = {"ok": "green", "error": "red", "hang": "magenta"}[t.outcome]
        table.add_row(t.name, t.device, f"[{style}]{t.outcome}[/]", output.fmt_seconds(t.wall_s),
                      escape((t.error or "").splitlines()[0][:160]) if t.error else "")
    o.print(table)
    o.print(f"Tracer.trace entries: {len(r.traces)} {r.traces_per_thread}; dynamo frames compiled ok: "
            f"{r.counters.frames_ok} of {r.counters.frames_total}; compiles that raised: {len(r.compile_failures)}; "
            f"tracing state stuck: {r.fx_flag_stuck}")
    if r.stacks:
        o.print("[bold]stacks of every thread at the timeout:[/]")
        for name, frames in r.stacks.items():
            o.print(f"  [bold]{escape(name)}[/]")
            for f in frames[-12:]:
                o.print(f"    {escape(str(f))}")
    for v in r.verdicts:
        o.print(f"[bold]→[/] {escape(v)}")
