"""A run whose numbers go non-finite stops before anything carries them: a step with a NaN or infinite loss
or gradient norm (AdamW would make every weight NaN), and weights an update left non-finite although its
loss was finite (checked before every save). The run stops with CheckFailed (exit 1), a `diverged` event in
metrics.jsonl and the newest checkpoint named; the single-device loop, the engine's step barrier and every
torchrun rank (their loss and gradient norm are summed across ranks, so all stop together) call these. A
checkpoint that already holds such weights (saved by a version without the check) is refused at resume."""

from __future__ import annotations

import math
from typing import Any

from dflash.model import nonfinite_parameters


def check_step(trainer: Any, m: Any) -> None:
    """`diverged` when step `m`'s (a StepMetrics) loss or gradient norm is not finite."""
    if not (math.isfinite(m.loss) and math.isfinite(m.grad_norm)):
        diverged(trainer, m.step, {"loss": m.loss, "grad_norm": m.grad_norm, "lr": m.lr},
                 f"loss {m.loss}, gradient norm {m.grad_norm} (lr {m.lr:g})")


def check_weights(trainer: Any) -> None:
    """`diverged` when a drafter parameter holds a non-finite value. One device sync (a save takes a
    snapshot anyway)."""
    bad = nonfinite_parameters(trainer.drafter)
    if bad:
        shown = ", ".join(bad[:3]) + (f" and {len(bad) - 3} more" if len(bad) > 3 else "")
        diverged(trainer, trainer.step, {"nonfinite_parameters": bad[:16]},
                 f"the update left non-finite values in {len(bad)} parameter(s) ({shown})")


def diverged(trainer: Any, step: int, data: dict[str, Any], what: str) -> None:
    """CheckFailed: training went non-finite at `step` (`what` says how). Waits for a save still being written
    (it is finite, and named), writes the `diverged` event, keeps the exception in `trainer.stopped` (the
    engine raises it from a worker thread and again after its run) and raises it."""
    from compilewatch import CheckFailed
    from dflash.checkpoint.writer import newest_on_disk

    trainer.saver.wait()
    trainer.saver.poll()
    trainer.write_event("diverged", {"step": step, **data})
    if not trainer.primary:  # rank 0 writes the checkpoints, and may still be publishing one
        where = "rank 0 names the newest checkpoint"
    else:
        newest = newest_on_disk(trainer.run_dir)
        where = f"the newest checkpoint is {newest}" if newest is not None else "no checkpoint of this run is on disk"
    trainer.stopped = CheckFailed(f"training diverged at step {step}: {what}; the drafter's weights are no longer "
                                  f"finite, so the run stops without saving them; {where}",
                                  hint="lower optim.lr (or raise optim.warmup_ratio; `dflash train --print-config` "
                                       "shows them) and train again with another --out")
    raise trainer.stopped


def refuse_nonfinite_state(drafter: Any, where: str) -> None:
    """BadInput when the weights just restored from `where` are not finite (saved after a divergence)."""
    from compilewatch import BadInput

    bad = nonfinite_parameters(drafter)
    if bad:
        raise BadInput(f"{where} holds non-finite weights ({len(bad)} parameter(s), e.g. {bad[0]}): it was "
                       "saved after training diverged, and every step from it would be NaN",
                       hint="resume from an earlier checkpoint (write its name, e.g. step_000100, into "
                            "RUN/checkpoints/latest), or train again with a lower optim.lr and another --out")
