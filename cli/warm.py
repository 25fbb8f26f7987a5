"""`compilewatch warm`: compile a workload on each device one after another, verify, hand off."""

from __future__ import annotations

from typing import Annotated, Optional

import typer
from rich.table import Table

from cli import output
from cli.progress import Progress
from cli.options import BackendOpt, JsonOpt
from cli.lazy import lazy

handoff_lib = lazy("compilewatch.devices.handoff")
warm_lib = lazy("compilewatch.devices.warm")
from compilewatch.devices.spec import parse_devices
from compilewatch.fsutil import atomic_write_json
from compilewatch.torchinfo import check_cache_dir_usable
from compilewatch.tracing.targets import FlexShape, check_backend, resolve_workload


def warm_cmd(
    devices: Annotated[str, typer.Option("--devices", "-d", help="Devices to warm, in order: 5,6,7 / cuda:0 / cpu.")],
    cmd: Annotated[Optional[list[str]], typer.Argument(help="After --: the program to hand over to.")] = None,
    workload: Annotated[str, typer.Option("--workload", help="flex_attention (default: causal), compile, "
                                          "a workload an installed package registers (dflash: its training mask; "
                                          "an unknown name lists them), or module:obj / file.py:obj "
                                          "(a Workload or a callable taking the device).")] = "flex_attention",
    seq: Annotated[int, typer.Option("--seq", help="Attention workloads: context length S (Q=KV=S for flex_attention).")] = 3072,
    blocks: Annotated[int, typer.Option("--blocks", help="Block-structured workloads (dflash): query blocks per sequence.")] = 512,
    block_size: Annotated[int, typer.Option("--block-size", help="Block-structured workloads (dflash): tokens per block.")] = 16,
    heads: Annotated[int, typer.Option("--heads", help="Attention workloads: attention heads.")] = 32,
    head_dim: Annotated[int, typer.Option("--head-dim", help="Attention workloads: head dimension.")] = 128,
    batch: Annotated[int, typer.Option("--batch", help="Attention workloads: batch size.")] = 1,
    dtype: Annotated[str, typer.Option("--dtype", help="Attention workloads: auto (bf16 on CUDA, fp32 on CPU), bf16, fp16, fp32.")] = "auto",
    backend: BackendOpt = "inductor",
    steps: Annotated[int, typer.Option("--steps", help="Workload runs per device in the warm pass.")] = 1,
    verify: Annotated[bool, typer.Option("--verify/--no-verify", help="Run a second pass that must compile nothing.")] = True,
    strict: Annotated[bool, typer.Option("--strict/--no-strict", help="Verify under set_stance('fail_on_recompile') "
                                         "(a compile becomes an error; nothing compiles). --no-strict lets it compile and counts it.")] = True,
    report: Annotated[Optional[str], typer.Option("--report", help="Also write the JSON report to this file.")] = None,
    as_json: JsonOpt = False,
) -> None:
    """Compile a workload on each device one after another, verify, then hand control to CMD.

    Devices are warmed in this process, in this thread, never concurrently; then a second pass on
    every device must compile nothing (exit 1 if something recompiles, naming the function and why).

    CMD as `python script.py ...`, `script.py ...` or `-m module ...` runs in this process (compiled
    state in memory carries over); any other command is exec'd (only on-disk caches carry over).

    Examples:

      compilewatch warm --devices 5,6,7 --workload dflash

      compilewatch warm --devices 0,1 --seq 4096 --dtype bf16 \\
        -- python train.py --config big.toml

      compilewatch warm --devices cpu --workload compile \\
        --backend aot_eager --json

      compilewatch warm --devices 0 --workload mypkg.model:warm_workload \\
        -- -m mypkg.train
    """
    devs = parse_devices(devices)
    plan = handoff_lib.plan(cmd) if cmd else None  # validate CMD before spending minutes compiling
    shape = FlexShape(context=seq, blocks=blocks, block_size=block_size, heads=heads, head_dim=head_dim,
                      batch=batch, dtype=dtype)
    check_cache_dir_usable()  # before torch._dynamo is imported: it creates the cache dir
    check_backend(backend)
    wl = resolve_workload(workload, backend, shape)
    describe = getattr(wl, "describe", None)
    what = describe() if callable(describe) else wl.name
    output.err.print(f"warming {what} on {', '.join(devs)} (backend {backend}), one device at a time")
    with _DeviceBars(devs, verify) as on_event:
        result = warm_lib.prewarm(devs, wl, verify=verify, strict=strict, steps=steps, progress=on_event)
    if report:
        atomic_write_json(report, result)
    output.emit(result, as_json, _render)
    if not result.ok:
        if plan:
            output.err.print("not handing off: warm did not succeed (fix the finding above, or run the program "
                             "without warm)")
        raise typer.Exit(1)
    if plan is None:
        return
    output.err.print(f"hand-off: {plan.describe()}")
    if plan.mode == "in-process":
        handoff_lib.run_in_process(plan)
        return
    handoff_lib.exec_command(plan)


