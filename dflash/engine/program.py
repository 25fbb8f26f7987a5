"""DFlash on the multi-device engine: target workers compute taps, drafter replicas train on them.

`train_multi(trainer, cfg.topology)` runs the same training as `Trainer.train()`
(same data order, anchors, schedule, loss, checkpoints), spread over threads:
- the target workers (one per target device, each with its own copy of the frozen target) turn
  micro-batch `i` into `{"batch", "taps"}`;
- drafter replica 0 is the trainer itself (its drafter, optimizer, run directory); replicas 1..
  are copies on their devices with the target's frozen embedding and LM head only;
- the global batch of a step is `replicas x grad_accum` micro-batches, the next ones of the
  epoch plan — exactly what a single-device trainer with `grad_accum = replicas x grad_accum` sees.
  Each replica backpropagates its micro-batch's Σ w·CE; the engine sums gradients and divides by
  the global batch's Σ w, the single-device loss (dflash.model.loss) to the last term.

Metrics rows (metrics.jsonl) carry the engine's split too: time waiting for targets vs computing.

Across processes (`group`, a dflash.distributed.group.ProcessGroup): the global batch of a step is
`world_size x replicas x grad_accum` micro-batches; rank k trains on the k-th contiguous share of
every step's global batch (`Plan.global_index`), so the shares are disjoint, deterministic and cover
the epoch exactly as a single device with that grad_accum would. The engine sums gradients across
processes inside its step barrier; only rank 0 writes the run directory's metrics.jsonl,
config.toml and checkpoints; every rank writes its own `RUN/ranks/rank-N/` (metrics of its share,
compilewatch watcher events).
"""

from __future__ import annotations

import copy
import dataclasses
import threading
import time
from typing import Any, Callable, Sequence

import torch

from dflash.config import TopologyConfig
from dflash.engine.engine import Engine, EngineConfig, Program, Replica
from dflash.engine.report import EngineReport, StepRecord
from dflash.model import DFlashDrafter, build_drafter, loss_backward
from dflash.training.result import TrainResult
from dflash.training.schedule import lr_at
from dflash.training.trainer import Trainer


@dataclasses.dataclass
class Plan:
    """Global micro-batch index -> (epoch, sample indices), from the dataset's per-epoch plan."""

    trainer: Trainer
    per_step: int  # micro-batches per optimizer step in this process (replicas x grad_accum)
    rank: int = 0  # this process's share of every step's global batch (torch.distributed rank)
    world: int = 1  # processes

    def __post_init__(self) -> None:
        self.global_per_step = self.per_step * self.world
        have = self.trainer.dataset.batches_per_epoch()
        if have < self.global_per_step:
            from compilewatch import BadInput

            raise BadInput(f"the data has {have} micro-batches per epoch, fewer than one global batch "
                           f"({self.world} process(es) x {self.per_step} micro-batches per step)",
                           hint="use more data, fewer devices or processes, or a smaller train.grad_accum / data.batch_size")
        self.steps_per_epoch = have // self.global_per_step
        self._lock = threading.Lock()
        self._plans: dict[int, list[list[int]]] = {}

    def global_index(self, index: int) -> int:
        """This process's micro-batch `index` (the engine's numbering) -> its index in the global plan."""
        step, j = divmod(index, self.per_step)
        return step * self.global_per_step + self.rank * self.per_step + j

    def batch(self, index: int):
        epoch, within = divmod(self.global_index(index), self.steps_per_epoch * self.global_per_step)
        with self._lock:
            plan = self._plans.get(epoch)
            if plan is None:
                plan = self._plans[epoch] = self.trainer.dataset.epoch_plan(epoch)
                for old in [e for e in self._plans if e < epoch - 1]:
                    del self._plans[old]
        return self.trainer.dataset.make_batch(plan[within], epoch)


