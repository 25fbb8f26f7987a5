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
when training starts (`dflash --help` stays light): once the data file is checked, the target's weights
start into the page cache (dflash.model.prefetch), and torch and transformers' model stack are imported
in a thread (dflash.training.preload) while this one goes on (devices, the rendezvous, the run directory,
the reads of dflash.training.build).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Literal

from compilewatch import BadInput, CheckFailed
from dflash.config import Config, TopologyConfig

if TYPE_CHECKING:
    from dflash.distributed.group import RankInfo
    from dflash.distributed.train_rank import DistributedResult
    from dflash.engine.report import EngineReport
    from dflash.training.result import TrainResult

Mode = Literal["single", "engine", "distributed"]
Event = Callable[[str, dict[str, Any]], None]


@dataclass(frozen=True)
class RunOutcome:
    """What one run returns, whatever its mode."""
    mode: Mode
    result: "TrainResult"  # this process's (rank 0's is the run's)
    engine: "EngineReport | None"  # the engine's report (engine and distributed modes)
    distributed: "DistributedResult | None" = None  # this rank's and every rank's reports (distributed mode)
    failure: CheckFailed | None = None  # distributed: this rank's error (PeerFailed when a peer caused it)
    rank_report: str | None = None  # distributed: where this rank's report.json is

    @property
    def ranks(self) -> tuple:
        """Every rank's report (distributed mode, when the run ended ok everywhere; else this rank's)."""
        return () if self.distributed is None else self.distributed.ranks

    @property
    def verdicts(self) -> tuple[str, ...]:
        """Across ranks: caches, identical weights (distributed mode)."""
        return () if self.distributed is None else self.distributed.verdicts


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


def _raise_if_out_of_memory(e: RuntimeError, trainer) -> None:
    """A step that ran out of memory is a config too large for the device: BadInput (exit 2) that
    says which step and what to lower, with the checkpoints written so far kept; not a traceback."""
    from dflash.training.memory_plan import out_of_memory

    why = out_of_memory(e)
    if why is None:
        return
    d = trainer.cfg.data
    raise BadInput(f"training ran out of memory on {trainer.device} at step {trainer.step + 1}: {why}",
                   hint=f"lower data.batch_size ({d.batch_size}), data.num_anchors ({d.num_anchors}) or "
                        f"data.max_length ({d.max_length}), or with data.pack = true raise data.pack_chunks; "
                        "the checkpoints written so far are kept") from None


def train(cfg: Config, *, resume: bool = False, distributed: bool | None = None, on_event: Event | None = None,
          info: "RankInfo | None" = None, until: int | None = None, watch: bool = True) -> RunOutcome:
    """Train the run `cfg` describes (see the module docstring). Events, in order: "mode" ({"mode"},
    once the mode is picked and the devices checked: nothing heavy has run yet); distributed: "rank"
    (this rank's devices, backend, cache) and "ranks" (cross-rank cache verdicts); "notes" (the
    Trainer's notes, single and engine modes); then the Trainer's progress. `until`: stop after that
    step (the schedule still spans the whole run). `info`: this rank (default: torchrun's
    environment). Raises BadInput for bad input; on Ctrl-C (one device; the engine's while it starts), a
    KeyboardInterrupt whose `message` names the step reached and the newest checkpoint
    (dflash.training.result.TrainingInterrupted; while the run starts: what its run directory holds),
    raised once a checkpoint being written is written."""
    on_event = on_event or (lambda kind, data: None)
    try:
        return _train(cfg, resume, distributed, on_event, info, until, watch)
    except KeyboardInterrupt as e:
        from dflash.training.result import TrainingInterrupted, interrupted_starting

        if isinstance(e, TrainingInterrupted) or info is not None or pick_mode(cfg, distributed) == "distributed":
            raise  # a torchrun rank's is torchrun's
        raise interrupted_starting(cfg) from None  # before the trainer was built: what the run dir holds


def _train(cfg: Config, resume: bool, distributed: bool | None, on_event: Event, info: "RankInfo | None",
           until: int | None, watch: bool) -> RunOutcome:
    from dflash.data.cache import cache_root, check_root
    from dflash.data.dataset import check_data_path
    from dflash.model.prefetch import prefetch_weights
    from dflash.training.preload import start_imports

    check_data_path(cfg.data)  # inputs before anything heavy (Trainer.from_config checks it again)
    check_root(cache_root(cfg.data))  # and a data.cache_dir that cannot be a directory
    prefetching = prefetch_weights(cfg.target.path)  # the disk starts now, before torch (dflash.model.prefetch)
    # torch and transformers' model stack in a thread from here on (issue 39); torch and the trainer's own
    # modules are its first stage, which this thread waits for rather than import them beside it
    start_imports(cfg.target, first=("dflash.training.trainer",)).wait("torch")
    from dflash.training.trainer import Trainer
    if cfg.cache.remote:  # before anything compiles, in every mode (each torchrun rank runs this)
        from compilewatch import enable_remote_cache

        enable_remote_cache(cfg.cache.remote)
    mode = pick_mode(cfg, distributed)
    check_devices(cfg.topology)
    on_event("mode", {"mode": mode})
    joined = None
    if mode == "distributed":
        from dflash.distributed.group import require_rank_info
        from dflash.distributed.train_rank import join

        joined = join(cfg, info or require_rank_info(), on_event)
        cfg = joined.cfg
        resume = resume or joined.restarted  # torchrun --max-restarts: every rank resumes
    topo = joined.topology if joined is not None else cfg.topology
    home = None
    if mode != "single":
        from dflash.engine.program import target_home

        home = target_home(topo.target_devices, topo.drafter_devices)
    # the one place a run's Trainer is built, for every mode
    try:
        trainer = Trainer.from_config(cfg, resume=resume, on_event=on_event, lock=joined is None or joined.info.primary,
                                      device=topo.trainer_device, target_device=home)
    finally:
        if prefetching is not None:
            prefetching.stop()  # the weights are read (or the start failed): no more reading ahead
    try:
        if joined is None:
            on_event("notes", {"notes": list(trainer.notes)})
        else:
            from dflash.distributed.train_rank import agree

            agree(joined, trainer, on_event)
        if mode == "single":
            result, report = trainer.train(until), None
        else:
            from dflash.engine.program import train_multi

            result, report = train_multi(trainer, topo, watch=watch, until=until,
                                         group=joined.group if joined is not None else None)
    except RuntimeError as e:  # torch.OutOfMemoryError is one
        _raise_if_out_of_memory(e, trainer)
        raise
    except KeyboardInterrupt:
        if mode == "distributed":  # a torchrun rank is torchrun's (the engine saves on Ctrl-C and reports it)
            raise
        stopped = True  # said once the trainer is closed: a checkpoint being written is finished first
    else:
        stopped = False
    finally:
        try:
            trainer.close()  # a Ctrl-C while it waits for a checkpoint's write is raised once that is written
        except KeyboardInterrupt:
            if mode == "distributed":
                raise
            stopped = True
    if stopped:
        from dflash.training.result import interrupted

        raise interrupted(trainer)
    if joined is None:
        return RunOutcome(mode, result, report)
    from dflash.distributed.train_rank import failure, finish_rank, rank_report_path

    out = finish_rank(joined, trainer, result, report, watch=watch)
    return RunOutcome(mode, result, report, out, failure(out), rank_report_path(out))
