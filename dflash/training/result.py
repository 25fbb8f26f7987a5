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