def _drafter_copy(trainer: Trainer, device: torch.device) -> DFlashDrafter:
    """A fresh drafter on `device` with the trainer's weights (not a deepcopy: compiled layers must
    get their own compiled wrappers, or they would keep calling the original's parameters)."""
    return build_drafter(trainer.cfg, trainer.drafter.spec, device, state=trainer.drafter.state_dict())


def _target_on(trainer: Trainer, device: torch.device):
    """The target a worker on `device` runs: the trainer's own full target where it lives (loaded once),
    else a new one."""
    if device == trainer.full_target.device:
        return trainer.full_target
    from dflash.model.target import load_target

    target = load_target(trainer.cfg.target, trainer.cfg.drafter.num_layers, device)
    if target.mask_token_id != trainer.target.mask_token_id or target.layer_ids != trainer.target.layer_ids:
        raise RuntimeError(f"the target loaded on {device} differs from the trainer's (mask token or taps)")
    return target


def target_home(target_devices: Sequence[str], drafter_devices: Sequence[str]) -> str | None:
    """Where the engine's Trainer keeps the full target: None (its own device, the first drafter
    device) when a target worker runs there too, else the first target device. Then the drafter
    device holds only the embedding and LM head (issue 16: a split 8B run held a 15.3 GiB copy there,
    13 GiB of it never used), and the target worker on that device reuses the Trainer's copy."""
    first = torch.device(drafter_devices[0])
    if any(torch.device(d) == first for d in target_devices):
        return None
    return target_devices[0]


