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
import math
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Callable

import torch

from compilewatch import BadInput
from dflash import checkpoint as ckpt
from dflash.config import EMBEDDED_DATA, Config, apply_overrides, load_toml, to_toml
from dflash.data import Batch, ChatDataset
from dflash.loss import LossOutput, draft_loss, estimated_tau, loss_weights, make_blocks, weight_sum
from dflash.mask import build_masks, detect_backend
from dflash.metrics import MetricsWriter, StepMetrics, check_tensorboard, memory_bytes
from dflash.model import DFlashDrafter, DrafterSpec
from dflash.runlock import RunLock
from dflash.target import Target, load_target, resolve_device, resolve_dtype

Event = Callable[[str, dict[str, Any]], None]  # progress callback: (kind, data)


def lr_at(step: int, total: int, cfg) -> float:
    """Learning rate for the optimizer step with 0-based index `step` (warmup, then cosine / wsd)."""
    peak, low = cfg.lr, cfg.lr * cfg.min_lr_ratio
    warm = int(round(cfg.warmup_ratio * total))
    if step < warm:
        return peak * (step + 1) / warm
    if cfg.schedule == "constant":
        return peak
    if cfg.schedule == "wsd":
        decay = max(1, int(round(cfg.decay_ratio * total)))
        start = total - decay
        if step < start:
            return peak
        return low + (peak - low) * max(0.0, (total - step - 1) / decay)
    progress = (step - warm) / max(1, total - warm - 1)
    return low + (peak - low) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def drafter_spec(cfg: Config, target: Target) -> DrafterSpec:
    tc, d = target.config, cfg.drafter
    layer_types = tuple("sliding_attention" if i in d.sliding_layers else "full_attention" for i in range(d.num_layers))
    return DrafterSpec(
        hidden_size=target.hidden_size, num_hidden_layers=d.num_layers,
        num_attention_heads=d.num_attention_heads or tc.num_attention_heads,
        num_key_value_heads=d.num_key_value_heads or tc.num_key_value_heads,
        head_dim=d.head_dim or getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads,
        intermediate_size=d.intermediate_size or tc.intermediate_size, vocab_size=target.vocab_size,
        rms_norm_eps=float(getattr(tc, "rms_norm_eps", 1e-6)), rope_theta=float(_rope_theta(tc)),
        rope_scaling=target_rope_scaling(tc), attention_bias=bool(getattr(tc, "attention_bias", False)),
        max_position_embeddings=int(getattr(tc, "max_position_embeddings", 40960)), block_size=d.block_size,
        num_target_layers=target.num_layers, target_layer_ids=target.layer_ids, mask_token_id=target.mask_token_id,
        layer_types=layer_types, sliding_window=d.sliding_window if d.sliding_layers else None,
    )


def build_drafter(cfg: Config, spec: DrafterSpec, device: torch.device,
                  state: dict[str, torch.Tensor] | None = None) -> DFlashDrafter:
    """A drafter on `device`: seeded init (or `state`'s weights), and on CUDA with
    `train.compile_layers` every decoder layer compiled (parameters and state_dict keep their names;
    each copy gets its own compiled wrappers)."""
    drafter = DFlashDrafter(spec)
    if state is None:
        drafter.init_weights(torch.Generator().manual_seed(cfg.train.seed))
    drafter.to(device)
    if state is not None:
        drafter.load_state_dict(state)
    if cfg.train.compile_layers and device.type == "cuda":
        for layer in drafter.layers:
            layer.compile(dynamic=False)
    return drafter


