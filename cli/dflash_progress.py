"""Live progress for dflash commands, on stderr (stdout stays data): phases, a step bar, checkpoints."""

from __future__ import annotations

from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from cli.output import err, fmt_bytes


class TrainProgress:
    """The `on_event` callback of dflash.trainer.Trainer, rendered with rich."""

    def __init__(self, enabled: bool = True) -> None:
        self.progress = Progress(
            TextColumn("[bold]{task.description}"), BarColumn(bar_width=24), MofNCompleteColumn(), TimeElapsedColumn(),
            TimeRemainingColumn(), TextColumn("{task.fields[info]}"), console=err, transient=False, disable=not enabled,
        )
        self.task = None
        self.sub = None

    def __enter__(self) -> TrainProgress:
        self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.stop()

    def __call__(self, kind: str, data: dict[str, Any]) -> None:
        if kind == "phase":
            name = data["name"]
            detail = {"target": f"loading target {data.get('source')}",
                      "regenerate": f"regenerating {data.get('conversations')} answers with the target",
                      "data": f"tokenizing {data.get('conversations')} conversations",
                      "eval": f"speculative decoding on {data.get('prompts')} prompts"}.get(name, name)
            self.progress.console.print(f"[dim]·[/] {detail}")
            if name in ("regenerate", "eval"):
                self.sub = self.progress.add_task(name, total=None, info="")
        elif kind in ("regen", "eval") and self.sub is not None:
            self.progress.update(self.sub, completed=data["done"], total=data["total"])
        elif kind == "start":
            if self.sub is not None:
                self.progress.remove_task(self.sub)
                self.sub = None
            s = data["data"]
            self.progress.console.print(
                f"[dim]·[/] {s.kept} sequences ({s.tokens} tokens, {s.loss_tokens} trained), device {data['device']}, "
                f"attention {data['backend']}, run dir {data['run_dir']}")
            render_skips(self.progress.console, s)
            self.task = self.progress.add_task("train", total=data["total_steps"], completed=data["step"], info="")
        elif kind == "step" and self.task is not None:
            m = data["metrics"]
            info = (f"loss {m.loss:.3f} acc₁ {m.accuracy[0]:.2f} τ≈{m.tau_estimate:.2f} "
                    f"{m.tokens_per_s / 1000:,.1f}k tok/s {fmt_bytes(m.memory_bytes)}")
            self.progress.update(self.task, completed=m.step, info=info)
        elif kind == "checkpoint":
            self.progress.console.print(f"[dim]·[/] checkpoint {data['path']}")


def render_skips(console, stats) -> None:
    """Every skipped record, counted by reason, with the first examples of each (dflash.data.DataStats)."""
    if not stats.dropped:
        return
    console.print(f"[yellow]warning:[/] {stats.skipped} of {stats.records + len(stats.warnings)} records skipped "
                  "(--strict makes this an error):", highlight=False)
    for reason, n in stats.dropped.items():
        console.print(f"  {n} × {reason}", markup=False, highlight=False)
        for ex in stats.examples.get(reason, []):
            console.print(f"      e.g. {ex}", markup=False, highlight=False, style="dim")
