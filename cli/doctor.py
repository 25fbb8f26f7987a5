"""`compilewatch doctor`: one report on the compile environment, with verdicts."""

from __future__ import annotations

import typer
from rich.table import Table

from cli import output
from cli.options import JsonOpt
from cli.lazy import lazy

doctor_lib = lazy("compilewatch.doctor")

_STYLE = {"ok": "green", "info": "dim", "warn": "yellow", "problem": "red"}


def doctor_cmd(as_json: JsonOpt = False) -> None:
    """One report: environment, cache vs system key, GPUs, FX-flag race, dynamo limits, verdicts.

    Environment facts, the inductor cache (size, system key), GPUs, the FX-flag race, dynamo
    limits and known torch issues, each ending in a verdict. Exit 1 if a verdict is a problem.

    Examples:

      compilewatch doctor

      compilewatch doctor --json
    """
    from compilewatch.torchinfo import check_cache_dir_usable

    check_cache_dir_usable()  # else importing torch._dynamo raises from torch's os.makedirs
    report = doctor_lib.doctor()
    output.emit(report, as_json, _render)
    raise typer.Exit(0 if report.ok else 1)


def _render(r: doctor_lib.DoctorReport) -> None:
    o = output.out
    e, c, d = r.env, r.cache, r.dynamo
    facts = Table(box=None, show_header=False)
    facts.add_row("python", f"{e.python} ({e.platform})")
    facts.add_row("torch", f"{e.torch}  cuda {e.torch_cuda or '-'}  cudnn {e.cudnn or '-'}  nccl {e.nccl or '-'}")
    facts.add_row("triton", e.triton or "-")
    facts.add_row("GPUs", "; ".join(r.gpus.gpus) if r.gpus.available else (r.gpus.reason or "none"))
    if r.gpus.driver_version:
        facts.add_row("driver", r.gpus.driver_version)
    facts.add_row("cache", f"{c.path} ({c.source}), {output.fmt_bytes(c.size_bytes)} in {c.files} files"
                  if c.exists else f"{c.path} ({c.source}), not created yet")
    if c.subdirs:
        facts.add_row("", ", ".join(f"{k} {output.fmt_bytes(v)}" for k, v in c.subdirs.items()))
    if c.elsewhere:
        facts.add_row("", "outside it: " + ", ".join(f"{k} {output.fmt_bytes(v)}" for k, v in c.elsewhere.items()))
    match = {True: "matches", False: "DOES NOT MATCH", None: "unknown"}[c.system_key_match]
    facts.add_row("system key", f"{c.system_key[:16]}… ({match})")
    if r.remote is not None:
        state = {True: "reachable", False: "UNREACHABLE", None: "not probed"}[r.remote.reachable]
        facts.add_row("remote cache", f"{r.remote.url} ({r.remote.source}): {', '.join(r.remote.enabled) or 'none on'}, {state}")
    facts.add_row("FX flag", f"layout: {r.fx.layout}, now: {r.fx.flag_now}, stuck state: {r.fx.stuck}, "
                  f"error_on_nested_fx_trace: {r.fx.error_on_nested_fx_trace}")
    if r.fx.race is not None:
        facts.add_row("thread race", r.fx.race.headline)
    facts.add_row("dynamo", f"recompile_limit {d.recompile_limit}, accumulated {d.accumulated_recompile_limit}, "
                  f"config per thread: {d.config_per_thread}")
    for k, v in e.env.items():
        facts.add_row(k, v)
    o.print(facts)
    for v in r.verdicts:
        style = _STYLE[v.level]
        o.print(f"[{style}]{v.level:>7}[/] [bold]{v.topic}[/]: {v.message}", markup=True)
        if v.advice and v.level in ("warn", "problem"):
            o.print(f"          → {v.advice}")