class _DeviceBars:
    """A progress task per device (stderr, cli.progress): warm, then verify."""

    def __init__(self, devices: list[str], verify: bool) -> None:
        self.devices = devices
        self.total = 2 if verify else 1
        self.progress = Progress()
        self.tasks: dict[int, object] = {}

    def __enter__(self) -> warm_lib.ProgressFn:
        self.progress.__enter__()
        return self.on_event

    def __exit__(self, *exc: object) -> None:
        self.progress.__exit__(*exc)

    def on_event(self, e: warm_lib.WarmEvent) -> None:
        task = self.tasks.get(e.index)
        if task is None:
            task = self.tasks[e.index] = self.progress.add(f"{self.devices[e.index]} ({e.index})", total=self.total)
        if e.state == "start":
            self.progress.update(task, info=f"{e.phase}ing" if e.phase == "warm" else "verifying")
            return
        r = e.result
        status = "ok" if r is not None and r.ok else "FAILED"
        detail = f"{e.phase} {status} {output.fmt_seconds(r.wall_s if r else None)}"
        if r is not None and e.phase == "warm":
            detail += f", {r.frames_compiled} frame compile(s)"
        self.progress.update(task, advance=1, info=detail)


def _render(r: warm_lib.WarmReport) -> None:
    o = output.out
    o.print(f"[bold]warm {r.workload}[/] on {', '.join(r.devices)} (torch {r.torch_version}, cache {r.cache_dir}) "
            f"in {output.fmt_seconds(r.wall_s)}")
    table = Table("pass", "device", "result", "time", "frames", "compiles", "traces", "FX hit/miss", "AOT hit/miss",
                  "peak mem", box=None)
    for run in (*r.warm, *r.verify):
        c = run.counters
        res = "[green]ok[/]" if run.ok else ("[red]recompiled[/]" if run.recompile else "[red]error[/]")
        mem = output.fmt_bytes(run.peak_memory_bytes)
        table.add_row(run.phase, run.device, res, output.fmt_seconds(run.wall_s), str(run.frames_compiled),
                      str(run.compile_windows), str(run.trace_windows), f"{c.fxgraph_cache_hit}/{c.fxgraph_cache_miss}",
                      f"{c.autograd_cache_hit}/{c.autograd_cache_miss}", mem)
    o.print(table)
    if any(run.memory_metric == "rss_delta" for run in r.warm):
        o.print("[dim]peak mem on CPU is the process RSS growth during the run; on CUDA torch.cuda.max_memory_allocated[/]")
    for run in (*r.warm, *r.verify):
        if run.error:
            o.print(f"[red]{run.phase} {run.device} error:[/] {run.error}")
    for rc in r.recompiles:
        o.print(f"[red]recompile on {rc.device}:[/] {rc.function}" + (f" at {rc.location}" if rc.location else ""))
        for reason in rc.reasons:
            o.print(f"    guard failure: {reason}")
    for v in r.verdicts:
        o.print(f"[bold]→[/] {v}")
