"""One entry for a dflash training run: the Config's topology picks single device, engine or torchrun.

    out = train(cfg)               # cfg.topology: one device, or target + drafter device lists
    out = train(cfg, resume=True)  # continue cfg.checkpoint.out_dir (its config.toml holds the topology)

Modes (`pick_mode`):
- single: one Trainer on `topology.device` (Trainer.train);
- engine: target workers and drafter replicas in threads over `topology.target_devices` /
  `drafter_devices` (dflash.engine.program.train_multi); the Trainer is replica 0, on the first drafter
  device (`TopologyConfig.trainer_device`, the one place that rule lives);
- distributed: this process is one rank of a torchrun job (dflash.distributed.train_rank), running one of
  the above on its node. Whether a process is a torchrun rank is how it was started, not part of the
  run, so it is not in the config: it is read from torchrun's environment (or forced by the caller).

The function returns data and never prints; the Trainer is always closed. torch is imported only
when training starts (`dflash --help` stays light).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Literal

from compilewatch import BadInput
from dflash.config import Config, TopologyConfig

if TYPE_CHECKING:
    from dflash.distributed.group import RankInfo
    from dflash.distributed.train_rank import DistributedResult
    from dflash.engine.engine import EngineReport
    from dflash.training.result import TrainResult

Mode = Literal["single", "engine", "distributed"]
Event = Callable[[str, dict[str, Any]], None]


@dataclass(frozen=True)
class RunOutcome:
    mode: Mode
    result: "TrainResult"  # this process's (rank 0's is the run's)
    engine: "EngineReport | None"  # the engine's report (engine and distributed modes)
    distributed: "DistributedResult | None"  # this rank's and every rank's reports (distributed mode)


def pick_mode(cfg: Config, distributed: bool | None = None) -> Mode:
    """`distributed`: None = whether torchrun started this process (its environment says so)."""
    from dflash.distributed.group import rank_info

    if distributed is None:
        distributed = rank_info() is not None
    if distributed:
        return "distributed"
    return "engine" if cfg.topology.engine else "single"


def check_devices(topo: TopologyConfig) -> None:
    """Every listed device is visible to this process (names were normalized by the config);
    BadInput names the setting. The single device is checked when the Trainer resolves it."""
    from compilewatch import parse_device

    for name in ("target_devices", "drafter_devices"):
        for d in getattr(topo, name):
            try:
                parse_device(d)
            except BadInput as e:
                raise BadInput(f"topology.{name} (--{name.replace('_', '-')}): {e.message}", hint=e.hint) from None


def train(cfg: Config, *, resume: bool = False, distributed: bool | None = None, on_event: Event | None = None,
          info: "RankInfo | None" = None, until: int | None = None) -> RunOutcome:
    """Train the run `cfg` describes (see the module docstring). `on_event(kind, data)` receives
    progress; kind "notes" carries the Trainer's notes once it is built. `until`: stop after that
    step (the schedule still spans the whole run). Raises BadInput for bad input."""
    on_event = on_event or (lambda kind, data: None)
    mode = pick_mode(cfg, distributed)
    check_devices(cfg.topology)
    if mode == "distributed":
        from dflash.distributed.train_rank import train_distributed

        out = train_distributed(cfg, resume=resume, until=until, on_event=on_event, info=info)
        return RunOutcome(mode, out.result, out.engine, out)
    from dflash.training.trainer import Trainer

    topo = cfg.topology
    home = None
    if mode == "engine":
        from dflash.engine.program import target_home

        home = target_home(topo.target_devices, topo.drafter_devices)
    trainer = Trainer.from_config(cfg, resume=resume, on_event=on_event, target_device=home)
    try:
        on_event("notes", {"notes": list(trainer.notes)})
        if mode == "single":
            return RunOutcome(mode, trainer.train(until), None, None)
        from dflash.engine.program import train_multi

        result, report = train_multi(trainer, topo.target_devices, topo.drafter_devices, stall_after=topo.stall_after,
                                     prewarm=topo.prewarm, guard=topo.guard, queue_depth=topo.queue_depth, until=until)
        return RunOutcome(mode, result, report, None)
    finally:
        trainer.close()
