"""The Trainer: one device, one drafter, a frozen target; steps, schedule, checkpoints, resume.

`Trainer.from_config(cfg)` builds every component (target, data, drafter, optimizer; dflash.training.build)
and validates all input before the run directory is created, so bad input leaves nothing behind.
`begin` starts writing the run (config.toml, metrics, the start event, the disk preflight): this loop
and the engine's (dflash.engine.program.train_multi) both start there, and both add their steps to the
`RunLog` it returns (metrics rows, progress, the periodic eval; the TrainResult, dflash.training.result,
is built from what it kept). `train()` runs to the end; `train_step(batches)` is one optimizer step
over a global batch of micro-batches; `forward_backward(batch, denominator)` is the per-micro-batch
piece a multi-device engine runs on each replica (it accumulates gradients; the engine sums them
across replicas, then calls `optimizer_step`).

Numerics: fp32 master weights and AdamW state; on GPU the forward runs under bf16 autocast with the
target in bf16. The loss denominator Σw is computed from the data of the whole global batch first, so
accumulation and replica splits give exactly the global-batch gradient. Data order, anchors and init
depend only on the seed, so a resumed run repeats an uninterrupted one step for step.
"""

from __future__ import annotations

import math
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import torch

from dflash.checkpoint.state_check import restore_training_state
from dflash.checkpoint.writer import Saver
from dflash.config import Config, to_toml
from dflash.data.dataset import Batch, ChatDataset
from dflash.model import (
    DFlashDrafter,
    LossOutput,
    Target,
    blocks_of,
    detect_backend,
    estimated_tau,
    loss_backward,
    loss_weights,
    resolve_dtype,
    weight_sum,
)
from dflash.training import divergence
from dflash.training.build import build_trainer
from dflash.training.memory_plan import plan_for
from dflash.training.metrics import MetricsWriter, StepClock, StepMetrics, memory_bytes
from dflash.training.result import TrainResult
from dflash.training.schedule import lr_at

Event = Callable[[str, dict[str, Any]], None]  # progress callback: (kind, data)