def drafter_loss(drafter: DFlashDrafter, embed: torch.nn.Module, head: torch.nn.Module, taps: torch.Tensor,
                 batch: Batch, *, mask_token_id: int, weights: torch.Tensor, denominator: torch.Tensor | float,
                 backend: str, compute_dtype: torch.dtype) -> LossOutput:
    """One micro-batch's loss on the drafter's device (no backward). Everything passed in lives there:
    `taps` (B, S, k·H) may come from a target on another device; `embed`/`head` are the target's frozen
    modules (or copies of them on this device). A multi-device engine calls this per replica."""
    spec = drafter.spec
    dev = taps.device
    blocks = make_blocks(batch.input_ids, batch.loss_mask, batch.lengths, batch.anchors, batch.anchor_valid,
                         spec.block_size, mask_token_id)
    seq = batch.input_ids.shape[1]
    masks = build_masks(batch.anchors, seq, spec.block_size, backend, spec.sliding_window,
                        need_sliding="sliding_attention" in spec.layer_types)
    ctx_pos = torch.arange(seq, device=dev).expand(batch.input_ids.shape[0], seq)  # (B, S)
    with torch.no_grad():
        embeds = embed(blocks.ids)  # (B, N*bs, H), frozen
    autocast = torch.autocast(dev.type, dtype=compute_dtype, enabled=compute_dtype != torch.float32)
    with autocast:
        hidden = drafter(embeds, taps, blocks.pos, ctx_pos, masks=masks)  # (B, N*bs, H)
        return draft_loss(hidden, head, blocks, weights, denominator)


def _rope_parameters(tc) -> dict:
    """The target's RoPE parameters (transformers 5 `rope_parameters`, 4.x `rope_scaling` + `rope_theta`);
    a per-layer-type dict (Gemma 3) gives its full-attention entry."""
    rp = dict(getattr(tc, "rope_parameters", None) or getattr(tc, "rope_scaling", None) or {})
    if "full_attention" in rp and isinstance(rp["full_attention"], dict):
        rp = dict(rp["full_attention"])
    return rp


def _rope_theta(tc) -> float:
    return _rope_parameters(tc).get("rope_theta") or getattr(tc, "rope_theta", None) or 10000.0


def target_rope_scaling(tc) -> dict | None:
    """The target's RoPE scaling without the theta ({"rope_type": "yarn", "factor": 4.0, ...}); None = plain."""
    rp = {k: v for k, v in _rope_parameters(tc).items() if k != "rope_theta"}
    rope_type = rp.get("rope_type", rp.get("type", "default"))
    return None if rope_type == "default" else {**rp, "rope_type": rope_type}


def load_training_data(cfg: Config, target: Target, on_event: Event) -> tuple[ChatDataset, list, list[str]]:
    """Conversations -> (regenerated by the target if asked) -> tokenized dataset, plus eval prompts
    (held out of training when they come from the dataset itself) and notes. Tokenized data comes
    from the data cache (dflash.datacache) when its key matches, else is tokenized into it."""
    from dflash.datacache import prepare

    n_eval = cfg.eval.num_prompts if cfg.eval.at_end else 0
    regen = None
    if cfg.data.regenerate:
        def regen(convs: list) -> list:
            from dflash.regen import regenerate

            on_event("phase", {"name": "regenerate", "conversations": len(convs)})
            return regenerate(convs, target, max_new_tokens=cfg.data.regen_max_new_tokens, batch_size=64,
                              seed=cfg.train.seed, progress=lambda d, n: on_event("regen", {"done": d, "total": n}))[0]
    prepared = prepare(cfg.data, target.tokenizer, cfg.drafter.block_size, n_eval=n_eval, regenerate=regen,
                       on_event=on_event)
    notes = list(prepared.notes)
    if prepared.cache_dir is not None:
        notes.append(f"data cache {'hit' if prepared.hit else 'built'}: {prepared.cache_dir}"
                     + ("" if prepared.hit else f" ({prepared.workers} worker(s), {prepared.seconds:.1f} s)"))
    dataset = ChatDataset(prepared.samples, cfg.data, cfg.drafter.block_size, cfg.train.seed, prepared.stats)
    return dataset, prepared.eval_convs, notes


def _mean(xs) -> float:
    xs = [x for x in xs if not math.isnan(x)]
    return sum(xs) / len(xs) if xs else math.nan


def default_run_dir(cfg: Config) -> Path:
    return Path("runs") / f"{cfg.recipe}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"


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
    eval: Any = None  # dflash.eval.EvalResult when eval.at_end
    notes: list[str] = field(default_factory=list)


