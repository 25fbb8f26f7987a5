"""Live progress for dflash commands, on stderr (stdout stays data): phases, a step bar, checkpoints.
Rendered through cli.progress: bars on a terminal, periodic plain lines in logs."""

from __future__ import annotations

from typing import Any

from cli.output import clean, fmt_bytes
from cli.progress import Progress


class TrainProgress:
    """The `on_event` callback of dflash.training.trainer.Trainer (and of eval / regen progress)."""

    def __init__(self, enabled: bool = True) -> None:
        self.progress = Progress(enabled=enabled)
        self.task = None
        self.sub = None
        self.last_eval = ""  # the latest periodic eval's τ, shown on the step line

    def __enter__(self) -> TrainProgress:
        self.progress.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.__exit__(*exc)

    def __call__(self, kind: str, data: dict[str, Any]) -> None:
        p = self.progress
        if kind == "phase":
            name = data["name"]
            detail = {"target": f"loading target {data.get('source')}",
                      "regenerate": _regenerating(data),
                      "data": f"tokenizing {data.get('conversations')} conversations",
                      "data-cache": f"tokenized data {'from the cache' if data.get('hit') else 'cached'}: "
                                    f"{data.get('dir')}",
                      "eval": f"speculative decoding on {_prompts(data.get('prompts'))}"}.get(name, name)
            p.print(f"[dim]·[/] {clean(str(detail))}")  # a path from the user
            if name in ("regenerate", "eval", "data"):
                if self.sub is not None:
                    p.remove(self.sub)
                total = {"eval": data.get("prompts"), "regenerate": data.get("answers", data.get("conversations"))
                         }.get(name, data.get("conversations"))
                self.sub = p.add("tokenize" if name == "data" else name,
                                 total=total if isinstance(total, int) and total > 0 else None)
            elif name == "data-cache" and self.sub is not None:
                p.remove(self.sub)
                self.sub = None
        elif kind in ("regen", "eval", "tokenize") and self.sub is not None:
            info = f"{data['workers']} worker(s)" if "workers" in data else None
            p.update(self.sub, completed=data["done"], total=data["total"], info=info)
        elif kind == "start":
            if self.sub is not None:
                p.remove(self.sub)
                self.sub = None
            s = data["data"]
            p.print(f"[dim]·[/] {s.kept} sequences ({s.tokens} tokens, {s.loss_tokens} trained), "
                    f"{data['total_steps']} steps, device {data['device']}, attention {data['backend']}, "
                    f"run dir {clean(str(data['run_dir']))}")
            render_skips(p, s)
            self.task = p.add("train", total=data["total_steps"], completed=data["step"])
        elif kind == "step" and self.task is not None:
            m = data["metrics"]
            info = (f"loss {m.loss:.3f} acc₁ {m.accuracy[0]:.2f} τ≈{m.tau_estimate:.2f} "
                    f"{m.tokens_per_s / 1000:,.1f}k tok/s {fmt_bytes(m.memory_bytes)}{self.last_eval}")
            p.update(self.task, completed=m.step, info=info)
        elif kind == "phase-done":
            beside = f", read beside {', '.join(data['beside'])}" if data.get("beside") else ""
            p.print(f"[dim]·[/] {data['name']}: {data['seconds']:.1f} s (at {data['at']:.1f} s since process start)"
                    f"{beside}", highlight=False)
        elif kind == "disk":
            p.print(f"[dim]·[/] checkpoints: {fmt_bytes(data['checkpoint_bytes'])} each "
                    f"({'measured' if data['measured'] else 'estimated'}), {data['saves']} to write, at most "
                    f"{fmt_bytes(data['peak_bytes'])} on disk at once (keep_last {data['keep_last']}); "
                    f"{fmt_bytes(data['free_bytes'])} free", highlight=False)
        elif kind == "checkpoint":
            gone = f", removed {', '.join(data['removed'])}" if data.get("removed") else ""
            gone += f", kept only the export of {', '.join(data['stripped'])}" if data.get("stripped") else ""
            p.print(f"[dim]·[/] checkpoint {clean(str(data['path']))} ({fmt_bytes(data['bytes'])}; training paused "
                    f"{data['blocked_s']:.2f} s, written in {data['write_s']:.1f} s beside it{clean(gone)})",
                    highlight=False)
            for note in data.get("notes") or ():
                p.print(f"[yellow]warning:[/] {clean(note)}", highlight=False)
        elif kind == "checkpoint-skipped":
            p.print(f"[yellow]warning:[/] checkpoint at step {data['step']} NOT saved: " + clean(
                f"{data['reason']}; newest on disk: {data['newest'] or 'none'}; {data['then']}"), highlight=False)
        elif kind == "periodic_eval":
            self.last_eval = f" eval τ {data['tau']:.2f}@{data['step']}"
            parts = data.get("parts_s") or {}
            setup = ""
            if data.get("warmed_up") and parts.get("plain"):
                setup = (f" (first eval: {parts.get('warm_up', 0) + parts['plain']:.1f} s of it warm-up and the "
                         "plain baseline, reused later)")
            elif data.get("warmed_up") and data.get("plain_baseline") not in (None, "measured"):
                setup = (f" (first eval of this process: {parts.get('warm_up', 0):.1f} s of it warm-up; plain "
                         f"baseline of {data.get('plain_baseline')})")
            extra = "".join(f"; {what} ran beside it" for what in data.get("beside") or ())
            if data.get("waited_for_pinning_s", 0) >= 0.05:
                extra += f"; waited {data['waited_for_pinning_s']:.1f} s for the checkpoint buffers to be pinned first"
            p.print(f"[dim]·[/] eval at step {data['step']}: τ = {data['tau']:.2f} (max {data['max_tau']}), speedup "
                    f"{data['speedup']:.2f}x on {data['prompts']} prompts, {data['seconds']:.1f} s{clean(setup + extra)}",
                    highlight=False)


def _prompts(n: Any) -> str:
    return f"{n} prompt" if n == 1 else f"{n} prompts"


def _regenerating(data: dict[str, Any]) -> str:
    """The regenerate phase's line: answers (what its bar counts) in conversations (multi-turn chats have more)."""
    answers, convs = data.get("answers"), data.get("conversations")
    if answers is None or answers == convs:
        return f"regenerating {convs} answers with the target"
    return f"regenerating {answers} answers in {convs} conversations with the target"


def render_skips(p: Progress, stats) -> None:
    """Every skipped record, counted by reason, with the first examples of each (dflash.data.dataset.DataStats)."""
    if not stats.dropped:
        return
    p.print(f"[yellow]warning:[/] {stats.skipped} of {stats.records + len(stats.warnings)} records skipped "
             "(--strict makes this an error):", highlight=False)
    for reason, n in stats.dropped.items():
        p.print(f"  {n} × {reason}", markup=False, highlight=False)
        for ex in stats.examples.get(reason, []):
            p.print(f"      e.g. {ex}", markup=False, highlight=False, style="dim")
