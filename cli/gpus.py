"""`compilewatch gpus`: per-GPU memory, utilization and processes, with an imbalance verdict."""

from __future__ import annotations

import json
import sys
import time
from typing import Annotated, Optional

import typer
from rich.console import Group
from rich.table import Table
from rich.text import Text

from cli import output
from cli.options import JsonOpt
from compilewatch.devices import gpus as gpus_lib
from compilewatch.errors import BadInput
from compilewatch.serialize import to_jsonable


MAX_WATCH_S = 86400  # a day: time.sleep overflows far beyond it


def gpus_cmd(
    watch: Annotated[Optional[float], typer.Option("--watch", "-w", help="Refresh every S seconds until Ctrl-C "
                                                   "(with --json: one JSON array per line).")] = None,
    count: Annotated[Optional[int], typer.Option("--count", help="With --watch: stop after N refreshes.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Per-GPU memory, utilization and processes, with an imbalance verdict.

    Shows every NVIDIA GPU: memory used/total, utilization, processes (name, command line, user),
    and flags a GPU that uses far less memory than the other GPUs of the same job.

    Exit 0 when all is well or there is no NVIDIA driver (`[]` with --json), 1 when a GPU is flagged.

    Examples:

      compilewatch gpus

      compilewatch gpus --json

      compilewatch gpus --watch 2
    """
    if count is not None and (watch is None or count < 1):
        raise BadInput(f"--count {count}: " + ("it counts --watch refreshes, and --watch is not given" if watch is None
                                                  else "must be >= 1"),
                       hint="e.g. compilewatch gpus --watch 2 --count 10; leave --count out to refresh until Ctrl-C")
    if watch is None:
        st = gpus_lib.status()
        if as_json:
            output.print_json(list(st.gpus))
        else:
            output.out.print(_renderable(st))
            for w in st.warnings:
                output.warn(w)
        raise typer.Exit(1 if st.imbalances else 0)
    if not 0 <= watch <= MAX_WATCH_S:  # also nan and inf, which time.sleep refuses with a traceback
        raise BadInput(f"--watch must be a number of seconds from 0 to {MAX_WATCH_S}, got {watch:g}",
                       hint="e.g. --watch 2 refreshes every 2 seconds")
    _watch(watch, count, as_json)


def _watch(every: float, count: int | None, as_json: bool) -> None:
    from rich.live import Live

    n = 0
    try:
        if as_json:
            while count is None or n < count:
                st = gpus_lib.status()
                sys.stdout.write(json.dumps(to_jsonable(list(st.gpus))) + "\n")
                sys.stdout.flush()
                n += 1
                if count is None or n < count:
                    time.sleep(every)
            return
        if not output.out.is_terminal:  # a log or a pipe: no redraw, so every refresh is printed in turn
            while count is None or n < count:
                st = gpus_lib.status()
                output.out.print(Group(_renderable(st), Text(time.strftime("%H:%M:%S"), style="dim")))
                n += 1
                if count is None or n < count:
                    time.sleep(every)
            return
        with Live(console=output.out, auto_refresh=False) as live:
            while count is None or n < count:
                st = gpus_lib.status()
                live.update(Group(_renderable(st), Text(time.strftime("%H:%M:%S"), style="dim")), refresh=True)
                n += 1
                if count is None or n < count:
                    time.sleep(every)
    except KeyboardInterrupt:  # the normal way to leave --watch
        pass


def _renderable(st: gpus_lib.GpuStatus):
    if not st.available:
        return Text(st.verdicts[0])
    table = Table("gpu", "name", "memory", "util", "processes", box=None)
    for g in st.gpus:
        mem = f"{output.fmt_bytes(g.memory_used)} / {output.fmt_bytes(g.memory_total)}"
        if g.imbalance:
            mem = f"[red]{mem} ![/]"
        procs = "\n".join(
            f"{p.pid} {p.user or '?'} {output.fmt_bytes(p.gpu_memory)} {(p.cmdline or p.name or 'not visible')[:80]}"
            for p in g.processes) or "-"
        table.add_row(str(g.index), g.name, mem, "-" if g.utilization is None else f"{g.utilization}%", procs)
    lines = [Text.assemble(("→ ", "bold"), v) for v in st.verdicts]
    head = Text(f"driver {st.driver_version or '?'}", style="dim")
    return Group(head, table, *lines)
