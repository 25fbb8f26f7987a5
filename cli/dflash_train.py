"""`dflash train`: parse the flags into a config, call dflash.run.train, render the result."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from cli import output
from cli.dflash_dist import DistBackendOpt, DistributedOpt, DistTimeoutOpt
from cli.dflash_engine import NoGuardOpt, NoPrewarmOpt, StallOpt, finish, render_engine
from cli.dflash_progress import TrainProgress
from cli.options import DeviceOpt, DrafterDevicesOpt, JsonOpt, TargetDevicesOpt
from compilewatch.errors import BadInput, CheckFailed
from compilewatch.serialize import to_jsonable
from dflash.config import build_config, parse_set, to_dict, to_toml


def train_cmd(
    recipe: Annotated[str, typer.Option("--recipe", help="Named recipe: tiny (embedded default) or qwen3_8b.")] = "tiny",
    config: Annotated[Optional[str], typer.Option("--config", "-c", help="TOML config file (its `recipe` applies first).")] = None,
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="Override a field: --set optim.lr=3e-4 (repeatable).")] = None,
    target: Annotated[Optional[str], typer.Option("--target", help="Local HF target directory (= --set target.path=...).")] = None,
    data: Annotated[Optional[str], typer.Option("--data", help="Chat JSONL (= --set data.path=...).")] = None,
    out: Annotated[Optional[str], typer.Option("--out", "-o", help="Run directory (default runs/<recipe>-<time>).")] = None,
    device: DeviceOpt = None,
    max_steps: Annotated[Optional[int], typer.Option("--max-steps", help="Stop after N optimizer steps.")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue the run in --out from its latest checkpoint, with its "
                                                          "config.toml (devices included; flags given here override).")] = False,
    strict: Annotated[bool, typer.Option("--strict", help="Any skipped data record is an error (exit 2) (= --set data.strict=true).")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Run one worst-case step of the config on the meta device (no weights, no data, nothing written) and exit.")] = False,
    print_config: Annotated[bool, typer.Option("--print-config", help="Print the resolved config as TOML and exit.")] = False,
    target_devices: TargetDevicesOpt = None,
    drafter_devices: DrafterDevicesOpt = None,
    no_prewarm: NoPrewarmOpt = False,
    no_guard: NoGuardOpt = False,
    stall_after: StallOpt = None,
    distributed: DistributedOpt = False,
    dist_backend: DistBackendOpt = None,
    dist_timeout: DistTimeoutOpt = None,
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
    from dflash.run import check_devices, pick_mode, train
    from dflash.checkpoint.resume import build_config_for_resume  # torch and transformers: only when training

    try:
        overrides = parse_set(set_ or [])
        flags = topology_overrides(device, target_devices, drafter_devices, no_prewarm=no_prewarm, no_guard=no_guard,
                                   stall_after=stall_after, dist_backend=dist_backend, dist_timeout=dist_timeout)
        for key, val in (("target.path", target), ("data.path", data), ("checkpoint.out_dir", out),
                         ("train.max_steps", max_steps), ("data.strict", strict or None)):
            if val is not None:
                flags[key] = val
        overrides.update(flags)
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
        from dflash.training.dryrun import dry_run as run_dry

        report = run_dry(cfg)
        output.emit(report, as_json, _render_dry)
        if report.notes:
            raise CheckFailed("dry run: " + "; ".join(report.notes))
        return
    mode = pick_mode(cfg, distributed or None)
    if mode == "distributed":
        from cli.dflash_dist import run_rank

        run_rank(cfg, resume=resume, as_json=as_json, render=_render)
        return
    check_devices(cfg.topology)  # before the summary: a device this machine lacks is bad input
    output.err.print(summary(cfg, resumed=sorted(k for k in overrides if k.startswith("topology.")) if resume else None),
                     markup=False, highlight=False)

    with TrainProgress() as progress:
        def on_event(kind: str, d: dict) -> None:
            if kind == "notes":
                for note in d["notes"]:
                    output.err.print(f"[dim]note:[/] {note}")
            progress(kind, d)

        done = train(cfg, resume=resume, distributed=False, on_event=on_event)
    result = {**to_jsonable(done.result), "config": to_dict(cfg)}
    if done.engine is not None:
        result["engine"] = to_jsonable(done.engine)
    output.emit(result, as_json, _render)
    if done.engine is not None:
        if not as_json:
            render_engine(done.engine)
        finish(done.engine)


def _device_list(spec: str, option: str) -> tuple[str, ...]:
    items = tuple(x for x in spec.split(",") if x.strip())
    if not items:
        raise BadInput(f"{option}: no devices given", hint=f"e.g. {option} 0,1,2 or {option} cpu,cpu")
    return items


def topology_overrides(device: str | None, target_devices: str | None, drafter_devices: str | None, *,
                       no_prewarm: bool, no_guard: bool, stall_after: float | None, dist_backend: str | None,
                       dist_timeout: float | None) -> dict[str, object]:
    """The topology flags given on the command line as `topology.*` overrides (flags not given are
    absent: a resumed run keeps its config.toml's). `--device` means one device (it clears device
    lists a resumed run had); the device lists mean the engine (its trainer runs on the first
    drafter device, so `--device` does not go with them). Names are checked by the config."""
    out: dict[str, object] = {}
    if (target_devices is None) != (drafter_devices is None):
        raise BadInput("--target-devices and --drafter-devices go together",
                       hint="e.g. --target-devices 0,1,2,3,4 --drafter-devices 5,6,7")
    if drafter_devices is not None and target_devices is not None:
        if device is not None:
            raise BadInput("--device does not go with --drafter-devices",
                           hint="the trainer (replica 0) runs on the first drafter device; drop --device")
        out.update({"topology.device": "auto", "topology.target_devices": _device_list(target_devices, "--target-devices"),
                    "topology.drafter_devices": _device_list(drafter_devices, "--drafter-devices")})
    elif device is not None:
        out.update({"topology.device": device, "topology.target_devices": (), "topology.drafter_devices": ()})
    for key, val in (("prewarm", False if no_prewarm else None), ("guard", False if no_guard else None),
                     ("stall_after", stall_after), ("dist_backend", dist_backend), ("dist_timeout", dist_timeout)):
        if val is not None:
            out[f"topology.{key}"] = val
    return out


def summary(cfg, resumed: list[str] | None = None) -> str:
    """What `dflash train` is about to do, on one screen (the full config: --print-config, and
    config.toml in the run dir). `resumed`: the topology keys the command line overrode on --resume
    (the rest came from the run's config.toml)."""
    t, d, o, tr, topo = cfg.target, cfg.data, cfg.optim, cfg.train, cfg.topology
    where = (f"target workers {','.join(topo.target_devices)}, drafter replicas {','.join(topo.drafter_devices)}"
             if topo.engine else topo.device)
    steps = f"{tr.epochs} epochs" + (f", at most {tr.max_steps} steps" if tr.max_steps else "")
    run_dir = cfg.checkpoint.out_dir or f"runs/{cfg.recipe}-<time>"
    lines = [
        f"dflash train: recipe {cfg.recipe}",
        f"  target   {t.path} (dtype {t.dtype})",
        f"  drafter  {cfg.drafter.num_layers} layers, block size {cfg.drafter.block_size}",
        f"  data     {d.path}" + (" (answers regenerated by the target)" if d.regenerate else "")
        + f", max length {d.max_length}, batch {d.batch_size}",
        f"  devices  {where}, attention {tr.attention}, dtype {tr.dtype}",
    ]
    if topo.engine:
        lines.append(f"  engine   stall after {topo.stall_after:g} s, prewarm {'on' if topo.prewarm else 'OFF'}, "
                     f"guard {'on' if topo.guard else 'OFF'}, queue depth {topo.queue_depth}")
    if resumed is not None:
        lines.append(f"  resumed  devices and engine settings from {run_dir}/config.toml"
                     + (f"; from the command line: {', '.join(k.split('.', 1)[1] for k in resumed)}" if resumed else ""))
    lines += [
        f"  steps    {steps}, lr {o.lr:g} ({o.schedule}), checkpoint every {cfg.checkpoint.every}",
        f"  run dir  {run_dir} (full config: config.toml there, or --print-config)",
    ]
    return "\n".join(lines)


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
