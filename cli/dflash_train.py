"""`dflash train`: parse, build the config, build the Trainer, train, always close."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from cli import output
from cli.dflash_engine import (DrafterDevicesOpt, NoGuardOpt, NoPrewarmOpt, StallOpt, TargetDevicesOpt, engine_devices,
                               finish, render_engine)
from cli.dflash_dist import DistBackendOpt, DistributedOpt, DistTimeoutOpt
from cli.dflash_progress import TrainProgress
from cli.options import JsonOpt
from compilewatch.errors import BadInput, CheckFailed
from compilewatch.serialize import to_jsonable
from dflash.config import build_config, parse_set, to_dict, to_toml
from dflash.distributed import DEFAULT_TIMEOUT_S, rank_info


def train_cmd(
    recipe: Annotated[str, typer.Option("--recipe", help="Named recipe: tiny (embedded default) or qwen3_8b.")] = "tiny",
    config: Annotated[Optional[str], typer.Option("--config", "-c", help="TOML config file (its `recipe` applies first).")] = None,
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="Override a field: --set optim.lr=3e-4 (repeatable).")] = None,
    target: Annotated[Optional[str], typer.Option("--target", help="Local HF target directory (= --set target.path=...).")] = None,
    data: Annotated[Optional[str], typer.Option("--data", help="Chat JSONL (= --set data.path=...).")] = None,
    out: Annotated[Optional[str], typer.Option("--out", "-o", help="Run directory (default runs/<recipe>-<time>).")] = None,
    device: Annotated[Optional[str], typer.Option("--device", "-d", help="cpu, cuda, cuda:N or N (default auto).")] = None,
    max_steps: Annotated[Optional[int], typer.Option("--max-steps", help="Stop after N optimizer steps.")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue the run in --out from its latest checkpoint.")] = False,
    strict: Annotated[bool, typer.Option("--strict", help="Any skipped data record is an error (exit 2) (= --set data.strict=true).")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Run one worst-case step of the config on the meta device (no weights, no data, nothing written) and exit.")] = False,
    print_config: Annotated[bool, typer.Option("--print-config", help="Print the resolved config as TOML and exit.")] = False,
    target_devices: TargetDevicesOpt = None,
    drafter_devices: DrafterDevicesOpt = None,
    no_prewarm: NoPrewarmOpt = False,
    no_guard: NoGuardOpt = False,
    stall_after: StallOpt = 300.0,
    distributed: DistributedOpt = False,
    dist_backend: DistBackendOpt = "auto",
    dist_timeout: DistTimeoutOpt = DEFAULT_TIMEOUT_S,
    as_json: JsonOpt = False,
) -> None:
    """Train a DFlash drafter. With no arguments: the embedded tiny target and data, about 30 s on a
    2-core CPU (26 s CPU time measured; longer on a busy machine). Prints a short summary, then
    progress; the full config: --print-config, or config.toml in the run dir.

    Examples:
      dflash train
      dflash train --recipe qwen3_8b --target /models/Qwen3-8B \\
        --data data/regen.jsonl --out runs/q8
      dflash train --out runs/q8 --resume
      dflash train --recipe qwen3_8b --dry-run
      dflash train --config my.toml --set optim.lr=3e-4 --set train.max_steps=1000
      dflash train --recipe qwen3_8b --target /models/Qwen3-8B \\
        --target-devices 0,1,2,3,4 --drafter-devices 5,6,7
      torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d \\
        --rdzv-endpoint node0:29500 -m dflash train \\
        --target-devices 0,1,2,3,4 --drafter-devices 5,6,7 --out /shared/runs/q8
    """
    from dflash.trainer import Trainer, build_config_for_resume  # torch and transformers: only when training

    overrides = {}
    devices = engine_devices(target_devices, drafter_devices)
    distributed = distributed or rank_info() is not None  # torchrun started this process
    if devices is not None and not distributed:
        if device is not None:
            raise BadInput("--device does not go with --drafter-devices",
                           hint="the trainer (replica 0) runs on the first drafter device; drop --device")
        device = devices[1][0]
    try:
        overrides.update(parse_set(set_ or []))
        for key, val in (("target.path", target), ("data.path", data), ("checkpoint.out_dir", out),
                         ("train.device", device), ("train.max_steps", max_steps), ("data.strict", strict or None)):
            if val is not None:
                overrides[key] = val
        if resume:
            if out is None:
                raise BadInput("--resume needs --out RUN_DIR (the run to continue)")
            cfg = build_config_for_resume(out, overrides)
        else:
            cfg = build_config(recipe, config, overrides)
    except ValueError as e:
        raise BadInput(f"bad config: {e}", hint="see `dflash train --print-config` for every field") from None
    if print_config:
        output.emit(to_dict(cfg), as_json, lambda _: output.out.print(to_toml(cfg), markup=False))
        return
    if dry_run:
        from dflash.dryrun import dry_run as run_dry

        report = run_dry(cfg)
        output.emit(report, as_json, _render_dry)
        if report.notes:
            raise CheckFailed("dry run: " + "; ".join(report.notes))
        return
    if distributed:
        from cli.dflash_dist import run_rank

        run_rank(cfg, resume=resume, devices=devices, backend=dist_backend, timeout_s=dist_timeout, stall_after=stall_after,
                 prewarm=not no_prewarm, guard=not no_guard, as_json=as_json, render=_render)
        return
    output.err.print(summary(cfg, devices), markup=False, highlight=False)
    trainer = None
    with TrainProgress() as progress:
        try:
            trainer = Trainer.from_config(cfg, resume=resume, on_event=progress)
            for note in trainer.notes:
                output.err.print(f"[dim]note:[/] {note}")
            if devices is None:
                result, report = trainer.train(), None
            else:
                from dflash.program import train_multi

                result, report = train_multi(trainer, *devices, stall_after=stall_after, prewarm=not no_prewarm,
                                             guard=not no_guard)
        finally:
            if trainer is not None:
                trainer.close()
    data = {**to_jsonable(result), "config": to_dict(cfg)}
    if report is not None:
        data["engine"] = to_jsonable(report)
    output.emit(data, as_json, _render)
    if report is not None:
        if not as_json:
            render_engine(report)
        finish(report)


def summary(cfg, devices: tuple[tuple[str, ...], tuple[str, ...]] | None = None) -> str:
    """What `dflash train` is about to do, on one screen (the full config: --print-config, and
    config.toml in the run dir)."""
    t, d, o, tr = cfg.target, cfg.data, cfg.optim, cfg.train
    where = (f"target workers {','.join(devices[0])}, drafter replicas {','.join(devices[1])}" if devices
             else tr.device)
    steps = f"{tr.epochs} epochs" + (f", at most {tr.max_steps} steps" if tr.max_steps else "")
    run_dir = cfg.checkpoint.out_dir or f"runs/{cfg.recipe}-<time>"
    return "\n".join([
        f"dflash train: recipe {cfg.recipe}",
        f"  target   {t.path} (dtype {t.dtype})",
        f"  drafter  {cfg.drafter.num_layers} layers, block size {cfg.drafter.block_size}",
        f"  data     {d.path}" + (" (answers regenerated by the target)" if d.regenerate else "")
        + f", max length {d.max_length}, batch {d.batch_size}",
        f"  devices  {where}, attention {tr.attention}, dtype {tr.dtype}",
        f"  steps    {steps}, lr {o.lr:g} ({o.schedule}), checkpoint every {cfg.checkpoint.every}",
        f"  run dir  {run_dir} (full config: config.toml there, or --print-config)",
    ])


def _f(x, digits: int = 3) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _render(r: dict) -> None:
    o = output.out
    o.print(f"trained {r['steps']}/{r['total_steps']} steps in {output.fmt_seconds(r['seconds'])}: mean loss "
            f"{_f(r['first_epoch_loss'])} (first epoch) -> {_f(r['last_epoch_loss'])} (last epoch), "
            f"estimated τ {_f(r['last_epoch_tau_estimate'], 2)} (last epoch, training batches)")
    acc = r.get("last_epoch_accuracy") or []
    if acc:
        o.print("per-slot accuracy (last epoch mean, training batches): "
                + " ".join(f"{a:.2f}" if a is not None else "-" for a in acc))
    ev = r.get("eval")
    if ev:
        o.print(f"speculative decoding: τ = {ev['tau']:.2f} (max {ev['max_tau']}), speedup {ev['speedup']:.2f}x vs plain "
                f"decoding, outputs {'match' if ev['outputs_match'] else 'DIFFER'} ({ev['prompts']} prompts)")
    if r["checkpoints"]:
        o.print(f"export: {r['checkpoints'][-1]} (config.json + model.safetensors)")
    o.print(f"run dir: {r['run_dir']} (metrics.jsonl, config.toml)")


def _render_dry(r) -> None:
    o = output.out
    o.print(f"dry run (meta device, nothing written): target {r.target_source}, {r.target_layers} layers, "
            f"hidden {r.target_hidden}, taps {list(r.layer_ids)}")
    o.print(f"drafter: {r.drafter_params / 1e6:,.1f} M parameters, {output.fmt_bytes(r.drafter_trainable_bytes)} "
            f"of fp32 weights + grads + AdamW state; {r.grads} parameters got gradients")
    o.print(f"one micro-batch: taps {r.taps_shape} -> drafter hidden {r.hidden_shape} -> loss and backward: ok")
    for n in r.notes:
        o.print(f"[red]{n}[/]")
