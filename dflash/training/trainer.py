"""The Trainer: one device, one drafter, a frozen target; steps, schedule, checkpoints, resume.

`Trainer.from_config(cfg)` builds every component (target, data, drafter, optimizer) and validates all
input before the run directory is created, so bad input leaves nothing behind. `train()` runs to the
end; `train_step(batches)` is one optimizer step over a global batch of micro-batches;
`forward_backward(batch, denominator)` is the per-micro-batch piece a multi-device engine runs on each
replica (it accumulates gradients; the engine sums them across replicas, then calls `optimizer_step`).

Numerics: fp32 master weights and AdamW state; on GPU the forward runs under bf16 autocast with the
target in bf16. The loss denominator Σw is computed from the data of the whole global batch first, so
accumulation and replica splits give exactly the global-batch gradient. Data order, anchors and init
depend only on the seed, so a resumed run repeats an uninterrupted one step for step.
"""

from __future__ import annotations

import contextlib
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Callable

import torch

from compilewatch import BadInput
from dflash.checkpoint import manifest, store as ckpt
from dflash.checkpoint.runlock import RunLock
from dflash.checkpoint.state_check import check_training_state, load_optimizer_state
from dflash.config import Config, to_toml
from dflash.data.dataset import Batch, ChatDataset
from dflash.data.prepare import load_training_data
from dflash.model.build import build_drafter, drafter_spec
from dflash.model.drafter import DFlashDrafter, DrafterSpec
from dflash.model.loss import LossOutput, drafter_loss, estimated_tau, loss_weights, make_blocks, weight_sum
from dflash.model.mask import detect_backend
from dflash.model.target import Target, load_target, resolve_device, resolve_dtype
from dflash.training.metrics import MetricsWriter, StepMetrics, check_tensorboard, memory_bytes
from dflash.training.result import RunLog, TrainResult
from dflash.training.schedule import lr_at

Event = Callable[[str, dict[str, Any]], None]  # progress callback: (kind, data)


def default_run_dir(cfg: Config) -> Path:
    return Path("runs") / f"{cfg.recipe}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"