class RunLog:
    """What a run keeps of its steps for its result: the first and last step, and the first and the
    latest epoch's worth of metrics (for the epoch means). Shared by `Trainer.train` and the engine's
    `dflash.program.train_multi`, so both log, report progress and build results the same way."""

    def __init__(self, trainer: "Trainer", total: int, window: int) -> None:
        self.trainer, self.total, self.window = trainer, total, window
        self.first: StepMetrics | None = None
        self.last: StepMetrics | None = None
        self.history: list[StepMetrics] = []

    def add(self, m: StepMetrics) -> None:
        """Keep `m`, write it to the metrics log when due, and tell the progress listener."""
        self.first = self.first or m
        self.last = m
        self.history.append(m)
        if len(self.history) > 2 * self.window:
            del self.history[self.window:-self.window]  # keep the first and the latest epoch's worth
        if m.step % self.trainer.cfg.metrics.log_every == 0 or m.step == 1 or m.step == self.total:
            self.trainer._writer.write(m)
        self.trainer.on_event("step", {"metrics": m, "total_steps": self.total})

    def result(self, t0: float, *, run_eval: bool) -> "TrainResult":
        """Run the end-of-run eval (if configured, `run_eval` and the run reached its last step) and
        build the TrainResult."""
        t, h, w = self.trainer, self.history, self.window
        result_eval = None
        if run_eval and t.cfg.eval.at_end and t.eval_convs and t.step == self.total:
            result_eval = t.evaluate()
            t._writer.write_event("eval", {"result": result_eval})
        first, last = self.first, self.last
        return TrainResult(run_dir=str(t.run_dir), steps=t.step, total_steps=self.total,
                           first_loss=first.loss if first else math.nan, last_loss=last.loss if last else math.nan,
                           first_epoch_loss=_mean(m.loss for m in h[:w]),
                           last_epoch_loss=_mean(m.loss for m in h[-w:]),
                           last_epoch_tau_estimate=_mean(m.tau_estimate for m in h[-w:]),
                           last_epoch_accuracy=tuple(_mean(slot) for slot in zip(*(m.accuracy for m in h[-w:]))),
                           last=last, checkpoints=t.checkpoints, seconds=time.perf_counter() - t0,
                           eval=result_eval, notes=t.notes)


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
        `lock`: hold the run directory's lock (dflash.runlock) until close(); the ranks of a torchrun
        job share one run directory, and only rank 0 holds it. `device`: default the config's
        `topology.trainer_device` (a torchrun rank passes its own). `target_device`: load the full
        target there instead, and keep only its embedding and LM head on the trainer's device (the
        engine's split topology, `dflash.program.target_home`)."""
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
                state = ckpt.load_training_state(start)
                saved = DrafterSpec(**state["spec"])
                ckpt.check_compatible(saved, target.hidden_size, target.num_layers, target.layer_ids, str(start))
                if saved != spec:
                    raise BadInput(f"the drafter in {str(start)!r} differs from this config's drafter",
                                   hint="resume with the run's own config (it is in the run directory's config.toml)")
        except BaseException:
            torch.set_num_threads(threads_before)
            if run_lock is not None:
                run_lock.release()
                if created and not any(run_dir.iterdir()):
                    run_dir.rmdir()  # bad input leaves nothing behind
            raise
        trainer = cls(cfg, target, dataset, drafter, run_dir, eval_convs=eval_convs, notes=notes, on_event=on_event,
                      full_target=full_target)
        trainer._threads_before = threads_before
        trainer._lock = run_lock
        if state is not None:
            trainer.load_state_dict(state)
            notes.append(f"resumed from {start} at step {trainer.step}")
        return trainer

    # ------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        from dataclasses import asdict

        return {"step": self.step, "model": {k: v.detach().cpu().clone() for k, v in self.drafter.state_dict().items()},
                "optimizer": self.optimizer.state_dict(), "spec": asdict(self.drafter.spec), "total_steps": self.total_steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.drafter.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
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
        dflash.program warms every engine replica with them)."""
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
        from dflash.eval import DrafterProposer, evaluate, prompt_ids

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


def build_config_for_resume(run_dir: str | Path, overrides: dict[str, Any]) -> Config:
    """A resumed run uses its own saved config (plus explicit overrides, e.g. a longer max_steps)."""
    path = Path(run_dir) / "config.toml"
    if not path.is_file():
        raise BadInput(f"--resume: {str(path)!r} not found", hint="point --out at the run directory to continue")
    cfg = load_toml(path, overrides)
    return apply_overrides(cfg, {"checkpoint.out_dir": str(run_dir)})