class Trainer:
    def __init__(self, cfg: Config, target: Target, dataset: ChatDataset, drafter: DFlashDrafter,
                 run_dir: Path, *, eval_convs=None, notes: list[str] | None = None, on_event: Event | None = None,
                 full_target: Target | None = None) -> None:
        """`target` is on the trainer's device; `full_target` (default: `target`) is the whole model
        when `target` is only its embedding and LM head (`Target.embed_head_on`): end-of-run eval and
        the engine's target worker use it where it lives."""
        self.cfg, self.target, self.dataset, self.drafter = cfg, target, dataset, drafter
        # the resolved config as config.toml and every checkpoint keep it; data.accept_changed is one resume's
        self.config_toml = to_toml(replace(cfg, data=replace(cfg.data, accept_changed=False)))
        self.full_target = full_target or target
        self.device = target.device
        self.run_dir = Path(run_dir)
        self.eval_convs, self.notes = eval_convs or [], list(notes or [])
        self.stopped: Exception | None = None  # why training stopped early (`diverged`), for the engine
        self.primary = True  # this process writes the run (rank 0 of a torchrun job); `begin` sets it
        self.on_event = on_event or (lambda kind, data: None)
        self.backend = detect_backend(self.device, cfg.train.attention)
        self.compute_dtype = resolve_dtype(cfg.train.dtype, self.device)
        self.weights = loss_weights(cfg.drafter.block_size, cfg.gamma, device=self.device)
        self.chunk_plan = plan_for(cfg, spec=drafter.spec, drafter=drafter, target_config=target.config,
                                   block_budget=dataset.block_budget, device=self.device, target_dtype=target.dtype)
        self.pack_chunks = self.chunk_plan.chunks  # data.pack_chunks resolved ("auto": by the GPU's memory)
        if cfg.data.pack_chunks == "auto":
            self.notes.append(self.chunk_plan.note())
        self.optimizer = torch.optim.AdamW(
            drafter.parameters(), lr=cfg.optim.lr, betas=(cfg.optim.beta1, cfg.optim.beta2), eps=cfg.optim.eps,
            weight_decay=cfg.optim.weight_decay, fused=self.device.type == "cuda")
        self.step = 0  # optimizer steps completed
        self.steps_per_epoch = dataset.steps_per_epoch(cfg.train.grad_accum)
        self.total_steps = cfg.train.max_steps or cfg.train.epochs * self.steps_per_epoch
        self._writer: MetricsWriter | None = None
        self.checkpoints: list[str] = []
        self._threads_before: int | None = None
        self._lock = None  # the run directory's RunLock, when this trainer holds it (from_config)
        self.resumed_from: Path | None = None  # the checkpoint this run continued (from_config's --resume)
        self.data_check = None  # --resume: the data against the checkpoint's record (dflash.checkpoint.data_check)
        self.phases = None  # from_config's dflash.training.startup.Phases: the start's, the first step's time too
        self.saver = Saver(self.run_dir, cfg.checkpoint, self.compute_dtype, self._saved)

    # ------------------------------------------------------------ building
    @classmethod
    def from_config(cls, cfg: Config, *, resume: bool = False, on_event: Event | None = None, lock: bool = True,
                    device: str | None = None, target_device: str | None = None) -> Trainer:
        """Build everything from `cfg` (dflash.training.build); with `resume`, continue the latest
        checkpoint of its run dir. `lock`: hold the run directory's lock (dflash.checkpoint.runlock)
        until close(); the ranks of a torchrun job share one run directory, and only rank 0 holds it.
        `device`: default the config's `topology.trainer_device` (a torchrun rank passes its own).
        `target_device`: load the full target there instead, and keep only its embedding and LM head
        on the trainer's device (the engine's split topology, `dflash.engine.program.target_home`)."""
        return build_trainer(cfg, cls, resume=resume, on_event=on_event, lock=lock, device=device,
                             target_device=target_device)

    # ------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        from dataclasses import asdict

        return {"step": self.step, "model": {k: v.detach().cpu().clone() for k, v in self.drafter.state_dict().items()},
                "optimizer": self.optimizer.state_dict(), "spec": asdict(self.drafter.spec), "total_steps": self.total_steps}

    def load_state_dict(self, state: dict[str, Any], where: str = "the training state") -> None:
        """Continue from `state` (Trainer.state_dict's); BadInput, with nothing changed, when it does not
        fit this drafter, optimizer and run length (dflash.checkpoint.state_check)."""
        self.step = restore_training_state(state, self.drafter, self.optimizer, self.total_steps, where)
        divergence.refuse_nonfinite_state(self.drafter, where)
        self.saver.resumed_step = self.step  # newer checkpoints (a rewound `latest`) are not this run's to prune

    # ------------------------------------------------------------ one step
    def micro_batches(self, step: int) -> list[Batch]:
        """The micro-batches of optimizer step `step` (0-based): deterministic in (seed, step)."""
        return self.dataset.step_batches(step, self.cfg.train.grad_accum)

    def _blocks(self, batch: Batch):
        return blocks_of(batch, self.cfg.drafter.block_size, self.target.mask_token_id)

    def denominator(self, batches: list[Batch]) -> torch.Tensor:
        """Σw over a global batch (data only), clamped to avoid 0/0 on a batch without labels."""
        return sum(weight_sum(self._blocks(b.to(self.device)), self.weights) for b in batches).clamp_min(1e-6)

    def forward_backward(self, batch: Batch, denominator: torch.Tensor, clock: StepClock | None = None) -> LossOutput:
        """Target taps -> drafter -> loss for one micro-batch on this trainer's device; backward (grads add up).
        `clock`: where the step's time went (spans "target" and "drafter"); nothing here waits for the GPU."""
        clock = clock if clock is not None else StepClock(self.device)
        batch = batch.to(self.device)
        t0 = clock.mark()
        taps = self.target.taps(batch.input_ids, getattr(batch, "position_ids", None),
                                getattr(batch, "run_bounds", None))  # (B, S, k·H)
        t1 = clock.mark()
        out = loss_backward(self.drafter, self.target.embed, self.target.head, taps, batch,
                            chunks=self.pack_chunks, mask_token_id=self.target.mask_token_id,
                            weights=self.weights, denominator=denominator, backend=self.backend,
                            compute_dtype=self.compute_dtype)
        clock.add("target", t0, t1)
        clock.add("drafter", t1, clock.mark())
        return out

    def optimizer_step(self, step: int) -> tuple[float, float]:
        """Clip, set the scheduled lr, step AdamW, clear grads. Returns (lr, grad norm before clipping)."""
        params = [p for p in self.drafter.parameters() if p.grad is not None]
        clip = self.cfg.optim.clip
        norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"))
        lr = lr_at(step, self.total_steps, self.cfg.optim)
        for g in self.optimizer.param_groups:
            g["lr"] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return lr, float(norm)

    def train_step(self, batches: list[Batch]) -> StepMetrics:
        """One optimizer step over `batches` (the global batch); returns its metrics."""
        t0 = time.perf_counter()
        clock = StepClock(self.device)
        batches = [b.to(self.device) for b in batches]  # once (the denominator and the step read them)
        denom = self.denominator(batches)
        outs = [self.forward_backward(b, denom, clock) for b in batches]
        t_opt = clock.mark()
        lr, norm = self.optimizer_step(self.step)
        clock.add("optim", t_opt, clock.mark())
        self._sync()
        timer = {"data": 0.0, "target": 0.0, "drafter": 0.0, **clock.seconds()}
        self.step += 1
        wce = sum(float(o.weighted_ce) for o in outs)
        correct = sum(o.correct for o in outs).cpu()
        count = sum(o.count for o in outs).cpu()
        acc = tuple(float(c / n) if n > 0 else float("nan") for c, n in zip(correct[1:], count[1:]))
        seconds = time.perf_counter() - t0
        tokens = sum(b.tokens for b in batches)
        valid = int(sum(int(b.anchor_valid.sum()) for b in batches))
        slots = sum(int(b.anchor_valid.numel()) for b in batches)
        token_slots = sum(int(b.input_ids.numel()) for b in batches)
        return StepMetrics(
            step=self.step, epoch=(self.step - 1) // self.steps_per_epoch, loss=wce / float(denom), lr=lr,
            grad_norm=norm, accuracy=acc,
            tau_estimate=estimated_tau(sum(float(o.accepted) for o in outs), sum(float(o.full_blocks) for o in outs)),
            tokens=tokens, blocks=valid, seconds=seconds,
            tokens_per_s=tokens / seconds if seconds > 0 else 0.0,
            block_slots=slots, valid_block_share=valid / slots if slots else 0.0,
            valid_blocks_per_s=valid / seconds if seconds > 0 else 0.0,
            token_slots=token_slots, target_fill=tokens / token_slots if token_slots else 0.0,
            time_split={k: round(v, 6) for k, v in timer.items()}, memory_bytes=memory_bytes(self.device))

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def warm_batches(self) -> list[Batch]:
        """One micro-batch per bucket length, at the shapes training uses (for compile warm-up;
        dflash.engine.program warms every engine replica with them): `ChatDataset.warm_batches`."""
        return self.dataset.warm_batches()

    # ------------------------------------------------------------ the loop
    def save(self, final: bool = False, *, checked: bool = False) -> str:
        """Checkpoint the current step: a snapshot now, written in the background (dflash.checkpoint.writer);
        returns the checkpoint's path (published when its write ends, reported by `saver.poll`). The weights
        are checked finite first (`check_weights`; `checked`: the caller just did)."""
        if not checked:
            self.check_weights()
        return self.saver.save(self.step, self.drafter, self.optimizer, self.total_steps, self.config_toml,
                               final=final, plan=self.disk_plan, data=getattr(self.dataset, "identity", None))

    def disk_plan(self):
        """This run's checkpoint disk use from its current step (dflash.checkpoint.diskspace)."""
        return self.saver.plan(self.drafter, self.step, self.total_steps)

    def preflight_disk(self) -> None:
        """Before training: the run's projected disk use (event "disk"); BadInput with the numbers when
        one more checkpoint cannot fit."""
        from dataclasses import asdict

        plan = self.disk_plan()
        self.on_event("disk", {**asdict(plan), "keep_last": self.cfg.checkpoint.keep_last})
        self.saver.preflight(plan)

    def _saved(self, kind: str, data: dict[str, Any]) -> None:
        """A save ended (the Saver reports it from the loop's thread): metrics.jsonl, notes, progress."""
        if kind == "checkpoint":
            self.checkpoints.append(data["path"])
        else:
            self.notes.append(f"checkpoint at step {data['step']} skipped: {data['reason']}; newest on disk: "
                              f"{data['newest'] or 'none'}; {data['then']}")
        self.write_event(kind, data)
        self.on_event(kind, data)

    def _keep_foreign_config(self) -> None:
        """A fresh run in a directory that already holds another config.toml (the user's own, in `--out .`,
        or a killed run's with other settings), or a metrics.jsonl that is not a restart's of this very
        config: moved aside to NAME.bak-<time>, never overwritten or cut (dflash.checkpoint.rundir)."""
        from dflash.checkpoint.rundir import keep_foreign_files

        if self.resumed_from is not None:
            return
        notes = keep_foreign_files(self.run_dir, self.config_toml)
        if notes:
            self.notes.extend(notes)
            self.on_event("notes", {"notes": notes})

    def write_event(self, kind: str, data: dict[str, Any]) -> None:
        """An event row in the metrics log (metrics.jsonl); nothing before `begin` opened it."""
        if self._writer is not None:
            self._writer.write_event(kind, data)

    def write_metrics(self, m: StepMetrics) -> None:
        """A step's row in the metrics log; nothing before `begin` opened it."""
        if self._writer is not None:
            self._writer.write(m)

    def begin(self, total_steps: int, steps_per_epoch: int, *, primary: bool = True, own_dir: Path | None = None,
              extra: dict[str, Any] | None = None) -> RunLog:
        """Start writing the run, the same for this loop and the engine's: the run directory, (primary:
        the process that writes the run) its config.toml, the metrics log (`own_dir`'s for another
        rank), the "start" event (`extra`: more of it), the disk preflight (primary), train mode.
        Returns the RunLog that the loop adds its steps to."""
        from compilewatch import atomic_write_text

        own = self.run_dir if own_dir is None else own_dir
        own.mkdir(parents=True, exist_ok=True)
        self.primary = primary
        if primary:
            self._keep_foreign_config()
            atomic_write_text(self.run_dir / "config.toml", self.config_toml)
        writer = self.open_metrics(self.run_dir if primary else own)
        if writer.truncated:
            self.notes.append(f"metrics.jsonl: dropped {writer.truncated} rows past step {self.step} "
                              "(the killed segment's; this run writes them again)")
        start = {"step": self.step, "total_steps": total_steps, "backend": self.backend, "device": str(self.device),
                 "data": self.dataset.stats, "run_dir": str(self.run_dir), **(extra or {})}
        writer.write_event("start", {**start, "notes": self.notes})
        check, now = self.data_check, getattr(self.dataset, "identity", None)
        if check is not None and check.status != "same":  # the data against the checkpoint's (--resume)
            writer.write_event("data_check", check.event(now, self.cfg.data.accept_changed))
        self.on_event("start", start)
        if primary:
            self.preflight_disk()
        self.drafter.train()
        return RunLog(self, total_steps, steps_per_epoch, primary=primary)

    def train(self, until: int | None = None) -> TrainResult:
        """Train to `total_steps` (or stop after step `until`; the schedule is unchanged),
        checkpointing every `checkpoint.every` steps and at the end."""
        t0 = time.perf_counter()
        log = self.begin(self.total_steps, self.steps_per_epoch)
        stop = min(self.total_steps, until) if until is not None else self.total_steps
        while self.step < stop:
            td = time.perf_counter()
            batches = self.micro_batches(self.step)
            data_s = time.perf_counter() - td
            m = self.train_step(batches)
            m = StepMetrics(**{**{f: getattr(m, f) for f in m.__dataclass_fields__},
                               "time_split": {**m.time_split, "data": round(data_s, 6)}})
            log.add(m)
            self.check_step(m)  # raises when non-finite: before a save could write the weights
            if m.step % self.cfg.checkpoint.every == 0 or m.step == self.total_steps:
                self.save(final=m.step == stop)
        self.saver.finish(self.step)
        return log.result(t0, run_eval=True)

    def check_step(self, m: StepMetrics) -> None:
        """CheckFailed when step `m` went non-finite (dflash.training.divergence)."""
        divergence.check_step(self, m)

    def check_weights(self) -> None:
        """CheckFailed when a drafter weight is non-finite: checked before every save (dflash.training.divergence)."""
        divergence.check_weights(self)

    def evaluate(self, limit: int | None = None):
        """Speculative decoding on the held-out prompts (the first `limit` of them) with this drafter
        (dflash.eval.in_training)."""
        from dflash.eval.in_training import evaluate_trainer

        return evaluate_trainer(self, limit)

    def open_metrics(self, directory: Path | None = None) -> MetricsWriter:
        """Open the metrics log (`metrics.jsonl` in `directory`, default the run dir; rows past the
        current step are dropped) as this trainer's: steps and events go there; `close()` closes it."""
        if self._writer is not None:
            self._writer.close()
        self._writer = MetricsWriter(self.run_dir if directory is None else directory,
                                     tensorboard=self.cfg.metrics.tensorboard, after_step=self.step)
        return self._writer

    def close(self) -> None:
        """Wait for a checkpoint being written (a Ctrl-C meanwhile is raised once it is written), close the
        metrics log and release the run's lock."""
        try:
            self.saver.close()  # a write still running is waited for, never dropped
        finally:
            self._release()

    def _release(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._threads_before is not None:
            torch.set_num_threads(self._threads_before)
            self._threads_before = None
        if self._lock is not None:
            self._lock.release()
            self._lock = None


def _mean(xs) -> float:
    xs = [x for x in xs if not math.isnan(x)]
    return sum(xs) / len(xs) if xs else math.nan


class RunLog:
    """What a run keeps of its steps for its result: the first and last step, and the first and the
    latest epoch's worth of metrics (for the epoch means). Shared by `Trainer.train` and the engine's
    `dflash.engine.program.train_multi`, so both log, report progress and build results the same way."""

    def __init__(self, trainer: Trainer, total: int, window: int, *, primary: bool = True) -> None:
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
        "periodic_eval" event with its cost (seconds; where they went, and what it captured and reused
        from earlier evals: dflash.eval.in_training.last_cost), and the same event for the progress line.
        It first waits for the checkpoint buffers being pinned after step 1 (`waited_for_pinning_s`), and
        names a checkpoint write still running beside it (`beside`). On the engine it runs inside the
        step barrier (every replica waits: the weights are the step's)."""
        from dflash.eval.in_training import last_cost

        t = self.trainer
        waited = t.saver.settle()  # the first save's pinned buffers (reserved after step 1): not beside the timing
        beside = ["a checkpoint write"] if t.saver.busy else []  # a save's write still running: said, not waited for
        t0 = time.perf_counter()
        r = t.evaluate(limit=t.cfg.eval.every_prompts)
        data = {"step": step, "tau": r.tau, "max_tau": r.max_tau, "speedup": r.speedup, "prompts": r.prompts,
                "outputs_match": r.outputs_match, "mismatched_prompts": r.mismatched_prompts,
                "near_tie_prompts": r.near_tie_prompts, "seconds": round(time.perf_counter() - t0, 3),
                "waited_for_pinning_s": round(waited, 3), "beside": beside, **last_cost(t)}
        t.write_event("periodic_eval", data)
        t.on_event("periodic_eval", data)

    def result(self, t0: float, *, run_eval: bool) -> TrainResult:
        """Run the end-of-run eval (if configured, `run_eval`, and this call stepped the run to its last step:
        a resume of a finished run evaluated at its end already) and build the TrainResult."""
        t, h, w = self.trainer, self.history, self.window
        result_eval = None
        if run_eval and t.cfg.eval.at_end and t.eval_convs and t.step == self.total and self.last is not None:
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
