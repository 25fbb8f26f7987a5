"""What a run returns (TrainResult), shared by the single-device loop, the engine's
(dflash.engine.program.train_multi) and a torchrun rank's (dflash.distributed.train_rank).
`RunLog` (dflash.training.trainer) builds it from the steps it kept."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dflash.training.metrics import StepMetrics


@dataclass(frozen=True)
class TrainResult:
    run_dir: str
    steps: int
    total_steps: int
    first_loss: float  # the first step of this call
    last_loss: float  # the last step
    first_epoch_loss: float  # mean over the first epoch's steps (this call): less noisy than one step
    last_epoch_loss: float  # mean over the last epoch's worth of steps
    last_epoch_tau_estimate: float  # mean estimated τ over the last epoch's worth of steps
    last_epoch_accuracy: tuple[float, ...]  # per slot 1..B-1, mean over the last epoch's worth of steps
    last: StepMetrics | None
    checkpoints: list[str]
    seconds: float
    eval: Any = None  # dflash.eval.evaluate.EvalResult when eval.at_end
    notes: list[str] = field(default_factory=list)


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C stopped a one-device run (`dflash.train` raises it once the Trainer is closed: a checkpoint
    being written was finished first). Still a KeyboardInterrupt (exit 130); `message` says where the run
    stands: the step it reached, the newest checkpoint on disk and how to go on from it."""

    def __init__(self, run_dir: str | None, step: int | None, total_steps: int | None, newest: str | None,
                 newest_step: int | None, every: int, *, evaluates: bool = True) -> None:
        """`step` None: the run was still starting (no trainer yet); `run_dir` None: not chosen yet.
        `evaluates`: the run ends with an evaluation (eval.at_end)."""
        super().__init__(run_dir, step)
        self.run_dir, self.step, self.total_steps = run_dir, step, total_steps
        self.newest, self.newest_step, self.every, self.evaluates = newest, newest_step, every, evaluates

    def __str__(self) -> str:
        return self.message

    @property
    def message(self) -> str:
        import shlex

        run = shlex.quote(self.run_dir or "")
        if self.step is None:  # before the trainer was built: what the run directory already holds
            if self.newest is None:
                where = f" in {self.run_dir}" if self.run_dir else ""
                return f"interrupted before training started: nothing saved{where}; run the command again to start over"
            return (f"interrupted before training started: the newest checkpoint is {self.newest} (step "
                    f"{self.newest_step}); continue with `dflash train --out {run} --resume`")
        if self.newest is None:
            return (f"interrupted at step {self.step} of {self.total_steps}, before the run's first checkpoint "
                    f"(checkpoint.every = {self.every}): nothing in {self.run_dir} to resume from; run the "
                    "command again to start over")
        if self.newest_step is not None and self.newest_step >= self.total_steps and not self.evaluates:
            return (f"interrupted after the last step ({self.total_steps}): the run is complete, its final "
                    f"checkpoint {self.newest} is saved")
        if self.newest_step is not None and self.newest_step >= self.total_steps:
            return (f"interrupted after the last step ({self.total_steps}): the final checkpoint {self.newest} is "
                    f"saved; the end-of-run evaluation did not finish: `dflash eval {run}` measures it")
        behind = self.step - (self.newest_step or 0)
        return (f"interrupted at step {self.step} of {self.total_steps}: the newest checkpoint is {self.newest} "
                f"({behind} step(s) behind); continue with `dflash train --out {run} --resume`")


def interrupted(trainer: Any) -> TrainingInterrupted:
    """What a Ctrl-C leaves of `trainer`'s run (call it once the trainer is closed)."""
    from dflash.checkpoint.store import step_number
    from dflash.checkpoint.writer import newest_on_disk

    newest = newest_on_disk(trainer.run_dir)
    return TrainingInterrupted(str(trainer.run_dir), trainer.step, trainer.total_steps,
                               None if newest is None else str(newest),
                               None if newest is None else step_number(newest.name), trainer.cfg.checkpoint.every,
                               evaluates=bool(trainer.cfg.eval.at_end and trainer.eval_convs))


def interrupted_starting(cfg: Any) -> TrainingInterrupted:
    """What a Ctrl-C leaves of the run `cfg` describes while it was starting (no trainer yet): the
    checkpoints its run directory already holds (a resume's), else nothing."""
    from pathlib import Path

    from dflash.checkpoint.store import step_number
    from dflash.checkpoint.writer import newest_on_disk

    out = cfg.checkpoint.out_dir
    newest = newest_on_disk(Path(out)) if out else None
    return TrainingInterrupted(str(out) if out else None, None, None, None if newest is None else str(newest),
                               None if newest is None else step_number(newest.name), cfg.checkpoint.every)
