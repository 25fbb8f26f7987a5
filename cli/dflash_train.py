"""`dflash train`: build the config from the flags, call dflash.train, render the result."""

from __future__ import annotations

import contextlib
from typing import Annotated, Optional

import typer

import dflash
from cli import output
from cli.dflash_next import print_next_steps
from cli.dflash_dist import DistributedOpt, RankLog, record_error, render_rank
from cli.dflash_engine import finish, render_engine
from cli.dflash_flags import TRAIN_FLAGS, with_config_flags
from cli.dflash_progress import TrainProgress
from cli.options import JsonOpt
from cli.signals import EXIT_SIGTERM, sigterm_as_interrupt
from compilewatch.errors import BadInput, CheckFailed
from compilewatch.serialize import to_jsonable


@with_config_flags(TRAIN_FLAGS)
def train_cmd(
    recipe: Annotated[str, typer.Option("--recipe", help="Named recipe: tiny (embedded default) or qwen3_8b.")] = "tiny",
    config: Annotated[Optional[str], typer.Option("--config", "-c", help="TOML config file (its `recipe` applies first).")] = None,
    set_: Annotated[Optional[list[str]], typer.Option("--set", help="Override a field: --set optim.lr=3e-4 (repeatable).")] = None,
    resume: Annotated[bool, typer.Option("--resume", help="Continue the run in --out from its latest checkpoint, with its "
                                                          "config.toml (devices included; flags given here override).")] = False,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Run one worst-case step of the config on the meta device (no weights, no data, nothing written) and exit.")] = False,
    print_config: Annotated[bool, typer.Option("--print-config", help="Print the resolved config as TOML and exit.")] = False,
    distributed: DistributedOpt = False,
    as_json: JsonOpt = False,
    config_flags: dict | None = None,
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
    overrides = {**_parse_set(set_), **(config_flags or {})}
    cfg = _config(recipe, config, overrides, resume)
    if print_config:
        output.emit(dflash.to_dict(cfg), as_json, lambda _: output.out.print(dflash.to_toml(cfg), markup=False))
        return
    if dry_run:
        report = dflash.dry_run(cfg)
        output.emit(report, as_json, _render_dry)
        if report.notes:
            raise CheckFailed("dry run: " + "; ".join(report.notes))
        return
    if resume:
        complete = dflash.run_complete(cfg, overrides)  # checkpoint names and metrics' tail: nothing loaded
        if complete is not None:
            output.emit(complete, as_json, _render_complete)
            return
    view = TrainView(cfg, sorted(k for k in overrides if k.startswith("topology.")) if resume else None)
    with sigterm_as_interrupt(distributed=distributed) as signalled:
        try:
            with view:
                done = dflash.train(cfg, resume=resume, distributed=distributed or None, on_event=view)
        except Exception as e:
            record_error(e)  # a torchrun rank: where torchrun looks for it (no-op otherwise)
            raise
        except KeyboardInterrupt as e:  # Ctrl-C or SIGTERM: where the run stands and how to go on
            _interrupted(e, signalled["terminated"])
        try:  # still inside: after the engine's stop, a second signal here is held off, not a bare `interrupted`
            _show(done, cfg, as_json, signalled["terminated"])
        except KeyboardInterrupt:  # the first signal, while the result of a run that ended is shown
            output.err.print(("SIGTERM: " if signalled["terminated"] else "") + "interrupted after the run ended: "
                             f"its checkpoints and metrics.jsonl are in {done.result.run_dir}", markup=False,
                             highlight=False)
            raise typer.Exit(EXIT_SIGTERM if signalled["terminated"] else 130) from None


def _show(done, cfg, as_json: bool, terminated: bool) -> None:
    """The result of a run that ended (the engine's: also when a signal stopped it)."""
    if done.mode == "distributed":
        render_rank(done, cfg, as_json, _render)
        return
    result = {**to_jsonable(done.result), "config": dflash.to_dict(cfg)}
    if done.engine is not None:
        result["engine"] = to_jsonable(done.engine)
    output.emit(result, as_json, _render)
    if done.engine is not None:
        if not as_json:
            render_engine(done.engine)
            if done.engine.outcome == "interrupted":
                _render_engine_stop(result, terminated)
        finish(done.engine, EXIT_SIGTERM if terminated and done.engine.outcome == "interrupted" else None)


def _parse_set(items: list[str] | None) -> dict[str, object]:
    try:
        return dflash.parse_set(items or [])
    except ValueError as e:
        raise BadInput(f"bad config: {e}", hint="see `dflash train --print-config` for every field") from None


def _config(recipe: str, config: str | None, overrides: dict[str, object], resume: bool):
    """The run's config: the recipe/TOML plus overrides, or a resumed run's own config.toml plus them."""
    try:
        if resume:
            out = overrides.get("checkpoint.out_dir")
            if out is None:
                raise BadInput("--resume needs --out RUN_DIR (the run to continue)")
            if config is not None or recipe != "tiny":  # they were silently ignored: the run's config.toml rules
                flag = f"--config {config}" if config is not None else f"--recipe {recipe}"
                raise BadInput(f"{flag} does not go with --resume: a resumed run continues with its own config.toml",
                               hint="change fields of the resumed run with --set section.field=value, or start a "
                                    "new run with it (another --out, without --resume)")
            return dflash.resume_config(str(out), overrides)
        return dflash.build_config(recipe, config, overrides)
    except ValueError as e:
        raise BadInput(f"bad config: {e}", hint="see `dflash train --print-config` for every field") from None


class TrainView:
    """The `on_event` of dflash.train: once the mode is known, the summary and the progress display
    (one process), or the per-rank log lines (a torchrun rank: rank 0 shows progress)."""

    def __init__(self, cfg, resumed: list[str] | None) -> None:
        self.cfg, self.resumed = cfg, resumed
        self.stack = contextlib.ExitStack()
        self.sink = None

    def __enter__(self) -> TrainView:
        return self

    def __exit__(self, *exc) -> None:
        self.stack.__exit__(*exc)

    def __call__(self, kind: str, d: dict) -> None:
        if kind == "mode":
            if d["mode"] != "distributed":  # devices were checked: a device this machine lacks was bad input
                output.err.print(summary(self.cfg, resumed=self.resumed), markup=False, highlight=False)
                self.sink = self.stack.enter_context(TrainProgress())
            return
        if kind == "rank" and self.sink is None:
            self.sink = RankLog(self.stack.enter_context(TrainProgress(enabled=d["info"].primary)))
        if kind == "notes":
            for note in d["notes"]:
                output.note(note)
        if self.sink is not None:
            self.sink(kind, d)


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
        import dflash

        changed, shown = dflash.changes_since_checkpoint(cfg), 8
        if changed:
            more = f" (and {len(changed) - shown} more)" if len(changed) > shown else ""
            lines.append(f"  changed  since the checkpoint's train_config.toml: {'; '.join(changed[:shown])}{more}")
        data = dflash.data_since_checkpoint(cfg)  # hashes the data once (the run's own check reuses it)
        if data is not None and data.line() is not None:
            lines.append(f"  {'changed' if data.changed else 'data':<8} {data.line()}")
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
        beyond = ev["mismatched_prompts"] - ev.get("near_tie_prompts", 0)
        outputs = ("match" if ev["outputs_match"] else f"DIFFER on {beyond}" if beyond
                   else f"match up to rounding (near-ties on {ev['near_tie_prompts']})")
        o.print(f"speculative decoding: τ = {ev['tau']:.2f} (max {ev['max_tau']}), speedup {ev['speedup']:.2f}x vs plain "
                f"decoding, outputs {outputs} ({output.count(ev['prompts'], 'prompt')})")
    if r["checkpoints"]:
        o.print(f"export: {r['checkpoints'][-1]} (config.json + model.safetensors)")
        for line in _check_lines(r["checkpoints"][-1]):
            o.print(line, markup=False, highlight=False)
    o.print(f"run dir: {r['run_dir']} (metrics.jsonl, config.toml)")
    print_next_steps(r)


def _interrupted(e: KeyboardInterrupt, terminated: bool) -> None:
    """Ctrl-C (exit 130) or SIGTERM (143): dflash.train's message says where the run stands."""
    message = getattr(e, "message", None)
    if not terminated and not isinstance(message, str):
        raise e  # before the trainer ran: the app's plain "interrupted"
    said = message if isinstance(message, str) else "before training started: nothing of the run to resume"
    output.err.print(("SIGTERM: " if terminated else "") + output.clean(said), markup=False, highlight=False)
    raise typer.Exit(EXIT_SIGTERM if terminated else 130) from None


def _render_engine_stop(r: dict, terminated: bool) -> None:
    """Ctrl-C (or SIGTERM) on the engine: it saved where it stopped; how to go on (on stderr, last)."""
    import shlex

    if r["steps"] >= r["total_steps"] or not r["checkpoints"]:
        return
    output.err.print(("SIGTERM: " if terminated else "") + f"interrupted at step {r['steps']} of {r['total_steps']}: saved {r['checkpoints'][-1]}; continue "
                     f"with `dflash train --out {shlex.quote(str(r['run_dir']))} --resume`", markup=False,
                     highlight=False)


def _render_complete(c) -> None:
    output.out.print(f"run complete at step {c.step} ({c.total_steps} steps scheduled): nothing to resume in "
                     f"{c.run_dir}", markup=False)
    output.err.print(f"[dim]hint:[/] to train further, pass a larger --max-steps: `dflash train --out {c.run_dir} "
                     f"--resume --max-steps {c.step * 2}`", highlight=False)


def _check_lines(export: str) -> list[str]:
    """`dflash check`'s static verdict on the run's last export, against the target it trained with."""
    from cli.dflash_check import verdict_lines

    try:
        report = dflash.check_export(export, measure=False, read_weights=False)  # checked before the save
    except BadInput as e:
        return [f"check: could not check the export: {e.message}"]
    return verdict_lines({**to_jsonable(report), "ok": report.ok})


def _render_dry(r) -> None:
    o = output.out
    o.print(f"dry run (meta device, nothing written): target {r.target_source}, {r.target_layers} layers, "
            f"hidden {r.target_hidden}, taps {list(r.layer_ids)}")
    o.print(f"drafter: {r.drafter_params / 1e6:,.1f} M parameters, {output.fmt_bytes(r.drafter_trainable_bytes)} "
            f"of fp32 weights + grads + AdamW state; {r.grads} parameters got gradients")
    o.print(f"one micro-batch: taps {r.taps_shape} -> drafter hidden {r.hidden_shape} -> loss and backward: ok")
    for n in r.notes:
        o.print(f"[red]{n}[/]")