def dflash_program(trainer: Trainer, drafter_devices: Sequence[str], *, rank: int = 0,
                   world: int = 1) -> tuple[Program, Plan]:
    cfg = trainer.cfg
    R = len(drafter_devices)
    plan = Plan(trainer, R * cfg.train.grad_accum, rank, world)
    total = cfg.train.max_steps or cfg.train.epochs * plan.steps_per_epoch
    one: dict[torch.device, torch.Tensor] = {}
    targets: dict[str, Any] = {}

    def make_producer(device: str) -> Callable[[int], Any]:
        target = targets[device] = _target_on(trainer, torch.device(device))

        def produce(index: int) -> dict[str, Any]:
            batch = plan.batch(index).to(target.device)
            return {"batch": batch, "taps": target.taps(batch.input_ids, getattr(batch, "position_ids", None),
                                                        getattr(batch, "run_bounds", None))}  # (B, S, k·H)
        return produce

    def make_replica(index: int, device: str) -> Replica:
        dev = torch.device(device)
        if index == 0:
            if dev != trainer.device:
                raise RuntimeError(f"replica 0 must run on the trainer's device {trainer.device}, not {device}")
            tr = trainer
        else:
            side = trainer.target if dev == trainer.target.device else trainer.target.embed_head_on(dev)
            tr = Trainer(cfg, side, trainer.dataset, _drafter_copy(trainer, dev), trainer.run_dir, notes=[])
            # resume: the same AdamW state, copied (load_state_dict keeps tensors that need no dtype/device
            # change by reference: replicas on one device would share moments and step counts)
            tr.optimizer.load_state_dict(copy.deepcopy(trainer.optimizer.state_dict()))
            tr.step = trainer.step
        tr.total_steps, tr.steps_per_epoch = total, plan.steps_per_epoch
        one[dev] = torch.tensor(1.0, device=dev)
        return Replica(index, device, tr.drafter, tr.optimizer, {"trainer": tr, "outs": []})

    def loss(tr: Trainer, batch, taps: torch.Tensor):
        """Forward and backward of one micro-batch (packed: chunk by chunk, data.pack_chunks)."""
        return loss_backward(tr.drafter, tr.target.embed, tr.target.head, taps, batch,
                             chunks=tr.pack_chunks, mask_token_id=tr.target.mask_token_id,
                             weights=tr.weights, denominator=one[tr.device], backend=tr.backend,
                             compute_dtype=tr.compute_dtype)  # loss = Σ w·CE (denominator 1)

    def forward_backward(rep: Replica, item: dict[str, Any]) -> tuple[float, float]:
        tr: Trainer = rep.state["trainer"]
        out = loss(tr, item["batch"], item["taps"])
        rep.state["outs"].append((out, int(item["batch"].anchor_valid.sum())))
        w = float(out.weight)
        return (float(out.weighted_ce) / w if w > 0 else 0.0), w

    def optimizer_step(rep: Replica, step: int) -> None:
        rep.state["trainer"].optimizer_step(step)

    def warm(rep: Replica) -> None:
        tr: Trainer = rep.state["trainer"]
        k_h = len(trainer.target.layer_ids) * trainer.target.hidden_size
        batches = tr.warm_batches()  # one per bucket length: every shape training will use
        if tr.dataset.packed:  # packed: the drafter's shapes do not depend on the rows used (the taps are padded)
            batches = [batches[0], batches[len(batches) // 2]]  # chunks over a window of rows, and over all rows
        for b in batches:
            b = b.to(tr.device)
            taps = torch.zeros(*b.input_ids.shape, k_h, dtype=trainer.target.dtype, device=tr.device)  # as produced
            loss(tr, b, taps)

    def warm_producer(device: str) -> None:
        target = targets[device]
        if not target.compile_taps:
            return  # nothing to compile: the eager forward needs no warm-up
        for b in trainer.warm_batches():  # the compiled target forward at every bucket length
            pos = getattr(b, "position_ids", None)
            target.taps(b.input_ids.to(target.device), None if pos is None else pos.to(target.device))

    def save(rep: Replica, steps_done: int) -> str | None:
        tr: Trainer = rep.state["trainer"]
        tr.step = steps_done
        tr.check_weights()  # every rank (the same weights): a diverged run stops on all of them, none saves
        if rank != 0:
            return None  # rank 0 writes checkpoints; every rank holds the same state
        return tr.save(final=steps_done == tr.total_steps, checked=True)

    return Program(make_producer=make_producer, make_replica=make_replica, forward_backward=forward_backward,
                   optimizer_step=optimizer_step, warm=warm, save=save,
                   warm_producer=warm_producer,
                   tokens=lambda item: item["batch"].tokens), plan


def _metrics(trainer: Trainer, replicas: list[Replica], rec: StepRecord, plan: Plan):
    """A StepMetrics row for the step the engine just committed (called inside the step barrier)."""
    from dflash.model import estimated_tau
    from dflash.training.metrics import StepMetrics, memory_bytes

    outs = [o for r in replicas for o, _ in r.state["outs"]]
    blocks = sum(b for r in replicas for _, b in r.state["outs"])
    for r in replicas:
        r.state["outs"] = []
    correct = sum(o.correct.cpu() for o in outs)
    count = sum(o.count.cpu() for o in outs)
    acc = tuple(float(c / n) if n > 0 else float("nan") for c, n in zip(correct[1:], count[1:]))
    grads = [p.grad for p in replicas[0].model.parameters() if p.grad is not None]
    norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))) if grads else 0.0
    tokens = rec.tokens or 0
    return StepMetrics(
        step=rec.step + 1, epoch=rec.step // plan.steps_per_epoch, loss=rec.loss,
        lr=lr_at(rec.step, trainer.total_steps, trainer.cfg.optim), grad_norm=norm, accuracy=acc,
        tau_estimate=estimated_tau(sum(float(o.accepted) for o in outs), sum(float(o.full_blocks) for o in outs)),
        tokens=tokens, blocks=blocks, seconds=rec.wall_s, tokens_per_s=tokens / rec.wall_s if rec.wall_s > 0 else 0.0,
        time_split={"wait_targets_max": round(max(rec.wait_s), 6), "compute_max": round(max(rec.compute_s), 6),
                    "reduce": round(rec.reduce_s, 6)},
        memory_bytes=memory_bytes(trainer.device))


