"""What a run returns (TrainResult) and what it keeps of its steps to build it (RunLog), shared by the
single-device loop and the engine's."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dflash.training.metrics import StepMetrics

if TYPE_CHECKING:
    from dflash.training.trainer import Trainer


def _mean(xs) -> float:
    xs = [x for x in xs if not math.isnan(x)]
    return sum(xs) / len(xs) if xs else math.nan


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


class RunLog:
    """What a run keeps of its steps for its result: the first and last step, and the first and the
    latest epoch's worth of metrics (for the epoch means). Shared by `Trainer.train` and the engine's
    `dflash.engine.program.train_multi`, so both log, report progress and build results the same way."""

    def __init__(self, trainer: "Trainer", total: int, window: int, *, primary: bool = True) -> None:
        """`primary`: this process writes the run (rank 0): it runs the periodic eval (eval.every)."""
        self.trainer, self.total, self.window, self.primary = trainer, total, window, primary
        self.first: StepMetrics | None = None
        self.last: StepMetrics | None = None
        self.history: list[StepMetrics] = []

    def add(self, m: StepMetrics) -> None:
        """Keep `m`, write it to the metrics log when due, and tell the progress listener; report the
        saves that ended, the first step's time (a start phase) and run the periodic eval when due."""
        if self.first is None:
            if self.trainer.phases is not None:
                self.trainer.phases.mark("first step", m.seconds)
            if self.primary:  # the process that saves: pin its snapshot buffers beside the next steps
                self.trainer.saver.reserve(self.trainer.drafter, self.trainer.optimizer)
        self.first = self.first or m
        self.last = m
        self.history.append(m)
        if len(self.history) > 2 * self.window:
            del self.history[self.window:-self.window]  # keep the first and the latest epoch's worth
        if m.step % self.trainer.cfg.metrics.log_every == 0 or m.step == 1 or m.step == self.total:
            self.trainer.write_metrics(m)
        self.trainer.on_event("step", {"metrics": m, "total_steps": self.total})
        self.trainer.saver.poll()  # saves written in the background since the last step: reported now
        ev = self.trainer.cfg.eval
        if self.primary and ev.every and m.step % ev.every == 0 and self.trainer.eval_convs:
            self.periodic_eval(m.step)

    def periodic_eval(self, step: int) -> None:
        """τ by real speculative decoding on a few held-out prompts (eval.every): a metrics.jsonl
        "periodic_eval" event with its cost (seconds), and the same event for the progress line. On the engine
        it runs inside the step barrier (every replica waits: the weights are the step's)."""
        t = self.trainer
        t0 = time.perf_counter()
        r = t.evaluate(limit=t.cfg.eval.every_prompts)
        data = {"step": step, "tau": r.tau, "max_tau": r.max_tau, "speedup": r.speedup, "prompts": r.prompts,
                "outputs_match": r.outputs_match, "seconds": round(time.perf_counter() - t0, 3)}
        t.write_event("periodic_eval", data)
        t.on_event("periodic_eval", data)

    def result(self, t0: float, *, run_eval: bool) -> "TrainResult":
        """Run the end-of-run eval (if configured, `run_eval` and the run reached its last step) and
        build the TrainResult."""
        t, h, w = self.trainer, self.history, self.window
        result_eval = None
        if run_eval and t.cfg.eval.at_end and t.eval_convs and t.step == self.total:
            result_eval = t.evaluate()
            t.write_event("eval", {"result": result_eval})
        first, last = self.first, self.last
        return TrainResult(run_dir=str(t.run_dir), steps=t.step, total_steps=self.total,
                           first_loss=first.loss if first else math.nan, last_loss=last.loss if last else math.nan,
                           first_epoch_loss=_mean(m.loss for m in h[:w]),
                           last_epoch_loss=_mean(m.loss for m in h[-w:]),
                           last_epoch_tau_estimate=_mean(m.tau_estimate for m in h[-w:]),
                           last_epoch_accuracy=tuple(_mean(slot) for slot in zip(*(m.accuracy for m in h[-w:]))),
                           last=last, checkpoints=t.checkpoints, seconds=time.perf_counter() - t0,
                           eval=result_eval, notes=t.notes)