class Trainer:
    def __init__(self, cfg: Config, target: Target, dataset: ChatDataset, drafter: DFlashDrafter,
                 run_dir: Path, *, eval_convs=None, notes: list[str] | None = None, on_event: Event | None = None,
                 full_target: Target | None = None) -> None:
        """`target` is on the trainer's device; `full_target` (default: `target`) is the whole model
        when `target` is only its embedding and LM head (`Target.embed_head_on`): end-of-run eval and
        the engine's target worker use it where it lives."""
        self.cfg, self.target, self.dataset, self.drafter = cfg, target, dataset, drafter
        self.full_target = full_target or target
        self.device = target.device
        self.run_dir = Path(run_dir)
        self.eval_convs, self.notes = eval_convs or [], list(notes or [])
        self.on_event = on_event or (lambda kind, data: None)
        self.backend = detect_backend(self.device, cfg.train.attention)
        self.compute_dtype = resolve_dtype(cfg.train.dtype, self.device)
        self.weights = loss_weights(cfg.drafter.block_size, cfg.gamma, device=self.device)
        self.optimizer = torch.optim.AdamW(
            drafter.parameters(), lr=cfg.optim.lr, betas=(cfg.optim.beta1, cfg.optim.beta2), eps=cfg.optim.eps,
            weight_decay=cfg.optim.weight_decay, fused=self.device.type == "cuda")
        self.step = 0  # optimizer steps completed
        self.steps_per_epoch = max(1, dataset.batches_per_epoch() // cfg.train.grad_accum)
        self.total_steps = cfg.train.max_steps or cfg.train.epochs * self.steps_per_epoch
        self._plan: tuple[int, list[list[int]]] | None = None
        self._writer: MetricsWriter | None = None
        self.checkpoints: list[str] = []
        self._threads_before: int | None = None
        self._lock: RunLock | None = None

    # ------------------------------------------------------------ building
    @classmethod
    def from_config(cls, cfg: Config, *, resume: bool = False, on_event: Event | None = None, lock: bool = True,
                    device: str | None = None, target_device: str | None = None) -> Trainer:
        """Build everything from `cfg`; with `resume`, continue the latest checkpoint of its run dir.
        `lock`: hold the run directory's lock (dflash.checkpoint.runlock) until close(); the ranks of a torchrun
        job share one run directory, and only rank 0 holds it. `device`: default the config's
        `topology.trainer_device` (a torchrun rank passes its own). `target_device`: load the full
        target there instead, and keep only its embedding and LM head on the trainer's device (the
        engine's split topology, `dflash.engine.program.target_home`)."""
        on_event = on_event or (lambda kind, data: None)
        run_dir = Path(cfg.checkpoint.out_dir) if cfg.checkpoint.out_dir else default_run_dir(cfg)
        if run_dir.exists() and not run_dir.is_dir():
            raise BadInput(f"--out {str(run_dir)!r} exists and is not a directory",
                           hint="--out names the run directory dflash creates; choose another name")
        start = None
        if resume:
            start = ckpt.latest_checkpoint(run_dir)
            if start is None:
                raise BadInput(f"--resume: no checkpoint in {str(run_dir)!r}",
                               hint="point --out at the run directory of the run to continue")
        elif ckpt.latest_checkpoint(run_dir) is not None:
            raise BadInput(f"{str(run_dir)!r} already holds checkpoints",
                           hint="pass --resume to continue that run, or choose another --out")
        device = resolve_device(device or cfg.topology.trainer_device)
        detect_backend(device, cfg.train.attention)  # bad backend/device pairs fail before any work
        check_tensorboard(cfg.metrics)
        created = not run_dir.exists()
        run_lock = RunLock(run_dir).acquire() if lock else None
        threads_before = torch.get_num_threads()
        if device.type == "cpu" and cfg.train.cpu_threads:
            torch.set_num_threads(cfg.train.cpu_threads)  # restored by close()
        try:
            on_event("phase", {"name": "target", "source": cfg.target.path})
            home = resolve_device(target_device) if target_device is not None else device
            full_target = load_target(cfg.target, cfg.drafter.num_layers, home)
            target = full_target if target_device is None else full_target.embed_head_on(device)
            notes = list(full_target.notes)
            if target_device is not None:
                notes.append(f"target on {home} (a target worker's device); {device} holds its embedding and LM head")
            dataset, eval_convs, data_notes = load_training_data(cfg, full_target, on_event)
            notes += data_notes
            spec = drafter_spec(cfg, target)
            drafter = build_drafter(cfg, spec, device)
            state = None
            if start is not None:
                unverified = manifest.check(start)  # sizes + checksums of every file it lists (BadInput)
                if unverified:
                    notes.append(unverified)
                state = ckpt.load_training_state(start)
                saved = DrafterSpec(**state["spec"])
                ckpt.check_compatible(saved, target.hidden_size, target.num_layers, target.layer_ids, str(start))
                if saved != spec:
                    raise BadInput(f"the drafter in {str(start)!r} differs from this config's drafter",
                                   hint="resume with the run's own config (it is in the run directory's config.toml)")
            trainer = cls(cfg, target, dataset, drafter, run_dir, eval_convs=eval_convs, notes=notes, on_event=on_event,
                          full_target=full_target)
            trainer._threads_before = threads_before
            if state is not None:
                # checked against the drafter and optimizer before anything changes
                trainer.load_state_dict(state, where=str(start / ckpt.STATE_FILE))
                trainer.notes.append(f"resumed from {start} at step {trainer.step}")
        except BaseException:  # every failure once the lock is held: release it (the next --resume must work)
            torch.set_num_threads(threads_before)
            if run_lock is not None:
                run_lock.release()
                if created and not any(run_dir.iterdir()):
                    run_dir.rmdir()  # bad input leaves nothing behind
            raise
        trainer._lock = run_lock
        return trainer

    # ------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        from dataclasses import asdict

        return {"step": self.step, "model": {k: v.detach().cpu().clone() for k, v in self.drafter.state_dict().items()},
                "optimizer": self.optimizer.state_dict(), "spec": asdict(self.drafter.spec), "total_steps": self.total_steps}

    def load_state_dict(self, state: dict[str, Any], where: str = "the training state") -> None:
        """Continue from `state` (Trainer.state_dict's); BadInput, with nothing changed, when it does not
        fit this drafter, optimizer and run length (dflash.checkpoint.state_check)."""
        check_training_state(state, self.drafter, self.optimizer, self.total_steps, where)
        self.drafter.load_state_dict(state["model"])
        load_optimizer_state(self.optimizer, state["optimizer"])
        self.step = int(state["step"])

    # ------------------------------------------------------------ one step
    def micro_batches(self, step: int) -> list[Batch]:
        """The micro-batches of optimizer step `step` (0-based): deterministic in (seed, step)."""
        epoch, within = divmod(step, self.steps_per_epoch)
        if self._plan is None or self._plan[0] != epoch:
            self._plan = (epoch, self.dataset.epoch_plan(epoch))
        ga = self.cfg.train.grad_accum
        return [self.dataset.make_batch(ix, epoch) for ix in self._plan[1][within * ga: (within + 1) * ga]]

    def _blocks(self, batch: Batch):
        return make_blocks(batch.input_ids, batch.loss_mask, batch.lengths, batch.anchors, batch.anchor_valid,
                           self.cfg.drafter.block_size, self.target.mask_token_id)

    def denominator(self, batches: list[Batch]) -> torch.Tensor:
        """Σw over a global batch (data only), clamped to avoid 0/0 on a batch without labels."""
        return sum(weight_sum(self._blocks(b.to(self.device)), self.weights) for b in batches).clamp_min(1e-6)

    def forward_backward(self, batch: Batch, denominator: torch.Tensor, timer: dict[str, float] | None = None) -> LossOutput:
        """Target taps -> drafter -> loss for one micro-batch on this trainer's device; backward (grads add up)."""
        timer = timer if timer is not None else {}
        t0 = time.perf_counter()
        batch = batch.to(self.device)
        taps = self.target.taps(batch.input_ids)  # (B, S, k·H)
        self._sync()
        t1 = time.perf_counter()
        out = drafter_loss(self.drafter, self.target.embed, self.target.head, taps, batch,
                           mask_token_id=self.target.mask_token_id, weights=self.weights, denominator=denominator,
                           backend=self.backend, compute_dtype=self.compute_dtype)
        out.loss.backward()
        self._sync()
        timer["target"] = timer.get("target", 0.0) + (t1 - t0)
        timer["drafter"] = timer.get("drafter", 0.0) + (time.perf_counter() - t1)
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
        timer: dict[str, float] = {"data": 0.0}
        denom = self.denominator(batches)
        outs = [self.forward_backward(b, denom, timer) for b in batches]
        t_opt = time.perf_counter()
        lr, norm = self.optimizer_step(self.step)
        self._sync()
        timer["optim"] = time.perf_counter() - t_opt
        self.step += 1
        wce = sum(float(o.weighted_ce) for o in outs)
        correct = sum(o.correct for o in outs).cpu()
        count = sum(o.count for o in outs).cpu()
        acc = tuple(float(c / n) if n > 0 else float("nan") for c, n in zip(correct[1:], count[1:]))
        seconds = time.perf_counter() - t0
        tokens = sum(b.tokens for b in batches)
        return StepMetrics(
            step=self.step, epoch=(self.step - 1) // self.steps_per_epoch, loss=wce / float(denom), lr=lr,
            grad_norm=norm, accuracy=acc,
            tau_estimate=estimated_tau(sum(float(o.accepted) for o in outs), sum(float(o.full_blocks) for o in outs)),
            tokens=tokens, blocks=int(sum(int(b.anchor_valid.sum()) for b in batches)), seconds=seconds,
            tokens_per_s=tokens / seconds if seconds > 0 else 0.0,
            time_split={k: round(v, 6) for k, v in timer.items()}, memory_bytes=memory_bytes(self.device))

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def warm_batches(self) -> list[Batch]:
        """One micro-batch per bucket length, at the shapes training uses (for compile warm-up;
        dflash.engine.program warms every engine replica with them)."""
        out = []
        for seq in self.dataset.buckets:
            s = self.dataset.samples[0]
            n = min(seq, s.input_ids.numel())
            ids = torch.zeros(1, seq, dtype=torch.long)
            ids[0, :n] = s.input_ids[:n]
            lm = torch.zeros(1, seq, dtype=torch.bool)
            lm[0, :n] = s.loss_mask[:n]
            na = self.cfg.data.num_anchors
            bs = self.cfg.data.batch_size
            b = Batch(input_ids=ids.repeat(bs, 1), loss_mask=lm.repeat(bs, 1), lengths=torch.full((bs,), n),
                      anchors=torch.zeros(bs, na, dtype=torch.long), anchor_valid=torch.ones(bs, na, dtype=torch.bool))
            out.append(b)
        return out

    # ------------------------------------------------------------ the loop
    def save(self) -> Path:
        path = ckpt.save_checkpoint(self.run_dir, self.step, self.drafter, self.compute_dtype, self.state_dict(),
                                    to_toml(self.cfg))
        self.checkpoints.append(str(path))
        self.on_event("checkpoint", {"step": self.step, "path": str(path)})
        return path

    def train(self, until: int | None = None) -> TrainResult:
        """Train to `total_steps` (or stop after step `until`; the schedule is unchanged),
        checkpointing every `checkpoint.every` steps and at the end."""
        from compilewatch import atomic_write_text

        t0 = time.perf_counter()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.run_dir / "config.toml", to_toml(self.cfg))
        self.open_metrics()
        if self._writer.truncated:
            self.notes.append(f"metrics.jsonl: dropped {self._writer.truncated} rows past step {self.step} "
                              "(the killed segment's; this run writes them again)")
        self._writer.write_event("start", {"step": self.step, "total_steps": self.total_steps, "notes": self.notes,
                                           "data": self.dataset.stats, "backend": self.backend, "device": str(self.device)})
        self.on_event("start", {"step": self.step, "total_steps": self.total_steps, "backend": self.backend,
                                "device": str(self.device), "data": self.dataset.stats, "run_dir": str(self.run_dir)})
        self.drafter.train()
        log = RunLog(self, self.total_steps, self.steps_per_epoch)
        stop = min(self.total_steps, until) if until is not None else self.total_steps
        while self.step < stop:
            td = time.perf_counter()
            batches = self.micro_batches(self.step)
            data_s = time.perf_counter() - td
            m = self.train_step(batches)
            m = StepMetrics(**{**{f: getattr(m, f) for f in m.__dataclass_fields__},
                               "time_split": {**m.time_split, "data": round(data_s, 6)}})
            log.add(m)
            if m.step % self.cfg.checkpoint.every == 0 or m.step == self.total_steps:
                self.save()
        return log.result(t0, run_eval=True)

    def evaluate(self):
        from dflash.eval.evaluate import DrafterProposer, evaluate, prompt_ids

        self.on_event("phase", {"name": "eval", "prompts": len(self.eval_convs)})
        self.drafter.eval()
        # decoding shapes change every round: run compiled layers eagerly instead of recompiling them
        stance = torch.compiler.set_stance("force_eager") if self.cfg.train.compile_layers else contextlib.nullcontext()
        target = self.full_target
        # the drafter decodes beside the target: a copy of it where the target lives, when the trainer
        # holds only the target's embedding and head (the engine's split topology)
        drafter = self.drafter if target is self.target else build_drafter(
            self.cfg, self.drafter.spec, target.device, state=self.drafter.state_dict()).eval()
        try:
            prompts = prompt_ids(target.tokenizer, self.eval_convs)
            with stance:
                return evaluate(DrafterProposer(drafter, target), target, prompts,
                                self.cfg.eval.max_new_tokens, self.cfg.drafter.block_size,
                                progress=lambda d, n: self.on_event("eval", {"done": d, "total": n}))
        finally:
            self.drafter.train()

    def open_metrics(self, directory: Path | None = None) -> MetricsWriter:
        """Open the metrics log (`metrics.jsonl` in `directory`, default the run dir; rows past the
        current step are dropped) as this trainer's: steps and events go there; `close()` closes it."""
        if self._writer is not None:
            self._writer.close()
        self._writer = MetricsWriter(self.run_dir if directory is None else directory,
                                     tensorboard=self.cfg.metrics.tensorboard, after_step=self.step)
        return self._writer

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._threads_before is not None:
            torch.set_num_threads(self._threads_before)
            self._threads_before = None
        if self._lock is not None:
            self._lock.release()
            self._lock = None