def finished_report(target_devices: Sequence[str], drafter_devices: Sequence[str], step: int,
                    stop: int) -> EngineReport:
    """The engine's report for a run that is already at its last step: no thread started, ok."""
    return EngineReport(
        outcome="ok", target_devices=tuple(target_devices), drafter_devices=tuple(drafter_devices), start_step=step,
        steps_done=step, wall_s=0.0, setup_s=0.0, prewarm=None, guard="not used (no thread started)", steps=(),
        tokens_per_s=None, steps_per_s=None, wait_fraction=None, failure=None, threads=(), stacks={},
        max_param_diff=None, watch=None, saved=(), verdicts=(f"nothing to train: the run is at step {step} of {stop}; no thread started.",))


def rank_dir(run_dir, rank: int):
    """Where rank `rank` of a distributed run writes its own files."""
    from pathlib import Path

    return Path(run_dir) / "ranks" / f"rank-{rank}"


def train_multi(trainer: Trainer, topo: TopologyConfig, *, watch: bool = True, until: int | None = None,
                group: Any = None) -> tuple[TrainResult, EngineReport]:
    """Train with the engine on `topo` (the topology section as it is: devices, stall watchdog, queue
    depth, prewarm, guard); same outputs as Trainer.train() (run dir, metrics, checkpoints, eval).
    `until`: stop after that step (the schedule still spans the whole run), like Trainer.train(until).
    `group`: a dflash.distributed.group.ProcessGroup when this process is one rank of several (see above)."""
    cfg = trainer.cfg
    target_devices, drafter_devices = topo.target_devices, topo.drafter_devices
    rank, world = (group.rank, group.world_size) if group is not None else (0, 1)
    program, plan = dflash_program(trainer, drafter_devices, rank=rank, world=world)
    total = cfg.train.max_steps or cfg.train.epochs * plan.steps_per_epoch
    t0 = time.perf_counter()
    own = rank_dir(trainer.run_dir, rank) if group is not None else trainer.run_dir
    log = trainer.begin(total, plan.steps_per_epoch, primary=rank == 0, own_dir=own,
                        extra={"target_devices": list(target_devices), "drafter_devices": list(drafter_devices)})
    holder: dict[str, Engine] = {}

    def on_step(rec: StepRecord) -> None:
        m = _metrics(trainer, holder["engine"].replicas, rec, plan)
        log.add(m)
        # a non-finite loss or gradient norm (the same on every rank: both are summed across them) raises
        # inside the step barrier, so no replica steps its optimizer; raised again below, from this thread
        trainer.check_step(m)

    stop = min(total, until) if until is not None else total
    if trainer.step >= stop:  # a finished run resumed: nothing to train (as Trainer.train), the result again
        report = finished_report(target_devices, drafter_devices, trainer.step, stop)
        trainer.write_event("engine", {"report": report})
        return log.result(t0, run_eval=rank == 0), report
    ecfg = EngineConfig.from_topology(topo, steps=stop, start_step=trainer.step, grad_accum=cfg.train.grad_accum,
                                      watch=watch, save_every=cfg.checkpoint.every,
                                      watch_report=str(own / "watch.jsonl") if watch else None)
    # with a group: every rank's threads start together (after every rank's prewarm), and each step's
    # gradients are summed across ranks inside the engine's step barrier
    holder["engine"] = Engine(program, ecfg, on_step=on_step, collective=group,
                              on_workers_start=group.barrier if group is not None else None)
    report = holder["engine"].run()
    trainer.step = report.steps_done
    if trainer.stopped is not None:  # diverged (the engine's report says "failed", naming this error)
        trainer.write_event("engine", {"report": report})
        raise trainer.stopped
    if report.ok or report.outcome == "interrupted":
        trainer.saver.finish(trainer.step)  # the last write: waited for; CheckFailed when it failed
    trainer.write_event("engine", {"report": report})
    result = log.result(t0, run_eval=report.ok and rank == 0)
    return result, report
